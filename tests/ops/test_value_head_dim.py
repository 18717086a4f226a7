"""Values with a head dim of their own (Dv) on the dense, paged and ragged ops: output [..., Dv],
against the float64 reference across dtypes, (Dk, Dv) pairs, GQA groups up to 128 and the options;
MLA in latent space, its values a view of the keys' first 512 columns read in place.

Dimension legend: B requests, H_q query heads, H_kv KV heads, G = H_q / H_kv, L query rows,
T cache positions, Dk the head dim of queries and keys, Dv of values.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.metal_emu.reference import paged_reference_attention
from tests.ops.test_decode_shapes import LENGTHS, STARTS, attended
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, max_abs_error, numpy_reference, to_numpy64

T = 45


def case(dtype, Dk, Dv, G, L, window, starts, seed, H_kv=2, view=False):
    """Queries [B, H_q, L, Dk], keys [B, H_kv, T, Dk], values [B, H_kv, T, Dv] (with view, the keys'
    first Dv columns), clean and with NaN / inf where no row reads."""
    rng = np.random.default_rng(seed)
    B = len(LENGTHS)
    q = mx.array(rng.standard_normal((B, H_kv * G, L, Dk)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, H_kv, T, Dk)).astype(np.float32)).astype(dtype)
    v = k[..., :Dv] if view else mx.array(rng.standard_normal((B, H_kv, T, Dv)).astype(np.float32)).astype(dtype)
    unread = mx.array(~attended(LENGTHS, starts or [0] * B, L, window))[:, None, :, None]
    k_bad = mx.where(unread, mx.array(float("nan"), dtype), k)
    v_bad = k_bad[..., :Dv] if view else mx.where(unread, mx.array(float("inf"), dtype), v)
    return q, k, v, k_bad, v_bad


# (Dk, Dv): a fast head dim of both, DeepSeek-V2's 192 / 128, MLA's latent 576 / 512, generic ones.
PAIRS = [(80, 80), (192, 128), (40, 24), (24, 100)]
OPTIONS = [(None, None, False), (STARTS, 6, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("Dk,Dv", PAIRS)
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("L", [1, 3])
def test_dense_matches_float64(dtype, Dk, Dv, G, L, kernel_calls):
    for n, (starts, window, with_sinks) in enumerate(OPTIONS):
        sinks = mx.array(np.linspace(-1, 2, 2 * G).astype(np.float32)) if with_sinks else None
        q, k, v, k_bad, v_bad = case(dtype, Dk, Dv, G, L, window, starts, seed=Dk + Dv + G + L + n)
        out = mbd.batched_decode_attention(
            q, k_bad, v_bad, mx.array(LENGTHS), kv_starts=None if starts is None else mx.array(starts),
            window=window, sinks=sinks)
        assert out.shape == (*q.shape[:3], Dv) and out.dtype == dtype
        want = numpy_reference(q, k, v, LENGTHS, kv_starts=starts, window=window, sinks=sinks)
        assert max_abs_error(out, want) < TOLERANCE[dtype]
    assert kernel_calls() == len(OPTIONS)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("G,L", [(16, 2), (128, 1)])
def test_mla_latent_values_are_a_view_of_the_keys(dtype, G, L, kernel_calls):
    # One KV head of 576 (latent 512 + rope 64) for all query heads; values the latent, in place.
    q, k, v, k_bad, v_bad = case(dtype, 576, 512, G, L, None, None, seed=G, H_kv=1, view=True)
    out = mbd.batched_decode_attention(q, k_bad, v_bad, mx.array(LENGTHS), scale=0.07, softcap=20.0)
    assert out.shape == (*q.shape[:3], 512)
    want = numpy_reference(q, k, v, LENGTHS, scale=0.07, softcap=20.0)
    assert max_abs_error(out, want) < TOLERANCE[dtype]
    assert kernel_calls() == 1


def test_mla_chunk_with_packed_queries():
    # A prefill chunk and decodes of MLA heads in one call: packed rows, narrower values.
    q, k, v, _, _ = case(mx.bfloat16, 576, 512, 8, 1, None, None, seed=3, H_kv=1, view=True)
    rows = [1, 0, 1, 7, 30, 1]
    qs = np.concatenate([[0], np.cumsum(rows)])
    packed = mx.array(np.random.default_rng(4).standard_normal((qs[-1], 8, 576)).astype(np.float32)).astype(mx.bfloat16)
    out = mbd.batched_decode_attention(packed, k, v, mx.array(LENGTHS), query_starts=mx.array(qs))
    assert out.shape == (qs[-1], 8, 512)
    want = np.zeros(out.shape)
    for b in range(len(rows)):
        if rows[b]:
            rows_b = packed[qs[b] : qs[b + 1]].transpose(1, 0, 2)[None]
            want[qs[b] : qs[b + 1]] = numpy_reference(rows_b, k[b : b + 1], v[b : b + 1], LENGTHS[b : b + 1])[0].transpose(1, 0, 2)
    assert max_abs_error(out, want) < TOLERANCE[mx.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_matches_float64(dtype, block_size, kernel_calls):
    rng = np.random.default_rng(block_size)
    lens, B = [40, 0, 17, 61], 4
    mb = -(-max(lens) // block_size)
    nb = B * mb + 1
    tables = rng.permutation(nb)[: B * mb].reshape(B, mb).astype(np.int32)
    q = mx.array(rng.standard_normal((B, 8, 2, 192)).astype(np.float32)).astype(dtype)
    kp = mx.array(rng.standard_normal((nb, block_size, 2, 192)).astype(np.float32)).astype(dtype)
    vp = mx.array(rng.standard_normal((nb, block_size, 2, 128)).astype(np.float32)).astype(dtype)
    for pool in (vp, kp[..., :128]):  # values of their own, then a view of the key pool
        out = mbd.paged_decode_attention(q, kp, pool, mx.array(tables), mx.array(lens), window=30)
        assert out.shape == (B, 8, 2, 128)
        want = paged_reference_attention(to_numpy64(q), to_numpy64(kp), to_numpy64(pool), tables, np.array(lens),
                                         192**-0.5, 30)
        assert max_abs_error(out, want) < TOLERANCE[dtype]
    assert kernel_calls() == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_ragged_matches_float64(dtype, kernel_calls):
    rng = np.random.default_rng(2)
    lens = [5, 30, 0, 12]
    q = mx.array(rng.standard_normal((4, 4, 1, 96)).astype(np.float32)).astype(dtype)
    ks = [mx.array(rng.standard_normal((1, 2, n, 96)).astype(np.float32)).astype(dtype) for n in lens]
    vs = [mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32)).astype(dtype) for n in lens]
    out = mbd.ragged_decode_attention(q, ks, vs, sinks=mx.array([0.5, 1.0, -1.0, 2.0]))
    assert out.shape == (4, 4, 1, 64)
    for b, n in enumerate(lens):
        want = numpy_reference(q[b : b + 1], ks[b], vs[b], [n], sinks=mx.array([0.5, 1.0, -1.0, 2.0]))
        assert max_abs_error(out[b : b + 1], want) < TOLERANCE[dtype]
    assert kernel_calls() == 1


def test_references_and_gradients():
    q, k, v, _, _ = case(mx.float32, 40, 24, 2, 2, None, None, seed=1)
    lens = mx.array(LENGTHS)
    want = numpy_reference(q, k, v, LENGTHS)
    assert max_abs_error(mbd.reference_attention(q, k, v, lens), want) < 2e-5

    def fused(q, k, v):
        return (mbd.batched_decode_attention(q, k, v, lens) ** 2).sum()

    def plain(q, k, v):
        return (mbd.reference_attention(q, k, v, lens) ** 2).sum()

    for g_fused, g_plain in zip(mx.grad(fused, argnums=(0, 1, 2))(q, k, v), mx.grad(plain, argnums=(0, 1, 2))(q, k, v)):
        assert g_fused.shape == g_plain.shape
        assert max_abs_error(g_fused, to_numpy64(g_plain)) < 1e-5
    f = mx.compile(lambda q, k, v, n: mbd.batched_decode_attention(q, k, v, n), shapeless=True)
    assert max_abs_error(f(q, k, v, lens), want) < 2e-5


@pytest.mark.parametrize(
    "message, keys_dim, values_dim",
    [
        (r"the values' head dim 513 is not supported; 1 to 512 are", 64, 513),
        (r"the keys' head dim 577 is not supported; 1 to 576 are", 577, 512),
        (r"head dim 513 is not supported; head dims 1 to 512 are", 513, 513),
    ],
)
def test_head_dims_out_of_range_raise(message, keys_dim, values_dim, kernel_calls):
    q = mx.zeros((2, 2, 1, keys_dim))
    with pytest.raises(ValueError, match=rf"^\[batched_decode_attention\] {message}"):
        mbd.batched_decode_attention(q, mx.zeros((2, 1, 4, keys_dim)), mx.zeros((2, 1, 4, values_dim)), mx.array([4, 4]))
    assert kernel_calls() == 0
