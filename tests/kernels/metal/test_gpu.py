"""The Metal kernel on an Apple GPU against the reference (``pytest -m gpu``).

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request, T positions, D head dim. Skipped where Metal is absent; there,
tests/kernels/metal/test_metal_emulated.py runs the same kernel source on the CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tests.metal_emu.cases import attended
from tests.metal_emu.reference import row_range

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not mx.metal.is_available(),
        reason="needs a Metal GPU (Apple silicon, macOS); the Metal kernel runs under the emulation harness here",
    ),
]

mbd = pytest.importorskip("mlx_batched_decode")

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
# Fast head dims, and generic ones from each bucket (up to 32, 64, 128, 256, 512).
HEAD_DIMS = [1, 24, 32, 48, 64, 80, 96, 100, 112, 128, 160, 192, 200, 256, 300, 512]
# Against a float32 reference: output rounding plus the GPU's exp.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def inputs(b, h_kv, g, t, d, dtype, lens, *, rows=1, starts=None, window=None, sinks=False, capacity=None,
           seed=0):
    """Queries [B, H_q, L, D]; keys/values ``cache[:, :, :T]`` of a cache with
    ``capacity`` positions, where every position no query row of a request
    attends holds NaN (keys) and inf (values). Returns the arrays and the
    options (kv_starts, window, sinks) to pass on."""
    rng = np.random.default_rng(seed)
    capacity = capacity or t
    k = rng.standard_normal((b, h_kv, capacity, d)).astype(np.float32)
    v = rng.standard_normal((b, h_kv, capacity, d)).astype(np.float32)
    unread = np.ones((b, capacity), dtype=bool)
    unread[:, :t] = ~attended(lens, starts, rows, t, window)
    k.transpose(0, 2, 1, 3)[unread] = np.nan
    v.transpose(0, 2, 1, 3)[unread] = np.inf
    q = mx.array(rng.standard_normal((b, h_kv * g, rows, d)).astype(np.float32)).astype(dtype)
    keys = mx.array(k).astype(dtype)[:, :, :t]
    values = mx.array(v).astype(dtype)[:, :, :t]
    options = dict(
        kv_starts=None if starts is None else mx.array(starts, dtype=mx.int32),
        window=window,
        sinks=mx.array(1.5 * rng.standard_normal(h_kv * g).astype(np.float32)) if sinks else None,
    )
    return q, keys, values, mx.array(lens, dtype=mx.int32), options


def check(q, k, v, lens, **options):
    out = mbd.batched_decode_attention(q, k, v, lens, stream=mx.gpu, **options)
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    expected = mbd.reference_attention(*f32, lens, stream=mx.cpu, **options)
    got = np.array(out.astype(mx.float32))
    tol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.array(expected), atol=tol, rtol=tol)
    return got


def empty_rows(lens, starts, rows, t, window):
    """bool [B, L]: the query rows with no key."""
    out = np.zeros((len(lens), rows), dtype=bool)
    for b, n in enumerate(lens):
        start = 0 if starts is None else int(np.clip(starts[b], 0, t))
        for i in range(rows):
            lo, hi = row_range(int(np.clip(n, 0, t)), start, rows, i, window)
            out[b, i] = hi <= lo
    return out


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_pass(dtype, d, g, options):
    lens = [0, 1, 5, 48, 51, -2, 17, 33]
    extra = dict(rows=3, starts=[0, -1, 2, 10, 0, 0, 48, 5], window=9, sinks=True) if options == "all" else {}
    q, k, v, n, opts = inputs(len(lens), 16, g, 48, d, dtype, lens, capacity=64, **extra)
    got = check(q, k, v, n, **opts)
    empty = empty_rows(lens, extra.get("starts"), q.shape[2], 48, extra.get("window"))
    assert not got.transpose(0, 2, 1, 3)[empty].any()


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_long_context(dtype, d, options):
    """One or two requests with long contexts take the split-K path."""
    extra = dict(rows=5, window=2000, sinks=True) if options == "all" else {}
    q, k, v, n, opts = inputs(2, 2, 4, 3000, d, dtype, [3000, 17], capacity=4096,
                              starts=[100, 3] if extra else None, **extra)
    check(q, k, v, n, **opts)
    q, k, v, n, opts = inputs(1, 1, 8, 8192, d, dtype, [5000], starts=[40] if extra else None, **extra)
    check(q, k, v, n, **opts)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("window", [None, 1, 6, 700], ids=str)
@pytest.mark.parametrize("starts", [False, True], ids=["", "starts"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("t", [40, 1500], ids=["t40", "t1500"])
def test_options(t, rows, starts, window, sinks):
    lens = [t, 1, 0, t // 2, 3 * t, 7]
    kv_starts = [0, -3, 5, t // 4, 2, 7] if starts else None
    q, k, v, n, opts = inputs(len(lens), 1, 4, t, 128, mx.float16, lens, rows=rows, starts=kv_starts,
                              window=window, sinks=sinks, capacity=t + 16)
    got = check(q, k, v, n, **opts)
    assert not got.transpose(0, 2, 1, 3)[empty_rows(lens, kv_starts, rows, t, window)].any()


@pytest.mark.parametrize("d,g,rows", [(64, 12, 1), (64, 2, 5), (96, 3, 8), (512, 4, 2), (300, 1, 5), (128, 16, 4),
                                     (64, 33, 2)])
def test_rows_over_several_chunks(d, g, rows):
    """G * L rows above what one simdgroup holds spread over row chunks sharing staged K/V tiles
    (66 rows: 9 chunks, two row groups)."""
    q, k, v, n, opts = inputs(4, 2, g, 200, d, mx.float16, [200, 3, 0, 120], rows=rows, starts=[4, 0, 0, 9],
                              window=50, sinks=True)
    check(q, k, v, n, **opts)


@pytest.mark.parametrize("t,window", [(40, 9), (1500, 200)], ids=["single_pass", "split_k"])
def test_key_of_row_zero_alone(t, window):
    """NaN at the key only row 0 attends (the first of its window): the other rows are unchanged."""
    lens = [t, t // 2]
    q, k, v, n, opts = inputs(2, 2, 4, t, 64, mx.float32, lens, rows=4, window=window)
    expected = np.array(mbd.reference_attention(q, k, v, n, stream=mx.cpu, **opts))
    k_np = np.array(k)
    for b, length in enumerate(lens):
        k_np[b, :, row_range(length, 0, 4, 0, window)[0]] = np.nan
    got = np.array(mbd.batched_decode_attention(q, mx.array(k_np), v, n, stream=mx.gpu, **opts))
    assert np.isnan(got[:, :, 0]).all()
    np.testing.assert_allclose(got[:, :, 1:], expected[:, :, 1:], atol=1e-4, rtol=1e-4)


def test_windows_of_t_or_more_are_no_window():
    q, k, v, n, opts = inputs(3, 2, 2, 300, 96, mx.float16, [300, 40, 0], rows=2, starts=[0, 5, 0], sinks=True)
    unbounded = np.array(mbd.batched_decode_attention(q, k, v, n, stream=mx.gpu, **opts))
    for window in (300, 301, 10**6):
        opts["window"] = window
        np.testing.assert_array_equal(np.array(mbd.batched_decode_attention(q, k, v, n, stream=mx.gpu, **opts)),
                                      unbounded)


def test_strided_starts_and_sinks():
    """kv_starts and sinks may be views of larger buffers, or broadcast."""
    q, k, v, n, opts = inputs(4, 2, 4, 500, 128, mx.bfloat16, [500, 33, 0, 260], rows=2, starts=[3, 0, 0, 100],
                              window=64, sinks=True)
    starts = mx.repeat(opts["kv_starts"], 2)[::2]
    sinks = mx.repeat(opts["sinks"], 3)[::3]
    check(q, k, v, n, kv_starts=starts, window=64, sinks=sinks)
    check(q, k, v, n, kv_starts=mx.broadcast_to(mx.array(3), (4,)), window=64,
          sinks=mx.broadcast_to(mx.array(0.25), (8,)))


def test_wide_groups():
    q, k, v, n, _ = inputs(3, 2, 16, 200, 128, mx.float16, [200, 0, 99])
    check(q, k, v, n)


@pytest.mark.parametrize("layout", ["row_stride", "offset"])
@pytest.mark.parametrize("dtype,d", [(mx.float16, 64), (mx.bfloat16, 96), (mx.float32, 128), (mx.bfloat16, 512)],
                         ids=str)
def test_unaligned_views_take_scalar_loads(dtype, d, layout):
    """Rows off the vector width (a row stride of D + 1, or a first element one
    past an aligned one) read with scalar loads: aligned copies' output, bit for bit."""
    q, k, v, n, opts = inputs(3, 2, 4, 300, d, dtype, [300, 41, 0], rows=2, window=64, sinks=True)

    def unaligned(x):
        if layout == "row_stride":
            wide = mx.zeros((*x.shape[:-1], x.shape[-1] + 1), dtype=x.dtype)
            wide[..., :d] = x
            return wide[..., :d]
        flat = mx.zeros((x.size + 1,), dtype=x.dtype)
        flat[1:] = mx.contiguous(x).reshape(-1)
        return flat[1:].reshape(x.shape)

    aligned = np.array(mbd.batched_decode_attention(q, k, v, n, stream=mx.gpu, **opts).astype(mx.float32))
    got = check(unaligned(q), unaligned(k), unaligned(v), n, **opts)
    np.testing.assert_array_equal(got, aligned)


@pytest.mark.parametrize("sink", [None, 0.5, -float("inf")], ids=["no_sink", "finite_sink", "minus_inf_sink"])
@pytest.mark.parametrize("t", [40, 1500], ids=["single_pass", "split_k"])
def test_non_finite_scores_as_the_reference(t, sink):
    """NaN in a query, NaN and +inf in valid keys, -inf on the first keys of the
    simdgroups and splits, and a request whose keys all score -inf: NaN and inf
    where reference_attention and the CPU kernel have them (request 0: NaN, a
    softmax of -inf logits only, unless a finite sink takes the weight: zeros)."""
    rng = np.random.default_rng(t)
    q = np.abs(rng.standard_normal((3, 4, 2, 64))).astype(np.float32)  # positive: a -inf key row scores -inf
    k = rng.standard_normal((3, 2, t, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, t, 64)).astype(np.float32)
    q[1, 1, 0, 5] = np.nan
    k[1, 0, 3, 7] = np.nan
    k[1, 1, 2, 2] = np.inf
    k[0] = -np.inf
    for first in range(0, t, 64):
        k[2, :, first:first + 8] = -np.inf
    args = (mx.array(q), mx.array(k), mx.array(v), mx.array([t, t - 1, t]))
    opts = dict(sinks=None if sink is None else mx.full((4,), sink))
    got = np.array(mbd.batched_decode_attention(*args, stream=mx.gpu, **opts))
    expected = np.array(mbd.reference_attention(*args, stream=mx.cpu, **opts))
    cpu = np.array(mbd.batched_decode_attention(*args, stream=mx.cpu, **opts))
    for out in (got, cpu):
        for kind in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(kind(out), kind(expected))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(out[finite], expected[finite], atol=1e-4, rtol=1e-4)
    assert np.isnan(expected[0]).all() if sink in (None, -float("inf")) else not expected[0].any()
    assert np.isfinite(expected[2]).all()


@pytest.mark.parametrize("t", [48, 3000], ids=["single_pass", "split_k"])
@pytest.mark.parametrize("d", [64, 100, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap(dtype, d, t):
    """Scores capped at 5 (queries scaled up so that most pass it) with GQA, L = 3, kv_starts, a
    window and sinks; the uncapped reference lies far outside the tolerance."""
    q, k, v, n, opts = inputs(2, 2, 4, t, d, dtype, [t, t // 3], rows=3, starts=[3, 0], window=t // 2, sinks=True,
                              seed=d)
    q = q * 4
    got = check(q, k, v, n, softcap=5.0, **opts)
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    uncapped = np.array(mbd.reference_attention(*f32, n, stream=mx.cpu, **opts))
    assert np.abs(got - uncapped).max() > 10 * TOLERANCE[dtype]


def test_metal_backend():
    assert mbd.metal_backend() in ("metallib", "source")


def test_embedded_source_in_a_fresh_process(tmp_path):
    """A copy of the package without the metallib compiles the embedded source at
    the first call of each dtype and head dim, and computes what the reference does."""
    package = Path(mbd.__file__).parent
    shutil.copytree(package, tmp_path / package.name, ignore=shutil.ignore_patterns("*.metallib", "__pycache__"))
    # The extension finds libmlx at @loader_path/../mlx/lib.
    (tmp_path / "mlx").symlink_to(Path(mx.__file__).parent)
    code = (
        "import time, mlx.core as mx, numpy as np, mlx_batched_decode as mbd\n"
        f"assert mbd.__file__.startswith({str(tmp_path)!r}), mbd.__file__\n"
        "assert mbd.metal_backend() == 'source', mbd.metal_backend()\n"
        "for dtype, d, t in [(mx.float16, 128, 3000), (mx.bfloat16, 100, 40), (mx.float32, 64, 500)]:\n"
        "    q, k, v = (mx.random.normal(s).astype(dtype) for s in [(2, 8, 2, d), (2, 2, t, d), (2, 2, t, d)])\n"
        "    lens = mx.array([t, t // 3])\n"
        "    start = time.perf_counter()\n"
        "    out = mbd.batched_decode_attention(q, k, v, lens, stream=mx.gpu)\n"
        "    mx.eval(out)\n"
        "    print(f'first call {dtype} D={d}: {time.perf_counter() - start:.2f} s')\n"
        "    ref = mbd.reference_attention(q, k, v, lens, stream=mx.cpu)\n"
        "    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32)),\n"
        "                               atol=3e-2, rtol=3e-2)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    print(result.stdout)


def test_capture_of_one_decode_step(tmp_path):
    """metal_capture writes a .gputrace (needs MTL_CAPTURE_ENABLED=1 at process start)."""
    trace = tmp_path / "decode_step.gputrace"
    code = (
        "import mlx.core as mx, mlx_batched_decode as mbd\n"
        "from mlx_batched_decode.tools.profiling import metal_capture\n"
        "q = mx.random.normal((4, 32, 1, 128)).astype(mx.float16)\n"
        "k = mx.random.normal((4, 8, 1024, 128)).astype(mx.float16)\n"
        "lens = mx.array([1024, 7, 300, 0])\n"
        f"with metal_capture({str(trace)!r}):\n"
        "    mx.eval(mbd.batched_decode_attention(q, k, k, lens, stream=mx.gpu))\n"
    )
    env = dict(os.environ, MTL_CAPTURE_ENABLED="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert trace.exists()


def test_capture_without_capture_enabled_raises(tmp_path):
    from mlx_batched_decode.tools.profiling import metal_capture

    if os.environ.get("MTL_CAPTURE_ENABLED") == "1":
        pytest.skip("this process was started with captures enabled")
    with pytest.raises(RuntimeError, match="MTL_CAPTURE_ENABLED=1"):
        with metal_capture(tmp_path / "x.gputrace"):
            pass
