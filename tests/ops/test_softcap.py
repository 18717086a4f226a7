"""softcap on the four ops: each score s = scale * q . k becomes c * tanh(s / c) before ranges and
masks, sinks stay uncapped; against the float64 reference across dtypes, head dims, GQA groups,
L rows, windows, sinks and kv_starts, on every CPU kernel variant this machine has.

Queries are scaled up (x4, exact in every dtype) so that most scores pass the cap: each case also
checks that the uncapped result differs, so that a kernel ignoring softcap fails.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode as mbd
from tests.ops import test_paged_decode as paged
from tests.ops import test_quantized_attention as quantized
from tests.ops import test_ragged_decode as ragged
from tests.ops.test_decode_shapes import LENGTHS, options, shape_case
from tests.support.cpu_isa import isa  # noqa: F401  a fixture
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, make_inputs, max_abs_error, numpy_reference

CAP = 1.5
_ext = mbd._ext


def louder(q):
    """q x 4: exact in float16, bfloat16 and float32, and most scores then exceed CAP."""
    return q * mx.array(4.0, q.dtype)


def check(out, capped, uncapped, dtype):
    err = max_abs_error(out, capped)
    assert err < TOLERANCE[dtype], err
    # The cap matters in this case: a kernel that ignored it would miss the tolerance.
    assert np.max(np.abs(capped - uncapped)) > 3 * TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 80, 128, 256])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("L", [1, 5])
def test_dense_matches_float64(dtype, D, G, L, kernel_calls):
    for n, (starts, window, sinks) in enumerate(options(G, seed=D + L)):
        q, k, v, k_nan, v_nan = shape_case(dtype, D, G, L, window, starts, seed=D * 17 + L * 5 + n)
        q = louder(q)
        out = mbd.batched_decode_attention(
            q, k_nan, v_nan, mx.array(LENGTHS), kv_starts=None if starts is None else mx.array(starts),
            window=window, sinks=sinks, softcap=CAP,
        )
        kw = dict(kv_starts=starts, window=window, sinks=sinks)
        check(out, numpy_reference(q, k, v, LENGTHS, softcap=CAP, **kw), numpy_reference(q, k, v, LENGTHS, **kw), dtype)
    assert kernel_calls() == len(options(G))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_every_cpu_variant(isa, dtype):
    starts, window, sinks = options(4)[4]
    q, k, v, k_nan, v_nan = shape_case(dtype, 128, 4, 3, window, starts, seed=11)
    q = louder(q)
    out = mbd.batched_decode_attention(
        q, k_nan, v_nan, mx.array(LENGTHS), kv_starts=mx.array(starts), window=window, sinks=sinks, softcap=CAP
    )
    mx.eval(out)
    assert _ext.cpu_isa() == isa
    kw = dict(kv_starts=starts, window=window, sinks=sinks)
    check(out, numpy_reference(q, k, v, LENGTHS, softcap=CAP, **kw), numpy_reference(q, k, v, LENGTHS, **kw), dtype)


def test_sinks_are_not_capped():
    # Sinks far past the cap: capping them too would change every row.
    q, k, v = make_inputs(3, 4, 2, 40, 64, mx.float32, seed=3)
    q = louder(q)
    sinks = mx.array([8.0, -8.0, 5.0, 30.0])
    lens = [40, 7, 1]
    out = mbd.batched_decode_attention(q, k, v, mx.array(lens), sinks=sinks, softcap=CAP)
    want = numpy_reference(q, k, v, lens, sinks=sinks, softcap=CAP)
    capped_sinks = numpy_reference(q, k, v, lens, sinks=mx.array([CAP, -CAP, CAP, CAP]), softcap=CAP)
    assert max_abs_error(out, want) < TOLERANCE[mx.float32]
    assert np.max(np.abs(want - capped_sinks)) > 0.01


def test_ring(kernel_calls):
    # Logical position j of request b lives in slot (j + offset_b) mod T.
    q, k, v = make_inputs(3, 8, 2, 33, 64, mx.float16, seed=5)
    q = louder(q)
    offsets = [0, 7, 32]
    lens = [33, 20, 33]
    rolled = [mx.array(np.roll(np.array(x[b : b + 1].astype(mx.float32)), offsets[b], axis=2)).astype(x.dtype)
              for x in (k, v) for b in range(3)]
    k_ring, v_ring = mx.concatenate(rolled[:3]), mx.concatenate(rolled[3:])
    out = mbd.batched_decode_attention(
        q, k_ring, v_ring, mx.array(lens), ring_offset=mx.array(offsets), window=9, softcap=CAP)
    check(out, numpy_reference(q, k, v, lens, window=9, softcap=CAP), numpy_reference(q, k, v, lens, window=9),
          mx.float16)
    assert kernel_calls() == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("L", [1, 3])
def test_paged_matches_float64(dtype, block_size, L, kernel_calls):
    for n, (window, sinks) in enumerate(paged.options(4, seed=L)):
        q, k, v, k_nan, v_nan, tables = paged.paged_case(dtype, 64, 4, L, block_size, window, seed=L * 3 + n)
        q = louder(q)
        out = mbd.paged_decode_attention(
            q, k_nan, v_nan, mx.array(tables), mx.array(paged.LENGTHS), window=window, sinks=sinks, softcap=CAP)
        check(out, paged.float64_paged(q, k, v, tables, paged.LENGTHS, window, sinks, softcap=CAP),
              paged.float64_paged(q, k, v, tables, paged.LENGTHS, window, sinks), dtype)
    assert kernel_calls() == 4


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("D,group_size,L", [(64, 32, 1), (128, 64, 3), (96, 32, 2)])
def test_quantized_matches_float64(dtype, bits, D, group_size, L, kernel_calls):
    starts, window = [0, 0, 12, 30, 60, 5], 20
    sinks = mx.array(np.random.default_rng(bits).standard_normal(4).astype(np.float32) * 2)
    q, kq, vq, k_nan, v_nan = quantized.case(dtype, D, 2, L, group_size, bits, starts=starts, window=window, seed=D)
    q = louder(q)
    out = mbd.quantized_batched_decode_attention(
        q, k_nan, v_nan, mx.array(quantized.LENGTHS), group_size=group_size, bits=bits,
        kv_starts=mx.array(starts), window=window, sinks=sinks, softcap=CAP)
    kw = dict(starts=starts, window=window, sinks=sinks)
    want = quantized.expected(q, kq, vq, quantized.LENGTHS, group_size, bits, softcap=CAP, **kw)
    check(out, want, quantized.expected(q, kq, vq, quantized.LENGTHS, group_size, bits, **kw), dtype)
    assert kernel_calls() == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("L", [1, 3])
def test_ragged_matches_float64(dtype, G, L, kernel_calls):
    layouts = [ragged.LAYOUTS[b % len(ragged.LAYOUTS)] for b in range(len(ragged.LENGTHS))]
    for n, opts in enumerate(ragged.option_sets(G, L, seed=G + L)):
        starts = opts.get("kv_starts")
        case = ragged.RaggedCase(dtype, 64, G, L, ragged.LENGTHS, ragged.LENGTHS, starts, opts.get("window"),
                                 layouts, seed=G * 7 + n)
        case.q = louder(case.q)
        kw = dict(opts)
        if starts is not None:
            kw["kv_starts"] = mx.array(starts)
        out = mbd.ragged_decode_attention(case.q, case.keys, case.values, softcap=CAP, **kw)
        check(out, case.expected(ragged.LENGTHS, softcap=CAP, **opts), case.expected(ragged.LENGTHS, **opts), dtype)
    assert kernel_calls() == 4


def test_references_match_float64():
    # The fallbacks of the transforms: each reference op against the float64 loops.
    q, k, v = make_inputs(3, 8, 2, 30, 64, mx.float32, seed=9)
    q = louder(q)
    lens = [30, 12, 0]
    want = numpy_reference(q, k, v, lens, window=10, softcap=CAP)
    assert max_abs_error(mbd.reference_attention(q, k, v, mx.array(lens), window=10, softcap=CAP), want) < 2e-5
    keys = [k[b : b + 1, :, : max(n, 1)] for b, n in enumerate(lens)]
    values = [v[b : b + 1, :, : max(n, 1)] for b, n in enumerate(lens)]
    out = mbd.reference_ragged_attention(q, keys, values, mx.array(lens), window=10, softcap=CAP)
    assert max_abs_error(out, want) < 2e-5
    pq, pk, pv, _, _, tables = paged.paged_case(mx.float32, 64, 4, 2, 7, None, seed=1)
    pq = louder(pq)
    out = mbd.reference_paged_attention(pq, pk, pv, mx.array(tables), mx.array(paged.LENGTHS), softcap=CAP)
    assert max_abs_error(out, paged.float64_paged(pq, pk, pv, tables, paged.LENGTHS, softcap=CAP)) < 2e-5


def plain_capped_attention(q, k, v, scale):
    """Full-length GQA attention with capped scores in plain MLX ops: B, H_kv, G heads."""
    B, H_q, L, D = q.shape
    H_kv = k.shape[1]
    qg = q.reshape(B, H_kv, H_q // H_kv, L, D) * scale
    s = qg @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    s = CAP * mx.tanh(s / CAP)
    return (mx.softmax(s, axis=-1) @ mx.expand_dims(v, 2)).reshape(B, H_q, L, D)


def test_vjp_and_jvp_follow_the_capped_contract():
    q, k, v = make_inputs(2, 4, 2, 12, 32, mx.float32, seed=4)
    q = louder(q)
    lens = mx.array([12, 12])
    scale = 32**-0.5

    def fused(q, k, v):
        return mbd.batched_decode_attention(q, k, v, lens, softcap=CAP).sum()

    def plain(q, k, v):
        return plain_capped_attention(q, k, v, scale).sum()

    for g_fused, g_plain in zip(mx.grad(fused, argnums=(0, 1, 2))(q, k, v), mx.grad(plain, argnums=(0, 1, 2))(q, k, v)):
        assert max_abs_error(g_fused, np.array(g_plain).astype(np.float64)) < 1e-4
    tangents = [mx.ones_like(q), mx.zeros_like(k), mx.zeros_like(v)]
    (jf,) = mx.jvp(lambda q, k, v: mbd.batched_decode_attention(q, k, v, lens, softcap=CAP), [q, k, v], tangents)[1]
    (jp,) = mx.jvp(lambda q, k, v: plain_capped_attention(q, k, v, scale), [q, k, v], tangents)[1]
    assert max_abs_error(jf, np.array(jp).astype(np.float64)) < 1e-4


def test_compile_distinguishes_softcaps(kernel_calls):
    q, k, v = make_inputs(2, 4, 2, 10, 64, mx.float32)
    q = louder(q)
    lens = mx.array([10, 6])
    f = mx.compile(
        lambda q, k, v, n: mbd.batched_decode_attention(q, k, v, n, softcap=2.0)
        - mbd.batched_decode_attention(q, k, v, n, softcap=5.0)
    )
    want = numpy_reference(q, k, v, [10, 6], softcap=2.0) - numpy_reference(q, k, v, [10, 6], softcap=5.0)
    assert max_abs_error(f(q, k, v, lens), want) < 4e-5
    assert kernel_calls() == 2


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softcap_raises(softcap, kernel_calls):
    q, k, v = make_inputs(2, 4, 2, 8, 64, mx.float16)
    lens = mx.array([8, 3])
    tables = mx.array([[0], [1]])
    pages = k.reshape(2, 8, 2, 64)
    k8, v8 = mx.quantize(k, group_size=64, bits=8), mx.quantize(v, group_size=64, bits=8)
    calls = {
        "batched_decode_attention": lambda: mbd.batched_decode_attention(q, k, v, lens, softcap=softcap),
        "paged_decode_attention": lambda: mbd.paged_decode_attention(q, pages, pages, tables, lens, softcap=softcap),
        "quantized_batched_decode_attention": lambda: mbd.quantized_batched_decode_attention(
            q, k8, v8, lens, group_size=64, bits=8, softcap=softcap),
        "ragged_decode_attention": lambda: mbd.ragged_decode_attention(
            q, [k[:1], k[1:]], [v[:1], v[1:]], softcap=softcap),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=rf"^\[{op}\] softcap must be a finite number > 0"):
            call()
    assert kernel_calls() == 0
