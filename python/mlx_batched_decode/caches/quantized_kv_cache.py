"""A batched slot cache of quantized keys and values, in mlx-lm's ``QuantizedKVCache`` format.

Keys and values are each stored as the triple ``mx.quantize`` returns (affine quantization of
every ``group_size`` consecutive elements of a head's row), one buffer per member and layer:

    packed  uint32        [S, H_kv, capacity, D * bits / 32]
    scales  model dtype   [S, H_kv, capacity, D / group_size]
    biases  model dtype   [S, H_kv, capacity, D / group_size]

so that ``mx.dequantize(packed, scales, biases, group_size, bits)`` gives back the keys; values
may have a head dim of their own. A cache written with ``values=None`` keeps keys only (a
multi-head latent attention layer's ``r + R`` rows, whose values are their first ``r`` columns:
``latent_values``). The layout follows ``SlotKVCache``: request ``b`` of a step owns slot ``b``,
a step's new tokens are written with one scatter per buffer for the whole batch, and
``quantized_batched_decode_attention`` reads the strided views ``buffer[:B, :, :max_len]`` in
place.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
H_kv = key/value heads, T = positions, D = head dimension (Dv of values), S = slots.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .buffers import check_step, place_on_huge_pages, reserve_length, round_up, slot_growth
from .context import BatchedDecodeContext

QUANTIZED_BITS = (4, 8)
QUANTIZED_GROUP_SIZES = (32, 64, 128)

# (packed, scales, biases), as mx.quantize returns them.
Triple = tuple[mx.array, mx.array, mx.array]


def check_quantization(owner: str, bits: int, group_size: int) -> None:
    """ValueError ``[owner] ...`` unless ``bits`` and ``group_size`` are ones the kernel reads."""
    if bits not in QUANTIZED_BITS:
        raise ValueError(f"[{owner}] kv_bits must be 4 or 8, got {bits!r}")
    if group_size not in QUANTIZED_GROUP_SIZES:
        raise ValueError(f"[{owner}] kv_group_size must be 32, 64 or 128, got {group_size!r}")


def latent_values(keys: Triple, latent_dim: int, group_size: int, bits: int) -> Triple:
    """The values of quantized latent rows ``keys`` (``[..., r + R]`` quantized in groups of
    ``group_size``, which divides ``r``): the views of their first ``r = latent_dim`` columns'
    words, scales and biases, read in place."""
    packed, scales, biases = keys
    groups = latent_dim // group_size
    return packed[..., : latent_dim * bits // 32], scales[..., :groups], biases[..., :groups]


class QuantizedSlotKVCache:
    """One layer's quantized keys and values for a batch of requests (see the module docstring).

    ``keys`` and ``values`` are ``(packed, scales, biases)`` tuples of ``[S, H_kv, capacity, *]``
    buffers, ``None`` before the first write (``values`` always, for a cache of keys only); the
    scales' dtype is that of the keys first written (mx.quantize keeps its input's). Capacity
    and slot count grow as ``SlotKVCache``'s.
    """

    def __init__(self, group_size: int = 64, bits: int = 8, step: int = 256):
        check_quantization("QuantizedSlotKVCache", bits, group_size)
        self.group_size = group_size
        self.bits = bits
        self.step = check_step("QuantizedSlotKVCache", step)
        self.keys: Optional[Triple] = None
        self.values: Optional[Triple] = None

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers())

    def buffers(self) -> list[mx.array]:
        """The six buffers: packed, scales, biases of the keys, then of the values (the keys'
        three alone without values)."""
        return [] if self.keys is None else [*self.keys, *(self.values or ())]

    def quantize(self, x: mx.array) -> Triple:
        """``x [..., D]`` -> its ``(packed, scales, biases)`` at this cache's bits, group size."""
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def reserve(self, slots: int, length: int, keys: Triple, values: Optional[Triple]) -> None:
        """Make room for ``slots`` slots of ``length`` positions, the buffers shaped and typed like
        the members of the triples ``keys``/``values`` (``None``: keys only); growing copies
        each buffer once."""
        if self.keys is None:
            capacity = round_up(max(length, 1), self.step)

            def allocate(triple: Triple) -> Triple:
                return tuple(
                    mx.zeros((slots, x.shape[1], capacity, x.shape[3]), x.dtype) for x in triple
                )

            self.keys = allocate(keys)
            self.values = None if values is None else allocate(values)
        else:
            # As SlotKVCache: slots at least double, positions grow by whole chunks.
            widths = slot_growth(slots, length, self.slots, self.capacity, self.step)
            if widths is None:
                return
            self.keys = tuple(mx.pad(x, widths) for x in self.keys)
            if self.values is not None:
                self.values = tuple(mx.pad(x, widths) for x in self.values)
        place_on_huge_pages(self.buffers())

    def write_prompt(self, slot: int, keys: Triple, values: Optional[Triple]) -> None:
        """Store a prefilled request's quantized ``[1, H_kv, L, *]`` triples at positions
        ``0..L-1`` of ``slot`` (``values=None``: keys only)."""
        for name, triple in (("keys", keys), ("values", values or keys)):
            packed, scales, _ = triple
            if packed.shape[-1] * 32 // self.bits != scales.shape[-1] * self.group_size:
                raise ValueError(
                    f"[QuantizedSlotKVCache] the prompt's {name} are not quantized with "
                    f"bits={self.bits}, group_size={self.group_size}"
                )
        length = keys[0].shape[2]
        self.reserve(slot + 1, length, keys, values)
        for buffer, x in zip(self.buffers(), (*keys, *(values or ()))):
            buffer[slot : slot + 1, :, :length] = x

    def update(
        self, keys: mx.array, values: Optional[mx.array], context: BatchedDecodeContext
    ) -> tuple[Triple, Optional[Triple]]:
        """Quantize the step's new ``[B, H_kv, L, D]`` keys and ``[B, H_kv, L, Dv]`` values
        once and write them at ``context.new_positions`` (``values=None``: keys only).

        Returns the triples of strided views ``[B, H_kv, max_len, *]`` that attention reads in
        place (``None`` for the values of a cache of keys only); positions at or past a
        request's ``valid_lens`` hold stale data, never read.
        """
        new_keys = self.quantize(keys)
        new_values = None if values is None else self.quantize(values)
        self.reserve(context.batch_size, reserve_length(context), new_keys, new_values)
        # One scatter per buffer for the whole batch, in place, as SlotKVCache.update.
        for buffer, x in zip(self.buffers(), (*new_keys, *(new_values or ()))):
            buffer[context.rows, :, context.new_positions] = x.swapaxes(1, 2)
        batch, length = context.batch_size, context.max_len

        def views(triple: Triple) -> Triple:
            return tuple(x[:batch, :, :length] for x in triple)

        return views(self.keys), None if self.values is None else views(self.values)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if length == 0:
            return
        # Materialised first, as SlotKVCache.move: a live view would make the write a copy.
        pieces = [mx.contiguous(x[src : src + 1, :, :length]) for x in self.buffers()]
        mx.eval(pieces)
        for buffer, piece in zip(self.buffers(), pieces):
            buffer[dst : dst + 1, :, :length] = piece
