"""Packed queries (query_starts) on the four ops: request b's q_b rows (0 allowed) sit at
len_b - q_b + i, bottom-right causal, against a float64 reference of each request on its own rows,
across dtypes, head dims, GQA groups, q_b from 0 to 512, windows, sinks, kv_starts and softcap;
NaN and inf wherever no row reads; malformed starts raise before any work is queued.

Dimension legend: B requests, N packed rows, H_q query heads, H_kv KV heads, G = H_q / H_kv,
T cache positions, D head dim.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.metal_emu.reference import paged_reference_attention, row_range
from tests.metal_emu.reference import reference_attention as float64_attention
from tests.ops import test_quantized_attention as quantized
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, make_inputs, max_abs_error, to_numpy64

H_KV = 2
# Rows per request and lengths: an empty request, decodes, a short chunk longer than its keys
# (rows before position 0), a draft of 5 and a long chunk ending in a long request.
ROWS = [0, 1, 2, 5, 37, 1]
LENS = [9, 0, 40, 80, 130, 1]
T = 140
STARTS = [0, 0, 3, 50, 7, 0]


def starts_of(rows):
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)


def read_positions(lens, rows, starts, window, t=T):
    """bool [B, T]: the positions some row of each request attends."""
    mask = np.zeros((len(lens), t), dtype=bool)
    for b, (n, q_b) in enumerate(zip(lens, rows)):
        n, s = int(np.clip(n, 0, t)), int(np.clip(0 if starts is None else starts[b], 0, t))
        for i in range(q_b):
            lo, hi = row_range(n, s, q_b, i, window)
            mask[b, lo : max(lo, hi)] = True
    return mask


def packed_case(dtype, D, G, rows, lens, starts, window, seed, t=T):
    """Packed queries [N, H_q, D], clean keys/values [B, H_kv, T, D] and poisoned ones."""
    rng = np.random.default_rng(seed)
    B, N = len(rows), int(sum(rows))
    q = mx.array(rng.standard_normal((N, H_KV * G, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, H_KV, t, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H_KV, t, D)).astype(np.float32)).astype(dtype)
    unread = mx.array(~read_positions(lens, rows, starts, window, t))[:, None, :, None]
    return q, k, v, mx.where(unread, mx.array(float("nan"), dtype), k), mx.where(unread, mx.array(float("inf"), dtype), v)


def packed_expected(q, k, v, lens, rows, starts=None, window=None, sinks=None, softcap=None):
    """float64 [N, H_q, D]: each request's rows through the float64 reference, L = q_b."""
    q64, k64, v64 = to_numpy64(q), to_numpy64(k), to_numpy64(v)
    scale = 1.0 / np.sqrt(q64.shape[-1])
    s64 = None if sinks is None else to_numpy64(sinks)
    out = np.zeros(q64.shape)
    qs = starts_of(rows)
    for b in range(len(rows)):
        lo, hi = qs[b], qs[b + 1]
        if hi == lo:
            continue
        st = None if starts is None else np.asarray(starts[b : b + 1])
        r = float64_attention(q64[lo:hi].transpose(1, 0, 2)[None], k64[b : b + 1], v64[b : b + 1],
                              np.asarray(lens[b : b + 1]), scale, st, window, s64, softcap)
        out[lo:hi] = r[0].transpose(1, 0, 2)
    return out


def option_sets(G, seed):
    sinks = mx.array(np.random.default_rng(seed).standard_normal(H_KV * G).astype(np.float32) * 2)
    return [
        dict(),
        dict(kv_starts=STARTS),
        dict(window=6),
        dict(sinks=sinks, softcap=1.5),
        dict(kv_starts=STARTS, window=20, sinks=sinks),
    ]


def call_kw(opts):
    kw = dict(opts)
    if "kv_starts" in kw:
        kw["kv_starts"] = mx.array(kw["kv_starts"])
    return kw


def expected_kw(opts):
    return dict(starts=opts.get("kv_starts"), window=opts.get("window"), sinks=opts.get("sinks"),
                softcap=opts.get("softcap"))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("G", [1, 4])
def test_dense_matches_float64(dtype, D, G, kernel_calls):
    qs = mx.array(starts_of(ROWS))
    for n, opts in enumerate(option_sets(G, seed=D + G)):
        q, k, v, k_nan, v_nan = packed_case(dtype, D, G, ROWS, LENS, opts.get("kv_starts"), opts.get("window"),
                                            seed=D * 7 + G + n)
        out = mbd.batched_decode_attention(q, k_nan, v_nan, mx.array(LENS), query_starts=qs, **call_kw(opts))
        assert out.shape == q.shape and out.dtype == dtype
        err = max_abs_error(out, packed_expected(q, k, v, LENS, ROWS, **expected_kw(opts)))
        assert err < TOLERANCE[dtype], (opts.keys(), err)
    assert kernel_calls() == len(option_sets(G, 0))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("G", [4, 16])
def test_long_chunk_beside_decodes(dtype, G):
    # A 512-row prefill chunk over 600 keys in one call with three decodes and an empty request.
    rows, lens = [1, 512, 0, 1, 1], [300, 600, 5, 1, 77]
    q, k, v, k_nan, v_nan = packed_case(dtype, 64, G, rows, lens, None, None, seed=G, t=600)
    out = mbd.batched_decode_attention(q, k_nan, v_nan, mx.array(lens), query_starts=mx.array(starts_of(rows)))
    assert max_abs_error(out, packed_expected(q, k, v, lens, rows)) < TOLERANCE[dtype]


def test_decode_rows_equal_the_unpacked_call():
    # query_starts = arange(B + 1): the packed call is the L = 1 call, row for row.
    q, k, v = make_inputs(5, 8, 2, 50, 128, mx.float16, seed=2)
    lens = mx.array([50, 1, 0, 33, 17])
    plain = mbd.batched_decode_attention(q, k, v, lens, window=9)
    packed = mbd.batched_decode_attention(q[:, :, 0], k, v, lens, window=9, query_starts=mx.arange(6))
    assert mx.array_equal(packed, plain[:, :, 0]).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("G", [1, 4])
def test_ring_matches_float64(dtype, G, kernel_calls):
    # Rings (ring_offset): logical position j of request b in slot (j + offset_b) mod T; offsets
    # past T, negative and huge. Slots no row reads hold NaN keys and inf values.
    offsets = [0, 13, -5, 2**40 + 3, 69, 140]
    for n, opts in enumerate(option_sets(G, seed=G)):
        q, k, v, k_nan, v_nan = packed_case(dtype, 64, G, ROWS, LENS, opts.get("kv_starts"), opts.get("window"),
                                            seed=G * 11 + n)
        slots = (np.arange(T)[None, :] + np.array(offsets, dtype=np.int64)[:, None]) % T  # [B, T]: logical -> slot
        order = mx.array(np.argsort(slots, axis=1).astype(np.int32))[:, None, :, None]  # slot -> logical
        k_ring, v_ring = (mx.take_along_axis(x, order, axis=2) for x in (k_nan, v_nan))
        out = mbd.batched_decode_attention(q, k_ring, v_ring, mx.array(LENS), query_starts=mx.array(starts_of(ROWS)),
                                           ring_offset=mx.array(offsets, dtype=mx.int64), **call_kw(opts))
        err = max_abs_error(out, packed_expected(q, k, v, LENS, ROWS, **expected_kw(opts)))
        assert err < TOLERANCE[dtype], (opts.keys(), err)
    assert kernel_calls() == len(option_sets(G, 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_matches_float64(dtype, block_size, kernel_calls):
    # Requests 1 and 2 share their first pages: packed rows differ per request, so no item is shared.
    rows, lens = [3, 1, 1, 37, 0], [40, 33, 33, 60, 9]
    rng = np.random.default_rng(block_size)
    mb = -(-max(lens) // block_size) + 1
    nb = sum(-(-n // block_size) for n in lens) + 2
    tables = rng.permutation(nb * 2)[: len(lens) * mb].reshape(len(lens), mb) % nb
    tables[2, : 33 // block_size] = tables[1, : 33 // block_size]
    tables[4, 0] = -1
    q = mx.array(rng.standard_normal((sum(rows), 8, 64)).astype(np.float32)).astype(dtype)
    kp = mx.array(rng.standard_normal((nb, block_size, H_KV, 64)).astype(np.float32)).astype(dtype)
    vp = mx.array(rng.standard_normal((nb, block_size, H_KV, 64)).astype(np.float32)).astype(dtype)
    for window in (None, 7):
        out = mbd.paged_decode_attention(q, kp, vp, mx.array(tables.astype(np.int32)), mx.array(lens),
                                         window=window, query_starts=mx.array(starts_of(rows)))
        want = np.zeros(out.shape)
        qs = starts_of(rows)
        for b in range(len(rows)):
            if rows[b]:
                r = paged_reference_attention(
                    to_numpy64(q)[qs[b] : qs[b + 1]].transpose(1, 0, 2)[None], to_numpy64(kp), to_numpy64(vp),
                    tables[b : b + 1], np.asarray(lens[b : b + 1]), 64**-0.5, window)
                want[qs[b] : qs[b + 1]] = r[0].transpose(1, 0, 2)
        assert max_abs_error(out, want) < TOLERANCE[dtype]
    assert kernel_calls() == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_matches_float64(dtype, bits, kernel_calls):
    rows, lens = [2, 0, 1, 5, 1, 9], quantized.LENGTHS
    rng = np.random.default_rng(bits)
    q = mx.array(rng.standard_normal((sum(rows), 4, 64)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((6, 2, quantized.T, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((6, 2, quantized.T, 64)).astype(np.float32))
    kq, vq = quantized.quantized(k, 32, bits, dtype), quantized.quantized(v, 32, bits, dtype)
    out = mbd.quantized_batched_decode_attention(q, kq, vq, mx.array(lens), group_size=32, bits=bits, window=30,
                                                 query_starts=mx.array(starts_of(rows)))
    k64 = mx.array(quantized.dequantize64(*kq, 32, bits).astype(np.float32))
    v64 = mx.array(quantized.dequantize64(*vq, 32, bits).astype(np.float32))
    assert max_abs_error(out, packed_expected(q, k64, v64, lens, rows, window=30)) < TOLERANCE[dtype]
    assert kernel_calls() == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_ragged_matches_float64(dtype, kernel_calls):
    rows, lens = [1, 4, 0, 2], [20, 9, 3, 55]
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((sum(rows), 8, 80)).astype(np.float32)).astype(dtype)
    ks = [mx.array(rng.standard_normal((1, H_KV, n + 3, 80)).astype(np.float32)).astype(dtype) for n in lens]
    vs = [mx.array(rng.standard_normal((1, H_KV, n + 3, 80)).astype(np.float32)).astype(dtype) for n in lens]
    out = mbd.ragged_decode_attention(q, [x[:, :, :n] for x, n in zip(ks, lens)],
                                      [x[:, :, :n] for x, n in zip(vs, lens)], softcap=2.0,
                                      query_starts=mx.array(starts_of(rows)))
    want = np.zeros(out.shape)
    qs = starts_of(rows)
    for b, n in enumerate(lens):
        if rows[b]:
            r = float64_attention(to_numpy64(q)[qs[b] : qs[b + 1]].transpose(1, 0, 2)[None], to_numpy64(ks[b]),
                                  to_numpy64(vs[b]), np.array([n]), 80**-0.5, softcap=2.0)
            want[qs[b] : qs[b + 1]] = r[0].transpose(1, 0, 2)
    assert max_abs_error(out, want) < TOLERANCE[dtype]
    assert kernel_calls() == 1


def test_references_match_float64():
    # The fallbacks of the transforms, each reference op on packed queries.
    q, k, v, _, _ = packed_case(mx.float32, 64, 4, ROWS, LENS, STARTS, 20, seed=3)
    qs = mx.array(starts_of(ROWS))
    want = packed_expected(q, k, v, LENS, ROWS, starts=STARTS, window=20)
    out = mbd.reference_attention(q, k, v, mx.array(LENS), kv_starts=mx.array(STARTS), window=20, query_starts=qs)
    assert max_abs_error(out, want) < 2e-5
    keys = [k[b : b + 1] for b in range(len(LENS))]
    values = [v[b : b + 1] for b in range(len(LENS))]
    out = mbd.reference_ragged_attention(q, keys, values, mx.array(LENS), kv_starts=mx.array(STARTS), window=20,
                                         query_starts=qs)
    assert max_abs_error(out, want) < 2e-5


def test_vjp_and_jvp_follow_the_reference():
    q, k, v, _, _ = packed_case(mx.float32, 32, 2, [3, 0, 2], [12, 4, 7], None, None, seed=5, t=12)
    lens, qs = mx.array([12, 4, 7]), mx.array([0, 3, 3, 5])

    def fused(q, k, v):
        return (mbd.batched_decode_attention(q, k, v, lens, query_starts=qs) ** 2).sum()

    def plain(q, k, v):
        return (mbd.reference_attention(q, k, v, lens, query_starts=qs) ** 2).sum()

    for g_fused, g_plain in zip(mx.grad(fused, argnums=(0, 1, 2))(q, k, v), mx.grad(plain, argnums=(0, 1, 2))(q, k, v)):
        assert g_fused.shape == g_plain.shape
        assert max_abs_error(g_fused, to_numpy64(g_plain)) < 1e-5
    # A row's gradient is its own request's: the empty request's keys get none.
    g_k = mx.grad(fused, argnums=1)(q, k, v)
    assert mx.all(g_k[1] == 0).item() and mx.any(g_k[0] != 0).item()
    tangents = [mx.ones_like(q), mx.zeros_like(k), mx.zeros_like(v)]
    (jf,) = mx.jvp(lambda q, k, v: mbd.batched_decode_attention(q, k, v, lens, query_starts=qs), [q, k, v],
                   tangents)[1]
    (jp,) = mx.jvp(lambda q, k, v: mbd.reference_attention(q, k, v, lens, query_starts=qs), [q, k, v], tangents)[1]
    assert max_abs_error(jf, to_numpy64(jp)) < 1e-5


def test_compile(kernel_calls):
    q, k, v, _, _ = packed_case(mx.float16, 64, 4, ROWS, LENS, None, None, seed=8)
    f = mx.compile(lambda q, k, v, n, s: mbd.batched_decode_attention(q, k, v, n, query_starts=s) * 2)
    out = f(q, k, v, mx.array(LENS), mx.array(starts_of(ROWS)))
    assert max_abs_error(out, 2 * packed_expected(q, k, v, LENS, ROWS)) < 2 * TOLERANCE[mx.float16]
    assert kernel_calls() == 1


@pytest.mark.parametrize("starts", [[0, 2, 1, 4], [0, 1, 2, 3], [1, 1, 2, 4], [-3, 1, 2, 4], [0, 5, 9, 4]])
def test_malformed_starts_inside_compile_give_zeros(starts, kernel_calls):
    # The op cannot read traced values: the kernel checks them and writes zeros, reading nothing.
    q, k, v, _, _ = packed_case(mx.float32, 64, 1, [1, 1, 2], [5, 5, 5], None, None, seed=1, t=8)
    f = mx.compile(lambda q, k, v, n, s: mbd.batched_decode_attention(q, k, v, n, query_starts=s))
    out = f(q, k, v, mx.array([5, 5, 5]), mx.array(starts, dtype=mx.int32))
    assert out.shape == q.shape and mx.all(out == 0).item()
    assert kernel_calls() == 1


@pytest.mark.parametrize(
    "message, starts",
    [
        (r"query_starts must have shape \[B \+ 1\] = \(4,\), got \(3,\)", [0, 2, 4]),
        (r"query_starts must start at 0 and end at N = 4, got 1 \.\. 4", [1, 2, 3, 4]),
        (r"query_starts must start at 0 and end at N = 4, got 0 \.\. 3", [0, 1, 2, 3]),
        (r"query_starts must start at 0 and end at N = 4, got 0 \.\. 5", [0, 1, 2, 5]),
        (r"query_starts must not decrease, got 3 then 2 at request 1", [0, 3, 2, 4]),
        (r"query_starts must not decrease, got 0 then -1 at request 0", [0, -1, 2, 4]),
    ],
)
def test_malformed_starts_raise(message, starts, kernel_calls):
    q, k, v, _, _ = packed_case(mx.float32, 64, 1, [1, 1, 2], [5, 5, 5], None, None, seed=1, t=8)
    lens = mx.array([5, 5, 5])
    k8, v8 = mx.quantize(k, group_size=64, bits=8), mx.quantize(v, group_size=64, bits=8)
    pages = k.reshape(3, 8, 2, 64)
    tables = mx.array([[0], [1], [2]])
    qs = mx.array(starts)
    calls = {
        "batched_decode_attention": lambda: mbd.batched_decode_attention(q, k, v, lens, query_starts=qs),
        "paged_decode_attention": lambda: mbd.paged_decode_attention(q, pages, pages, tables, lens, query_starts=qs),
        "quantized_batched_decode_attention": lambda: mbd.quantized_batched_decode_attention(
            q, k8, v8, lens, group_size=64, bits=8, query_starts=qs),
        "ragged_decode_attention": lambda: mbd.ragged_decode_attention(
            q, [k[b : b + 1] for b in range(3)], [v[b : b + 1] for b in range(3)], query_starts=qs),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=rf"^\[{op}\] {message}"):
            call()
    assert kernel_calls() == 0


def test_malformed_shapes_raise(kernel_calls):
    q, k, v, _, _ = packed_case(mx.float32, 64, 1, [1, 1, 2], [5, 5, 5], None, None, seed=1, t=8)
    lens, qs = mx.array([5, 5, 5]), mx.array([0, 1, 2, 4])
    with pytest.raises(ValueError, match=r"queries must have shape \[N, H_q, D\] with query_starts"):
        mbd.batched_decode_attention(q[None], k, v, lens, query_starts=qs)
    with pytest.raises(ValueError, match=r"at least one row \(N >= 1\)"):
        mbd.batched_decode_attention(q[:0], k, v, lens, query_starts=mx.array([0, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"query_starts must have an integer dtype"):
        mbd.batched_decode_attention(q, k, v, lens, query_starts=qs.astype(mx.float32))
    assert kernel_calls() == 0


def test_vmap_over_stacked_steps():
    # Three serving steps of one shape at once: vmap runs the fallback, request by request.
    q = mx.random.normal((3, 5, 4, 32), key=mx.random.key(1))
    k = mx.random.normal((3, 2, 2, 9, 32), key=mx.random.key(2))
    v = mx.random.normal((3, 2, 2, 9, 32), key=mx.random.key(3))
    lens, qs = mx.array([9, 4]), mx.array([0, 3, 5])
    out = mx.vmap(lambda q, k, v: mbd.batched_decode_attention(q, k, v, lens, query_starts=qs))(q, k, v)
    assert out.shape == (3, 5, 4, 32)
    for i in range(3):
        assert max_abs_error(out[i], packed_expected(q[i], k[i], v[i], [9, 4], [3, 2])) < 2e-5
