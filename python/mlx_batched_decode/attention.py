"""The attention wrapper a model's attention layer calls once per layer in a decode step.

Three paths with the same interface:

- ``SlotAttention`` (default): every request's new K/V goes into the layer's ``SlotKVCache`` with
  one scatter, and ``batched_decode_attention`` reads ``buffer[:B, :, :max_len]`` in place with
  the context's ``valid_lens``, the layer's window and sinks. No pad, no concatenate, no mask.
- ``QuantizedSlotAttention``: the same over a ``QuantizedSlotKVCache`` (mlx-lm's 8- or 4-bit
  ``mx.quantize`` triples): the new K/V are quantized once and scattered, and
  ``quantized_batched_decode_attention`` reads the triples of views in place.
- ``SeedAttention``: the seed design of DESIGN.md section 1, kept as the baseline: per-request
  ``ContiguousKVCache``, right padding to ``max_len``, concatenation into one batch, an additive
  mask rebuilt per layer, ``mx.fast.scaled_dot_product_attention``.

Both serve L >= 1 new tokens per request (row ``i`` of request ``b`` sits at position
``p = seq_lens[b] + i`` and attends keys ``max(p - window + 1, 0) .. p``), sliding-window layers
(``window``, the number of keys a row attends, itself included) and attention sinks (``sinks``,
a per-head logit in the softmax denominator, as ``mx.fast.scaled_dot_product_attention``).

Dimension legend: B = requests in the step, L = new tokens per request, H_q = query heads,
H_kv = key/value heads, T = key/value positions, D = head dimension.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Optional

import mlx.core as mx

import mlx_batched_decode

from .context import BatchedDecodeContext
from .kv_cache import ContiguousKVCache, SlotKVCache
from .quantized_kv_cache import QuantizedSlotKVCache, Triple, check_quantization


def _default_scale(queries: mx.array, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(queries.shape[-1]) if scale is None else scale


class DecodeAttention(ABC):
    """A decode attention path: ``update`` writes the step's new K/V into the layer's cache and
    returns what attention reads, ``attend`` computes attention over it."""

    @abstractmethod
    def update(
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """New ``[B, H_kv, L, D]`` keys/values -> the ``[B, H_kv, T, D]`` keys/values to attend
        (on the quantized path, their ``(packed, scales, biases)`` triples)."""

    @abstractmethod
    def attend(
        self,
        context: BatchedDecodeContext,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: Optional[float] = None,
        window: Optional[int] = None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """``queries [B, H_q, L, D]`` over what ``update`` returned -> ``[B, H_q, L, D]``;
        ``window`` (int >= 1) bounds each row to its last keys, ``sinks`` is ``[H_q]`` float."""

    def __call__(
        self,
        context: BatchedDecodeContext,
        layer: int,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: Optional[float] = None,
        window: Optional[int] = None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """One layer's decode attention: ``queries [B, H_q, L, D]``, new ``keys``/``values``
        ``[B, H_kv, L, D]`` (RoPE already applied) -> ``[B, H_q, L, D]``."""
        all_keys, all_values = self.update(context, layer, keys, values)
        return self.attend(
            context, queries, all_keys, all_values, scale=scale, window=window, sinks=sinks
        )


class SlotAttention(DecodeAttention):
    """The zero-copy path: ``context.layer_caches[layer]`` is a ``SlotKVCache``."""

    def update(
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write the new ``[B, H_kv, L, D]`` keys/values; return ``[B, H_kv, max_len, D]`` views."""
        cache = context.layer_caches[layer]
        if not isinstance(cache, SlotKVCache):
            raise TypeError(
                f"[SlotAttention] layer {layer} needs a SlotKVCache, got {type(cache).__name__}"
            )
        return cache.update(keys, values, context)

    def attend(
        self,
        context: BatchedDecodeContext,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: Optional[float] = None,
        window: Optional[int] = None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """``queries [B, H_q, L, D]`` over the views from ``update`` -> ``[B, H_q, L, D]``."""
        return mlx_batched_decode.batched_decode_attention(
            queries, keys, values, context.valid_lens, scale=scale, window=window, sinks=sinks
        )


class QuantizedSlotAttention(DecodeAttention):
    """The zero-copy path over quantized keys/values: ``context.layer_caches[layer]`` is a
    ``QuantizedSlotKVCache`` of ``bits`` and ``group_size``; what ``update`` returns and
    ``attend`` reads are ``(packed, scales, biases)`` triples."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        check_quantization("QuantizedSlotAttention", bits, group_size)
        self.group_size = group_size
        self.bits = bits

    def update(
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[Triple, Triple]:
        """Quantize and write the new ``[B, H_kv, L, D]`` keys/values; return the triples of
        ``[B, H_kv, max_len, *]`` views."""
        cache = context.layer_caches[layer]
        if not (
            isinstance(cache, QuantizedSlotKVCache)
            and (cache.bits, cache.group_size) == (self.bits, self.group_size)
        ):
            raise TypeError(
                f"[QuantizedSlotAttention] layer {layer} needs a QuantizedSlotKVCache with "
                f"bits={self.bits}, group_size={self.group_size}, got {cache!r}"
            )
        return cache.update(keys, values, context)

    def attend(
        self,
        context: BatchedDecodeContext,
        queries: mx.array,
        keys: Triple,
        values: Triple,
        *,
        scale: Optional[float] = None,
        window: Optional[int] = None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """``queries [B, H_q, L, D]`` over the triples from ``update`` -> ``[B, H_q, L, D]``."""
        return mlx_batched_decode.quantized_batched_decode_attention(
            queries,
            keys,
            values,
            context.valid_lens,
            group_size=self.group_size,
            bits=self.bits,
            scale=scale,
            window=window,
            sinks=sinks,
        )


class SeedAttention(DecodeAttention):
    """The seed baseline: ``context.layer_caches[layer]`` holds B ``ContiguousKVCache``."""

    def update(
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write each request's ``L`` tokens into its own cache at its ``seq_lens[b]`` (forgetting
        any rejected draft tokens there), pad right, concatenate: ``[B, H_kv, max_len, D]``."""
        caches = context.layer_caches[layer]
        if (
            not isinstance(caches, (list, tuple))
            or len(caches) != context.batch_size
            or not all(isinstance(c, ContiguousKVCache) for c in caches)
        ):
            raise TypeError(
                f"[SeedAttention] layer {layer} needs {context.batch_size} ContiguousKVCache"
            )
        padded_keys, padded_values = [], []
        for b, cache in enumerate(caches):
            cache.rewind(context.seq_lens[b])
            k, v = cache.update_and_fetch(keys[b : b + 1], values[b : b + 1])
            pad = context.pad_sizes[b]
            if pad:
                widths = [(0, 0), (0, 0), (0, pad), (0, 0)]
                k, v = mx.pad(k, widths), mx.pad(v, widths)
            padded_keys.append(k)
            padded_values.append(v)
        return mx.concatenate(padded_keys, axis=0), mx.concatenate(padded_values, axis=0)

    def attend(
        self,
        context: BatchedDecodeContext,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: Optional[float] = None,
        window: Optional[int] = None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """``queries [B, H_q, L, D]`` over the padded batch, each row masked to its own keys."""
        mask = None
        if (
            context.needs_padding
            or context.query_len > 1
            or (window is not None and context.max_len > window)
        ):
            # The seed rebuilds this additive [B, 1, L, max_len] mask in every layer: key t is
            # visible to the row at position p when p - window < t <= p.
            rows = context.new_positions[:, :, None]
            visible = context.positions <= rows
            if window is not None:
                visible = visible & (context.positions > rows - window)
            mask = mx.where(visible, 0.0, -mx.inf).astype(queries.dtype)[:, None]
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=_default_scale(queries, scale), mask=mask, sinks=sinks
        )
