"""The unedited Metal kernel, compiled with g++ by the emulation harness, against
a float64 reference: every dtype x head dim (fast and generic), GQA groups, L
query rows, kv_starts, windows and sinks, both launch paths.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request, T positions, D head dim. Every K/V position no query row of a
request attends holds NaN (keys) or inf (values): it must change nothing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.metal_emu.build import build_library
from tests.metal_emu.cases import make_case
from tests.metal_emu.driver import EmulatedLibrary, HarnessError
from tests.metal_emu.reference import TOLERANCE, row_range, to_float64

DTYPES = ["float16", "bfloat16", "float32"]
FAST_DIMS = [32, 64, 80, 96, 112, 128, 160, 192, 256, 512]
# One or two per generic kernel (up to 32, 64, 128, 256, 512).
GENERIC_DIMS = [1, 24, 48, 100, 200, 300]
GROUPS = [1, 4, 8]
ROWS = [1, 2, 5, 8]

# T, H_kv, lengths, starts and a window per launch path: T <= 64 keeps one
# pass; a long T with few (request, KV head, row chunk) items takes split-K.
# Lengths: empty, one key, fewer keys than rows, full, above T and negative
# (both clamped). Starts: negative (clamped), inside, at and past the length.
PATHS = {
    "single_pass": dict(t=40, h_kv=2, lens=[0, 1, 5, 40, 33, 47, -3, 12], starts=[0, -2, 3, 10, 40, 0, 5, 100],
                        window=7),
    "split_k": dict(t=140, h_kv=1, lens=[140, 1, 0, 97, 300, 64], starts=[0, 0, 7, 60, -50, 64], window=130),
}


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def path_case(rng, path: str, dtype: str, d: int, g: int, rows: int, starts: bool, window: bool, sinks: bool):
    spec = PATHS[path]
    return make_case(rng, dtype, d, spec["h_kv"], g, spec["t"], spec["lens"], rows=rows,
                     starts=spec["starts"] if starts else None, window=spec["window"] if window else None,
                     sinks=sinks)


def empty_rows(case) -> np.ndarray:
    """bool [B, L]: the query rows with no key."""
    t, rows = case.keys.shape[2], case.queries.shape[2]
    out = np.zeros((len(case.valid_lens), rows), dtype=bool)
    for b, n in enumerate(case.valid_lens):
        start = 0 if case.kv_starts is None else int(np.clip(case.kv_starts[b], 0, t))
        for i in range(rows):
            lo, hi = row_range(int(np.clip(n, 0, t)), start, rows, i, case.window)
            out[b, i] = hi <= lo
    return out


def run_and_compare(lib, case, **kwargs):
    got = to_float64(case.run(lib, **kwargs), case.dtype)
    np.testing.assert_allclose(got, case.reference(), atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])
    # NaN/inf outside every row's range is never read; a row with no key is exactly zero.
    assert np.isfinite(got).all()
    assert not got.transpose(0, 2, 1, 3)[empty_rows(case)].any()
    return got


def assert_path(lib, case, path):
    b, h_q, rows, d = case.queries.shape
    plan = lib.plan(b, h_q, case.keys.shape[1], case.keys.shape[2], d, case.dtype, rows=rows, window=case.window)
    assert (plan["num_splits"] > 1) == (path == "split_k")


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("d", sorted(FAST_DIMS + GENERIC_DIMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(lib, dtype, d, path, options):
    """Every kernel, plain (L = 1, no option) and with every option on; G and L vary along the head dims."""
    turn = sorted(FAST_DIMS + GENERIC_DIMS).index(d) + DTYPES.index(dtype)
    on = options == "all"
    g, rows = GROUPS[turn % len(GROUPS)], ROWS[turn % len(ROWS)] if on else 1
    case = path_case(np.random.default_rng([d, turn, len(path)]), path, dtype, d, g, rows, on, on, on)
    assert_path(lib, case, path)
    run_and_compare(lib, case)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("window", [False, True], ids=["", "window"])
@pytest.mark.parametrize("starts", [False, True], ids=["", "starts"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_options(lib, path, rows, starts, window, sinks):
    """Every combination of the options, L and path; G varies (3 splits an i over row chunks)."""
    turn = ROWS.index(rows) + 2 * starts + window + sinks
    g = [1, 3, 8][turn % 3]
    case = path_case(np.random.default_rng([rows, turn, len(path)]), path, "float32", 64, g, rows, starts, window,
                     sinks)
    assert_path(lib, case, path)
    run_and_compare(lib, case)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_key_of_row_zero_alone(lib, path):
    """NaN at the key only row 0 of a request attends (the first of its window):
    row 0 turns NaN, which shows the key is read, and every other row is unchanged."""
    spec = PATHS[path]
    case = make_case(np.random.default_rng(4), "float32", 64, spec["h_kv"], 4, spec["t"], spec["lens"], rows=5,
                     window=spec["window"])
    assert_path(lib, case, path)
    expected = case.reference()
    hit = []
    for b, n in enumerate(case.valid_lens):
        length = int(np.clip(n, 0, spec["t"]))
        lo, hi = row_range(length, 0, 5, 0, spec["window"])
        if hi > lo and lo < row_range(length, 0, 5, 1, spec["window"])[0]:
            case.keys[b, :, lo] = np.nan
            hit.append(b)
    assert hit
    got = to_float64(case.run(lib), "float32")
    assert np.isnan(got[hit, :, 0]).all()
    np.testing.assert_allclose(got[:, :, 1:], expected[:, :, 1:], atol=TOLERANCE["float32"], rtol=TOLERANCE["float32"])
    others = [b for b in range(len(case.valid_lens)) if b not in hit]
    np.testing.assert_allclose(got[others], expected[others], atol=TOLERANCE["float32"], rtol=TOLERANCE["float32"])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_windows_of_t_or_more_are_no_window(lib, path):
    spec = PATHS[path]
    t = spec["t"]
    case = make_case(np.random.default_rng(6), "float16", 96, spec["h_kv"], 2, t, spec["lens"], rows=2,
                     starts=spec["starts"], sinks=True)
    unbounded = case.run(lib)
    for window in (t, t + 1, 10**6):
        case.window = window
        np.testing.assert_array_equal(case.run(lib), unbounded)
        run_and_compare(lib, case)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_positions_are_clamped(lib, path):
    """Lengths and starts outside [0, T] read what their clamped values read."""
    spec = PATHS[path]
    t, int_max, int_min = spec["t"], 2**31 - 1, -(2**31)
    case = make_case(np.random.default_rng(7), "float32", 128, spec["h_kv"], 4, t, [t + 1, 10 * t, -1, int_min, t],
                     rows=3, starts=[-1, int_max, int_min, 5, t + 3], window=spec["window"], sinks=True)
    assert_path(lib, case, path)
    out = case.run(lib)
    case.valid_lens = np.array([t, t, 0, 0, t], dtype=np.int32)
    case.kv_starts = np.array([0, t, 0, 5, t], dtype=np.int32)
    np.testing.assert_array_equal(out, case.run(lib))
    assert out[0].any() and not out[1:].any()


@pytest.mark.parametrize("max_threads", [32, 64, 96, 1024])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_threadgroup_sizes(lib, max_threads, path):
    """A pipeline allowing fewer threads gets fewer simdgroups per threadgroup."""
    case = path_case(np.random.default_rng(max_threads), path, "float32", 80, 4, 2, True, True, True)
    b, h_q, _, d = case.queries.shape
    assert lib.plan(b, h_q, h_q // 4, case.keys.shape[2], d, "float32", max_threads, rows=2)["group"][0] == min(
        256, max_threads)
    run_and_compare(lib, case, max_threads=max_threads)


@pytest.mark.parametrize("max_threads", [1024, 96, 32])
@pytest.mark.parametrize("d,g,rows,chunks", [(64, 12, 1, 2), (64, 2, 5, 2), (96, 3, 8, 3), (512, 4, 2, 2),
                                             (300, 1, 5, 2), (128, 16, 4, 8), (64, 33, 2, 9)])
def test_rows_over_several_chunks(lib, d, g, rows, chunks, max_threads):
    """G * L rows above what one simdgroup holds (8; 4 for D > 256) spread over row chunks, which
    share one threadgroup's staged K/V tiles (up to 8 chunks), or, past the pipeline's limit or
    8 chunks, row groups of their own."""
    case = make_case(np.random.default_rng(g * rows), "float16", d, 2, g, 50, [50, 3, 0, 20], rows=rows,
                     starts=[4, 0, 0, 9], window=12, sinks=True)
    p = lib.plan(4, 2 * g, 2, 50, d, "float16", max_threads, rows=rows, window=12)
    assert p["row_chunks"] == chunks
    assert p["group_chunks"] == min(chunks, 8, max_threads // 32, -(-chunks // p["row_groups"]))
    run_and_compare(lib, case, max_threads=max_threads)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_thread_backend_matches_fibers(lib, path):
    """Lanes as OS threads compute bit for bit what the fiber schedule computes."""
    spec = PATHS[path]
    case = make_case(np.random.default_rng(3), "bfloat16", 96, spec["h_kv"], 4, spec["t"], spec["lens"][:3], rows=2,
                     starts=spec["starts"][:3], window=spec["window"], sinks=True)
    np.testing.assert_array_equal(case.run(lib, backend="threads"), case.run(lib))


@pytest.mark.parametrize("layout", ["every_other", "broadcast"])
def test_strided_positions_and_sinks(lib, layout):
    """valid_lens, kv_starts and sinks may be views: every other element of a buffer, or broadcast."""
    spec = PATHS["split_k"]
    b = len(spec["lens"])
    if layout == "every_other":
        case = path_case(np.random.default_rng(9), "split_k", "float16", 128, 4, 2, True, True, True)
        for name in ("valid_lens", "kv_starts"):
            buffer = np.full(2 * b, 10**6, dtype=np.int32)
            buffer[::2] = getattr(case, name)
            setattr(case, name, buffer[::2])
    else:
        case = make_case(np.random.default_rng(9), "float16", 128, 1, 4, spec["t"], [101] * b, rows=2,
                         starts=[3] * b, window=spec["window"])
        case.valid_lens = np.broadcast_to(np.int32(101), (b,))
        case.kv_starts = np.broadcast_to(np.int32(3), (b,))
        case.sinks = np.broadcast_to(np.float32(0.5), (4,))
    run_and_compare(lib, case)


@pytest.mark.parametrize("b,t", [(0, 16), (3, 0)])
def test_empty_inputs(lib, b, t):
    """No request launches nothing; no positions (T = 0) gives zeros."""
    case = make_case(np.random.default_rng(1), "float16", 64, 2, 4, t, [5, 0, -1][:b], rows=2,
                     starts=[1, 0, 2][:b], window=3, sinks=True)
    got = run_and_compare(lib, case)
    assert got.shape == (b, 8, 2, 64) and not got.any()


@pytest.mark.parametrize("layout", ["row_stride", "offset"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype,d", [("float16", 64), ("bfloat16", 96), ("float32", 128), ("bfloat16", 512)])
def test_unaligned_views_take_scalar_loads(lib, dtype, d, path, layout):
    """Rows off the vector width (a row stride of D + 1, or first elements one
    element past a 16-byte boundary) are read with scalar loads: the output of
    the same values through aligned views, bit for bit."""
    spec = PATHS[path]
    case = make_case(np.random.default_rng(d), dtype, d, spec["h_kv"], 2, spec["t"], spec["lens"], rows=2,
                     starts=spec["starts"], window=spec["window"], sinks=True,
                     row_pad=1 if layout == "row_stride" else 0)
    assert_path(lib, case, path)
    got = case.run(lib, shift=1 if layout == "offset" else 0)
    assert not lib.vector_loads()
    np.testing.assert_allclose(to_float64(got, dtype), case.reference(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    case.queries, case.keys, case.values = (np.ascontiguousarray(x) for x in (case.queries, case.keys, case.values))
    np.testing.assert_array_equal(case.run(lib), got)
    assert lib.vector_loads()


def test_size_one_axes_do_not_decide_the_loads(lib):
    """An axis of size 1 is never stepped along: an odd stride there keeps the vector loads."""
    case = make_case(np.random.default_rng(8), "float32", 128, 1, 1, 30, [30], rows=1, window=6)
    odd = 4 * 129
    case.keys = np.lib.stride_tricks.as_strided(case.keys, strides=(odd, odd, *case.keys.strides[2:]))
    case.queries = np.lib.stride_tricks.as_strided(case.queries, strides=(odd, odd, odd, 4))
    run_and_compare(lib, case)
    assert lib.vector_loads()


def test_generic_head_dims_take_any_stride(lib):
    """The generic kernels load scalars: odd strides are fine."""
    case = make_case(np.random.default_rng(2), "float16", 100, 1, 2, 30, [30, 7], rows=2, window=5)
    buffers = [np.zeros((2, shape[1], shape[2], 101), dtype=np.float16)
               for shape in (case.queries.shape, case.keys.shape, case.values.shape)]
    for buffer, view in zip(buffers, (case.queries, case.keys, case.values)):
        buffer[..., :100] = view
    case.queries, case.keys, case.values = (buffer[..., :100] for buffer in buffers)
    run_and_compare(lib, case)
    assert lib.vector_loads()  # one element per load: every view fits


def test_every_head_dim_has_its_kernels(lib):
    """The plan names a main and a reduce kernel of the library for every dtype and head dim 1..512."""
    plans = [lib.plan(1, 1, 1, 4096, d, dtype) for dtype, d in itertools.product(DTYPES, range(1, 513))]
    names = {p["kernel"] for p in plans} | {p["reduce_kernel"] for p in plans}
    assert len(names) == 2 * 3 * (len(FAST_DIMS) + 5)
    for name in names:
        # The registry is searched before the buffers are checked.
        with pytest.raises(HarnessError, match="left unbound"):
            lib.dispatch(name, [], (1, 1, 1), (32, 1, 1))
