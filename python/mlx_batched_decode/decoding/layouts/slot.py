"""The slot layout: one cache row per request in every layer's buffers, read in place.

Full-attention layers keep a ``SlotKVCache``, sliding-window layers a ``RingSlotKVCache`` of
``R = window + lookahead`` positions per request, and with ``kv_bits`` every layer a
``QuantizedSlotKVCache`` (windowed layers then keep every position: the quantized op reads no
ring). A multi-head latent attention layer's cache keeps one ``[S, 1, capacity, r + R]`` buffer
of latent and rope keys and no values (``families.mla``). Request ``b`` of a step owns row
``b`` of every buffer; when a request leaves, the last row's request moves into its row.

``lookahead`` is the most a step writes past a row's window: ``c - 1`` for a prompt chunk of c
tokens (its first row reads keys from a window behind it) and the draft tokens k of a
speculative round. The target's L = k + 1 rows at ``s .. s + k`` read keys from
``s - window + 1`` on, ``window + k`` positions at once; and a round's writes at ``s .. s + k``
(the draft's one by one, the target's at once) overwrite positions ``s - window - k ..
s - window`` only, older than any key the next round reads once it restarts at ``s' >= s + 1``
after rejected tokens (``s' - window + 1`` on).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ...attention.ring import RingSlotAttention
from ...attention.slot import QuantizedSlotAttention, SlotAttention
from ...caches.kv_cache import SlotKVCache
from ...caches.context import BatchedDecodeContext
from ...caches.quantized_kv_cache import QuantizedSlotKVCache
from ...caches.ring_kv_cache import RingSlotKVCache
from .base import KVLayout

# A layer's cache in the slot layout.
SlotCache = Union[SlotKVCache, RingSlotKVCache, QuantizedSlotKVCache]


class SlotLayout(KVLayout):
    """``model``'s keys/values in slot caches of ``kv_step``-position chunks; with ``kv_bits``
    quantized, ``kv_bits`` bits per element in groups of ``kv_group_size``, in mlx-lm's
    ``QuantizedKVCache`` format. ``lookahead``: what the rings make room for (module docstring).

    Raises ``ValueError`` for a head dim ``kv_group_size`` does not divide (of keys, values, or
    an MLA layer's ``r + R`` rows and ``r`` latent).
    """

    def __init__(
        self,
        model: nn.Module,
        kv_step: int,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        lookahead: int = 0,
    ):
        super().__init__(model)
        self.kv_group_size = kv_group_size
        # Distinct ring sizes, each derived once per step by the context.
        self.ring_sizes: list[int] = []
        if kv_bits is not None:
            self._check_group_size()
            # Each layer's slot cache, and its attention path.
            self.caches: list[SlotCache] = [
                QuantizedSlotKVCache(kv_group_size, kv_bits, kv_step)
                for _ in range(self.num_layers)
            ]
            self.attentions = [QuantizedSlotAttention(kv_group_size, kv_bits)] * self.num_layers
            return
        full = SlotAttention()
        rings = [None if w is None else w + lookahead for w in self.windows]
        self.ring_sizes = sorted({r for r in rings if r is not None})
        self.caches = [
            SlotKVCache(kv_step) if r is None else RingSlotKVCache(r, kv_step) for r in rings
        ]
        self.attentions = [full if r is None else RingSlotAttention(r) for r in rings]

    def _check_group_size(self) -> None:
        """ValueError unless ``kv_group_size`` divides every layer's key and value head dims
        as the quantized cache keeps them (an MLA layer's ``r + R`` rows, whose values are
        their first ``r`` columns), measured with one token through mlx-lm's own caches."""
        for layer, (cache, latent) in enumerate(zip(self.one_token()[1], self.latents)):
            dims = (cache.keys.shape[-1], cache.values.shape[-1])
            if latent is not None:
                dims = (latent.key_dim, latent.latent_dim)
            for name, dim in zip(("key", "value"), dims):
                if dim % self.kv_group_size:
                    raise ValueError(
                        f"[BatchedDecoder] kv_group_size {self.kv_group_size} does not divide "
                        f"layer {layer}'s {name} head dim {dim}"
                    )

    def load(self, row: int, layers_kv: Optional[Sequence[tuple[mx.array, mx.array]]]) -> None:
        """As ``KVLayout.load``; the keys/values quantized first with ``kv_bits``."""
        if layers_kv is None:
            return
        if len(layers_kv) != self.num_layers:
            raise ValueError(
                f"[BatchedDecoder] need keys/values for {self.num_layers} layers, got "
                f"{len(layers_kv)}"
            )
        for cache, latent, (keys, values) in zip(self.caches, self.latents, layers_kv):
            quantized = isinstance(cache, QuantizedSlotKVCache)
            if latent is not None:
                rows = mx.concatenate([keys, values], axis=-1)
                cache.write_prompt(row, cache.quantize(rows) if quantized else rows, None)
            elif quantized:
                cache.write_prompt(row, cache.quantize(keys), cache.quantize(values))
            else:
                cache.write_prompt(row, keys, values)
        # Evaluate the copies now: their time stays out of the next step's.
        mx.eval(self.cache_arrays())

    def copy_row(self, src: int, dst: int, length: int) -> None:
        for cache in self.caches:
            # Room for the new row, shaped as the buffers themselves.
            cache.reserve(dst + 1, length, cache.keys, cache.values)
            cache.move(src, dst, length)

    def release(self, row: int, last: int, length: int) -> None:
        if row != last:
            for cache in self.caches:
                cache.move(last, row, length)

    def context(self, plan, seq_lens, query_lens, first_chunks) -> BatchedDecodeContext:
        return BatchedDecodeContext.packed_step(
            seq_lens, query_lens, self.caches, ring_sizes=self.ring_sizes,
            first_chunks=first_chunks, reserve_len=plan.reserve_len,
        )

    def cache_arrays(self) -> list[mx.array]:
        return [buffer for cache in self.caches for buffer in cache.buffers()]
