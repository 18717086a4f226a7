"""The seed layout, kept as the baseline: one ``ContiguousKVCache`` per request and layer.

Each layer's ``SeedAttention`` writes every request's new tokens into its own cache, pads them
right to the longest, concatenates them into one batch and attends with a mask and MLX's SDPA:
the design of DESIGN.md section 1 that the slot layout replaces.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ...attention.seed import SeedAttention
from ...caches.kv_cache import ContiguousKVCache
from ...caches.context import BatchedDecodeContext
from ..plan import StepPlan
from .base import KVLayout


class SeedLayout(KVLayout):
    """``model``'s keys/values in per-request caches growing by ``kv_step`` positions.

    Raises ``ValueError`` for a model with multi-head latent attention (it decodes on the slot
    or paged layout only).
    """

    def __init__(self, model: nn.Module, kv_step: int):
        super().__init__(model)
        if any(self.latents):
            raise ValueError(
                f"[BatchedDecoder] {type(model).__name__}'s multi-head latent attention decodes "
                "on the slot path (or kv_layout='paged'), not attention='seed'"
            )
        self.kv_step = kv_step
        self.attentions = [SeedAttention()] * self.num_layers
        # rows[b][layer]: request b's own cache of that layer.
        self.rows: list[list[ContiguousKVCache]] = []

    def load(self, row: int, layers_kv: Optional[Sequence[tuple[mx.array, mx.array]]]) -> None:
        if layers_kv is not None and len(layers_kv) != self.num_layers:
            raise ValueError(
                f"[BatchedDecoder] need keys/values for {self.num_layers} layers, got "
                f"{len(layers_kv)}"
            )
        caches = [ContiguousKVCache(self.kv_step) for _ in range(self.num_layers)]
        self.rows.append(caches)
        if layers_kv is None:
            return
        for cache, (keys, values) in zip(caches, layers_kv):
            cache.update_and_fetch(keys, values)
        mx.eval(self.cache_arrays())

    def copy_row(self, src: int, dst: int, length: int) -> None:
        caches = [ContiguousKVCache(self.kv_step) for _ in range(self.num_layers)]
        for cache, parent in zip(caches, self.rows[src]):
            cache.update_and_fetch(parent.keys[:, :, :length], parent.values[:, :, :length])
        self.rows.append(caches)

    def release(self, row: int, last: int, length: int) -> None:
        self.rows[row] = self.rows[last]
        self.rows.pop()

    def context(self, plan: StepPlan, seq_lens, query_lens, first_chunks) -> BatchedDecodeContext:
        layer_caches = [[row[layer] for row in self.rows] for layer in range(self.num_layers)]
        return BatchedDecodeContext.packed_step(
            seq_lens, query_lens, layer_caches, first_chunks=first_chunks
        )

    def cache_arrays(self) -> list[mx.array]:
        caches = [c for row in self.rows for c in row if c.keys is not None]
        return [x for c in caches for x in (c.keys, c.values)]
