"""mx.compile (plain and shapeless), vmap, vjp and jvp of the primitive."""

import mlx.core as mx
import pytest

import mlx_batched_decode as mbd
from tests.support.numerics import make_inputs, max_abs_error, numpy_reference


def test_compile(kernel_calls):
    q, k, v = make_inputs(3, 8, 2, 50, 64, mx.float32)
    lens = mx.array([50, 0, 13])
    f = mx.compile(lambda q, k, v, n: mbd.batched_decode_attention(q, k, v, n) * 2.0)
    out = f(q, k, v, lens)
    mx.eval(out)
    assert kernel_calls() == 1
    assert max_abs_error(out, 2 * numpy_reference(q, k, v, [50, 0, 13])) < 4e-5


def test_compile_shapeless_follows_new_shapes(kernel_calls):
    f = mx.compile(
        lambda q, k, v, n: mbd.batched_decode_attention(q, k, v, n, scale=0.2) + 1.0,
        shapeless=True,
    )
    for B, T, lens in [(2, 30, [30, 4]), (5, 77, [0, 77, 1, 40, 2]), (1, 600, [600])]:
        q, k, v = make_inputs(B, 4, 2, T, 64, mx.float32, seed=T)
        out = f(q, k, v, mx.array(lens))
        assert out.shape == (B, 4, 1, 64)
        expected = numpy_reference(q, k, v, lens, scale=0.2) + 1.0
        assert max_abs_error(out, expected) < 4e-5
    assert kernel_calls() == 3


def test_compile_distinguishes_scales():
    q, k, v = make_inputs(2, 4, 2, 10, 64, mx.float32)
    lens = mx.array([10, 6])
    f = mx.compile(
        lambda q, k, v, n: mbd.batched_decode_attention(q, k, v, n, scale=0.1)
        - mbd.batched_decode_attention(q, k, v, n, scale=0.5)
    )
    expected = numpy_reference(q, k, v, [10, 6], scale=0.1) - numpy_reference(
        q, k, v, [10, 6], scale=0.5
    )
    assert max_abs_error(f(q, k, v, lens), expected) < 4e-5


def test_vmap_over_stacked_batches():
    N, B = 3, 2
    parts = [make_inputs(B, 4, 2, 24, 64, mx.float32, seed=s) for s in range(N)]
    lens = mx.array([[24, 1], [0, 12], [7, 24]])
    q, k, v = (mx.stack([p[i] for p in parts]) for i in range(3))
    out = mx.vmap(mbd.batched_decode_attention)(q, k, v, lens)
    assert out.shape == (N, B, 4, 1, 64)
    for i in range(N):
        expected = numpy_reference(q[i], k[i], v[i], lens[i].tolist())
        assert max_abs_error(out[i], expected) < 2e-5


def test_vmap_with_shared_keys():
    q, k, v = make_inputs(2, 4, 2, 16, 64, mx.float32)
    qs = mx.stack([q, q * 2.0])
    lens = mx.array([16, 9])
    out = mx.vmap(mbd.batched_decode_attention, in_axes=(0, None, None, None))(qs, k, v, lens)
    for i in range(2):
        assert max_abs_error(out[i], numpy_reference(qs[i], k, v, [16, 9])) < 2e-5


@pytest.mark.parametrize("argnum", [0, 1, 2])
def test_gradients_match_reference(argnum):
    q, k, v = make_inputs(3, 8, 2, 20, 64, mx.float32, seed=9)
    lens = mx.array([20, 0, 7])
    w = mx.random.normal((3, 8, 1, 64))

    def loss(fn):
        return lambda *x: (fn(*x, lens) * w).sum()

    g = mx.grad(loss(mbd.batched_decode_attention), argnums=argnum)(q, k, v)
    g_ref = mx.grad(loss(mbd.reference_attention), argnums=argnum)(q, k, v)
    assert not mx.any(mx.isnan(g)).item()
    assert mx.allclose(g, g_ref, atol=1e-5).item()
    # Finite differences along one direction confirm the reference itself.
    x = [q, k, v]
    d = mx.random.normal(x[argnum].shape)
    eps = 1e-2
    plus, minus = list(x), list(x)
    plus[argnum] = x[argnum] + eps * d
    minus[argnum] = x[argnum] - eps * d
    f = loss(mbd.reference_attention)
    fd = (f(*plus) - f(*minus)) / (2 * eps)
    assert abs((g * d).sum().item() - fd.item()) < 1e-2 * max(1.0, abs(fd.item()))


def test_jvp_matches_reference():
    q, k, v = make_inputs(2, 4, 2, 12, 64, mx.float32)
    lens = mx.array([12, 5])
    t = [mx.random.normal(q.shape), mx.random.normal(k.shape), mx.random.normal(v.shape)]
    _, (jv,) = mx.jvp(lambda a, b, c: mbd.batched_decode_attention(a, b, c, lens), [q, k, v], t)
    _, (jv_ref,) = mx.jvp(lambda a, b, c: mbd.reference_attention(a, b, c, lens), [q, k, v], t)
    assert mx.allclose(jv, jv_ref, atol=1e-5).item()


def options():
    """kv_starts, window and sinks of a B=3, H_q=4 call."""
    return dict(kv_starts=mx.array([0, 2, 5]), window=6, sinks=mx.array([0.3, -1.0, 2.0, 0.0]))


def reference_with_options(q, k, v, lens, scale=None):
    o = options()
    return numpy_reference(
        q, k, v, lens, scale=scale, kv_starts=[0, 2, 5], window=o["window"], sinks=o["sinks"]
    )


def test_compile_shapeless_with_every_option(kernel_calls):
    f = mx.compile(
        lambda q, k, v, n, s, sk: mbd.batched_decode_attention(
            q, k, v, n, kv_starts=s, window=6, sinks=sk, scale=0.2
        ),
        shapeless=True,
    )
    o = options()
    for T, L, lens in [(30, 1, [30, 4, 9]), (77, 3, [77, 0, 40]), (600, 5, [600, 7, 599])]:
        q, k, v = make_inputs(3, 4, 2, T, 64, mx.float32, seed=T, L=L)
        out = f(q, k, v, mx.array(lens), o["kv_starts"], o["sinks"])
        assert out.shape == (3, 4, L, 64)
        assert max_abs_error(out, reference_with_options(q, k, v, lens, scale=0.2)) < 4e-5
    assert kernel_calls() == 3


def test_compile_distinguishes_windows_and_options():
    q, k, v = make_inputs(3, 4, 2, 20, 64, mx.float32, L=2)
    lens = mx.array([20, 11, 3])
    f = mx.compile(
        lambda q, k, v, n: mbd.batched_decode_attention(q, k, v, n, window=3)
        - mbd.batched_decode_attention(q, k, v, n, window=9)
        + mbd.batched_decode_attention(q, k, v, n, kv_starts=n - 2)
    )
    expected = (
        numpy_reference(q, k, v, [20, 11, 3], window=3)
        - numpy_reference(q, k, v, [20, 11, 3], window=9)
        + numpy_reference(q, k, v, [20, 11, 3], kv_starts=[18, 9, 1])
    )
    assert max_abs_error(f(q, k, v, lens), expected) < 4e-5


def test_vmap_with_every_option():
    N = 2
    parts = [make_inputs(3, 4, 2, 24, 32, mx.float32, seed=s, L=3) for s in range(N)]
    q, k, v = (mx.stack([p[i] for p in parts]) for i in range(3))
    lens = mx.array([[24, 1, 12], [0, 24, 7]])
    o = options()
    out = mx.vmap(
        lambda q, k, v, n: mbd.batched_decode_attention(q, k, v, n, **o), in_axes=(0, 0, 0, 0)
    )(q, k, v, lens)
    for i in range(N):
        expected = reference_with_options(q[i], k[i], v[i], lens[i].tolist())
        assert max_abs_error(out[i], expected) < 2e-5


@pytest.mark.parametrize("argnum", [0, 1, 2, 3])
def test_gradients_with_every_option_match_reference(argnum):
    q, k, v = make_inputs(3, 4, 2, 20, 64, mx.float32, seed=9, L=3)
    lens = mx.array([20, 0, 7])
    o = options()
    w = mx.random.normal((3, 4, 3, 64))

    def loss(fn):
        return lambda q, k, v, sinks: (
            fn(q, k, v, lens, kv_starts=o["kv_starts"], window=o["window"], sinks=sinks) * w
        ).sum()

    args = (q, k, v, o["sinks"])
    g = mx.grad(loss(mbd.batched_decode_attention), argnums=argnum)(*args)
    g_ref = mx.grad(loss(mbd.reference_attention), argnums=argnum)(*args)
    assert not mx.any(mx.isnan(g)).item()
    assert mx.allclose(g, g_ref, atol=1e-5).item()
    # Finite differences along one direction confirm the reference itself.
    d = mx.random.normal(args[argnum].shape)
    eps = 1e-2
    plus, minus = list(args), list(args)
    plus[argnum] = args[argnum] + eps * d
    minus[argnum] = args[argnum] - eps * d
    f = loss(mbd.reference_attention)
    fd = (f(*plus) - f(*minus)) / (2 * eps)
    assert abs((g * d).sum().item() - fd.item()) < 1e-2 * max(1.0, abs(fd.item()))


def test_jvp_with_every_option_matches_reference():
    q, k, v = make_inputs(3, 4, 2, 12, 64, mx.float32, L=2)
    lens = mx.array([12, 5, 9])
    o = options()
    t = [mx.random.normal(x.shape) for x in (q, k, v, o["sinks"])]

    def f(fn):
        return lambda a, b, c, s: fn(
            a, b, c, lens, kv_starts=o["kv_starts"], window=o["window"], sinks=s
        )

    primals = [q, k, v, o["sinks"]]
    _, (jv,) = mx.jvp(f(mbd.batched_decode_attention), primals, t)
    _, (jv_ref,) = mx.jvp(f(mbd.reference_attention), primals, t)
    assert mx.allclose(jv, jv_ref, atol=1e-5).item()
