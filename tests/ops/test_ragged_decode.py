"""ragged_decode_attention on the CPU kernel: one cache buffer per request, read in place.

Each request's keys and values are their own arrays, laid out as real engines keep them: slices
of a larger buffer (SGLang's doubling capacities), token-major buffers transposed, 3-d arrays,
several requests in one buffer. Every position no query row attends holds NaN keys and inf
values, so each case also proves those are never read. The float64 reference is the harness's
numpy reference applied to each request's own rows.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, T_b request b's
positions, D head dim.
"""

import mlx.core as mx
import numpy as np
import pytest
from tests.metal_emu.reference import reference_attention as float64_attention
from tests.metal_emu.reference import row_range

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, max_abs_error, to_numpy64

H_KV = 2
LAYOUTS = ("slice", "token_major", "three_d", "shared")
# T_b per request: empty, shorter than a block, uneven, longer than the split-K chunk.
LENGTHS = [0, 1, 17, 97, 5, 300]


def read_positions(length, start, L, window):
    """bool [T_b]: the positions some query row of a request attends."""
    read = np.zeros(length, dtype=bool)
    for i in range(L):
        lo, hi = row_range(length, start, L, i, window)
        read[max(lo, 0) : max(hi, 0)] = True
    return read


class RaggedCase:
    """Per-request clean rows (float64 truth) and poisoned in-place views (the op's input)."""

    def __init__(self, dtype, D, G, L, lengths, valid_lens, kv_starts, window, layouts, seed):
        rng = np.random.default_rng(seed)
        B = len(lengths)
        self.q = mx.array(rng.standard_normal((B, H_KV * G, L, D)).astype(np.float32)).astype(dtype)
        self.keys, self.values, self.clean = [], [], []
        shared_k = shared_v = None
        shared_at = 0
        if "shared" in layouts:
            cap = sum(lengths) + 7
            shared_k = np.full((1, H_KV, cap, D), np.nan, np.float32)
            shared_v = np.full((1, H_KV, cap, D), np.inf, np.float32)
        pending = []
        for b, (T_b, layout) in enumerate(zip(lengths, layouts)):
            k = rng.standard_normal((H_KV, T_b, D)).astype(np.float32)
            v = rng.standard_normal((H_KV, T_b, D)).astype(np.float32)
            self.clean.append((k, v))
            n = int(np.clip(valid_lens[b], 0, T_b))
            start = 0 if kv_starts is None else int(np.clip(kv_starts[b], 0, T_b))
            unread = np.ones(T_b, dtype=bool)
            unread[:n] = ~read_positions(n, start, L, window)
            k_bad = np.where(unread[None, :, None], np.nan, k)
            v_bad = np.where(unread[None, :, None], np.inf, v)
            pending.append((layout, T_b, k_bad, v_bad))
            if layout == "shared":
                shared_k[0, :, shared_at : shared_at + T_b] = k_bad
                shared_v[0, :, shared_at : shared_at + T_b] = v_bad
                shared_at += T_b
        big_k = None if shared_k is None else mx.array(shared_k).astype(dtype)
        big_v = None if shared_v is None else mx.array(shared_v).astype(dtype)
        shared_at = 0
        for layout, T_b, k_bad, v_bad in pending:
            if layout == "shared":
                views = (big_k[:, :, shared_at : shared_at + T_b], big_v[:, :, shared_at : shared_at + T_b])
                shared_at += T_b
            else:
                views = tuple(self.view(x, layout, T_b, dtype, fill) for x, fill in ((k_bad, np.nan), (v_bad, np.inf)))
            self.keys.append(views[0])
            self.values.append(views[1])
        mx.eval(self.q, *self.keys, *self.values)

    @staticmethod
    def view(x, layout, T_b, dtype, fill):
        """x [H_kv, T_b, D] as a strided view of a larger poisoned buffer."""
        cap = 2 * T_b + 3  # a doubling capacity, its tail never written
        if layout == "token_major":
            buf = np.full((1, cap, H_KV, x.shape[-1]), fill, np.float32)
            buf[0, :T_b] = x.transpose(1, 0, 2)
            return mx.array(buf).astype(dtype)[:, :T_b].transpose(0, 2, 1, 3)
        buf = np.full((1, H_KV, cap, x.shape[-1]), fill, np.float32)
        buf[0, :, :T_b] = x
        view = mx.array(buf).astype(dtype)[:, :, :T_b]
        return view[0] if layout == "three_d" else view

    def expected(self, valid_lens, kv_starts=None, window=None, sinks=None, scale=None, softcap=None):
        """float64 [B, H_q, L, D]: the dense float64 reference on each request's rows."""
        q64 = to_numpy64(self.q)
        scale = 1.0 / np.sqrt(q64.shape[-1]) if scale is None else scale
        s64 = None if sinks is None else to_numpy64(sinks)
        out = []
        for b, (k, v) in enumerate(self.clean):
            # Values rounded to the op's dtype, as the op reads them.
            k64 = to_numpy64(mx.array(k).astype(self.q.dtype))[None]
            v64 = to_numpy64(mx.array(v).astype(self.q.dtype))[None]
            starts = None if kv_starts is None else np.asarray(kv_starts[b : b + 1])
            out.append(float64_attention(q64[b : b + 1], k64, v64, np.asarray(valid_lens[b : b + 1]), scale, starts, window, s64,
                                        softcap))
        return np.concatenate(out, axis=0)


def option_sets(G, L, seed):
    rng = np.random.default_rng(seed)
    sinks = mx.array(rng.standard_normal(H_KV * G).astype(np.float32) * 2)
    starts = [0, 0, 3, 40, 2, 250]
    return [
        dict(),
        dict(window=7),
        dict(sinks=sinks),
        dict(kv_starts=starts, window=50, sinks=sinks),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [1, 32, 64, 80, 128, 256])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("L", [1, 3])
def test_matches_float64(dtype, D, G, L, kernel_calls):
    layouts = [LAYOUTS[(b + D) % len(LAYOUTS)] for b in range(len(LENGTHS))]
    calls = 0
    for n, opts in enumerate(option_sets(G, L, seed=D + G + L)):
        starts = opts.get("kv_starts")
        case = RaggedCase(dtype, D, G, L, LENGTHS, LENGTHS, starts, opts.get("window"), layouts, seed=D * 13 + n)
        kw = dict(opts)
        if starts is not None:
            kw["kv_starts"] = mx.array(starts)
        out = mbd.ragged_decode_attention(case.q, case.keys, case.values, **kw)
        mx.eval(out)
        calls += 1
        assert out.shape == case.q.shape and out.dtype == dtype
        err = max_abs_error(out, case.expected(LENGTHS, **opts))
        assert err < TOLERANCE[dtype], (opts.keys(), err)
    assert kernel_calls() == calls


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_clamped_lengths(dtype):
    """valid_lens past T_b read T_b keys, negative ones none; wide dtypes clamp before narrowing."""
    lengths = [4, 0, 33, 9]
    given = [1000, 5, -3, 2**40]
    clamped = [4, 0, 0, 9]
    case = RaggedCase(dtype, 64, 2, 1, lengths, clamped, None, None, ["slice", "three_d", "token_major", "slice"], seed=3)
    out = mbd.ragged_decode_attention(case.q, case.keys, case.values, mx.array(given, dtype=mx.int64))
    assert max_abs_error(out, case.expected(clamped)) < TOLERANCE[dtype]
    assert not np.any(to_numpy64(out)[1:3])


def test_default_lengths_are_the_buffers():
    case = RaggedCase(mx.float32, 64, 4, 2, [12, 3, 0], [12, 3, 0], None, None, ["slice", "three_d", "shared"], seed=5)
    out = mbd.ragged_decode_attention(case.q, case.keys, case.values)
    assert max_abs_error(out, case.expected([12, 3, 0])) < TOLERANCE[mx.float32]


def test_many_requests(kernel_calls):
    """B = 300 requests of uneven lengths (zeros included) in one call, every layout mixed."""
    rng = np.random.default_rng(11)
    lengths = [int(n) for n in rng.integers(0, 60, size=300)]
    lengths[::37] = [0] * len(lengths[::37])
    layouts = [LAYOUTS[b % len(LAYOUTS)] for b in range(300)]
    valid = [max(n - int(rng.integers(0, 3)), 0) for n in lengths]
    case = RaggedCase(mx.float16, 64, 2, 1, lengths, valid, None, None, layouts, seed=12)
    out = mbd.ragged_decode_attention(case.q, case.keys, case.values, mx.array(valid), window=16)
    assert max_abs_error(out, case.expected(valid, window=16)) < TOLERANCE[mx.float16]
    assert kernel_calls() == 1


def test_matches_the_dense_op():
    """Equal buffers in the ragged and the dense layout give equal outputs, bit for bit."""
    B, T, D = 4, 70, 128
    k = mx.random.normal((B, H_KV, T, D), key=mx.random.key(1)).astype(mx.bfloat16)
    v = mx.random.normal((B, H_KV, T, D), key=mx.random.key(2)).astype(mx.bfloat16)
    q = mx.random.normal((B, 8, 1, D), key=mx.random.key(3)).astype(mx.bfloat16)
    lens = mx.array([70, 3, 0, 41])
    dense = mbd.batched_decode_attention(q, k, v, lens)
    ragged = mbd.ragged_decode_attention(q, [k[b : b + 1] for b in range(2)] + [k[b] for b in range(2, B)], [v[b : b + 1] for b in range(2)] + [v[b] for b in range(2, B)], lens)
    assert mx.array_equal(dense, ragged).item()


def test_reads_in_place():
    """The op allocates its output, never a copy of the per-request buffers."""
    B, H, cap, D = 8, 8, 4096, 128
    ks = [mx.random.normal((1, cap, H, D)).astype(mx.float16) for _ in range(B)]
    vs = [mx.random.normal((1, H, cap, D)).astype(mx.float16) for _ in range(B)]
    q = mx.random.normal((B, 4 * H, 1, D)).astype(mx.float16)
    mx.eval(q, *ks, *vs)
    lengths = [cap - 1 - 300 * b for b in range(B)]
    keys = [k[:, :n].transpose(0, 2, 1, 3) for k, n in zip(ks, lengths)]
    values = [v[:, :, :n] for v, n in zip(vs, lengths)]
    buffers = sum(k.nbytes + v.nbytes for k, v in zip(keys, values))
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = mbd.ragged_decode_attention(q, keys, values)
    mx.eval(out)
    grown = mx.get_peak_memory() - before
    assert buffers > 2**26
    # The output, the lengths and the kernel's small state; a padded copy would be > 64 MiB.
    assert grown < out.nbytes + 2**20, grown


def test_empty_batch():
    out = mbd.ragged_decode_attention(mx.zeros((0, 4, 1, 64)), [], [])
    assert out.shape == (0, 4, 1, 64)


def test_transforms_follow_the_reference():
    """vjp, jvp and vmap run through the per-request reference (the primitive's fallback)."""
    case = RaggedCase(mx.float32, 32, 2, 2, [9, 0, 4], [9, 0, 4], None, None, ["slice", "three_d", "token_major"], seed=8)
    ks, vs = case.keys, case.values
    lens = mx.array([9, 0, 3])
    # The poisoned rows past a length would make every gradient NaN: use clean copies.
    ks = [mx.where(mx.isnan(k), 0.0, k) for k in ks]
    vs = [mx.where(mx.isinf(v), 0.0, v) for v in vs]

    def fused(q, *kv):
        return mbd.ragged_decode_attention(q, list(kv[:3]), list(kv[3:]), lens, window=3)

    def plain(q, *kv):
        return mbd.reference_ragged_attention(q, list(kv[:3]), list(kv[3:]), lens, window=3)

    args = [case.q, *ks, *vs]
    grads = mx.grad(lambda *a: fused(*a).sum(), argnums=list(range(7)))(*args)
    truth = mx.grad(lambda *a: plain(*a).sum(), argnums=list(range(7)))(*args)
    for g, t in zip(grads, truth):
        assert mx.allclose(g, t, atol=1e-5).item()
    tangent = [mx.ones_like(a) for a in args]
    (jv,) = mx.jvp(fused, args, tangent)[1]
    (jt,) = mx.jvp(plain, args, tangent)[1]
    assert mx.allclose(jv, jt, atol=1e-5).item()
    stacked = mx.stack([case.q, 2 * case.q])
    mapped = mx.vmap(lambda q: fused(q, *ks, *vs))(stacked)
    assert mx.allclose(mapped[1], plain(2 * case.q, *ks, *vs), atol=1e-5).item()


def test_compile(kernel_calls):
    """mx.compile traces one graph per B (the lists' length); shapes may change with shapeless=False."""
    f = mx.compile(lambda q, *kv: mbd.ragged_decode_attention(q, list(kv[: len(kv) // 2]), list(kv[len(kv) // 2 :])) * 2.0)
    for lengths in ([5, 9], [7, 1], [3, 30, 2]):
        case = RaggedCase(mx.float32, 64, 2, 1, lengths, lengths, None, None, ["slice"] * len(lengths), seed=len(lengths))
        out = f(case.q, *case.keys, *case.values)
        assert max_abs_error(out, 2 * case.expected(lengths)) < 4e-5
    assert kernel_calls() == 3


ERRORS = [
    ("lists of B = 2", lambda q, k, v: (q, k[:1], v[:1])),
    ("values[1] must have the shape of keys[1]", lambda q, k, v: (q, k, [v[0], v[1][:, :, :3]])),
    ("keys[1] is float16", lambda q, k, v: (q, [k[0], k[1].astype(mx.float16)], v)),
    ("values[0] is bfloat16", lambda q, k, v: (q, k, [v[0].astype(mx.bfloat16), v[1]])),
    ("keys[1] has 1 key/value heads", lambda q, k, v: (q, [k[0], k[1][:, :1]], [v[0], v[1][:, :1]])),
    ("keys[1] has head dim 32", lambda q, k, v: (q, [k[0], k[1][..., :32]], [v[0], v[1][..., :32]])),
    ("leading axis of 1", lambda q, k, v: (q, [mx.concatenate([k[0], k[0]]), k[1]], [mx.concatenate([v[0], v[0]]), v[1]])),
    ("keys[0] must have shape", lambda q, k, v: (q, [k[0][0, 0], k[1]], [v[0][0, 0], v[1]])),
    ("queries must have shape", lambda q, k, v: (q[0], k, v)),
    ("positive multiple", lambda q, k, v: (q[:, :3], k, v)),
]


@pytest.mark.parametrize("message, corrupt", ERRORS, ids=[e[0] for e in ERRORS])
def test_malformed_lists(message, corrupt, kernel_calls):
    q = mx.zeros((2, 4, 1, 64))
    k = [mx.zeros((1, 2, 5, 64)), mx.zeros((1, 2, 8, 64))]
    v = [mx.zeros((1, 2, 5, 64)), mx.zeros((1, 2, 8, 64))]
    with pytest.raises(ValueError, match=r"^\[ragged_decode_attention\] .*" + message.replace("[", r"\[").replace("]", r"\]")):
        mbd.ragged_decode_attention(*corrupt(q, k, v))
    with pytest.raises(ValueError, match=r"^\[ragged_decode_attention\]"):
        mbd.reference_ragged_attention(*corrupt(q, k, v))
    assert kernel_calls() == 0


OPTION_ERRORS = [
    ("valid_lens must have shape", dict(valid_lens=mx.array([1, 2, 3]))),
    ("valid_lens must have an integer dtype", dict(valid_lens=mx.array([1.0, 2.0]))),
    ("kv_starts must have shape", dict(kv_starts=mx.array([0]))),
    ("window must be >= 1", dict(window=0)),
    ("sinks must have shape", dict(sinks=mx.zeros((3,)))),
    ("scale must be finite", dict(scale=float("inf"))),
]


@pytest.mark.parametrize("message, kw", OPTION_ERRORS, ids=[e[0] for e in OPTION_ERRORS])
def test_malformed_options(message, kw, kernel_calls):
    q = mx.zeros((2, 4, 1, 64))
    k = [mx.zeros((2, 5, 64)), mx.zeros((1, 2, 8, 64))]
    with pytest.raises(ValueError, match=r"^\[ragged_decode_attention\] .*" + message):
        mbd.ragged_decode_attention(q, k, k, **kw)
    assert kernel_calls() == 0
