"""A batched slot cache for a sliding-window layer that keeps only the last R positions: a ring.

Position ``p`` of the request in slot ``b`` lives at ring slot ``p mod R`` of row ``b``, so the
buffers hold ``R`` positions per request however long it runs (memory in proportion to the
window, as mlx-lm's ``RotatingKVCache``), and ``batched_decode_attention`` reads them in place
through ``ring_offset`` (``ring_step``). ``R`` must cover every key a step's rows read, and every
key a later step may still read after rejected draft tokens were written over the ring:
``BatchedDecoder`` takes ``R = window + k`` with ``k`` draft tokens per round (``window``
without a draft model), see ``decoding.layouts.slot``.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
H_kv = key/value heads, D = head dimension, S = slots, R = ring positions per request.
"""

from __future__ import annotations

import mlx.core as mx

from .buffers import SlotBuffers, check_step, first_capacity, place_on_huge_pages, slot_growth
from .context import BatchedDecodeContext


class RingSlotKVCache(SlotBuffers):
    """One windowed layer's keys and values for a batch of requests: ``[S, H_kv, capacity, D]``
    each, ``capacity <= size``.

    As ``SlotKVCache``, request ``b`` of a step owns slot (row) ``b``, one scatter per buffer
    writes a step's new tokens and attention reads a strided view in place; the capacity grows
    in chunks of ``step`` positions up to ``size`` (R), after which positions wrap around.
    Before a request passes R positions its position ``p`` is slot ``p``: growing keeps every
    position where it is.
    """

    def __init__(self, size: int, step: int = 256):
        if size < 1:
            raise ValueError(f"[RingSlotKVCache] size must be >= 1, got {size}")
        self.size = size
        self.step = check_step("RingSlotKVCache", step)

    def reserve(self, slots: int, length: int, keys: mx.array, values: mx.array) -> None:
        """Make room for ``slots`` slots of ``length`` positions (at most ``size`` are kept),
        shaped and typed like ``keys``/``values``; growing copies the buffers once."""
        length = min(length, self.size)
        if self.keys is None:
            capacity = first_capacity(length, self.step, self.size)
            self.keys = mx.zeros((slots, keys.shape[1], capacity, keys.shape[3]), keys.dtype)
            self.values = mx.zeros(
                (slots, values.shape[1], capacity, values.shape[3]), values.dtype
            )
        else:
            widths = slot_growth(slots, length, self.slots, self.capacity, self.step, self.size)
            if widths is None:
                return
            self.keys = mx.pad(self.keys, widths)
            self.values = mx.pad(self.values, widths)
        place_on_huge_pages([self.keys, self.values])

    def write_prompt(self, slot: int, keys: mx.array, values: mx.array) -> None:
        """Store a prefilled request's ``[1, H_kv, P, D]`` keys/values (positions ``0..P-1``):
        its last ``min(P, R)`` positions, position ``p`` at ring slot ``p mod R``."""
        length = keys.shape[2]
        self.reserve(slot + 1, length, keys, values)
        start = max(length - self.size, 0)
        first = start % self.size
        # The kept positions run from ring slot `first` to the end of the ring, then from 0.
        head = min(length - start, self.size - first)
        for buffer, x in ((self.keys, keys), (self.values, values)):
            buffer[slot : slot + 1, :, first : first + head] = x[:, :, start : start + head]
            if start + head < length:
                buffer[slot : slot + 1, :, : length - start - head] = x[:, :, start + head :]

    def update(
        self, keys: mx.array, values: mx.array, context: BatchedDecodeContext
    ) -> tuple[mx.array, mx.array]:
        """Write the step's new ``[B, H_kv, L, D]`` keys/values at ring slots
        ``context.rings[size].new_slots``.

        Returns the strided views ``[B, H_kv, min(max_len, R), D]`` that attention reads in
        place with the ring's ``valid_lens`` and ``ring_offset``.
        """
        ring = context.rings.get(self.size)
        if ring is None:
            raise ValueError(
                f"[RingSlotKVCache] the step's context has no ring of {self.size} positions "
                f"(its ring_sizes are {sorted(context.rings)})"
            )
        self.reserve(context.batch_size, ring.max_len, keys, values)
        return self.scatter(
            context.rows, ring.new_slots, context.batch_size, ring.max_len, keys, values
        )

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s ring, which holds its first ``length`` positions' last ``R``,
        into slot ``dst``."""
        self.copy_slot(src, dst, min(length, self.size))
