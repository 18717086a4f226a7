"""``SeedAttention``: the seed design of DESIGN.md section 1, kept as the baseline.

Per-request ``ContiguousKVCache``, right padding to ``max_len``, concatenation into one batch,
an additive mask rebuilt per layer, ``mx.fast.scaled_dot_product_attention``.

Shapes use the dimension legend of the package docstring (``mlx_batched_decode.attention``).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..caches.context import BatchedDecodeContext
from ..caches.kv_cache import ContiguousKVCache
from .base import AttendOptions, DecodeAttention


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

    def _attend(self, context, queries, keys, values, options: AttendOptions) -> mx.array:
        """``queries [B, H_q, L, D]`` over the padded batch, each row masked to its own keys."""
        scale = 1.0 / math.sqrt(queries.shape[-1]) if options.scale is None else options.scale
        mask = None
        if (
            context.needs_padding
            or context.query_len > 1
            or (options.window is not None and context.max_len > options.window)
        ):
            # The seed rebuilds this additive [B, 1, L, max_len] mask in every layer: key t is
            # visible to the row at position p when p - window < t <= p.
            rows = context.new_positions[:, :, None]
            visible = context.positions <= rows
            if options.window is not None:
                visible = visible & (context.positions > rows - options.window)
            mask = mx.where(visible, 0.0, -mx.inf).astype(queries.dtype)[:, None]
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=options.sinks
        )
