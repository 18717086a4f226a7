"""quantized_batched_decode_attention on the fused CPU kernel, against float64 attention over
the dequantized keys and values.

The float64 reference dequantizes the packed integers itself (numpy: unpack, scale * w + bias),
independently of mx.dequantize. Every position that no query row of a request attends holds
NaN scales and biases and all-ones words, so each case also proves those positions are never
read.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, T positions,
D head dim of queries and keys, Dv of values, W = D * bits / 32 packed words, S = D / group_size
groups.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from tests.metal_emu.reference import reference_attention as float64_attention
from tests.metal_emu.reference import row_range

import mlx_batched_decode as mbd
from tests.support.numerics import TOLERANCE, dtype_id, to_numpy64

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
T = 70
# Empty, one key, all of T, uneven ones, one past T (clamped).
LENGTHS = [0, 1, T, 37, 64, 90]


def dequantize64(packed, scales, biases, group_size, bits):
    """float64 [..., D] of a (packed, scales, biases) triple, from the integers."""
    words = np.array(packed).astype(np.uint64)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)
    ints = (words[..., None] >> shifts) & ((1 << bits) - 1)
    ints = ints.reshape(*words.shape[:-1], words.shape[-1] * per_word).astype(np.float64)
    s = np.repeat(to_numpy64(scales), group_size, axis=-1)
    b = np.repeat(to_numpy64(biases), group_size, axis=-1)
    return s * ints + b


def attended(lens, starts, rows, window, t):
    """bool [B, T]: the positions some query row of each request attends."""
    mask = np.zeros((len(lens), t), dtype=bool)
    for b, n in enumerate(lens):
        n = int(np.clip(n, 0, t))
        s = 0 if starts is None else int(np.clip(starts[b], 0, t))
        for i in range(rows):
            lo, hi = row_range(n, s, rows, i, window)
            mask[b, lo:max(lo, hi)] = True
    return mask


def quantized(x, group_size, bits, scale_dtype):
    """mx.quantize of x [B, H_kv, T, D] with scales and biases cast to scale_dtype."""
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return packed, scales.astype(scale_dtype), biases.astype(scale_dtype)


def poisoned(triple, unread):
    """The triple with all-ones words and NaN scales and biases at positions unread [B, T]."""
    packed, scales, biases = triple
    mask = mx.array(unread)[:, None, :, None]
    return (
        mx.where(mask, mx.array(0xFFFFFFFF, mx.uint32), packed),
        mx.where(mask, mx.array(float("nan"), scales.dtype), scales),
        mx.where(mask, mx.array(float("nan"), biases.dtype), biases),
    )


def case(dtype, D, G, L, group_size, bits, scale_dtype=None, starts=None, window=None, seed=0,
         lens=LENGTHS, t=T, H_kv=2, Dv=None):
    """Queries, the clean and poisoned key/value triples and the float64 reference's inputs;
    values of head dim Dv (None: D)."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    q = mx.array(rng.standard_normal((B, H_kv * G, L, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((B, H_kv, t, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, H_kv, t, Dv or D)).astype(np.float32))
    scale_dtype = scale_dtype or dtype
    kq, vq = quantized(k, group_size, bits, scale_dtype), quantized(v, group_size, bits, scale_dtype)
    unread = ~attended(lens, starts, L, window, t)
    return q, kq, vq, poisoned(kq, unread), poisoned(vq, unread)


def expected(q, kq, vq, lens, group_size, bits, starts=None, window=None, sinks=None, scale=None, softcap=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return float64_attention(
        to_numpy64(q), dequantize64(*kq, group_size, bits), dequantize64(*vq, group_size, bits),
        np.asarray(lens, dtype=np.int64), scale, None if starts is None else np.asarray(starts, dtype=np.int64),
        window, None if sinks is None else to_numpy64(sinks), softcap)


def check(out, want, dtype):
    assert out.dtype == dtype
    err = float(np.max(np.abs(to_numpy64(out) - want), initial=0.0))
    assert err < TOLERANCE[dtype], err


# (D, group_size): the kernels of their own (64, 128) and the generic one (96, 256), every group size.
DIMS = [(64, 32), (64, 64), (128, 64), (128, 128), (96, 32), (256, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D,group_size", DIMS)
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_float64(dtype, D, group_size, bits, kernel_calls):
    # G and L vary with the case so that every combination meets R = G * L of 1, 4, 6 and 12.
    G, L = [(1, 1), (4, 1), (2, 3), (4, 3)][(D // 32 + group_size // 32 + bits) % 4]
    q, kq, vq, k_nan, v_nan = case(dtype, D, G, L, group_size, bits, seed=D + group_size + bits)
    out = mbd.quantized_batched_decode_attention(
        q, k_nan, v_nan, mx.array(LENGTHS), group_size=group_size, bits=bits)
    check(out, expected(q, kq, vq, LENGTHS, group_size, bits), dtype)
    assert kernel_calls() == 1


# (D, Dv, group_size): DeepSeek-V2's 192 / 128, MLA's latent 576 / 512 (keys past 512 columns,
# 18 groups of 32), MiniCPM3's 96 / 64, values wider than keys.
VALUE_DIMS = [(192, 128, 64), (576, 512, 32), (576, 512, 64), (96, 64, 32), (64, 128, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D,Dv,group_size", VALUE_DIMS)
@pytest.mark.parametrize("bits", [4, 8])
def test_values_of_their_own_head_dim(dtype, D, Dv, group_size, bits, kernel_calls):
    G, L = [(1, 1), (4, 1), (2, 3), (4, 3)][(D // 32 + Dv // 32 + bits) % 4]
    starts, window = ([0, 0, 12, 30, 60, 5], 40) if bits == 4 else (None, None)
    q, kq, vq, k_nan, v_nan = case(dtype, D, G, L, group_size, bits, starts=starts, window=window,
                                   seed=D + Dv + bits, Dv=Dv)
    out = mbd.quantized_batched_decode_attention(
        q, k_nan, v_nan, mx.array(LENGTHS), group_size=group_size, bits=bits,
        kv_starts=None if starts is None else mx.array(starts), window=window)
    assert out.shape == (len(LENGTHS), q.shape[1], L, Dv)
    check(out, expected(q, kq, vq, LENGTHS, group_size, bits, starts, window), dtype)
    assert kernel_calls() == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("D,Dv,G,L", [(128, 128, 8, 3), (64, 64, 16, 1), (192, 128, 4, 5), (96, 64, 32, 1)])
def test_many_query_rows_read_each_block_dequantized_once(dtype, D, Dv, G, L, bits, kernel_calls):
    """Work items of many query rows read each block's rows dequantized once (the CPU kernel's
    dequantize_block: 16 rows or more at 8 bits, 8 at 4; 32 and 24 on AVX-512), the others score
    the integers: windows, starts, sinks and NaN in unread positions on both."""
    starts = [0, 0, 12, 30, 60, 5]
    sinks = mx.array(np.random.default_rng(G).standard_normal(2 * G).astype(np.float32))
    for n, (kv_starts, window, sink) in enumerate([(None, None, None), (starts, 9, sinks), (starts, 40, None)]):
        q, kq, vq, k_nan, v_nan = case(dtype, D, G, L, 32, bits, starts=kv_starts, window=window,
                                       seed=n + D, Dv=Dv)
        out = mbd.quantized_batched_decode_attention(
            q, k_nan, v_nan, mx.array(LENGTHS), group_size=32, bits=bits,
            kv_starts=None if kv_starts is None else mx.array(kv_starts), window=window, sinks=sink)
        check(out, expected(q, kq, vq, LENGTHS, 32, bits, kv_starts, window, sink), dtype)
    assert kernel_calls() == 3


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("G", [2, 16])
def test_a_value_only_some_rows_read_stays_out_of_the_others(G, bits):
    """L = 3 rows in a window of 4 over 20 keys: position 14 is row 0's alone. An infinite
    value scale there (row 0's output is then not finite) must leave rows 1 and 2 as they are
    without it, on the per-tile loops (G = 2) and on blocks dequantized once (G = 16)."""
    q, kq, vq, _, _ = case(mx.float32, 64, G, 3, 32, bits, lens=[20], t=20, H_kv=1)
    scales = np.array(vq[1])
    scales[0, 0, 14] = np.inf
    broken = (vq[0], mx.array(scales), vq[2])
    out = mbd.quantized_batched_decode_attention(q, kq, broken, mx.array([20]), group_size=32, bits=bits, window=4)
    want = expected(q, kq, vq, [20], 32, bits, window=4)
    out = to_numpy64(out)
    assert not np.isfinite(out[:, :, 0]).all()
    np.testing.assert_allclose(out[:, :, 1:], want[:, :, 1:], atol=TOLERANCE[mx.float32], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [4, 8])
def test_latent_values_are_a_view_of_the_keys(dtype, bits, kernel_calls):
    """MLA in latent space: one KV head of r + R = 576 columns, 16 query heads, the values the
    keys' first r = 512 columns, their words, scales and biases sliced in place."""
    r, R, group_size = 512, 64, 64
    q, kq, _, k_nan, _ = case(dtype, r + R, 16, 1, group_size, bits, seed=bits, H_kv=1)
    latent = lambda triple: (triple[0][..., :r * bits // 32], triple[1][..., :r // group_size],
                             triple[2][..., :r // group_size])
    out = mbd.quantized_batched_decode_attention(q, k_nan, latent(k_nan), mx.array(LENGTHS),
                                                 group_size=group_size, bits=bits)
    check(out, expected(q, kq, latent(kq), LENGTHS, group_size, bits), dtype)
    assert kernel_calls() == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("L", [1, 4])
def test_starts_windows_sinks(dtype, bits, L):
    starts = [0, 0, 12, 30, 60, 5]
    sinks = mx.array(np.random.default_rng(bits + L).standard_normal(6).astype(np.float32) * 2)
    for n, (kv_starts, window, sink) in enumerate(
            [(starts, None, None), (None, 9, None), (None, None, sinks), (starts, 1, sinks), (starts, 40, sinks)]):
        q, kq, vq, k_nan, v_nan = case(dtype, 128, 3, L, 64, bits, starts=kv_starts, window=window, seed=n)
        out = mbd.quantized_batched_decode_attention(
            q, k_nan, v_nan, mx.array(LENGTHS), bits=bits,
            kv_starts=None if kv_starts is None else mx.array(kv_starts), window=window, sinks=sink)
        check(out, expected(q, kq, vq, LENGTHS, 64, bits, kv_starts, window, sink), dtype)


@pytest.mark.parametrize("scale_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=dtype_id)
def test_scales_of_another_dtype(dtype, scale_dtype):
    q, kq, vq, k_nan, v_nan = case(dtype, 64, 4, 1, 32, 8, scale_dtype=scale_dtype, seed=3)
    out = mbd.quantized_batched_decode_attention(q, k_nan, v_nan, mx.array(LENGTHS), group_size=32, bits=8)
    check(out, expected(q, kq, vq, LENGTHS, 32, 8), dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_long_requests_split_into_chunks(bits):
    """Requests longer than a work item's 512 keys: split-K and the merge, with L = 2 and a window."""
    lens, t = [1500, 513, 1100], 1500
    for window in (None, 700):
        q, kq, vq, k_nan, v_nan = case(mx.float16, 128, 4, 2, 64, bits, window=window, lens=lens, t=t, seed=9)
        out = mbd.quantized_batched_decode_attention(q, k_nan, v_nan, mx.array(lens), bits=bits, window=window)
        check(out, expected(q, kq, vq, lens, 64, bits, window=window), mx.float16)


@pytest.mark.parametrize("bits", [4, 8])
def test_nan_outside_every_range_changes_nothing(bits):
    starts, window = [0, 0, 20, 5, 40, 3], 11
    q, kq, vq, k_nan, v_nan = case(mx.float32, 64, 2, 3, 32, bits, starts=starts, window=window, seed=5)
    args = dict(group_size=32, bits=bits, kv_starts=mx.array(starts), window=window)
    clean = mbd.quantized_batched_decode_attention(q, kq, vq, mx.array(LENGTHS), **args)
    dirty = mbd.quantized_batched_decode_attention(q, k_nan, v_nan, mx.array(LENGTHS), **args)
    assert not np.isnan(np.array(dirty)).any()
    np.testing.assert_array_equal(np.array(clean), np.array(dirty))


@pytest.mark.parametrize("bits", [4, 8])
def test_strided_views_read_in_place(bits):
    """Triples sliced from a larger slot cache ([:, :, :T]), words of every other element of a
    wider buffer (a strided last axis) and scales of a transposed buffer."""
    dtype, D, gs = mx.bfloat16, 128, 64
    q, kq, vq, _, _ = case(dtype, D, 2, 2, gs, bits, t=T + 30, seed=11)
    lens = [min(n, T) for n in LENGTHS]

    def view(triple):
        packed, scales, biases = triple
        wide = mx.repeat(packed, 2, axis=-1)[..., ::2]
        transposed = mx.contiguous(scales.swapaxes(2, 3)).swapaxes(2, 3)
        return wide[:, :, :T], transposed[:, :, :T], biases[:, :, :T]

    kv, vv = view(kq), view(vq)
    mx.eval(kv, vv)
    out = mbd.quantized_batched_decode_attention(q, kv, vv, mx.array(lens), group_size=gs, bits=bits)
    check(out, expected(q, kv, vv, lens, gs, bits), dtype)


@pytest.mark.parametrize("isa", mbd._ext.cpu_isas())
def test_every_instruction_set(isa):
    previous = mbd._ext.cpu_isa()
    mbd._ext.set_cpu_isa(isa)
    try:
        # 4 query rows per item, and 32 (each block dequantized once on every variant).
        for bits, (D, Dv), G in itertools.product((4, 8), ((128, 128), (576, 512)), (4, 32)):
            q, kq, vq, k_nan, v_nan = case(mx.float16, D, G, 1, 64, bits, seed=bits, Dv=Dv)
            out = mbd.quantized_batched_decode_attention(q, k_nan, v_nan, mx.array(LENGTHS), bits=bits)
            check(out, expected(q, kq, vq, LENGTHS, 64, bits), mx.float16)
    finally:
        mbd._ext.set_cpu_isa(previous)


@pytest.mark.parametrize("isa", mbd._ext.cpu_isas())
@pytest.mark.parametrize("bits", [4, 8])
def test_query_words_cost_far_less_than_the_quantization(isa, bits):
    """With 16-bit queries the variants with AVX2 or AVX512-VNNI score keys on their integers, the queries
    as int16 words with a scale per group, each element off by up to max |q_g| / 65534. A query
    element 100x the rest of its group makes that step largest: the error it adds must stay far
    below what quantizing the keys and values costs against the unquantized ones (under 5%)."""
    rng = np.random.default_rng(bits)
    B, D, gs = len(LENGTHS), 128, 64
    q = rng.standard_normal((B, 8, 1, D)).astype(np.float32)
    q[..., ::gs] *= 100
    q = mx.array(q).astype(mx.float16)
    k = mx.array(rng.standard_normal((B, 2, T, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, 2, T, D)).astype(np.float32))
    kq, vq = quantized(k, gs, bits, mx.float16), quantized(v, gs, bits, mx.float16)
    want = expected(q, kq, vq, LENGTHS, gs, bits)
    unquantized = float64_attention(to_numpy64(q), to_numpy64(k), to_numpy64(v),
                                    np.asarray(LENGTHS, dtype=np.int64), D ** -0.5, None, None, None)
    quantization_cost = float(np.max(np.abs(want - unquantized)))
    previous = mbd._ext.cpu_isa()
    mbd._ext.set_cpu_isa(isa)
    try:
        out = mbd.quantized_batched_decode_attention(q, kq, vq, mx.array(LENGTHS), group_size=gs, bits=bits)
        mx.eval(out)  # the op is lazy: evaluated while the variant is forced
    finally:
        mbd._ext.set_cpu_isa(previous)
    err = float(np.max(np.abs(to_numpy64(out) - want)))
    assert err < 0.05 * quantization_cost, (err, quantization_cost)


def test_fallback_matches_the_kernel():
    """vjp, jvp and vmap run the plain-MLX fallback (mx.dequantize + reference_attention)."""
    q, kq, vq, _, _ = case(mx.float32, 64, 2, 1, 32, 8, seed=2)
    lens = mx.array(LENGTHS)

    def f(x):
        return mbd.quantized_batched_decode_attention(x, kq, vq, lens, group_size=32).sum()

    def ref(x):
        k = mx.dequantize(*kq, group_size=32, bits=8)
        v = mx.dequantize(*vq, group_size=32, bits=8)
        return mbd.reference_attention(x, k, v, lens).sum()

    np.testing.assert_allclose(np.array(mx.grad(f)(q)), np.array(mx.grad(ref)(q)), atol=1e-5)
    tangent = mx.ones_like(q)
    np.testing.assert_allclose(np.array(mx.jvp(f, [q], [tangent])[1][0]),
                               np.array(mx.jvp(ref, [q], [tangent])[1][0]), atol=1e-4)
    batched = mx.vmap(lambda x: mbd.quantized_batched_decode_attention(x, kq, vq, lens, group_size=32))(
        mx.stack([q, 2 * q]))
    for i, x in enumerate([q, 2 * q]):
        np.testing.assert_allclose(
            np.array(batched[i]),
            np.array(mbd.quantized_batched_decode_attention(x, kq, vq, lens, group_size=32)), atol=1e-5)


@pytest.mark.parametrize("shapeless", [False, True])
def test_compile(shapeless, kernel_calls):
    q, kq, vq, _, _ = case(mx.float16, 64, 2, 1, 64, 4, seed=4)

    def f(x, k, v, lens):
        return mbd.quantized_batched_decode_attention(x, k, v, lens, bits=4)

    compiled = mx.compile(f, shapeless=shapeless)
    lens = mx.array(LENGTHS)
    np.testing.assert_array_equal(np.array(compiled(q, kq, vq, lens)), np.array(f(q, kq, vq, lens)))
    assert kernel_calls() == 2


def _triples(B=2, H_kv=2, T=8, D=64, group_size=64, bits=8, dtype=mx.float16):
    k = mx.random.normal((B, H_kv, T, D)).astype(dtype)
    return mx.quantize(k, group_size=group_size, bits=bits), mx.quantize(k, group_size=group_size, bits=bits)


@pytest.mark.parametrize("change,message", [
    (dict(bits=3), "bits must be 4 or 8"),
    (dict(group_size=16), "group_size must be 32, 64 or 128"),
    (dict(keys=lambda k: k[:2]), "keys must be a (packed, scales, biases) triple"),
    (dict(values=lambda v: (*v, v[0])), "values must be a (packed, scales, biases) triple"),
    (dict(keys=lambda k: (k[0].astype(mx.int32), k[1], k[2])), "packed must be uint32"),
    (dict(keys=lambda k: (k[0][..., :8], k[1], k[2])), "packed must have shape"),
    (dict(values=lambda v: (v[0], v[1][..., :1, :], v[2])), "scales and biases must have shape"),
    (dict(keys=lambda k: (k[0], k[1], k[2].astype(mx.float32))), "scales and biases must share"),
    (dict(keys=lambda k: (k[0], k[1].astype(mx.int32), k[2].astype(mx.int32))), "scales and biases must share"),
    (dict(values=lambda v: (v[0], v[1].astype(mx.float32), v[2].astype(mx.float32))),
     "scales of keys and values must share"),
    (dict(queries=lambda q: mx.zeros((2, 4, 1, 128), mx.float16)), "packed must have shape"),
    (dict(queries=lambda q: q.astype(mx.int32)), "queries must be float16, bfloat16 or float32"),
    (dict(queries=lambda q: q[:, :3]), "must be a positive multiple"),
    (dict(queries=lambda q: q[0]), "queries must have shape"),
    (dict(valid_lens=mx.array([1.0, 2.0])), "valid_lens must have an integer dtype"),
    (dict(valid_lens=mx.array([1])), "valid_lens must have shape"),
    (dict(window=0), "window must be >= 1"),
    (dict(sinks=mx.zeros((3,))), "sinks must have shape"),
])
def test_malformed_arguments(change, message):
    (k, v), q = _triples(), mx.zeros((2, 4, 1, 64), mx.float16)
    args = dict(queries=q, keys=k, values=v, valid_lens=mx.array([3, 8]), bits=8, group_size=64)
    for name, value in change.items():
        args[name] = value(args[name]) if callable(value) else value
    with pytest.raises(ValueError, match=r"^\[quantized_batched_decode_attention\] .*" + message.replace("(", r"\(")
                       .replace(")", r"\)")):
        mbd.quantized_batched_decode_attention(
            args.pop("queries"), args.pop("keys"), args.pop("values"), args.pop("valid_lens"), **args)


def test_head_dim_must_divide_into_groups():
    k = mx.random.normal((1, 1, 4, 96)).astype(mx.float16)
    kq = mx.quantize(k, group_size=32, bits=4)
    with pytest.raises(ValueError, match="head dim 96 is not supported with group_size 64"):
        mbd.quantized_batched_decode_attention(mx.zeros((1, 1, 1, 96), mx.float16), kq, kq, mx.array([4]),
                                               bits=4, group_size=64)


@pytest.mark.parametrize("D,Dv,group_size,message", [
    (128, 96, 64, "the values' head dim 96 is not supported with group_size 64"),
    (128, 544, 32, "the values' head dim 544 is not supported with group_size 32; multiples of group_size up to 512"),
    (608, 512, 32, "the keys' head dim 608 is not supported with group_size 32; multiples of group_size up to 576"),
])
def test_head_dims_out_of_range_raise(D, Dv, group_size, message, kernel_calls):
    k = mx.quantize(mx.zeros((1, 1, 4, D)), group_size=group_size, bits=8)
    v = mx.quantize(mx.zeros((1, 1, 4, Dv)), group_size=32, bits=8)
    with pytest.raises(ValueError, match=r"^\[quantized_batched_decode_attention\] " + message):
        mbd.quantized_batched_decode_attention(mx.zeros((1, 1, 1, D)), k, v, mx.array([4]),
                                               bits=8, group_size=group_size)
    assert kernel_calls() == 0


def test_gpu_stream_without_metal_is_rejected():
    (k, v), q = _triples(), mx.zeros((2, 4, 1, 64), mx.float16)
    with pytest.raises(ValueError, match="gpu"):
        mbd.quantized_batched_decode_attention(q, k, v, mx.array([3, 8]), stream=mx.gpu)
