"""Inputs of the emulated-kernel tests: ragged batches read through strided views.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request (packed queries: q_b of request b, N in all), T positions, D head
dim of queries and keys, Dv of values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .reference import packed_reference, reference_attention, request_rows, row_range, to_dtype, to_float64


@dataclass
class Case:
    """One call: storage arrays (views into larger buffers), the op's options
    (None when absent) and their float64 values."""

    dtype: str
    queries: np.ndarray  # [B, H_q, L, D], or packed [N, H_q, D]
    keys: np.ndarray  # [B, H_kv, T, D]
    values: np.ndarray  # [B, H_kv, T, Dv]
    valid_lens: np.ndarray  # int32 [B]
    scale: float
    kv_starts: np.ndarray | None = None  # int32 [B]
    window: int | None = None
    sinks: np.ndarray | None = None  # float32 [H_q]
    # int32 [B], given to the kernel raw: position j of request b in slot (j + ring_offset[b]) mod T.
    ring_offset: np.ndarray | None = None
    softcap: float | None = None  # c > 0: each score s becomes c * tanh(s / c)
    # int32 [B + 1], given to the kernel raw: packed queries, request b's rows query_starts[b] .. [b + 1] - 1.
    query_starts: np.ndarray | None = None

    def run(self, lib, **kwargs) -> np.ndarray:
        """The emulated kernels' output [B, H_q, L, Dv] ([N, H_q, Dv] packed) in the storage
        dtype; ``kwargs`` go to ``EmulatedLibrary.attention``."""
        if self.ring_offset is not None:
            kwargs["ring_offset"] = self.ring_offset
        if self.query_starts is not None:
            kwargs["query_starts"] = self.query_starts
        return lib.attention(self.queries, self.keys, self.values, self.valid_lens, self.dtype, self.scale,
                             kv_starts=self.kv_starts, window=self.window, sinks=self.sinks, softcap=self.softcap,
                             **kwargs)

    def rows(self) -> list[int]:
        """The query rows of each request (request_rows)."""
        return request_rows(self.queries, self.query_starts, len(self.valid_lens))

    def reference(self) -> np.ndarray:
        """float64 output [B, H_q, L, Dv] ([N, H_q, Dv] packed, of valid query_starts) of the
        inputs as rounded to ``dtype``."""
        keys, values = to_float64(self.keys, self.dtype), to_float64(self.values, self.dtype)
        if self.ring_offset is not None:
            # Back in time order: logical position j from slot (j + offset) mod T.
            keys, values = unring(keys, self.ring_offset), unring(values, self.ring_offset)
        sinks = None if self.sinks is None else self.sinks.astype(np.float64)
        queries = to_float64(self.queries, self.dtype)
        if self.query_starts is None:
            return reference_attention(queries, keys, values, self.valid_lens, self.scale, self.kv_starts,
                                       self.window, sinks, self.softcap)
        return packed_reference(
            lambda b, q: reference_attention(q, keys[b:b + 1], values[b:b + 1], self.valid_lens[b:b + 1], self.scale,
                                             None if self.kv_starts is None else self.kv_starts[b:b + 1],
                                             self.window, sinks, self.softcap),
            queries, self.query_starts, values.shape[-1])


def unring(x: np.ndarray, ring_offset: np.ndarray) -> np.ndarray:
    """[B, H, T, ...] stored as a ring -> time order: out[b, :, j] = x[b, :, (j + ring_offset[b]) mod T]."""
    t = x.shape[2]
    return np.stack([np.roll(x[n], -(int(r) % max(t, 1)), axis=1) for n, r in enumerate(ring_offset)])


def attended(lens, starts, rows, t: int, window: int | None) -> np.ndarray:
    """bool [B, T]: the positions some query row of each request attends; ``rows``: L, or the
    rows of each request."""
    mask = np.zeros((len(lens), t), dtype=bool)
    per_request = [rows] * len(lens) if np.isscalar(rows) else rows
    for b, n in enumerate(lens):
        length = int(np.clip(n, 0, t))
        start = 0 if starts is None else int(np.clip(starts[b], 0, t))
        for i in range(per_request[b]):
            lo, hi = row_range(length, start, per_request[b], i, window)
            mask[b, lo:max(lo, hi)] = True
    return mask


def make_case(rng: np.random.Generator, dtype: str, d: int, h_kv: int, g: int, t: int, lens: list[int],
              extra_capacity: int = 5, *, rows: int = 1, starts: list[int] | None = None,
              window: int | None = None, sinks: bool = False, row_pad: int = 0, scale: float | None = None,
              softcap: float | None = None, dv: int | None = None, latent: bool = False,
              query_rows: list[int] | None = None) -> Case:
    """Keys/values are ``cache[:, :, :t, :d]`` (values ``[..., :dv]``, Dv = ``dv`` or D) of
    caches with ``extra_capacity`` more positions and rows of ``d + row_pad`` (``dv +
    row_pad``) elements; every position no query row of a request attends is NaN (keys) and
    inf (values), the extra ones included, and so are the pad elements. ``latent``: values
    are the view ``keys[..., :dv]`` (MLA's latent), NaN where keys are. Queries are every
    other row of a larger buffer (rows padded alike): [B, H_q, rows, D], or, with
    ``query_rows`` (request b's q_b), packed [N, H_q, D] with query_starts. Sinks (when asked
    for) are every other element of one buffer. ``scale``: None for 1 / sqrt(D)."""
    b = len(lens)
    dv = d if dv is None else dv
    per_request = rows if query_rows is None else list(query_rows)
    width = d + row_pad
    cache_k = rng.standard_normal((b, h_kv, t + extra_capacity, width))
    cache_v = rng.standard_normal((b, h_kv, t + extra_capacity, dv + row_pad))
    unread = np.ones((b, t + extra_capacity), dtype=bool)
    unread[:, :t] = ~attended(lens, starts, per_request, t, window)
    cache_k.transpose(0, 2, 1, 3)[unread] = np.nan
    cache_v.transpose(0, 2, 1, 3)[unread] = np.inf
    cache_k[..., d:] = np.nan
    cache_v[..., dv:] = np.inf
    keys = to_dtype(cache_k, dtype)[:, :, :t]
    if query_rows is None:
        q_buffer = rng.standard_normal((b, h_kv * g, 2 * rows, width))
    else:
        q_buffer = rng.standard_normal((2 * sum(query_rows), h_kv * g, width))
    q_buffer[..., d:] = np.nan
    q_buffer = to_dtype(q_buffer, dtype)
    sink_buffer = (1.5 * rng.standard_normal(2 * h_kv * g)).astype(np.float32)
    return Case(
        dtype=dtype,
        queries=q_buffer[:, :, 1::2, :d] if query_rows is None else q_buffer[1::2, :, :d],
        keys=keys[..., :d],
        values=keys[..., :dv] if latent else to_dtype(cache_v, dtype)[:, :, :t, :dv],
        valid_lens=np.array(lens, dtype=np.int32),
        scale=float(d) ** -0.5 if scale is None else scale,
        kv_starts=None if starts is None else np.array(starts, dtype=np.int32),
        window=window,
        sinks=sink_buffer[::2] if sinks else None,
        softcap=softcap,
        query_starts=None if query_rows is None else np.cumsum([0, *query_rows], dtype=np.int32),
    )


def make_ring_case(rng: np.random.Generator, dtype: str, d: int, h_kv: int, g: int, t: int, lens: list[int],
                   ring: list[int], **kwargs) -> Case:
    """``make_case`` with the T positions of each request stored as a ring: logical position j
    of request b in slot (j + ring[b]) mod T of the same buffers (the NaN of every position no
    row attends goes along; the extra capacity past T stays NaN). ``ring`` reaches the kernel
    as given, any int32."""
    case = make_case(rng, dtype, d, h_kv, g, t, lens, **kwargs)
    for n, r in enumerate(ring):
        shift = int(r) % max(t, 1)
        case.keys[n] = np.roll(case.keys[n], shift, axis=1)
        case.values[n] = np.roll(case.values[n], shift, axis=1)
    case.ring_offset = np.array(ring, dtype=np.int32)
    return case


def ring_unread(case: Case) -> np.ndarray:
    """bool [B, T]: the slots of a ring case that no query row reads."""
    t = case.keys.shape[2]
    unread = ~attended(case.valid_lens, case.kv_starts, case.queries.shape[2], t, case.window)
    return np.stack([np.roll(u, int(r) % max(t, 1)) for u, r in zip(unread, case.ring_offset)])
