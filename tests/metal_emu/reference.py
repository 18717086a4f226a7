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


def row_range(length: int, start: int, rows: int, i: int, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that row ``i`` of ``rows`` attends in a request of ``length`` keys whose
    first valid key is ``start`` (both already clamped to [0, T])."""
    p = length - rows + i
    lo = max(start, 0 if window is None else p - window + 1, 0)
    return lo, p + 1


def capped(scores, softcap=None):
    """Scores through logit softcapping: c * tanh(s / c) for softcap c > 0; unchanged for None."""
    return scores if softcap is None else softcap * np.tanh(scores / softcap)


def reference_attention(queries, keys, values, valid_lens, scale, kv_starts=None, window=None, sinks=None,
                        softcap=None):
    """float64 attention of each query row over its own range of keys.

    queries [B, H_q, L, D], keys [B, H_kv, T, D], values [B, H_kv, T, Dv] (float64), valid_lens and
    kv_starts [B] (clamped to [0, T]), window an int >= 1 or None, sinks [H_q] or None.
    Row i of request b sits at p = len_b - L + i and attends keys
    max(start_b, p - window + 1, 0) .. p; a sink is one more logit in the row's
    softmax, with no value. A row with no key gets zeros. Keys outside a row's
    range are never looked at, so NaN there changes nothing. softcap: None, or
    c > 0: each score s = scale * q . k becomes c * tanh(s / c); sinks are not capped.
    """
    b, h_q, rows, _ = queries.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    out = np.zeros((b, h_q, rows, values.shape[-1]))
    for n in range(b):
        length = int(np.clip(valid_lens[n], 0, t))
        start = 0 if kv_starts is None else int(np.clip(kv_starts[n], 0, t))
        for i in range(rows):
            lo, hi = row_range(length, start, rows, i, window)
            if hi <= lo:
                continue
            for h in range(h_q):
                kv = h // (h_q // h_kv)
                scores = capped(keys[n, kv, lo:hi] @ queries[n, h, i] * scale, softcap)
                m = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
                # Non-finite scores give NaN where a softmax does (all -inf: 0/0), quietly.
                with np.errstate(invalid="ignore"):
                    weights = np.exp(scores - m)
                    total = weights.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
                    out[n, h, i] = weights @ values[n, kv, lo:hi] / total
    return out


def query_starts_valid(query_starts, n: int) -> bool:
    """Whether query_starts [B + 1] start at 0, never decrease and end at N = ``n``."""
    return query_starts[0] == 0 and query_starts[-1] == n and bool(np.all(np.diff(query_starts) >= 0))


def request_rows(queries, query_starts, requests: int) -> list[int]:
    """The query rows of each of ``requests`` requests: L of queries [B, H_q, L, D], or q_b of packed
    queries [N, H_q, D] (none at all for malformed query_starts)."""
    if query_starts is None:
        return [queries.shape[2]] * requests
    if not query_starts_valid(query_starts, queries.shape[0]):
        return [0] * requests
    return [int(n) for n in np.diff(query_starts)]


def packed_reference(request_reference, queries, query_starts, dv: int) -> np.ndarray:
    """Packed queries [N, H_q, D] (float64) with query_starts [B + 1]: the [N, H_q, Dv] output,
    each request's q_b rows an L = q_b call (``request_reference(b, q)`` maps request b's rows as
    [1, H_q, q_b, D] to [1, H_q, q_b, Dv]); all zeros for malformed starts (query_starts_valid)."""
    out = np.zeros((queries.shape[0], queries.shape[1], dv))
    if not query_starts_valid(query_starts, queries.shape[0]):
        return out
    for b, (lo, hi) in enumerate(zip(query_starts[:-1], query_starts[1:])):
        if hi > lo:
            out[lo:hi] = request_reference(b, queries[lo:hi].transpose(1, 0, 2)[None])[0].transpose(1, 0, 2)
    return out


def paged_reference_attention(queries, key_pages, value_pages, block_tables, valid_lens, scale, window=None,
                              sinks=None, softcap=None):
    """float64 attention over paged caches, one query row at a time.

    key_pages/value_pages [NB, BS, H_kv, D] (float64), block_tables [B, MB] (ints),
    valid_lens [B] (clamped to [0, MB * BS]). Position j of request b is row j % BS of
    block block_tables[b, j // BS]; a position whose block lies outside [0, NB) holds no
    key. Otherwise as ``reference_attention``: a row with no key gets zeros; softcap caps scores.
    """
    b, h_q, rows, _ = queries.shape
    nb, bs, h_kv = key_pages.shape[:3]
    t = block_tables.shape[1] * bs
    out = np.zeros((b, h_q, rows, value_pages.shape[-1]))
    for n in range(b):
        length = int(np.clip(valid_lens[n], 0, t))
        for i in range(rows):
            lo, hi = row_range(length, 0, rows, i, window)
            blocks = [int(block_tables[n, p // bs]) for p in range(lo, hi)]
            kept = [(blk, p % bs) for blk, p in zip(blocks, range(lo, hi)) if 0 <= blk < nb]
            if not kept:
                continue
            blk, off = np.array(kept).T
            for h in range(h_q):
                kv = h // (h_q // h_kv)
                keys, values = key_pages[blk, off, kv], value_pages[blk, off, kv]
                scores = capped(keys @ queries[n, h, i] * scale, softcap)
                m = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
                with np.errstate(invalid="ignore"):
                    weights = np.exp(scores - m)
                    total = weights.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
                    out[n, h, i] = weights @ values / total
    return out
