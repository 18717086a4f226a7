"""The ragged Metal kernel (one buffer per request) on an Apple GPU against the reference
(``pytest -m gpu``): requests of their own caches in groups of dispatches (B = 40 and 1024),
views of one shared cache, 3-d and token-major arrays, T_b = 0, lengths above T_b.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows per request,
T_b request b's positions, D head dim. Skipped where Metal is absent; there,
tests/kernels/metal/test_metal_ragged_emulated.py runs the same kernel source on the CPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not mx.metal.is_available(),
        reason="needs a Metal GPU (Apple silicon, macOS); the ragged kernel runs under the emulation harness here",
    ),
]

mbd = pytest.importorskip("mlx_batched_decode")

# Against a float32 reference: output rounding plus the GPU's exp.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def requests(rng, lengths, h_kv, d, dtype, layout):
    """Keys and values per request: "own" [1, H_kv, T_b, D] slices of caches of their own,
    "shared" slices of one [B, H_kv, capacity, D] cache, "mixed" 3-d and token-major views."""
    capacity = max(lengths, default=0) + 3
    if layout == "shared":
        cache_k = mx.array(rng.standard_normal((len(lengths), h_kv, capacity, d)).astype(np.float32)).astype(dtype)
        cache_v = mx.array(rng.standard_normal((len(lengths), h_kv, capacity, d)).astype(np.float32)).astype(dtype)
        return ([cache_k[b:b + 1, :, :t] for b, t in enumerate(lengths)],
                [cache_v[b:b + 1, :, :t] for b, t in enumerate(lengths)])
    keys, values = [], []
    for b, t in enumerate(lengths):
        if layout == "mixed" and b % 2:
            token_major = mx.array(rng.standard_normal((2, t + 3, h_kv, d)).astype(np.float32)).astype(dtype)
            keys.append(token_major[0, :t].transpose(1, 0, 2))
            values.append(token_major[1, :t].transpose(1, 0, 2))
        else:
            own = mx.array(rng.standard_normal((2, 1, h_kv, t + 3, d)).astype(np.float32)).astype(dtype)
            keys.append(own[0, :, :, :t] if layout == "own" else own[0, 0, :, :t])
            values.append(own[1, :, :, :t] if layout == "own" else own[1, 0, :, :t])
    return keys, values


@pytest.mark.parametrize("layout", ["own", "shared", "mixed"])
@pytest.mark.parametrize("b", [5, 40, 1024])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_matches_the_reference(dtype, b, layout):
    rng = np.random.default_rng(b)
    h_kv, g, d, rows = 2, 4, 128, 2
    lengths = [int(n) for n in rng.integers(0, 300 if b < 1024 else 8, b)]
    keys, values = requests(rng, lengths, h_kv, d, dtype, layout)
    q = mx.array(rng.standard_normal((b, h_kv * g, rows, d)).astype(np.float32)).astype(dtype)
    lens = mx.array([n + (b_ % 3) - 1 for b_, n in enumerate(lengths)], dtype=mx.int32)
    options = dict(window=200, sinks=mx.array(rng.standard_normal(h_kv * g).astype(np.float32)))
    got = mbd.ragged_decode_attention(q, keys, values, lens, stream=mx.gpu, **options)
    want = mbd.reference_ragged_attention(q.astype(mx.float32), [k.astype(mx.float32) for k in keys],
                                          [v.astype(mx.float32) for v in values], lens, stream=mx.cpu, **options)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
