"""Non-finite values inside the query rows' ranges, on the emulated Metal kernel
against ``reference_attention`` (MLX, float32): the same NaN, +inf and -inf
positions, the finite values within tolerance. Both launch paths.

- The adversarial cases of tests/ops/test_adversarial.py (NaN, +inf, -inf sprinkled
  over queries, keys and values, valid region and padding alike), which that
  file runs on the default device (the CPU here).
- Targeted ones: NaN in a query, NaN or +inf in a valid key, a -inf score on
  the first key each simdgroup and split takes (the online softmax's
  exp(-inf - -inf)), and rows whose scores are all -inf. Those give NaN, as a
  softmax of -inf logits only (0/0), on the Metal kernel, the CPU kernel and
  the reference alike, unless a finite sink takes the whole weight (zeros); a
  row with no key at all gives zeros.
- On the tiled path (packed queries of many rows): NaN or inf in a key or a value
  at a position inside a tile's keys (the joint interval of its rows' ranges) but
  outside some rows' ranges (a window or a causal end between rows): those rows
  stay as float64 attention leaves them, finite; with vector and scalar loads.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request, T positions, D head dim.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from tests.kernels.metal.test_metal_tiled_emulated import library as tiled_library
from tests.kernels.metal.test_metal_varlen_emulated import plan_of
from tests.metal_emu.build import build_library
from tests.metal_emu.cases import make_case
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.mutants import TILED_NON_FINITE_ONLY, mutant_source
from tests.metal_emu.reference import TOLERANCE, to_dtype, to_float64

mbd = pytest.importorskip("mlx_batched_decode")

DTYPES = ["float16", "bfloat16", "float32"]
MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# make_case arguments: the shapes of tests/ops/test_adversarial.py (one pass), and a long one (split-K).
PATHS = {
    "single_pass": dict(d=64, h_kv=2, g=2, t=9),
    "split_k": dict(d=64, h_kv=1, g=4, t=200),
}
# The targeted cases: more keys than simdgroups in one pass.
TARGETED = dict(PATHS, single_pass=dict(d=64, h_kv=2, g=2, t=40))


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def to_mlx(x: np.ndarray, dtype: str) -> mx.array:
    return mx.array(to_float64(np.ascontiguousarray(x), dtype).astype(np.float32)).astype(MX_DTYPES[dtype])


def mlx_call(case, stream: mx.Stream, fn) -> np.ndarray:
    """``fn`` (an op of the package) on the case's values as MLX arrays; float64 [B, H_q, L, D]."""
    out = fn(*(to_mlx(x, case.dtype) for x in (case.queries, case.keys, case.values)),
             mx.array(np.ascontiguousarray(case.valid_lens)), scale=case.scale,
             kv_starts=None if case.kv_starts is None else mx.array(np.ascontiguousarray(case.kv_starts)),
             window=case.window, sinks=None if case.sinks is None else mx.array(np.ascontiguousarray(case.sinks)),
             stream=stream)
    return np.array(out.astype(mx.float32)).astype(np.float64)


def assert_agree(got: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    """The same NaN, +inf and -inf positions; finite values within the dtype's tolerance."""
    for kind in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(kind(got), kind(expected), err_msg=kind.__name__)
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def check(lib: EmulatedLibrary, case) -> np.ndarray:
    """The emulated kernel and the CPU kernel agree with reference_attention; returns the reference."""
    expected = mlx_call(case, mx.cpu, mbd.reference_attention)
    assert_agree(to_float64(case.run(lib), case.dtype), expected, case.dtype)
    assert_agree(mlx_call(case, mx.cpu, mbd.batched_decode_attention), expected, case.dtype)
    return expected


def assert_path(lib, case, path):
    b, h_q, rows, d = case.queries.shape
    plan = lib.plan(b, h_q, case.keys.shape[1], case.keys.shape[2], d, case.dtype, rows=rows, window=case.window)
    assert (plan["num_splits"] > 1) == (path == "split_k")
    return plan


def sprinkle(x: np.ndarray, dtype: str, rng: np.random.Generator, count: int) -> None:
    """Writes NaN, +inf or -inf into ``count`` random entries of the view ``x`` (storage of ``dtype``)."""
    flat = rng.choice(x.size, size=count, replace=False)
    x[np.unravel_index(flat, x.shape)] = to_dtype(rng.choice([np.nan, np.inf, -np.inf], size=count), dtype)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(12))
def test_adversarial_non_finite_values(lib, seed, dtype, path):
    """As test_adversarial's non-finite cases: a few entries of one or more of
    Q, K, V made non-finite anywhere, lengths from -1 to T + 1."""
    rng = np.random.default_rng(seed)
    spec = PATHS[path]
    lens = rng.integers(-1, spec["t"] + 2, size=3 if path == "single_pass" else 2).tolist()
    case = make_case(rng, dtype, lens=lens, extra_capacity=0, **spec)
    for i in rng.choice(3, size=rng.integers(1, 4), replace=False):
        sprinkle((case.queries, case.keys, case.values)[i], dtype, rng, 3)
    check(lib, case)


def targeted_case(path: str, dtype: str, sinks: bool):
    """Request 0 has keys, request 1 too, request 2 none; queries are positive, so
    that a key row of -inf scores -inf for every head."""
    spec = TARGETED[path]
    t = spec["t"]
    case = make_case(np.random.default_rng([t, len(dtype)]), dtype, lens=[t, t - 2, 0], rows=2, sinks=sinks,
                     **spec)
    case.queries[:] = to_dtype(np.abs(to_float64(case.queries, dtype)), dtype)
    return case


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_in_a_query_or_a_key(lib, dtype, path, sinks):
    """NaN in one query row, NaN and +inf in valid keys: NaN wherever the reference has it, not zeros."""
    case = targeted_case(path, dtype, sinks)
    case.queries[0, 1, 0, 5] = to_dtype(np.array(np.nan), dtype)
    case.keys[1, 0, 3, 7] = to_dtype(np.array(np.nan), dtype)
    case.keys[0, 0, 1, 2] = to_dtype(np.array(np.inf), dtype)
    assert_path(lib, case, path)
    expected = check(lib, case)
    assert np.isnan(expected[0, 1, 0]).all() and np.isnan(expected[1, :2]).all()


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minus_inf_on_the_first_key_of_every_simdgroup(lib, dtype, path):
    """The first key each simdgroup (and split) takes scores -inf: it weighs 0, the rows stay finite."""
    case = targeted_case(path, dtype, False)
    plan = assert_path(lib, case, path)
    for split in range(plan["num_splits"]):
        first = split * plan["split_len"]
        case.keys[:2, :, first:first + plan["group"][0] // 32] = to_dtype(np.array(-np.inf), dtype)
    expected = check(lib, case)
    assert np.isfinite(expected[:2]).all()


@pytest.mark.parametrize("sinks", ["none", "finite", "minus_inf"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_rows_whose_scores_are_all_minus_inf(lib, path, sinks):
    """NaN on every backend (0/0), unless a finite sink takes the whole weight:
    zeros; the row without keys gives zeros either way."""
    case = targeted_case(path, "float32", sinks != "none")
    if sinks == "minus_inf":
        case.sinks = np.full(case.queries.shape[1], -np.inf, dtype=np.float32)
    case.keys[0] = -np.inf
    assert_path(lib, case, path)
    expected = check(lib, case)
    assert (np.isnan(expected[0]).all() if sinks != "finite" else not expected[0].any())
    assert np.isfinite(expected[1]).all() and not expected[2].any()


# Packed requests of 5 and 6 rows (G = 4: tiles of 20 and 24 rows) with a window of 4: request 0's
# rows attend [12, 16) .. [16, 20), request 1's [4, 8) .. [9, 13). Each position poisoned below is
# inside its tile's keys and inside one or two rows' ranges only: the window start of the first row,
# the causal end of the last, one in between.
IN_TILE = dict(t=24, lens=[20, 13], query_rows=[5, 6], window=4)
IN_TILE_POSITIONS = [(0, 12), (0, 19), (1, 5)]


def in_tile_case(dtype: str, where: str, poison: float):
    """IN_TILE over 2 KV heads, G = 4, D = 64; ``poison`` in one element of KV head 1's ``where``
    (keys or values) at each of IN_TILE_POSITIONS."""
    case = make_case(np.random.default_rng(len(dtype)), dtype, 64, 2, 4, IN_TILE["t"], IN_TILE["lens"],
                     query_rows=IN_TILE["query_rows"], window=IN_TILE["window"])
    target = getattr(case, where)
    for b, position in IN_TILE_POSITIONS:
        target[b, 1, position, 3] = to_dtype(np.array(poison), dtype)
    return case


@pytest.mark.parametrize("loads", ["vector", "scalar"])
@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["keys", "values"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_non_finite_inside_a_tile_outside_a_rows_range(dtype, where, poison, loads):
    """A row whose range misses the poisoned positions stays finite, as in float64 attention; the
    rows that attend one agree with it too (NaN, inf or finite as it gives)."""
    lib = tiled_library()
    case = in_tile_case(dtype, where, poison)
    assert plan_of(lib, case)["tiled"]
    got = to_float64(case.run(lib, shift=0 if loads == "vector" else 1), dtype)
    assert lib.vector_loads() == (loads == "vector")
    expected = case.reference()
    assert_agree(got, expected, dtype)
    assert np.isfinite(expected).any() and not np.isfinite(expected).all()


@pytest.mark.parametrize("name", sorted(TILED_NON_FINITE_ONLY))
def test_tiled_mutant_fails(name):
    """P V of a block with a non-finite value kept to each row's keys: mutants that forget the value
    or the rows' ranges must give NaN where float64 attention is finite."""
    mutant = EmulatedLibrary(build_library(mutant_source(name, ["batched_decode_attention_float32_64"])))
    for poison in (np.nan, np.inf):
        case = in_tile_case("float32", "values", poison)
        got = to_float64(case.run(mutant), "float32")
        assert (np.isnan(got) & np.isfinite(case.reference())).any(), name
