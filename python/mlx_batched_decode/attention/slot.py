"""The zero-copy paths: new K/V scattered into a slot cache, the fused op reading it in place.

``SlotAttention`` over a ``SlotKVCache`` with ``batched_decode_attention``,
``QuantizedSlotAttention`` over a ``QuantizedSlotKVCache`` with
``quantized_batched_decode_attention``. The op is looked up on ``mlx_batched_decode`` at each
call, so that whoever replaces the public op (a test's spy) sees every call.

Shapes use the dimension legend of the package docstring (``mlx_batched_decode.attention``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

import mlx_batched_decode

from ..caches.context import BatchedDecodeContext
from ..caches.kv_cache import SlotKVCache
from ..caches.quantized_kv_cache import (
    QuantizedSlotKVCache,
    Triple,
    check_quantization,
    latent_values,
)
from .base import AttendOptions, DecodeAttention


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

    def _attend(self, context, queries, keys, values, options: AttendOptions) -> mx.array:
        """``queries [B, H_q, L, D]`` over the views from ``update`` -> ``[B, H_q, L, D]``."""
        return mlx_batched_decode.batched_decode_attention(
            queries, keys, values, context.valid_lens, **options._asdict()
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
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: Optional[mx.array]
    ) -> tuple[Triple, Optional[Triple]]:
        """Quantize and write the new ``[B, H_kv, L, D]`` keys/values; return the triples of
        ``[B, H_kv, max_len, *]`` views (``values=None``: keys only, ``None`` for the values)."""
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

    def attend(self, context, queries, keys, values, *, new_keys_values=None, **options):
        """As ``DecodeAttention.attend``; the rows of a packed context's ``first_chunk_rows``
        (a prompt's first tokens) attend their own ``new_keys_values`` unquantized
        (``attend_first_chunks``), as mlx-lm's prefill attends a prompt before it quantizes."""
        out = super().attend(context, queries, keys, values, **options)
        return attend_first_chunks(out, context, queries, new_keys_values, options)

    def attend_latent(self, context, queries, keys, latent_dim, **options):
        """As ``DecodeAttention.attend_latent`` over the quantized rows ``update`` returned for
        ``values=None``: the values are the views of their first ``latent_dim`` columns."""
        values = latent_values(keys, latent_dim, self.group_size, self.bits)
        return self.attend(context, queries, keys, values, **options)

    def _attend(self, context, queries, keys, values, options: AttendOptions) -> mx.array:
        """``queries [B, H_q, L, D]`` over the triples from ``update`` -> ``[B, H_q, L, Dv]``."""
        return mlx_batched_decode.quantized_batched_decode_attention(
            queries,
            keys,
            values,
            context.valid_lens,
            group_size=self.group_size,
            bits=self.bits,
            **options._asdict(),
        )


def attend_first_chunks(out, context, queries, new_keys_values, options) -> mx.array:
    """``out [N, H_q, 1, Dv]`` with the rows of each of ``context.first_chunk_rows`` replaced by
    their attention over their own new keys ``[N, H_kv, 1, D]`` and values ``[N, H_kv, 1, Dv]``
    with the dense op (rows ``start .. end - 1`` are one request's first positions, causal among
    themselves)."""
    if new_keys_values is None:
        return out
    new_keys, new_values = new_keys_values
    for start, end in context.first_chunk_rows:
        # [count, H_kv, 1, D] -> one request's [1, H_kv, count, D].
        keys = new_keys[start:end].transpose(2, 1, 0, 3)
        values = new_values[start:end].transpose(2, 1, 0, 3)
        bounds = mx.array([0, end - start], dtype=mx.int32)
        out[start:end] = mlx_batched_decode.batched_decode_attention(
            queries[start:end, :, 0], keys, values, bounds[1:], query_starts=bounds, **options
        )[:, :, None]
    return out
