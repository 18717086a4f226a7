"""The CPU kernel's AMX tile path (float16 and bfloat16 work items with many query rows)
against float64, on CPUs that have AMX; skipped, with the reason, elsewhere.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, T positions,
D head dim. A work item has R = G * L query rows (times the requests it serves where they
share pages); the tiles take float16 items with R >= 12 and bfloat16 items with R >= 8, in
groups of 16 rows.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.support.numerics import TOLERANCE, dtype_id, max_abs_error, numpy_reference
from tests.ops.test_decode_shapes import LENGTHS, STARTS, T, shape_case
from tests.ops.test_paged_decode import float64_paged
from tests.ops.test_query_starts import packed_case, packed_expected, starts_of
from tests.support.paged_cases import read_rows

pytestmark = pytest.mark.skipif(
    "amx" not in mbd._ext.cpu_isas(), reason="this CPU (or OS) offers no AMX tiles"
)
DTYPES = [mx.float16, mx.bfloat16]


@pytest.fixture(autouse=True)
def amx_variant():
    previous = mbd._ext.cpu_isa()
    mbd._ext.set_cpu_isa("amx")
    yield
    mbd._ext.set_cpu_isa(previous)


def tile_blocks_of(fn):
    """(fn's result, the blocks it computed on tiles)."""
    start = mbd._ext.cpu_tile_blocks()
    out = fn()
    mx.eval(out)
    return out, mbd._ext.cpu_tile_blocks() - start


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [1, 24, 32, 80, 112, 128, 192, 512])
@pytest.mark.parametrize("G,L", [(4, 3), (4, 4), (2, 10), (8, 5), (1, 12)])
def test_matches_float64(dtype, D, G, L):
    sinks = mx.array(np.linspace(-1.0, 2.0, 2 * G).astype(np.float32))
    for starts, window in ((None, None), (STARTS, 6), (None, 100)):
        q, k, v, k_nan, v_nan = shape_case(dtype, D, G, L, window, starts, seed=D + G + L)
        out, blocks = tile_blocks_of(
            lambda: mbd.batched_decode_attention(
                q, k_nan, v_nan, mx.array(LENGTHS),
                kv_starts=None if starts is None else mx.array(starts), window=window, sinks=sinks,
            )
        )
        assert blocks > 0, "the tile path did not run"
        expected = numpy_reference(q, k, v, LENGTHS, kv_starts=starts, window=window, sinks=sinks)
        assert max_abs_error(out, expected) < TOLERANCE[dtype], (starts, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_long_requests_and_layouts(dtype):
    # Several 512-key items per request, lengths not a multiple of the 32-key block, and the
    # cache read through a prefix view, a [B, T, H_kv, D] transpose, a strided last axis and a
    # negative position stride.
    rng = np.random.default_rng(4)
    B, H_kv, G, L, D, cap = 3, 2, 4, 4, 128, 1200
    q = mx.array(rng.standard_normal((B, H_kv * G, L, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, H_kv, cap, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H_kv, cap, D)).astype(np.float32)).astype(dtype)
    lens, starts = [1100, 530, 77], [0, 3, 70]
    layouts = {
        "prefix view": (k[:, :, :1101], v[:, :, :1101]),
        "transposed": tuple(
            mx.contiguous(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)[:, :, :1101] for x in (k, v)
        ),
        "strided last axis": tuple(mx.repeat(x, 2, axis=-1)[..., ::2][:, :, :1101] for x in (k, v)),
        "positions reversed in memory": tuple(
            mx.contiguous(x[:, :, ::-1])[:, :, ::-1][:, :, :1101] for x in (k, v)
        ),
    }
    expected = numpy_reference(q, k[:, :, :1101], v[:, :, :1101], lens, kv_starts=starts, window=700)
    for name, (k_in, v_in) in layouts.items():
        out, blocks = tile_blocks_of(
            lambda: mbd.batched_decode_attention(
                q, k_in, v_in, mx.array(lens), kv_starts=mx.array(starts), window=700
            )
        )
        assert blocks > 0, name
        assert max_abs_error(out, expected) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [80, 128])
def test_query_layouts(dtype, D):
    # The queries become tile operands by a masked load of each contiguous row (D = 80 ends
    # within a 32-element chunk), or element by element along a strided last axis. Rows
    # followed by inf in memory stay on the tiles only if nothing past D is read.
    q, k, v, _, _ = shape_case(dtype, D, 4, 4, None, None, seed=D)
    expected = numpy_reference(q, k, v, LENGTHS)
    inf_after = mx.full((*q.shape[:-1], 16), float("inf"), dtype)
    layouts = {
        "[B, L, H_q, D] in memory": mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3),
        "rows followed by inf": mx.concatenate([q, inf_after], axis=-1)[..., :D],
        "strided last axis": mx.repeat(q, 2, axis=-1)[..., ::2],
    }
    for name, q_in in layouts.items():
        out, blocks = tile_blocks_of(lambda: mbd.batched_decode_attention(q_in, k, v, mx.array(LENGTHS)))
        assert blocks > 0, name
        assert max_abs_error(out, expected) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("poison", ["keys", "values", "queries"])
@pytest.mark.parametrize("L", [4, 8])
def test_non_finite_blocks_leave_other_rows_alone(dtype, poison, L):
    # A tile product cannot skip inf or NaN, so a block (or, for queries, an item) holding one
    # runs on the vector path: rows that do not attend it stay exact, and the whole result
    # equals the vector-only variant's, NaN for NaN. L = 8 makes two row groups, whose
    # states must both be untouched when the block is left to the vector path.
    G = 4
    q, k, v, _, _ = shape_case(dtype, 64, G, L, 6, None, seed=12)
    lens = mx.array(LENGTHS)
    position = T - L - 5  # attended by row 0 of request 0 only (window 6)
    bad = {"keys": mx.array(k), "values": mx.array(v), "queries": mx.array(q)}[poison]
    if poison == "queries":
        bad[0, 1, 2, 7] = float("inf")
    else:
        bad[0, :, position, 3] = float("inf")
    args = {"keys": (q, bad, v), "values": (q, k, bad), "queries": (bad, k, v)}[poison]
    out = mbd.batched_decode_attention(*args, lens, window=6)
    mbd._ext.set_cpu_isa("avx512bf16")
    vector = mbd.batched_decode_attention(*args, lens, window=6)
    mx.eval(vector)
    mbd._ext.set_cpu_isa("amx")
    out_np = np.array(out.astype(mx.float32))
    vector_np = np.array(vector.astype(mx.float32))
    assert np.array_equal(np.isnan(out_np), np.isnan(vector_np))
    assert np.array_equal(np.isinf(out_np), np.isinf(vector_np))
    finite = np.isfinite(vector_np)
    assert np.abs(out_np[finite] - vector_np[finite]).max() < TOLERANCE[dtype]
    if poison != "queries":
        # Only row 0 of request 0 attends the poisoned key.
        assert not np.isfinite(out_np[0, :, 0]).all()
        assert np.isfinite(out_np[0, :, 1:]).all() and np.isfinite(out_np[1:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [7, 16])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major pool", "head-major pool"])
def test_shared_pages_run_on_the_tiles(dtype, block_size, head_major):
    # G = 4, L = 1: 4 query rows a request, below the threshold, but the requests that share
    # a prefix's pages make one work item of 4 x (requests) rows per head, which the tiles
    # take in either pool layout (token-major [NB, BS, H_kv, D] too: those items keep one
    # head each). Blocks of 7 rows put page boundaries inside the 32-key blocks; the rows no
    # request attends hold NaN keys and inf values.
    rng = np.random.default_rng(block_size)
    H_kv, G, D = 2, 4, 128
    lens = [700, 700, 650, 613, 90, 0]
    prefix = 600 // block_size
    pages = [-(-n // block_size) for n in lens]
    nb = prefix + sum(p - prefix for p in pages[:4]) + pages[4] + 2
    ids = iter(rng.permutation(nb).tolist())
    tables = np.full((len(lens), max(pages) + 1), -1, np.int32)
    shared = [next(ids) for _ in range(prefix)]
    for b in range(4):
        tables[b, :prefix] = shared
        tables[b, prefix : pages[b]] = [next(ids) for _ in range(pages[b] - prefix)]
    tables[4, : pages[4]] = [next(ids) for _ in range(pages[4])]
    q = mx.array(rng.standard_normal((len(lens), H_kv * G, 1, D)).astype(np.float32)).astype(dtype)
    # Poisoned in the pool's own layout, then viewed as [NB, BS, H_kv, D].
    shape = (nb, H_kv, block_size, D) if head_major else (nb, block_size, H_kv, D)
    k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype) for _ in range(2))
    unread = ~read_rows(tables, lens, nb, block_size, 1, None)
    unread = mx.array(unread[:, None, :, None] if head_major else unread[:, :, None, None])
    k_nan = mx.where(unread, mx.array(float("nan"), dtype), k)
    v_nan = mx.where(unread, mx.array(float("inf"), dtype), v)
    if head_major:
        k, v, k_nan, v_nan = (mx.swapaxes(x, 1, 2) for x in (k, v, k_nan, v_nan))
    shared_before = mbd._ext.cpu_shared_items()
    out, blocks = tile_blocks_of(
        lambda: mbd.paged_decode_attention(q, k_nan, v_nan, mx.array(tables), mx.array(lens))
    )
    assert mbd._ext.cpu_shared_items() > shared_before
    assert blocks > 0, "the shared pages did not run on the tiles"
    assert max_abs_error(out, float64_paged(q, k, v, tables, lens)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_few_rows_stay_on_the_vector_path(dtype):
    # Below the row threshold the vector path is cheaper; L = 1 with G = 4 is 4 rows.
    q, k, v, _, _ = shape_case(dtype, 128, 4, 1, None, None, seed=1)
    out, blocks = tile_blocks_of(lambda: mbd.batched_decode_attention(q, k, v, mx.array(LENGTHS)))
    assert blocks == 0
    assert max_abs_error(out, numpy_reference(q, k, v, LENGTHS)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_packed_chunks_on_the_tiles(dtype):
    # A 200-row prefill chunk beside decodes, with softcap: the chunk's row groups that no key of
    # a block reaches keep their state, the others run on the tiles; the decodes stay on vectors.
    rows, lens = [1, 200, 0, 1], [40, 230, 3, 7]
    q, k, v, k_nan, v_nan = packed_case(dtype, 64, 4, rows, lens, None, None, seed=4, t=240)
    out, blocks = tile_blocks_of(
        lambda: mbd.batched_decode_attention(
            q, k_nan, v_nan, mx.array(lens), query_starts=mx.array(starts_of(rows)), softcap=2.0
        )
    )
    assert blocks > 0, "the tile path did not run"
    assert max_abs_error(out, packed_expected(q, k, v, lens, rows, softcap=2.0)) < TOLERANCE[dtype]
