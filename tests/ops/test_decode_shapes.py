"""Every attention shape real models decode with, on the fused CPU kernel, against float64:
L query rows per request, per-request key ranges (kv_starts), sliding windows, attention sinks
and any head dim.

Row i of request b sits at p = len_b - L + i and attends keys max(start_b, p - window + 1, 0)
.. p. Every K/V position that no row of a request attends holds NaN, so each case also proves
that those positions are never read.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, T positions,
D head dim.
"""

import mlx.core as mx
import numpy as np
import pytest
from tests.metal_emu.reference import row_range

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, max_abs_error, numpy_reference

T = 45
# Full, empty, one key, a start inside, a start that leaves only the last rows a key, and a
# start past the end (its range is empty).
LENGTHS = [T, 0, 1, 30, 44, 3]
STARTS = [0, 0, 0, 12, 40, 5]
# No window, a window of one key, one shorter than the lengths, one longer than T.
WINDOWS = [None, 1, 6, 100]
HEAD_DIMS = [1, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 512]


def attended(lens, starts, rows, window, t=T):
    """bool [B, T]: the positions some query row of each request attends."""
    mask = np.zeros((len(lens), t), dtype=bool)
    for b, (n, s) in enumerate(zip(lens, starts)):
        n, s = int(np.clip(n, 0, t)), int(np.clip(s, 0, t))
        for i in range(rows):
            lo, hi = row_range(n, s, rows, i, window)
            mask[b, lo:max(lo, hi)] = True
    return mask


def shape_case(dtype, D, G, L, window, starts, seed, H_kv=2, lens=LENGTHS):
    """Queries [B, H_q, L, D] and keys/values [B, H_kv, T, D] with NaN where no row reads."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    q = mx.array(rng.standard_normal((B, H_kv * G, L, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, H_kv, T, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H_kv, T, D)).astype(np.float32)).astype(dtype)
    unread = ~attended(lens, starts or [0] * B, L, window)
    unread = mx.array(unread)[:, None, :, None]
    k_nan = mx.where(unread, mx.array(float("nan"), dtype), k)
    v_nan = mx.where(unread, mx.array(float("inf"), dtype), v)
    return q, k, v, k_nan, v_nan


def options(G, H_kv=2, seed=0):
    """(kv_starts, window, sinks) combinations: every option alone and all together."""
    sinks = mx.array(np.random.default_rng(seed).standard_normal(H_kv * G).astype(np.float32) * 2)
    return [
        (None, None, None),
        (STARTS, None, None),
        (None, 6, None),
        (None, None, sinks),
        (STARTS, 1, sinks),
        (STARTS, 100, None),
        (None, 6, sinks),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("L", [1, 2, 5, 8])
def test_matches_float64(dtype, D, G, L, kernel_calls):
    calls = 0
    for n, (starts, window, sinks) in enumerate(options(G, seed=D + L)):
        q, k, v, k_nan, v_nan = shape_case(dtype, D, G, L, window, starts, seed=D * 31 + L * 7 + n)
        out = mbd.batched_decode_attention(
            q, k_nan, v_nan, mx.array(LENGTHS),
            kv_starts=None if starts is None else mx.array(starts), window=window, sinks=sinks,
        )
        mx.eval(out)
        calls += 1
        assert out.shape == q.shape and out.dtype == dtype
        expected = numpy_reference(q, k, v, LENGTHS, kv_starts=starts, window=window, sinks=sinks)
        err = max_abs_error(out, expected)
        assert err < TOLERANCE[dtype], (starts, window, sinks is not None, err)
        # Rows without a key are exactly zero; the NaN positions never reach any row.
        assert not np.isnan(np.array(out.astype(mx.float32))).any()
        lens = np.clip(LENGTHS, 0, T)
        for b in range(len(LENGTHS)):
            start = 0 if starts is None else starts[b]
            for i in range(L):
                lo, hi = row_range(int(lens[b]), start, L, i, window)
                if hi <= lo:
                    assert mx.all(out[b, :, i] == 0).item()
    assert kernel_calls() == calls


@pytest.mark.parametrize("L", [2, 5])
def test_a_key_only_some_rows_attend_leaves_the_others_alone(L):
    # Request 0 (length 45, window 6): position 45 - L - 5 is attended by row 0 only, position
    # 44 by the last row only. NaN there poisons exactly those rows.
    q, k, v, _, _ = shape_case(mx.float32, 64, 4, L, 6, None, seed=3)
    for position, poisoned in ((T - L - 5, 0), (T - 1, L - 1)):
        k_bad = mx.array(k)
        k_bad[0, :, position] = float("nan")
        out = np.array(mbd.batched_decode_attention(q, k_bad, v, mx.array(LENGTHS), window=6))
        for i in range(L):
            assert np.isnan(out[0, :, i]).all() == (i == poisoned), (position, i)
        assert np.isfinite(out[1:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_more_rows_than_keys(dtype):
    # L > len: the first rows sit before position 0 and attend nothing.
    q, k, v, _, _ = shape_case(dtype, 64, 2, 8, None, None, seed=5)
    lens = [3, 0, 8, 45, 1, 7]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens))
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[dtype]
    assert mx.all(out[0, :, :5] == 0).item() and mx.all(out[1] == 0).item()


def test_long_requests_split_across_work_items():
    # Ranges of several 512-key work items, cut by starts and windows not aligned to them.
    rng = np.random.default_rng(9)
    B, L, D, long_T = 3, 4, 128, 2100
    q = mx.array(rng.standard_normal((B, 16, L, D)).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((B, 4, long_T, D)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((B, 4, long_T, D)).astype(np.float32)).astype(mx.float16)
    lens, starts = [2100, 1500, 700], [0, 130, 699]
    sinks = mx.array([0.5] * 16)
    for window in (None, 1000, 513):
        out = mbd.batched_decode_attention(
            q, k, v, mx.array(lens), kv_starts=mx.array(starts), window=window, sinks=sinks
        )
        expected = numpy_reference(q, k, v, lens, kv_starts=starts, window=window, sinks=sinks)
        assert max_abs_error(out, expected) < TOLERANCE[mx.float16]


def test_window_and_start_clamped_like_lengths():
    # Starts outside [0, T] clamp to it; a window of 2**31 - 1 is no window.
    q, k, v, _, _ = shape_case(mx.float32, 32, 2, 3, None, None, seed=2)
    starts = mx.array([-7, 2**31 - 1, 50, 3, -(2**31), 44], mx.int32)
    out = mbd.batched_decode_attention(
        q, k, v, mx.array(LENGTHS), kv_starts=starts, window=2**31 - 1
    )
    clamped = [0, T, T, 3, 0, 44]
    expected = numpy_reference(q, k, v, LENGTHS, kv_starts=clamped)
    assert max_abs_error(out, expected) < TOLERANCE[mx.float32]


@pytest.mark.parametrize("starts_dtype", [mx.int8, mx.uint16, mx.int64, mx.uint64])
def test_start_dtypes(starts_dtype):
    q, k, v, _, _ = shape_case(mx.float32, 64, 2, 2, None, None, seed=4)
    starts = [0, 0, 0, 12, 40, 5]
    out = mbd.batched_decode_attention(
        q, k, v, mx.array(LENGTHS), kv_starts=mx.array(starts, dtype=starts_dtype)
    )
    assert max_abs_error(out, numpy_reference(q, k, v, LENGTHS, kv_starts=starts)) < 2e-5


def test_wide_starts_beyond_int32_are_clamped_to_T():
    q, k, v, _, _ = shape_case(mx.float32, 64, 2, 1, None, None, seed=6)
    starts = [2**32 + 1, 0, -(2**33), 2**31, 0, 1]
    out = mbd.batched_decode_attention(
        q, k, v, mx.array(LENGTHS), kv_starts=mx.array(starts, mx.int64)
    )
    expected = numpy_reference(q, k, v, LENGTHS, kv_starts=[T, 0, 0, T, 0, 1])
    assert max_abs_error(out, expected) < 2e-5


@pytest.mark.parametrize("sinks_dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_sink_dtypes_and_views(sinks_dtype):
    q, k, v, _, _ = shape_case(mx.float32, 64, 4, 2, None, None, seed=7)
    wide = mx.array(np.linspace(-3, 3, 16).astype(np.float32)).astype(sinks_dtype)
    for sinks in (wide[::2], mx.broadcast_to(wide[3:4], (8,)), wide[::-2]):
        out = mbd.batched_decode_attention(q, k, v, mx.array(LENGTHS), sinks=sinks)
        expected = numpy_reference(q, k, v, LENGTHS, sinks=sinks)
        assert max_abs_error(out, expected) < 2e-5


def test_sinks_match_mlx_sdpa():
    # mx.fast.scaled_dot_product_attention's sinks on each request's own rows and keys.
    q, k, v, _, _ = shape_case(mx.float32, 64, 4, 3, None, None, seed=8)
    sinks = mx.array(np.random.default_rng(1).standard_normal(8).astype(np.float32))
    lens = [45, 9, 30, 44, 3, 20]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens), sinks=sinks)
    for b, n in enumerate(lens):
        # The last L rows of a causal mask over n keys: row i sees keys 0 .. n - L + i.
        mask = mx.arange(n)[None, :] <= (n - 3 + mx.arange(3))[:, None]
        expected = mx.fast.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale=0.125, mask=mask,
            sinks=sinks,
        )
        assert mx.allclose(out[b : b + 1], expected, atol=2e-5).item()


def test_window_matches_mlx_sdpa_with_a_window_mask():
    q, k, v, _, _ = shape_case(mx.float16, 128, 2, 4, None, None, seed=10)
    window, lens = 16, [45, 9, 30, 44, 3, 20]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens), window=window)
    for b, n in enumerate(lens):
        p = n - 4 + mx.arange(4)[:, None]
        j = mx.arange(n)[None, :]
        mask = (j <= p) & (j > p - window)
        expected = mx.fast.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale=128**-0.5, mask=mask
        )
        rows = [i for i in range(4) if n - 4 + i >= 0]  # SDPA gives NaN for rows with no key
        err = mx.abs(out[b : b + 1, :, rows] - expected[:, :, rows]).max().item()
        assert err < 2 * TOLERANCE[mx.float16]


@pytest.mark.parametrize("isa", mbd._ext.cpu_isas())
def test_every_instruction_set_variant(isa):
    # Each compiled variant on the generic head dim and a fast one, with every option.
    previous = mbd._ext.cpu_isa()
    mbd._ext.set_cpu_isa(isa)
    try:
        for dtype in DTYPES:
            for D in (24, 112):
                starts, window, sinks = options(4)[4]
                q, k, v, k_nan, v_nan = shape_case(dtype, D, 4, 5, window, starts, seed=D)
                out = mbd.batched_decode_attention(
                    q, k_nan, v_nan, mx.array(LENGTHS), kv_starts=mx.array(starts),
                    window=window, sinks=sinks,
                )
                expected = numpy_reference(
                    q, k, v, LENGTHS, kv_starts=starts, window=window, sinks=sinks
                )
                assert max_abs_error(out, expected) < TOLERANCE[dtype]
    finally:
        mbd._ext.set_cpu_isa(previous)


def test_reference_attention_matches_float64():
    for starts, window, sinks in options(3, seed=2):
        q, k, v, k_nan, v_nan = shape_case(mx.float32, 40, 3, 5, window, starts, seed=11)
        out = mbd.reference_attention(
            q, k_nan, v_nan, mx.array(LENGTHS),
            kv_starts=None if starts is None else mx.array(starts), window=window, sinks=sinks,
        )
        expected = numpy_reference(q, k, v, LENGTHS, kv_starts=starts, window=window, sinks=sinks)
        assert max_abs_error(out, expected) < 2e-5
