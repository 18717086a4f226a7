"""Correctness of the fused kernel across dtype x head dim x GQA group x lengths."""

import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.support.numerics import (
    DTYPES,
    HEAD_DIMS,
    TOLERANCE,
    dtype_id,
    make_inputs,
    max_abs_error,
    numpy_reference,
)

# Deliberately uneven: empty, one key, fewer than a 32-key block, several
# blocks, a partial last block, and the full padded length.
T = 161
LENGTHS = [0, 1, 17, 97, 150, T]


def sdpa_per_request(q, k, v, lens, scale):
    """mx.fast.scaled_dot_product_attention on each request's unpadded slice."""
    rows = []
    for b, n in enumerate(lens):
        if n == 0:
            rows.append(None)
            continue
        rows.append(
            mx.fast.scaled_dot_product_attention(
                q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale=scale
            )[0]
        )
    return rows


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("G", [1, 4, 8])
def test_matches_references(dtype, D, G, kernel_calls):
    H_kv = 2
    B = len(LENGTHS)
    q, k, v = make_inputs(B, G * H_kv, H_kv, T, D, dtype, seed=D + G)
    lens = mx.array(LENGTHS, dtype=mx.int32)

    out = mbd.batched_decode_attention(q, k, v, lens)
    mx.eval(out)
    assert kernel_calls() == 1
    assert out.shape == (B, G * H_kv, 1, D) and out.dtype == dtype

    expected = numpy_reference(q, k, v, LENGTHS)
    assert max_abs_error(out, expected) < TOLERANCE[dtype]

    scale = 1.0 / math.sqrt(D)
    for b, row in enumerate(sdpa_per_request(q, k, v, LENGTHS, scale)):
        if row is None:
            assert mx.all(out[b] == 0).item(), "an empty request must give zeros"
            continue
        err = mx.abs(out[b].astype(mx.float32) - row.astype(mx.float32)).max().item()
        assert err < 2 * TOLERANCE[dtype], f"request {b}: {err}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 128])
def test_split_along_sequence(dtype, D, kernel_calls):
    # Lengths above the 512-key work chunk are split and merged with
    # log-sum-exp weights; 513 leaves a one-key last chunk.
    lens = [513, 1, 2048, 1100]
    q, k, v = make_inputs(len(lens), 8, 2, 2048, D, dtype, seed=7)
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens))
    mx.eval(out)
    assert kernel_calls() == 1
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[dtype]


def test_single_long_request_uses_split():
    q, k, v = make_inputs(1, 32, 8, 8192, 128, mx.float16, seed=3)
    lens = [8192]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens))
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[mx.float16]


def test_custom_scale():
    q, k, v = make_inputs(3, 4, 2, 40, 64, mx.float32)
    lens = [40, 3, 21]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens), scale=0.3)
    assert max_abs_error(out, numpy_reference(q, k, v, lens, scale=0.3)) < 2e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 6e4])
def test_padding_is_never_read(dtype, garbage):
    lens = [0, 5, 33, 64]
    q, k, v = make_inputs(4, 8, 2, 64, 128, dtype)
    clean = mbd.batched_decode_attention(q, k, v, mx.array(lens))
    pos = mx.arange(64)[None, None, :, None]
    pad = pos >= mx.array(lens)[:, None, None, None]
    k_bad = mx.where(pad, mx.array(garbage, dtype=dtype), k)
    v_bad = mx.where(pad, mx.array(garbage, dtype=dtype), v)
    dirty = mbd.batched_decode_attention(q, k_bad, v_bad, mx.array(lens))
    assert not mx.any(mx.isnan(dirty)).item()
    assert mx.array_equal(clean, dirty).item()
    assert mx.all(dirty[0] == 0).item()


def test_lengths_are_clamped_to_zero_and_T():
    q, k, v = make_inputs(4, 4, 4, 50, 64, mx.float32)
    lens = mx.array([-5, 50, 51, 2**31 - 1])
    out = mbd.batched_decode_attention(q, k, v, lens)
    expected = numpy_reference(q, k, v, [0, 50, 50, 50])
    assert max_abs_error(out, expected) < TOLERANCE[mx.float32]
    assert mx.all(out[0] == 0).item()


def test_length_clamp_does_not_read_past_a_view():
    # keys is a view of the first T positions of a bigger buffer whose tail
    # holds NaN: a length above T must stop at T, not read the tail.
    big_k = mx.full((2, 2, 96, 64), float("nan"))
    big_v = mx.full((2, 2, 96, 64), float("nan"))
    q, k, v = make_inputs(2, 2, 2, 32, 64, mx.float32)
    big_k[:, :, :32] = k
    big_v[:, :, :32] = v
    out = mbd.batched_decode_attention(
        q, big_k[:, :, :32], big_v[:, :, :32], mx.array([1000, 32])
    )
    assert max_abs_error(out, numpy_reference(q, k, v, [32, 32])) < 2e-5


@pytest.mark.parametrize("lens_dtype", [mx.int8, mx.int16, mx.int64, mx.uint32])
def test_integer_length_dtypes(lens_dtype):
    lens = [3, 0, 9]
    q, k, v = make_inputs(3, 4, 1, 9, 64, mx.float32)
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens, dtype=lens_dtype))
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < 2e-5


def test_empty_batch_and_empty_cache():
    q, k, v = make_inputs(0, 4, 2, 8, 64, mx.float16)
    out = mbd.batched_decode_attention(q, k, v, mx.zeros((0,), mx.int32))
    assert out.shape == (0, 4, 1, 64)
    q, k, v = make_inputs(2, 4, 2, 0, 64, mx.float16)
    out = mbd.batched_decode_attention(q, k, v, mx.array([0, 3]))
    assert out.shape == (2, 4, 1, 64) and mx.all(out == 0).item()


def test_reference_attention_matches_numpy():
    lens = [0, 1, 30, 77]
    q, k, v = make_inputs(4, 8, 2, 77, 96, mx.float32)
    out = mbd.reference_attention(q, k, v, mx.array(lens))
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < 2e-5


def test_nan_in_valid_keys_propagates_like_reference():
    lens = [4, 4]
    q, k, v = make_inputs(2, 2, 1, 8, 64, mx.float32)
    k[0, 0, 2, 5] = float("nan")
    out = np.array(mbd.batched_decode_attention(q, k, v, mx.array(lens)))
    ref = np.array(mbd.reference_attention(q, k, v, mx.array(lens)))
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()
