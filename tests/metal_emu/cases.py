"""Inputs of the emulated-kernel tests: ragged batches read through strided views.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request, T positions, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .reference import reference_attention, row_range, to_dtype, to_float64


@dataclass
class Case:
    """One call: storage arrays (views into larger buffers), the op's options
    (None when absent) and their float64 values."""

    dtype: str
    queries: np.ndarray  # [B, H_q, L, D]
    keys: np.ndarray  # [B, H_kv, T, D]
    values: np.ndarray  # [B, H_kv, T, D]
    valid_lens: np.ndarray  # int32 [B]
    scale: float
    kv_starts: np.ndarray | None = None  # int32 [B]
    window: int | None = None
    sinks: np.ndarray | None = None  # float32 [H_q]
    # int32 [B], given to the kernel raw: position j of request b in slot (j + ring_offset[b]) mod T.
    ring_offset: np.ndarray | None = None

    def run(self, lib, **kwargs) -> np.ndarray:
        """The emulated kernels' output [B, H_q, L, D] in the storage dtype;
        ``kwargs`` go to ``EmulatedLibrary.attention``."""
        if self.ring_offset is not None:
            kwargs["ring_offset"] = self.ring_offset
        return lib.attention(self.queries, self.keys, self.values, self.valid_lens, self.dtype, self.scale,
                             kv_starts=self.kv_starts, window=self.window, sinks=self.sinks, **kwargs)

    def reference(self) -> np.ndarray:
        """float64 output [B, H_q, L, D] of the inputs as rounded to ``dtype``."""
        keys, values = to_float64(self.keys, self.dtype), to_float64(self.values, self.dtype)
        if self.ring_offset is not None:
            # Back in time order: logical position j from slot (j + offset) mod T.
            keys, values = unring(keys, self.ring_offset), unring(values, self.ring_offset)
        return reference_attention(
            to_float64(self.queries, self.dtype), keys, values, self.valid_lens, self.scale, self.kv_starts,
            self.window, None if self.sinks is None else self.sinks.astype(np.float64))


def unring(x: np.ndarray, ring_offset: np.ndarray) -> np.ndarray:
    """[B, H, T, ...] stored as a ring -> time order: out[b, :, j] = x[b, :, (j + ring_offset[b]) mod T]."""
    t = x.shape[2]
    return np.stack([np.roll(x[n], -(int(r) % max(t, 1)), axis=1) for n, r in enumerate(ring_offset)])


def attended(lens, starts, rows: int, t: int, window: int | None) -> np.ndarray:
    """bool [B, T]: the positions some query row of each request attends."""
    mask = np.zeros((len(lens), t), dtype=bool)
    for b, n in enumerate(lens):
        length = int(np.clip(n, 0, t))
        start = 0 if starts is None else int(np.clip(starts[b], 0, t))
        for i in range(rows):
            lo, hi = row_range(length, start, rows, i, window)
            mask[b, lo:max(lo, hi)] = True
    return mask


def make_case(rng: np.random.Generator, dtype: str, d: int, h_kv: int, g: int, t: int, lens: list[int],
              extra_capacity: int = 5, *, rows: int = 1, starts: list[int] | None = None,
              window: int | None = None, sinks: bool = False, row_pad: int = 0) -> Case:
    """Keys/values are ``cache[:, :, :t, :d]`` of a cache with ``extra_capacity``
    more positions and rows of ``d + row_pad`` elements; every position no
    query row of a request attends is NaN (keys) and inf (values), the extra
    ones included, and so are the pad elements. Queries are every other row of
    a larger buffer (rows padded alike); sinks (when asked for) every other
    element of one."""
    b = len(lens)
    width = d + row_pad
    cache_k = rng.standard_normal((b, h_kv, t + extra_capacity, width))
    cache_v = rng.standard_normal((b, h_kv, t + extra_capacity, width))
    unread = np.ones((b, t + extra_capacity), dtype=bool)
    unread[:, :t] = ~attended(lens, starts, rows, t, window)
    cache_k.transpose(0, 2, 1, 3)[unread] = np.nan
    cache_v.transpose(0, 2, 1, 3)[unread] = np.inf
    cache_k[..., d:] = np.nan
    cache_v[..., d:] = np.inf
    q_buffer = rng.standard_normal((b, h_kv * g, 2 * rows, width))
    q_buffer[..., d:] = np.nan
    q_buffer = to_dtype(q_buffer, dtype)
    sink_buffer = (1.5 * rng.standard_normal(2 * h_kv * g)).astype(np.float32)
    return Case(
        dtype=dtype,
        queries=q_buffer[:, :, 1::2, :d],
        keys=to_dtype(cache_k, dtype)[:, :, :t, :d],
        values=to_dtype(cache_v, dtype)[:, :, :t, :d],
        valid_lens=np.array(lens, dtype=np.int32),
        scale=float(d) ** -0.5,
        kv_starts=None if starts is None else np.array(starts, dtype=np.int32),
        window=window,
        sinks=sink_buffer[::2] if sinks else None,
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
