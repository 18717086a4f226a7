"""One mlx-lm model as ``BatchedDecoder`` runs it: packed forward passes and the K/V rows.

A ``ServedModel`` holds what decoding one model needs besides the scheduler: the Python modules
whose attention is routed, each layer's window (from mlx-lm's own caches), and the keys/values
of every active request, one row per request in the scheduler's order: on the zero-copy path one
``SlotKVCache`` per full-attention layer and one ``RingSlotKVCache`` per sliding-window layer
(a ``QuantizedSlotKVCache`` per layer with ``kv_bits``), or one ``ContiguousKVCache`` per request
and layer on the seed path. A multi-head latent attention layer's ``SlotKVCache`` keeps one
``[S, 1, capacity, r + R]`` buffer of latent and rope keys and no values (``latent_attention``).

``BatchedDecoder`` serves its target model, and its draft model when it decodes speculatively,
each through one of these.

A windowed layer's ring keeps ``R = window + lookahead`` positions per request, ``lookahead``
being the most a step writes past a row's window: ``c - 1`` for a prompt chunk of c tokens (its
first row reads keys from a window behind it) and the draft tokens k of a speculative round.
The target's L = k + 1 rows at ``s .. s + k`` read keys from ``s - window + 1`` on, ``window + k``
positions at once; and a round's writes at ``s .. s + k`` (the draft's one by one, the target's
at once) overwrite positions ``s - window - k .. s - window`` only, older than any key the next
round reads once it restarts at ``s' >= s + 1`` after rejected tokens (``s' - window + 1`` on).

Dimension legend: N = tokens of a packed step, V = vocabulary size.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ..attention.base import DecodeAttention
from ..attention.ring import RingSlotAttention
from ..attention.seed import SeedAttention
from ..attention.slot import QuantizedSlotAttention, SlotAttention
from ..caches.kv_cache import ContiguousKVCache, SlotKVCache
from ..caches.packed_context import PackedDecodeContext
from ..caches.quantized_kv_cache import QuantizedSlotKVCache
from ..caches.ring_kv_cache import RingSlotKVCache
from ..families.mla import latent_specs
from ..families.patches import mlx_lm_attention_modules
from ..families.step_forward import routed_forward
from .mlx_lm_caches import layer_windows, prompt_caches

# A layer's cache on the zero-copy path.
SlotCache = Union[SlotKVCache, RingSlotKVCache, QuantizedSlotKVCache]


class ServedModel:
    """An mlx-lm model, its attention routed to ``attention`` (``"slot"`` or ``"seed"``); with
    ``kv_bits`` (``"slot"`` only) its keys and values are kept quantized, ``kv_bits`` bits per
    element in groups of ``kv_group_size``, in mlx-lm's ``QuantizedKVCache`` format (windowed
    layers then keep every position: the quantized op reads no ring). ``lookahead``: the draft
    tokens per speculative round (0 without a draft model), which the rings make room for.

    Raises ``ValueError`` for models it cannot serve: attention that does not go through
    mlx-lm's ``scaled_dot_product_attention`` (nor has a step forward pass of its own), layers
    whose cache is neither ``KVCache`` nor a plain ``RotatingKVCache``, a head dim that
    ``kv_group_size`` does not divide (of keys, values, or an MLA layer's ``r + R`` rows and
    ``r`` latent), or multi-head latent attention on the seed path.
    """

    def __init__(
        self,
        model: nn.Module,
        attention: str,
        kv_step: int,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        lookahead: int = 0,
    ):
        self.model = model
        self.kv_step = kv_step
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.routed_modules = mlx_lm_attention_modules(model)
        self.windows = layer_windows(model)
        self.num_layers = len(self.windows)
        self.latents = latent_specs(model)
        if any(self.latents) and attention != "slot":
            raise ValueError(
                f"[BatchedDecoder] {type(model).__name__}'s multi-head latent attention decodes "
                f"on the slot path (or kv_layout='paged'), not attention={attention!r}"
            )
        self.slot_caches: Optional[list[SlotCache]] = None
        # Distinct ring sizes, each derived once per step by the context.
        self.ring_sizes: list[int] = []
        if kv_bits is not None:
            self._check_group_size()
            quantized = QuantizedSlotAttention(kv_group_size, kv_bits)
            self.attentions: list[DecodeAttention] = [quantized] * self.num_layers
            self.slot_caches = [
                QuantizedSlotKVCache(kv_group_size, kv_bits, kv_step)
                for _ in range(self.num_layers)
            ]
        elif attention == "slot":
            full = SlotAttention()
            rings = [None if w is None else w + lookahead for w in self.windows]
            self.ring_sizes = sorted({r for r in rings if r is not None})
            self.attentions = [full if r is None else RingSlotAttention(r) for r in rings]
            self.slot_caches = [
                SlotKVCache(kv_step) if r is None else RingSlotKVCache(r, kv_step) for r in rings
            ]
        else:
            self.attentions = [SeedAttention()] * self.num_layers
        # Seed path: seed_rows[b][layer] is request b's own cache of that layer.
        self.seed_rows: list[list[ContiguousKVCache]] = []

    def _one_token(self) -> tuple[mx.array, list[Any]]:
        """One token through mlx-lm's own caches: its logits ``[1, 1, V]`` and the caches."""
        caches = prompt_caches(self.model)
        return self.model(mx.zeros((1, 1), dtype=mx.int32), cache=caches), caches

    def vocab_size(self) -> int:
        """V, the logits one token gets."""
        return self._one_token()[0].shape[-1]

    def _check_group_size(self) -> None:
        """ValueError unless ``kv_group_size`` divides every layer's key and value head dims
        as the quantized cache keeps them (an MLA layer's ``r + R`` rows, whose values are
        their first ``r`` columns), measured with one token through mlx-lm's own caches."""
        for layer, (cache, latent) in enumerate(zip(self._one_token()[1], self.latents)):
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
        """Give a new request row ``row``, the next free one, and store each layer's
        keys/values ``[1, H_kv, P, D]`` of its first P positions there (``None``: no position
        yet; an MLA layer's pair is mlx-lm's latent ``[1, 1, P, r]`` and rope keys
        ``[1, 1, P, R]``); quantized first with ``kv_bits``."""
        if layers_kv is not None and len(layers_kv) != self.num_layers:
            raise ValueError(
                f"[BatchedDecoder] need keys/values for {self.num_layers} layers, got "
                f"{len(layers_kv)}"
            )
        if self.slot_caches is None:
            # The seed path: the request's own caches, one per layer.
            self.seed_rows.append([ContiguousKVCache(self.kv_step) for _ in range(self.num_layers)])
        if layers_kv is None:
            return
        written = self.slot_caches if self.slot_caches is not None else self.seed_rows[row]
        for cache, latent, (keys, values) in zip(written, self.latents, layers_kv):
            if latent is not None:
                rows = mx.concatenate([keys, values], axis=-1)
                quantized = isinstance(cache, QuantizedSlotKVCache)
                cache.write_prompt(row, cache.quantize(rows) if quantized else rows, None)
            elif isinstance(cache, QuantizedSlotKVCache):
                cache.write_prompt(row, cache.quantize(keys), cache.quantize(values))
            elif isinstance(cache, ContiguousKVCache):
                cache.update_and_fetch(keys, values)
            else:
                cache.write_prompt(row, keys, values)
        # Evaluate the copies now: their time stays out of the next step's.
        mx.eval(self.cache_arrays())

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

    def forward_packed(
        self,
        tokens: mx.array,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        logit_rows: Sequence[int],
        first_chunks: Sequence[tuple[int, int]] = (),
        reserve_len: int = 0,
    ) -> mx.array:
        """One packed step: int32 ``tokens [N]``, request ``b``'s ``query_lens[b]`` of them at
        positions ``seq_lens[b] ..`` -> the logits ``[len(logit_rows), V]`` (lazy) of the
        tokens at packed rows ``logit_rows``. Writes every token's keys/values.
        ``first_chunks``, ``reserve_len``: as ``PackedDecodeContext``'s."""
        layer_caches = self.slot_caches
        if layer_caches is None:
            layer_caches = [
                [row[layer] for row in self.seed_rows] for layer in range(self.num_layers)
            ]
        context = PackedDecodeContext(
            seq_lens, query_lens, layer_caches, self.ring_sizes, first_chunks, reserve_len
        )
        return routed_forward(
            self.model, tokens, context, self.attentions, self.windows, self.routed_modules,
            logit_rows, self.latents,
        )

    def cache_arrays(self) -> list[mx.array]:
        """Every K/V buffer of the active requests: evaluating them runs pending writes of a
        step whose output is never read."""
        if self.slot_caches is not None:
            return [buffer for c in self.slot_caches for buffer in c.buffers()]
        caches = [c for row in self.seed_rows for c in row if c.keys is not None]
        return [x for c in caches for x in (c.keys, c.values)]
