"""batched_decode_attention over a ring (ring_offset) on the CPU kernel, against float64.

A ring of T slots holds logical position j of request b in slot (j + ring_offset[b]) mod T, as
mlx-lm's rotating caches do once they wrap. Every slot no query row attends holds NaN keys and
inf values, so each case also proves those slots are never read; the float64 reference sees the
keys in time order.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, T slots, D head dim.
"""

import mlx.core as mx
import numpy as np
import pytest
from tests.metal_emu.reference import reference_attention as float64_attention
from tests.metal_emu.reference import row_range

import mlx_batched_decode as mbd
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, max_abs_error, to_numpy64

H_KV = 2
T = 70
# Per request: full rings, partly filled ones, an empty one; offsets past T, negative, huge.
LENGTHS = [70, 70, 33, 0, 70, 5]
OFFSETS = [0, 13, -5, 21, 2**40 + 3, 69]


def ring_case(dtype, D, G, L, offsets, starts, window, seed):
    """Queries, logical float64 keys/values [B, H_kv, T, D], and the poisoned rings (the op's input)."""
    rng = np.random.default_rng(seed)
    B = len(LENGTHS)
    q = mx.array(rng.standard_normal((B, H_KV * G, L, D)).astype(np.float32)).astype(dtype)
    k = rng.standard_normal((B, H_KV, T, D)).astype(np.float32)
    v = rng.standard_normal((B, H_KV, T, D)).astype(np.float32)
    read = np.zeros((B, T), dtype=bool)
    for b, n in enumerate(LENGTHS):
        start = 0 if starts is None else int(np.clip(starts[b], 0, T))
        for i in range(L):
            lo, hi = row_range(n, start, L, i, window)
            read[b, max(lo, 0) : max(hi, 0)] = True
    slots = (np.arange(T)[None, :] + np.array(offsets, dtype=np.int64)[:, None]) % T  # [B, T]: logical -> slot
    k_ring = np.full_like(k, np.nan)
    v_ring = np.full_like(v, np.inf)
    for b in range(B):
        k_ring[b][:, slots[b][read[b]]] = k[b][:, read[b]]
        v_ring[b][:, slots[b][read[b]]] = v[b][:, read[b]]
    k_ring, v_ring = mx.array(k_ring).astype(dtype), mx.array(v_ring).astype(dtype)
    k64 = to_numpy64(mx.array(k).astype(dtype))
    v64 = to_numpy64(mx.array(v).astype(dtype))
    return q, k64, v64, k_ring, v_ring


def options(G, seed):
    sinks = mx.array(np.random.default_rng(seed).standard_normal(H_KV * G).astype(np.float32) * 2)
    starts = [0, 4, 10, 0, 60, 1]
    return [dict(), dict(window=9), dict(sinks=sinks, window=40), dict(kv_starts=starts), dict(kv_starts=starts, window=3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [1, 64, 128])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("L", [1, 4])
def test_matches_float64(dtype, D, G, L, kernel_calls):
    for n, opts in enumerate(options(G, seed=D + L)):
        starts, window = opts.get("kv_starts"), opts.get("window")
        q, k64, v64, k_ring, v_ring = ring_case(dtype, D, G, L, OFFSETS, starts, window, seed=D * 5 + n)
        kw = dict(opts)
        if starts is not None:
            kw["kv_starts"] = mx.array(starts)
        out = mbd.batched_decode_attention(q, k_ring, v_ring, mx.array(LENGTHS), ring_offset=mx.array(OFFSETS, dtype=mx.int64), **kw)
        sinks = None if "sinks" not in opts else to_numpy64(opts["sinks"])
        expected = float64_attention(to_numpy64(q), k64, v64, np.array(LENGTHS), 1.0 / np.sqrt(D),
                                     None if starts is None else np.array(starts), window, sinks)
        assert max_abs_error(out, expected) < TOLERANCE[dtype], opts.keys()
    assert kernel_calls() == len(options(G, 0))


def test_long_rings_split_at_the_wrap():
    """Rings longer than a work item's chunk, wrapping anywhere, with one request split into many pieces."""
    rng = np.random.default_rng(4)
    B, T_long, D = 3, 1500, 64
    q = mx.array(rng.standard_normal((B, 8, 1, D)).astype(np.float32))
    k = rng.standard_normal((B, H_KV, T_long, D)).astype(np.float32)
    v = rng.standard_normal((B, H_KV, T_long, D)).astype(np.float32)
    offsets = [511, 1, 1499]
    slots = (np.arange(T_long)[None, :] + np.array(offsets)[:, None]) % T_long
    k_ring = np.stack([k[b][:, np.argsort(slots[b])] for b in range(B)])
    v_ring = np.stack([v[b][:, np.argsort(slots[b])] for b in range(B)])
    lens = [1500, 1200, 1500]
    out = mbd.batched_decode_attention(q, mx.array(k_ring), mx.array(v_ring), mx.array(lens), ring_offset=mx.array(offsets))
    expected = float64_attention(to_numpy64(q), k.astype(np.float64), v.astype(np.float64), np.array(lens), 1.0 / np.sqrt(D))
    assert max_abs_error(out, expected) < TOLERANCE[mx.float32]


def test_int_offset_and_strided_ring():
    """An int applies to every request; a ring that is a view of a larger buffer is read in place."""
    q, k64, v64, k_ring, v_ring = ring_case(mx.float16, 64, 2, 1, [7] * len(LENGTHS), None, None, seed=1)
    big_k = mx.concatenate([k_ring, k_ring], axis=3)[..., :64]
    out = mbd.batched_decode_attention(q, big_k, v_ring, mx.array(LENGTHS), ring_offset=7 - 3 * T)
    expected = float64_attention(to_numpy64(q), k64, v64, np.array(LENGTHS), 1.0 / 8.0)
    assert max_abs_error(out, expected) < TOLERANCE[mx.float16]


def test_reference_takes_the_ring():
    q, k64, v64, k_ring, v_ring = ring_case(mx.float32, 32, 2, 3, OFFSETS, None, 5, seed=2)
    out = mbd.reference_attention(q, k_ring, v_ring, mx.array(LENGTHS), window=5, ring_offset=mx.array(OFFSETS, dtype=mx.int64))
    expected = float64_attention(to_numpy64(q), k64, v64, np.array(LENGTHS), 1.0 / np.sqrt(32), None, 5)
    assert max_abs_error(out, expected) < TOLERANCE[mx.float32]


def test_transforms_follow_the_reference():
    q, _, _, k_ring, v_ring = ring_case(mx.float32, 32, 2, 1, OFFSETS, None, None, seed=3)
    k_ring = mx.where(mx.isnan(k_ring), 0.0, k_ring)
    v_ring = mx.where(mx.isinf(v_ring), 0.0, v_ring)
    lens, ring = mx.array(LENGTHS), mx.array(OFFSETS, dtype=mx.int64)
    fused = lambda q, k, v: mbd.batched_decode_attention(q, k, v, lens, ring_offset=ring).sum()
    plain = lambda q, k, v: mbd.reference_attention(q, k, v, lens, ring_offset=ring).sum()
    for g, t in zip(mx.grad(fused, argnums=(0, 1, 2))(q, k_ring, v_ring), mx.grad(plain, argnums=(0, 1, 2))(q, k_ring, v_ring)):
        assert mx.allclose(g, t, atol=1e-5).item()


@pytest.mark.parametrize("bad, message", [
    (1.5, "got float"),
    ("3", "got str"),
    (mx.array([1.0] * 6), "got shape \\(6,\\) of float32"),
    (mx.array([1, 2]), "got shape \\(2,\\)"),
    (mx.zeros((6, 1), dtype=mx.int32), "got shape \\(6, 1\\)"),
])
def test_malformed_ring_offset(bad, message, kernel_calls):
    q, _, _, k_ring, v_ring = ring_case(mx.float32, 32, 1, 1, OFFSETS, None, None, seed=0)
    with pytest.raises(ValueError, match=r"^\[batched_decode_attention\] ring_offset must be an int or an integer .*" + message):
        mbd.batched_decode_attention(q, k_ring, v_ring, mx.array(LENGTHS), ring_offset=bad)
    assert kernel_calls() == 0


def test_other_layouts_refuse_a_ring():
    from mlx_batched_decode import _ext

    q = mx.zeros((1, 2, 1, 32))
    keys = [mx.zeros((1, 2, 4, 32))]
    # The public bindings of the other ops take no ring_offset at all.
    with pytest.raises(TypeError):
        _ext.ragged_decode_attention(q, keys, keys, ring_offset=1)
