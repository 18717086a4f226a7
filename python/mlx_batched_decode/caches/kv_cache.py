"""Key/value caches: one contiguous cache per request (the seed design) and a batched slot cache.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
H_kv = key/value heads, T = positions, D = head dimension, S = slots of a slot cache.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .buffers import (
    SlotBuffers,
    check_step,
    place_on_huge_pages,
    reserve_length,
    round_up,
    slot_growth,
)
from .context import BatchedDecodeContext


class ContiguousKVCache:
    """One request's keys and values for one layer: ``[1, H_kv, capacity, D]``.

    The capacity grows in chunks of ``step`` positions; ``offset`` counts the tokens written.
    A write that reaches or passes the capacity grows the buffers first and copies the tokens
    already written, so no token is ever dropped or overwritten.
    """

    def __init__(self, step: int = 256):
        self.step = check_step("ContiguousKVCache", step)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def rewind(self, length: int) -> None:
        """Forget every token past the first ``length`` (rejected draft tokens); the next write
        overwrites them."""
        if not 0 <= length <= self.offset:
            raise ValueError(
                f"[ContiguousKVCache] can rewind to 0..{self.offset} tokens, not {length}"
            )
        self.offset = length

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``[1, H_kv, L, D]``; return the filled
        ``[1, H_kv, offset, D]``."""
        end = self.offset + keys.shape[2]
        if end > self.capacity:
            self._grow(end, keys, values)
        self.keys[:, :, self.offset : end] = keys
        self.values[:, :, self.offset : end] = values
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grow(self, needed: int, keys: mx.array, values: mx.array) -> None:
        capacity = round_up(needed, self.step)
        new_keys = mx.zeros((1, keys.shape[1], capacity, keys.shape[3]), keys.dtype)
        new_values = mx.zeros((1, values.shape[1], capacity, values.shape[3]), values.dtype)
        if self.offset > 0:
            new_keys[:, :, : self.offset] = self.keys[:, :, : self.offset]
            new_values[:, :, : self.offset] = self.values[:, :, : self.offset]
        self.keys, self.values = new_keys, new_values


class SlotKVCache(SlotBuffers):
    """One layer's keys and values for a batch of requests: ``[S, H_kv, capacity, D]`` each.

    Request ``b`` of a step owns slot (row) ``b``. A decode step writes every request's new tokens
    at its own offset with one scatter per buffer, in place, and attention reads the strided view
    ``buffer[:B, :, :max_len]`` without a copy. The buffers are made on the first write, their
    capacity grows in chunks of ``step`` positions when a request outgrows it, and their slot count
    grows when more requests decode at once than there are slots. On Linux the buffers live on
    transparent huge pages, where the kernel streams them faster (``advise_huge_pages``).
    """

    def __init__(self, step: int = 256):
        self.step = check_step("SlotKVCache", step)

    def reserve(
        self, slots: int, length: int, keys: mx.array, values: Optional[mx.array]
    ) -> None:
        """Make room for ``slots`` slots of ``length`` positions, shaped and typed like
        ``keys``/``values`` (``values=None``: keys only, see ``SlotBuffers``).

        Growing copies the buffers once: the slot count at least doubles and the capacity grows
        to a multiple of ``step``; a cache that is big enough is left untouched.
        """
        if self.keys is None:
            capacity = round_up(max(length, 1), self.step)
            self.keys = mx.zeros((slots, keys.shape[1], capacity, keys.shape[3]), keys.dtype)
            if values is not None:
                self.values = mx.zeros(
                    (slots, values.shape[1], capacity, values.shape[3]), values.dtype
                )
        else:
            widths = slot_growth(slots, length, self.slots, self.capacity, self.step)
            if widths is None:
                return
            self.keys = mx.pad(self.keys, widths)
            if self.values is not None:
                self.values = mx.pad(self.values, widths)
        place_on_huge_pages(self.buffers())

    def write_prompt(self, slot: int, keys: mx.array, values: Optional[mx.array]) -> None:
        """Store a prefilled request's ``[1, H_kv, L, D]`` keys/values at positions
        ``0..L-1`` of ``slot``."""
        length = keys.shape[2]
        self.reserve(slot + 1, length, keys, values)
        self.keys[slot : slot + 1, :, :length] = keys
        if values is not None:
            self.values[slot : slot + 1, :, :length] = values

    def update(
        self, keys: mx.array, values: Optional[mx.array], context: BatchedDecodeContext
    ) -> tuple[mx.array, Optional[mx.array]]:
        """Write the step's new ``[B, H_kv, L, D]`` keys/values at ``context.new_positions``.

        Returns the strided views ``[B, H_kv, max_len, D]`` of the buffers that attention reads
        in place; positions at or past a request's ``valid_lens`` hold stale data, never read.
        """
        self.reserve(context.batch_size, reserve_length(context), keys, values)
        return self.scatter(
            context.rows, context.new_positions, context.batch_size, context.max_len, keys, values
        )

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        self.copy_slot(src, dst, length)
