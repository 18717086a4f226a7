"""paged_decode_attention on the CPU kernel against float64, over adversarial block tables.

Tables share blocks (two samples of one prompt, a common prefix), repeat a block inside one
request, pad with garbage past each length and hold out-of-pool entries inside it (paged_cases.py).
Every pool row that no query row attends holds NaN keys and inf values, window-cut rows
included, so each case also proves those rows are never read.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, D head dim,
NB blocks, BS rows per block, MB table entries per request.
"""

import mlx.core as mx
import numpy as np
import pytest
from tests.metal_emu.reference import paged_reference_attention
from tests.support.paged_cases import LENGTHS, paged_tables, read_rows

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, max_abs_error, to_numpy64

H_KV = 2


def paged_case(dtype, D, G, L, block_size, window, seed):
    """Queries, clean pools, poisoned pools (NaN/inf where no row reads), tables."""
    rng = np.random.default_rng(seed)
    tables, nb = paged_tables(block_size, seed)
    q = mx.array(rng.standard_normal((len(LENGTHS), H_KV * G, L, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((nb, block_size, H_KV, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((nb, block_size, H_KV, D)).astype(np.float32)).astype(dtype)
    unread = mx.array(~read_rows(tables, LENGTHS, nb, block_size, L, window))[:, :, None, None]
    k_nan = mx.where(unread, mx.array(float("nan"), dtype), k)
    v_nan = mx.where(unread, mx.array(float("inf"), dtype), v)
    return q, k, v, k_nan, v_nan, tables


def float64_paged(q, k, v, tables, lens, window=None, sinks=None, softcap=None):
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = None if sinks is None else to_numpy64(sinks)
    return paged_reference_attention(
        to_numpy64(q), to_numpy64(k), to_numpy64(v), tables, np.asarray(lens), scale, window, s, softcap
    )


def options(G, seed):
    sinks = mx.array(np.random.default_rng(seed).standard_normal(H_KV * G).astype(np.float32) * 2)
    return [(None, None), (6, None), (None, sinks), (1, sinks)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [24, 64, 128])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
def test_matches_float64(dtype, D, G, L, block_size, kernel_calls):
    shared_before = mbd._ext.cpu_shared_items()
    for n, (window, sinks) in enumerate(options(G, seed=D + L)):
        q, k, v, k_nan, v_nan, tables = paged_case(dtype, D, G, L, block_size, window, seed=D * 7 + L + n)
        out = mbd.paged_decode_attention(q, k_nan, v_nan, mx.array(tables), mx.array(LENGTHS), window=window, sinks=sinks)
        mx.eval(out)
        assert out.shape == q.shape and out.dtype == dtype
        expected = float64_paged(q, k, v, tables, LENGTHS, window, sinks)
        assert max_abs_error(out, expected) < TOLERANCE[dtype], (window, sinks is not None)
        assert not np.isnan(np.array(out.astype(mx.float32))).any()
        # Request 4 is empty and request 6 has only out-of-pool blocks: zeros.
        assert mx.all(out[4] == 0).item() and mx.all(out[6] == 0).item()
    assert kernel_calls() == 4
    # Requests 0 and 1 read their common pages in one work item per head.
    assert mbd._ext.cpu_shared_items() > shared_before


def test_reference_matches_float64():
    for block_size, window in ((7, None), (16, 6), (1, 1)):
        q, k, v, _, _, tables = paged_case(mx.float32, 64, 2, 3, block_size, window, seed=block_size)
        sinks = mx.array([0.5, -1.0, 2.0, 0.0])
        out = mbd.reference_paged_attention(q, k, v, mx.array(tables), mx.array(LENGTHS), window=window, sinks=sinks)
        assert max_abs_error(out, float64_paged(q, k, v, tables, LENGTHS, window, sinks)) < 2e-5


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_long_shared_prefix_across_work_items(block_size):
    # 1,100 shared positions span several 512-position work items; lengths, windows and L
    # cut them at points not aligned to items or blocks; two requests share everything.
    rng = np.random.default_rng(block_size)
    B, L, D, nb = 4, 2, 128, 400
    lens = [1130, 1130, 1250, 1101]
    mb = -(-max(lens) // block_size) + 1
    tables = np.full((B, mb), -1, np.int32)
    ids = rng.permutation(nb)
    prefix = -(-1100 // block_size)
    tables[:, :prefix] = ids[:prefix]
    used = prefix
    for b in range(1, B):
        own = -(-lens[b] // block_size) - prefix
        tables[b, prefix : prefix + own] = ids[used : used + own]
        used += own
    tables[0] = tables[1]
    q = mx.array(rng.standard_normal((B, 16, L, D)).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((nb, block_size, 4, D)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((nb, block_size, 4, D)).astype(np.float32)).astype(mx.float16)
    sinks = mx.array([0.5] * 16)
    for window in (None, 1000, 513):
        before = mbd._ext.cpu_shared_items()
        out = mbd.paged_decode_attention(q, k, v, mx.array(tables), mx.array(lens), window=window, sinks=sinks)
        expected = float64_paged(q, k, v, tables, lens, window, sinks)
        assert max_abs_error(out, expected) < TOLERANCE[mx.float16], window
        assert mbd._ext.cpu_shared_items() > before


def test_strided_pools_are_read_in_place():
    # Pools sliced from a larger pool (every other block, a subset of heads): any strides.
    q, k, v, _, _, tables = paged_case(mx.bfloat16, 64, 2, 1, 16, None, seed=3)
    big_k = mx.repeat(mx.concatenate([k, k], axis=2), 2, axis=0)
    big_v = mx.repeat(mx.concatenate([v, v], axis=2), 2, axis=0)
    k_view, v_view = big_k[::2, :, 2:4], big_v[::2, :, 2:4]
    out = mbd.paged_decode_attention(q, k_view, v_view, mx.array(tables), mx.array(LENGTHS))
    assert max_abs_error(out, float64_paged(q, k, v, tables, LENGTHS)) < TOLERANCE[mx.bfloat16]


def test_compile_and_transforms_use_the_contract():
    q, k, v, _, _, tables = paged_case(mx.float32, 64, 2, 1, 7, None, seed=4)
    t, lens = mx.array(tables), mx.array(LENGTHS)
    f = mx.compile(lambda q, k, v: mbd.paged_decode_attention(q, k, v, t, lens, window=6))
    expected = float64_paged(q, k, v, tables, LENGTHS, 6)
    assert max_abs_error(f(q, k, v), expected) < 2e-5
    g = mx.compile(lambda q, k, v: mbd.paged_decode_attention(q, k, v, t, lens), shapeless=True)
    assert max_abs_error(g(q, k, v), float64_paged(q, k, v, tables, LENGTHS)) < 2e-5
    # vjp runs the reference: its gradient equals the reference's own.
    loss = lambda fn: lambda q: fn(q, k, v, t, lens).sum()  # noqa: E731
    grad = mx.grad(loss(mbd.paged_decode_attention))(q)
    assert mx.allclose(grad, mx.grad(loss(mbd.reference_paged_attention))(q), atol=1e-5).item()


def bad(**changes):
    q = mx.zeros((2, 4, 1, 64), mx.float16)
    pages = mx.zeros((5, 16, 2, 64), mx.float16)
    args = dict(queries=q, key_pages=pages, value_pages=pages, block_tables=mx.zeros((2, 3), mx.int32),
                valid_lens=mx.array([3, 4]))
    args.update(changes)
    return args


@pytest.mark.parametrize("fn", [mbd.paged_decode_attention, mbd.reference_paged_attention])
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(queries=mx.zeros((2, 4, 64), mx.float16)), "queries must have shape"),
        (dict(key_pages=mx.zeros((5, 16, 128), mx.float16)), "key_pages must have shape"),
        (dict(value_pages=mx.zeros((5, 8, 2, 64), mx.float16)), "value_pages must have the shape"),
        (dict(key_pages=mx.zeros((5, 16, 3, 64), mx.float16), value_pages=mx.zeros((5, 16, 3, 64), mx.float16)),
         "multiple of the number of key/value heads"),
        (dict(key_pages=mx.zeros((0, 16, 2, 64), mx.float16), value_pages=mx.zeros((0, 16, 2, 64), mx.float16)),
         "at least one block"),
        (dict(value_pages=mx.zeros((5, 16, 2, 64), mx.float32)), "share one dtype"),
        (dict(block_tables=mx.zeros((2, 3), mx.int64)), "block_tables must be int32"),
        (dict(block_tables=mx.zeros((3, 3), mx.int32)), "block_tables must have shape"),
        (dict(block_tables=mx.zeros((2,), mx.int32)), "block_tables must have shape"),
        (dict(valid_lens=mx.array([1.0, 2.0])), "valid_lens must have an integer dtype"),
        (dict(valid_lens=mx.array([1, 2, 3])), "valid_lens must have shape"),
    ],
)
def test_malformed_arguments_raise_before_any_work(fn, changes, message, kernel_calls):
    with pytest.raises(ValueError, match=r"^\[paged_decode_attention\] .*" + message):
        fn(**bad(**changes))
    for options_, message_ in ((dict(window=0), "window must be >= 1"), (dict(scale=float("inf")), "scale must be finite"),
                               (dict(sinks=mx.zeros((3,))), "sinks must have shape")):
        with pytest.raises(ValueError, match=message_):
            fn(**bad(), **options_)
    assert kernel_calls() == 0
