"""float64 reference of batched decode attention and dtype conversions (numpy only)."""

from __future__ import annotations

import numpy as np

# Per-dtype tolerance of the emulated kernel against the float64 reference:
# one rounding of the output plus float32 accumulation.
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float array -> storage of ``dtype`` (bfloat16: uint16 bits, rounded to nearest even)."""
    if dtype == "bfloat16":
        bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(np.asarray(x, dtype=np.float32))
        return np.where(nan, 0x7FC0, rounded).astype(np.uint16)
    return np.asarray(x).astype(dtype)


def to_float64(x: np.ndarray, dtype: str) -> np.ndarray:
    """Storage of ``dtype`` -> float64 values."""
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


def reference_attention(queries, keys, values, valid_lens, scale):
    """float64 attention of each request over its first clamp(len, 0, T) positions.

    queries [B, H_q, 1, D], keys/values [B, H_kv, T, D] (float64), valid_lens [B].
    A request with no valid position gets zeros.
    """
    b, h_q, _, d = queries.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    out = np.zeros((b, h_q, 1, d))
    for i in range(b):
        n = int(np.clip(valid_lens[i], 0, t))
        if n == 0:
            continue
        for h in range(h_q):
            kv = h // (h_q // h_kv)
            scores = keys[i, kv, :n] @ queries[i, h, 0] * scale
            weights = np.exp(scores - scores.max())
            out[i, h, 0] = weights @ values[i, kv, :n] / weights.sum()
    return out
