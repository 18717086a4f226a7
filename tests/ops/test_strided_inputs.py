"""Keys/values that are views of a larger cache are read in place, never copied."""

import mlx.core as mx
import pytest

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, make_inputs, max_abs_error, numpy_reference


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefix_view_of_preallocated_cache(dtype):
    B, H_kv, capacity, D = 4, 2, 300, 128
    q, k_full, v_full = make_inputs(B, 8, H_kv, capacity, D, dtype, seed=1)
    T = 123
    k, v = k_full[:, :, :T], v_full[:, :, :T]
    lens = [0, 1, 64, T]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens))
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[dtype]


def test_transposed_layout_and_slot_subset():
    # A [B, T, H_kv, D] cache seen as [B, H_kv, T, D], and every other request.
    q, k, v = make_inputs(6, 4, 2, 40, 64, mx.float32, seed=2)
    k_t = mx.contiguous(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    v_t = mx.contiguous(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    lens = [40, 3, 17, 0, 39, 8]
    out = mbd.batched_decode_attention(q[::2], k_t[::2], v_t[::2], mx.array(lens[::2]))
    expected = numpy_reference(q[::2], k[::2], v[::2], lens[::2])
    assert max_abs_error(out, expected) < 2e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("H_kv, G", [(2, 4), (8, 1), (20, 2)])
@pytest.mark.parametrize("L", [1, 3])
def test_token_major_rows_of_many_heads(dtype, H_kv, G, L):
    # [B, T, H_kv, D] caches (heads side by side in each row), read a whole row per block for
    # up to 16 heads at a time; lengths past a work item's chunk, a window and a start.
    q, k, v = make_inputs(3, H_kv * G, H_kv, 700, 64, dtype, seed=H_kv + L, L=L)
    k_t = mx.contiguous(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    v_t = mx.contiguous(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    lens, starts = [700, 301, 2], [5, 0, 0]
    for window in (None, 90):
        out = mbd.batched_decode_attention(q, k_t, v_t, mx.array(lens), kv_starts=mx.array(starts), window=window)
        expected = numpy_reference(q, k, v, lens, kv_starts=starts, window=window)
        assert max_abs_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_contiguous_last_axis(dtype):
    q, k, v = make_inputs(2, 4, 2, 20, 128, dtype, seed=4)
    wide_k = mx.repeat(k, 2, axis=-1)  # every element twice: [..., ::2] recovers k
    wide_v = mx.repeat(v, 2, axis=-1)
    wide_q = mx.repeat(q, 2, axis=-1)
    lens = [20, 7]
    out = mbd.batched_decode_attention(
        wide_q[..., ::2], wide_k[..., ::2], wide_v[..., ::2], mx.array(lens)
    )
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[dtype]


def test_broadcast_queries():
    q, k, v = make_inputs(3, 4, 2, 16, 64, mx.float32, seed=5)
    q_b = mx.broadcast_to(q[:1], q.shape)
    lens = [16, 5, 9]
    out = mbd.batched_decode_attention(q_b, k, v, mx.array(lens))
    assert max_abs_error(out, numpy_reference(q_b, k, v, lens)) < 2e-5


def test_view_is_not_copied(kernel_calls):
    # The view holds 32 MiB of keys and values; the call may allocate only its
    # output and the partial softmax states, a small fraction of that.
    B, H_kv, capacity, D = 8, 8, 4096, 128
    T = 2048
    q = mx.random.normal((B, 32, 1, D)).astype(mx.float16)
    k_cache = mx.random.normal((B, H_kv, capacity, D)).astype(mx.float16)
    v_cache = mx.random.normal((B, H_kv, capacity, D)).astype(mx.float16)
    lens = mx.array([T] * B)
    mx.eval(q, k_cache, v_cache, lens)
    k, v = k_cache[:, :, :T], v_cache[:, :, :T]
    view_bytes = k.nbytes + v.nbytes

    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    active_before = mx.get_active_memory()
    out = mbd.batched_decode_attention(q, k, v, lens)
    mx.eval(out)
    extra = mx.get_peak_memory() - active_before

    assert kernel_calls() == 1
    assert extra < view_bytes / 16, f"{extra} bytes allocated for a {view_bytes}-byte view"
    ref = mbd.reference_attention(q[:1], k[:1], v[:1], lens[:1])
    assert mx.allclose(out[:1], ref, atol=4e-3).item()
