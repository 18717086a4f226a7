"""One mlx-lm model as ``BatchedDecoder`` runs it: prefill, batched forward passes, the K/V rows.

A ``ServedModel`` holds what decoding one model needs besides the scheduler: the Python modules
whose attention is routed, each layer's window (from mlx-lm's own caches), and the keys/values
of every active request, one row per request in the scheduler's order: one ``SlotKVCache`` per
layer on the zero-copy path, or one ``ContiguousKVCache`` per request and layer on the seed path.
``BatchedDecoder`` serves its target model, and its draft model when it decodes speculatively,
each through one of these.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
V = vocabulary size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .attention import DecodeAttention, SeedAttention, SlotAttention
from .context import BatchedDecodeContext
from .kv_cache import ContiguousKVCache, SlotKVCache
from .mlx_lm_adapter import StepLayerCache, mlx_lm_attention_modules, route_attention
from .mlx_lm_prefill import layer_windows, prefill, prompt_caches


class ServedModel:
    """An mlx-lm model, its attention routed to ``attention`` (``"slot"`` or ``"seed"``).

    Raises ``ValueError`` for models it cannot serve: attention that does not go through
    mlx-lm's ``scaled_dot_product_attention``, or layers whose cache is neither ``KVCache`` nor
    a plain ``RotatingKVCache``.
    """

    def __init__(self, model: nn.Module, attention: str, kv_step: int, prefill_step_size: int):
        self.model = model
        self.kv_step = kv_step
        self.prefill_step_size = prefill_step_size
        self.attention: DecodeAttention = (
            SlotAttention() if attention == "slot" else SeedAttention()
        )
        self.routed_modules = mlx_lm_attention_modules(model)
        self.windows = layer_windows(model)
        self.num_layers = len(self.windows)
        self.slot_caches: Optional[list[SlotKVCache]] = (
            [SlotKVCache(kv_step) for _ in range(self.num_layers)] if attention == "slot" else None
        )
        # Seed path: seed_rows[b][layer] is request b's own cache of that layer.
        self.seed_rows: list[list[ContiguousKVCache]] = []

    def vocab_size(self) -> int:
        """V, the logits one token gets: measured with one token through mlx-lm's own caches."""
        logits = self.model(mx.zeros((1, 1), dtype=mx.int32), cache=prompt_caches(self.model))
        return logits.shape[-1]

    def admit(self, row: int, prompt: Sequence[int]) -> None:
        """Prefill ``prompt`` (token ids, may be empty) into row ``row``, the next free one."""
        layers_kv = prefill(self.model, list(prompt), self.prefill_step_size) if prompt else None
        if self.slot_caches is not None:
            if layers_kv is not None:
                for cache, (keys, values) in zip(self.slot_caches, layers_kv):
                    cache.write_prompt(row, keys, values)
            written = self.slot_caches
        else:
            caches = [ContiguousKVCache(self.kv_step) for _ in range(self.num_layers)]
            if layers_kv is not None:
                for cache, (keys, values) in zip(caches, layers_kv):
                    cache.update_and_fetch(keys, values)
            self.seed_rows.append(caches)
            written = caches
        # Evaluate the copies now: prefill time stays out of the next step's time.
        mx.eval([(c.keys, c.values) for c in written if c.keys is not None])

    def release(self, row: int, last: int, length: int) -> None:
        """Free row ``row``: the request in row ``last`` (``length`` tokens cached) moves there,
        so the active requests always fill rows ``0..B-1``."""
        if self.slot_caches is not None:
            if row != last:
                for cache in self.slot_caches:
                    cache.move(last, row, length)
        else:
            self.seed_rows[row] = self.seed_rows[last]
            self.seed_rows.pop()

    def forward(self, tokens: mx.array, seq_lens: Sequence[int]) -> mx.array:
        """One batched step: int32 ``tokens [B, L]`` at positions ``seq_lens[b] ..`` -> logits
        ``[B, L, V]`` (lazy). Writes the tokens' keys/values into rows ``0..B-1``."""
        batch, query_len = tokens.shape
        if self.slot_caches is not None:
            layer_caches = self.slot_caches
        else:
            layer_caches = [
                [row[layer] for row in self.seed_rows] for layer in range(self.num_layers)
            ]
        context = BatchedDecodeContext(batch, seq_lens, layer_caches, query_len)
        step_caches = [
            StepLayerCache(self.attention, context, layer, window)
            for layer, window in enumerate(self.windows)
        ]
        with route_attention(self.routed_modules):
            return self.model(tokens, cache=step_caches)

    def cache_arrays(self) -> list[mx.array]:
        """Every K/V buffer of the active requests: evaluating them runs pending writes of a
        step whose output is never read."""
        if self.slot_caches is not None:
            caches = self.slot_caches
        else:
            caches = [c for row in self.seed_rows for c in row]
        return [a for c in caches if c.keys is not None for a in (c.keys, c.values)]
