"""The per-step decode context: arrays derived from ``seq_lens`` once per step.

Dimension legend: B = requests in the step, L = new tokens per request in the step (1 for a
plain decode step, k + 1 when a target model verifies k draft tokens), H_q / H_kv = query /
key-value heads, T = key/value positions read by attention, D = head dimension, R = positions
of a ring cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from .ring_step import RingStep, ring_step


@dataclass
class BatchedDecodeContext:
    """Everything the layers of one decode step share, computed once in ``__post_init__``.

    Build one per step, never per layer; layers only read it. ``seq_lens`` are host ints the
    scheduler already has, so building the context needs no device-to-host read.

    Args:
        batch_size: B, the number of requests decoding this step; request ``b`` sits in row
            (and slot) ``b`` of every batched cache.
        seq_lens: B host ints, tokens already in each request's cache before this step.
        layer_caches: one entry per layer, read by the attention wrapper: a ``SlotKVCache``
            (zero-copy path) or a sequence of B ``ContiguousKVCache`` (seed path).
        query_len: L, the new tokens every request feeds this step; they are written at
            positions ``seq_lens[b] .. seq_lens[b] + L - 1``, and whatever a cache held there
            (rejected draft tokens of an earlier step) is overwritten.

    Derived fields:
        offsets: int32 ``[B]``, ``seq_lens`` on the device: where this step's first token is
            written, and the RoPE offset of each request.
        max_len: ``max(seq_lens) + L``, the longest length after this step's tokens; attention
            reads the first ``max_len`` positions of the caches.
        valid_lens: int32 ``[B]``, ``offsets + L``: the lengths the kernel attends over.
        needs_padding: whether the lengths differ (the seed path pads only then).
        pad_sizes: B host ints, ``max(seq_lens) - seq_lens[b]``: the seed path's right padding.
        positions: int32 ``[max_len]`` ``arange``: key positions, for the seed path's masks.
        new_positions: int32 ``[B, L]``, ``offsets[b] + i``: the position of each new token,
            where it is written and where its query row sits.
        rows: int32 ``[B, 1]``, ``arange(B)``: the slot of each request, broadcast against
            ``new_positions`` by the one scatter per layer that writes every new token.
        rings: ``{R: RingStep}`` for each of ``ring_sizes``: the logical lengths, ring offsets
            and write slots of the ring caches of R positions (``ring_step``).
    """

    batch_size: int
    seq_lens: Sequence[int]
    layer_caches: Sequence[Any]
    query_len: int = 1
    ring_sizes: Sequence[int] = ()
    offsets: mx.array = field(init=False)
    max_len: int = field(init=False)
    valid_lens: mx.array = field(init=False)
    needs_padding: bool = field(init=False)
    pad_sizes: list[int] = field(init=False)
    positions: mx.array = field(init=False)
    new_positions: mx.array = field(init=False)
    rows: mx.array = field(init=False)
    rings: dict[int, RingStep] = field(init=False)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or len(self.seq_lens) != self.batch_size:
            raise ValueError(
                f"[BatchedDecodeContext] need batch_size >= 1 and one seq_len per request, got "
                f"batch_size={self.batch_size} and {len(self.seq_lens)} seq_lens"
            )
        if min(self.seq_lens) < 0:
            raise ValueError("[BatchedDecodeContext] seq_lens must be >= 0")
        if self.query_len < 1:
            raise ValueError(f"[BatchedDecodeContext] query_len must be >= 1, got {self.query_len}")
        longest = max(self.seq_lens)
        self.offsets = mx.array(self.seq_lens, dtype=mx.int32)
        self.max_len = longest + self.query_len
        # Derived on the device from offsets: no second host-to-device copy.
        self.valid_lens = self.offsets + self.query_len
        self.needs_padding = min(self.seq_lens) < longest
        self.pad_sizes = [longest - s for s in self.seq_lens]
        self.positions = mx.arange(self.max_len, dtype=mx.int32)
        self.new_positions = self.offsets[:, None] + mx.arange(self.query_len, dtype=mx.int32)
        self.rows = mx.arange(self.batch_size, dtype=mx.int32)[:, None]
        self.rings = {
            size: ring_step(size, self.max_len, self.valid_lens, self.new_positions)
            for size in self.ring_sizes
        }

    @property
    def max_query_len(self) -> int:
        """The most new tokens a request feeds this step: L (as ``PackedDecodeContext``'s)."""
        return self.query_len
