"""The self-test, ``python -m mlx_batched_decode.selftest``: it passes here, and it fails when
what it compares disagrees (a wrong reference, an op that reads past a request's length)."""

import subprocess
import sys

import mlx.core as mx
import pytest

from mlx_batched_decode import ops
from mlx_batched_decode.tools.selftest import cases, layouts, main, speed
from mlx_batched_decode.tools.selftest.backend import backend_name
from mlx_batched_decode.tools.selftest.compare import TOLERANCE, compare, worst_error


def test_quick_selftest_passes_and_reports():
    result = subprocess.run(
        [sys.executable, "-m", "mlx_batched_decode.selftest", "--quick"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"backend: {backend_name(mx.default_device())} (" in out
    assert "first call (dense, float16, D=128" in out
    assert "462 cases against reference_attention in float32" in out
    table = out.split("worst error", 1)[1]
    for op in cases.OPS:
        for dtype in ("float32", "float16", "bfloat16"):
            assert any(line.split()[:2] == [op, dtype] for line in table.splitlines()), (op, dtype)
    speed_rows = [line.split() for line in out.split("vs sdpa", 1)[1].splitlines() if line.strip()]
    assert {row[0] for row in speed_rows if row[0] in cases.OPS} == set(cases.OPS)
    assert "OK: 462 cases and 4 timed outputs within tolerance" in out
    assert "FAIL" not in out
    assert "462/462 cases" in result.stderr  # the progress bar reached the end


def test_a_reference_without_the_window_fails_the_window_cases(capsys):
    def no_window(*args, window=None, **kwargs):
        return ops.reference_attention(*args, **kwargs)

    assert main.main(["--quick", "--ops", "dense"], reference=no_window) == 1
    out = capsys.readouterr().out
    failures = [line for line in out.splitlines() if line.startswith("FAIL dense")]
    assert failures and all("window=" in line for line in failures)
    windowed = [c for c in cases.grid(True, ("dense",)) if c.variant.window]
    assert len(failures) == len(windowed)  # a window of 7 or 16 cuts every one of them
    assert f"FAIL: {len(failures)} check(s) failed; please report the whole output above" in out


def test_an_op_that_reads_past_the_lengths_fails(capsys, monkeypatch):
    # Unread positions hold NaN: one key past each request's length poisons its rows.
    real = ops.batched_decode_attention

    def one_key_too_many(queries, keys, values, valid_lens, **kwargs):
        return real(queries, keys, values, valid_lens + 1, **kwargs)

    monkeypatch.setattr(ops, "batched_decode_attention", one_key_too_many)
    assert main.main(["--quick", "--ops", "dense"]) == 1
    out = capsys.readouterr().out
    assert "error inf > tolerance" in out
    assert " FAIL" in out.split("vs sdpa", 1)[1]  # the timed output is checked too


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_compare_takes_the_dtypes_tolerance(dtype):
    expected = mx.random.normal((2, 4, 3, 8))
    out = expected.astype(dtype)
    assert compare(out, expected, dtype).ok
    tol = TOLERANCE[dtype]
    off = expected + mx.where(mx.arange(8) == 5, 2 * tol, 0.0)
    result = compare(off, expected, mx.float32)
    assert not result.ok if 2 * tol > TOLERANCE[mx.float32] else result.ok
    assert result.error == pytest.approx(2 * tol, rel=1e-3)
    assert compare(expected + 0.5 * tol, expected, dtype).ok


def test_worst_error_counts_non_finite_values_and_wrong_shapes_as_infinite():
    expected = mx.zeros((2, 3))
    for bad in (float("nan"), float("inf"), -float("inf")):
        out = mx.where(mx.arange(3) == 1, bad, 0.0) + expected
        assert worst_error(out, expected) == float("inf")
        assert not compare(out, expected, mx.bfloat16).ok
    assert worst_error(mx.zeros((3, 2)), expected) == float("inf")
    assert worst_error(mx.zeros((0, 3)), mx.zeros((0, 3))) == 0.0


def test_the_grids():
    quick, full = cases.grid(True), cases.grid(False)
    assert len(quick) == 462 and 3000 < len(full) < 4000
    for grid in (quick, full):
        assert {c.op for c in grid} == set(cases.OPS)
        assert {c.dtype for c in grid} == set(cases.DTYPES)
        assert all(c.head_dim % c.group_size == 0 for c in grid if c.op == "quantized")
        assert not any(c.variant.ring for c in grid if c.op != "dense")
        assert not any(c.variant.starts for c in grid if c.op == "paged")
        assert any(0 in c.lens for c in grid) and any(max(c.lens) >= 256 for c in grid)  # empty; split-K
    assert {c.head_dim for c in full} > {c.head_dim for c in quick}
    assert {c.group for c in full} == {1, 2, 4, 8}


@pytest.mark.parametrize("op", cases.OPS)
def test_every_layout_holds_its_truth(op):
    # The op's inputs and the truth are two forms of one cache: on the truth's own reference the
    # op's output is within tolerance, and the truth's unread positions are NaN.
    case = cases.Case(op, mx.float32, 64, 2, (5, 0, 40), cases.fit(op, cases.VARIANTS[3]), seed=3)
    prepared = layouts.prepare(case)
    t = prepared.truth
    expected = ops.reference_attention(t.queries, t.keys, t.values, t.lens, **t.options, stream=mx.cpu)
    assert compare(prepared.run(), expected, mx.float32).ok
    assert mx.isnan(t.keys[1]).all().item() and mx.isnan(t.keys[0, :, 5:]).all().item()


def test_bytes_read_counts_keys_values_queries_and_output():
    case = cases.Case("dense", mx.float16, 128, 4, (10, 20), kv_heads=8)
    assert speed.bytes_read(case) == 30 * 8 * 2 * 128 * 2 + 2 * (2 * 32 * 128 * 2)
    packed = cases.Case("quantized", mx.float16, 128, 4, (10, 20), kv_heads=8, bits=4, group_size=64)
    assert speed.bytes_read(packed) == 30 * 8 * 2 * (64 + 2 * 2 * 2) + 2 * (2 * 32 * 128 * 2)
