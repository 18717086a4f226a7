"""Inputs of the emulated-kernel tests: ragged batches read through strided views."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .reference import reference_attention, to_dtype, to_float64


@dataclass
class Case:
    """One call: storage arrays (views into larger buffers) and their float64 values."""

    dtype: str
    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    valid_lens: np.ndarray
    scale: float

    def reference(self) -> np.ndarray:
        """float64 output [B, H_q, 1, D] of the inputs as rounded to ``dtype``."""
        return reference_attention(
            to_float64(self.queries, self.dtype), to_float64(self.keys, self.dtype),
            to_float64(self.values, self.dtype), self.valid_lens, self.scale)


def make_case(rng: np.random.Generator, dtype: str, d: int, h_kv: int, g: int, t: int,
              lens: list[int], extra_capacity: int = 5) -> Case:
    """Keys/values are ``cache[:, :, :t]`` of a cache with ``extra_capacity`` more
    positions, their padding (every position past a request's length) filled
    with NaN and inf; queries are every other row of a larger buffer."""
    b = len(lens)
    cache_k = rng.standard_normal((b, h_kv, t + extra_capacity, d))
    cache_v = rng.standard_normal((b, h_kv, t + extra_capacity, d))
    for i, n in enumerate(lens):
        valid = int(np.clip(n, 0, t))
        cache_k[i, :, valid:] = np.nan
        cache_v[i, :, valid:] = np.inf
    q_buffer = to_dtype(rng.standard_normal((b, h_kv * g, 2, d)), dtype)
    return Case(
        dtype=dtype,
        queries=q_buffer[:, :, 1:2],
        keys=to_dtype(cache_k, dtype)[:, :, :t],
        values=to_dtype(cache_v, dtype)[:, :, :t],
        valid_lens=np.array(lens, dtype=np.int32),
        scale=float(d) ** -0.5,
    )
