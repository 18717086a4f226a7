"""Property-based tests: random shapes, dtypes, lengths, ranges, windows, sinks and layouts
against float64."""

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, max_abs_error, numpy_reference

# Every fast head dim of the kernels and generic ones (odd, not a multiple of 8 or 16).
HEAD_DIMS = [1, 3, 24, 32, 40, 64, 80, 96, 112, 128, 160, 192, 200, 256, 512]

SETTINGS = settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def decode_calls(draw):
    B = draw(st.integers(1, 5))
    H_kv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 3, 4, 8]))
    L = draw(st.sampled_from([1, 1, 2, 3, 5, 8]))
    D = draw(st.sampled_from(HEAD_DIMS))
    T = draw(st.integers(0, 70))
    dtype = draw(st.sampled_from(DTYPES))
    # Positions anywhere from negative to past T, with the edges over-represented.
    positions = st.lists(
        st.one_of(st.integers(-3, T + 3), st.sampled_from([0, 1, T, 2**31 - 1, -(2**31)])),
        min_size=B,
        max_size=B,
    )
    lens = draw(positions)
    starts = draw(st.one_of(st.none(), positions))
    window = draw(st.one_of(st.none(), st.integers(1, 80), st.just(2**31 - 1)))
    sinks = draw(st.one_of(st.none(), st.lists(st.floats(-4, 4), min_size=H_kv * G, max_size=H_kv * G)))
    layout = draw(st.sampled_from(["contiguous", "prefix_view", "transposed", "strided_dim"]))
    extra = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    return B, H_kv, G, L, D, T, dtype, lens, starts, window, sinks, layout, extra, seed


def build(B, H_kv, G, L, D, T, dtype, layout, extra, seed):
    """Queries [B, H_q, L, D] and keys/values of shape [B, H_kv, T, D] in the requested layout,
    with NaN wherever the layout leaves memory outside the view."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, H_kv * G, L, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, H_kv, T, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H_kv, T, D)).astype(np.float32)).astype(dtype)
    if layout == "prefix_view":
        pad = mx.full((B, H_kv, extra, D), float("nan"), dtype=dtype)
        return q, k, v, mx.concatenate([k, pad], 2)[:, :, :T], mx.concatenate([v, pad], 2)[:, :, :T]
    if layout == "transposed":
        kt = mx.contiguous(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        vt = mx.contiguous(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        return q, k, v, kt, vt
    if layout == "strided_dim":
        nan = mx.full(k.shape, float("nan"), dtype=dtype)
        kw = mx.stack([k, nan], -1).reshape(B, H_kv, T, 2 * D)[..., ::2]
        vw = mx.stack([v, nan], -1).reshape(B, H_kv, T, 2 * D)[..., ::2]
        return q, k, v, kw, vw
    return q, k, v, k, v


@SETTINGS
@given(decode_calls())
def test_kernel_matches_float64_reference(call):
    B, H_kv, G, L, D, T, dtype, lens, starts, window, sinks, layout, extra, seed = call
    q, k, v, k_in, v_in = build(B, H_kv, G, L, D, T, dtype, layout, extra, seed)
    out = mbd.batched_decode_attention(
        q, k_in, v_in, mx.array(lens, dtype=mx.int32),
        kv_starts=None if starts is None else mx.array(starts, dtype=mx.int32),
        window=window,
        sinks=None if sinks is None else mx.array(sinks),
    )
    expected = numpy_reference(q, k, v, lens, kv_starts=starts, window=window, sinks=sinks)
    assert out.shape == (B, H_kv * G, L, D) and out.dtype == dtype
    assert not mx.any(mx.isnan(out)).item()
    assert max_abs_error(out, expected) < TOLERANCE[dtype]
    empty = [b for b, n in enumerate(lens) if min(max(n, 0), T) == 0]
    for b in empty:
        assert mx.all(out[b] == 0).item()
