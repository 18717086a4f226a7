"""The AVX-512 CPU kernel variants (avx512fp16 and avx512bf16: rows of every dtype on 16-lane float32
vectors) against the float64 reference, each forced with set_cpu_isa. A variant this CPU (or build) lacks
is skipped, and says so; the contract test at the end runs on every variant this machine has."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.support.numerics import TOLERANCE, max_abs_error, numpy_reference
from tests.ops.test_decode_shapes import LENGTHS, options, shape_case

_ext = mbd._ext
WIDE_VARIANTS = [
    pytest.param(
        isa,
        marks=pytest.mark.skipif(
            isa not in _ext.cpu_isas(), reason=f"this build or CPU has no {isa} variant (cpu_isas: {_ext.cpu_isas()})"
        ),
    )
    for isa in ("avx512fp16", "avx512bf16")
]


def _forced(isa):
    previous = _ext.cpu_isa()
    _ext.set_cpu_isa(isa)
    return previous


def _output_of(isa, q, k, v, lens, **options):
    """float32 numpy output of batched_decode_attention on variant isa (forced, then restored);
    k and v as float32 numpy arrays, cast to the queries' dtype."""
    previous = _forced(isa)
    try:
        out = _ext.batched_decode_attention(
            q, mx.array(k).astype(q.dtype), mx.array(v).astype(q.dtype), mx.array(lens), **options)
        return np.array(out.astype(mx.float32))
    finally:
        _ext.set_cpu_isa(previous)


@pytest.fixture(params=WIDE_VARIANTS)
def wide_variant(request):
    previous = _forced(request.param)
    yield request.param
    _ext.set_cpu_isa(previous)


DTYPES = [mx.float16, mx.bfloat16, mx.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 200, 256, 512])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 8])
def test_head_dims_and_groups(wide_variant, dtype, D, G):
    # Every tile height the variant picks (4, 2, 1 query rows), fast and generic head dims.
    q, k, v, k_nan, v_nan = shape_case(dtype, D, G, 1, None, None, seed=D * 10 + G)
    before = _ext.cpu_kernel_calls()
    out = _ext.batched_decode_attention(q, k_nan, v_nan, mx.array(LENGTHS))
    mx.eval(out)
    assert _ext.cpu_isa() == wide_variant and _ext.cpu_kernel_calls() == before + 1
    assert max_abs_error(out, numpy_reference(q, k, v, LENGTHS)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 3, 4, 8])
@pytest.mark.parametrize("case", range(7))
def test_rows_starts_windows_sinks(wide_variant, dtype, L, case):
    # Blocks cut by a row's range take the masked accumulation; NaN / inf where no row reads.
    starts, window, sinks = options(4)[case]
    q, k, v, k_nan, v_nan = shape_case(dtype, 128, 4, L, window, starts, seed=case * 8 + L)
    out = _ext.batched_decode_attention(
        q, k_nan, v_nan, mx.array(LENGTHS), kv_starts=None if starts is None else mx.array(starts), window=window,
        sinks=sinks,
    )
    expected = numpy_reference(q, k, v, LENGTHS, kv_starts=starts, window=window, sinks=sinks)
    assert max_abs_error(out, expected) < TOLERANCE[dtype]


def test_long_requests_split_into_chunks(wide_variant):
    # Several 512-key chunks per request, merged; strided (sliced) K/V read in place.
    rng = np.random.default_rng(5)
    B, H_kv, G, T, D = 3, 2, 4, 1500, 128
    q = mx.array(rng.standard_normal((B, H_kv * G, 1, D)).astype(np.float32)).astype(mx.float16)
    cache = mx.array(rng.standard_normal((B, H_kv, T + 100, D)).astype(np.float32)).astype(mx.float16)
    k, v = cache[:, :, :T], cache[:, :, 50 : T + 50]
    lens = [1500, 1025, 700]
    out = _ext.batched_decode_attention(q, k, v, mx.array(lens))
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[mx.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_with_the_8_lane_kernel(wide_variant, dtype):
    # Same float32 arithmetic in another order: the two differ by output rounding only.
    q, k, v, _, _ = shape_case(dtype, 128, 4, 1, None, None, seed=3)
    wide = _ext.batched_decode_attention(q, k, v, mx.array(LENGTHS))
    _ext.set_cpu_isa("avx2")
    narrow = _ext.batched_decode_attention(q, k, v, mx.array(LENGTHS))
    diff = mx.abs(wide.astype(mx.float32) - narrow.astype(mx.float32)).max().item()
    # A few units in the last place of outputs below 1 (float16 2^-11, bfloat16 2^-8).
    assert diff <= {mx.float16: 2.0**-9, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-20}[dtype]


@pytest.mark.parametrize("isa", _ext.cpu_isas())
def test_float16_scores_accumulate_in_float32(isa):
    """Two keys whose scores, 128 and 128 + 2^-6, differ below float16's spacing at 128 (0.125):
    summed in float32 the second weighs sigmoid(2^-6) = 0.50390625 (float16-exact) of the output;
    summed in float16 the two would tie at 0.5. Every variant, forced in turn."""
    D = 128
    q = mx.ones((1, 4, 1, D), mx.float16)
    k = np.ones((1, 1, 2, D), np.float32)
    k[0, 0, 1, 5] = 1 + 2.0**-6
    v = np.zeros((1, 1, 2, D), np.float32)
    v[0, 0, 1] = 1.0
    got = _output_of(isa, q, k, v, [2], scale=1.0)
    expected = np.float16(1 / (1 + np.exp(-(2.0**-6))))
    assert expected == np.float16(0.50390625)
    assert np.all(got == expected), got[0, :, 0, :4]


@pytest.mark.parametrize("isa", _ext.cpu_isas())
@pytest.mark.parametrize("D", [64, 128, 256])
def test_bfloat16_weights_within_their_rounding(isa, D):
    """Where bfloat16 values are weighted with the bfloat16 dot product (avx512bf16), each weight
    is rounded to bfloat16 (2^-9 relative) and the softmax sums the rounded weights: two keys of
    values 0 and 1 give p1 / (p0 + p1) within 2^-8 relative, before the output's own rounding."""
    q = mx.ones((1, 1, 1, D), mx.bfloat16)
    k = np.zeros((1, 1, 2, D), np.float32)
    k[0, 0, 1, 0] = 0.3  # exp(0.3) has no exact bfloat16
    v = np.zeros((1, 1, 2, D), np.float32)
    v[0, 0, 1] = 1.0
    got = _output_of(isa, q, k, v, [2], scale=1.0)[0, 0, 0]
    exact = 1 / (1 + np.exp(-0.3))
    assert np.all(np.abs(got - exact) <= exact * (2.0**-8 + 2.0**-9)), got[:4]


@pytest.mark.parametrize("isa", _ext.cpu_isas())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [5, 33, 63])
def test_inf_value_in_an_odd_last_key(isa, dtype, length):
    """An infinite value at a row's last key, an odd count of keys into its block, makes that
    column inf, as in float64: the bfloat16 dot product pairs such a key with zeros, never with
    a copy of itself at weight 0 (0 x inf = NaN)."""
    D = 128
    rng = np.random.default_rng(length)
    q = mx.array(rng.standard_normal((1, 4, 1, D)).astype(np.float32)).astype(dtype)
    k = rng.standard_normal((1, 1, 64, D)).astype(np.float32)
    v = rng.standard_normal((1, 1, 64, D)).astype(np.float32)
    v[0, 0, length - 1, 7] = np.inf
    got = _output_of(isa, q, k, v, [length])
    expected = np.array(numpy_reference(q, mx.array(k).astype(dtype), mx.array(v).astype(dtype), [length]))
    assert np.all(np.isposinf(got[0, :, 0, 7])) and np.all(np.isposinf(expected[0, :, 0, 7]))
    finite = np.delete(got, 7, axis=-1)
    assert np.isfinite(finite).all() and np.abs(finite - np.delete(expected, 7, axis=-1)).max() < TOLERANCE[dtype]
