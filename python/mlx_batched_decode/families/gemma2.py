"""Gemma 2's attention: its soft-capped scores on the op, for the decoder and the plug-in.

mlx-lm's ``gemma2.Attention.__call__`` computes attention by hand (scores, ``cap * tanh(s /
cap)`` with ``cap = attn_logit_softcapping``, mask, softmax, values) with ``scale =
query_pre_attn_scalar ** -0.5`` and never calls ``scaled_dot_product_attention``, so rebinding
that name cannot reach it. ``attention_call`` is the ``__call__`` put in its place, while a
decoder step runs or while the plug-in is enabled: the same projections, rope and cache write,
then the router's ``serve`` with the layer's cap as the op's ``softcap`` (the op pairs query head
``h`` with key head ``h // G``: no repeated keys). A call the router declines runs mlx-lm's
soft-capped attention (``softcapped_attention``), but for one thing: with GQA mlx-lm reshapes
the queries to ``[B, H_kv, G, L, D]`` and the scores to ``[B, H_kv, G, L, T]``, against which a
batch cache's ``[B, 1, L, T]`` mask broadcasts with its requests on the ``H_kv`` axis (an
error unless B is 1 or ``H_kv``, other requests' padding masked when ``B == H_kv``); here the
mask goes on the batch axis (``[B, 1, 1, L, T]``), so each request gets its single-request
result.

Dimension legend: B = requests (N = tokens of a packed step), H_q = query heads,
H_kv = key/value heads, G = H_q / H_kv, L = new tokens per request, T = key/value positions,
D = head dimension, E = hidden size.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .standard import RoutedAttention


def project(layer: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``layer``'s (a ``gemma2.Attention``) projections of ``x [B, L, E]``: queries
    ``[B, H_q, L, D]``, keys and values ``[B, H_kv, L, D]``, before rope."""
    batch, rows, _ = x.shape
    queries = layer.q_proj(x).reshape(batch, rows, layer.n_heads, -1).transpose(0, 2, 1, 3)
    keys = layer.k_proj(x).reshape(batch, rows, layer.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = layer.v_proj(x).reshape(batch, rows, layer.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return queries, keys, values


def attention_call(router: RoutedAttention) -> Callable:
    """``gemma2.Attention.__call__`` that attends through ``router``'s ``serve``."""

    def __call__(
        self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None
    ) -> mx.array:
        """``x [B, L, E]`` -> ``[B, L, E]``; ``mask`` bool or additive, ``[L, T]`` or
        ``[B, 1, L, T]`` (a batch cache's), or ``None``; ``cache`` any mlx-lm cache, a
        decoder step's, or ``None``."""
        B, L, _ = x.shape
        queries, keys, values = project(self, x)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)
        output = router.serve(
            queries, keys, values, cache, self.scale, mask, softcap=self.attn_logit_softcapping
        )
        if output is None:
            output = softcapped_attention(self, queries, keys, values, mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))

    return __call__


def softcapped_attention(
    layer: nn.Module, queries: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array]
) -> mx.array:
    """mlx-lm's soft-capped attention of ``queries [B, H_q, L, D]`` over ``keys``/``values
    [B, H_kv, T, D]`` -> ``[B, H_q, L, D]``, but for where a 4-D mask's requests go."""
    B, _, L, _ = queries.shape
    queries = queries * layer.scale
    if layer.repeats > 1:
        queries = queries.reshape(B, layer.n_kv_heads, layer.repeats, L, layer.head_dim)
        keys = mx.expand_dims(keys, 2)
        values = mx.expand_dims(values, 2)
        # [B, 1, L, T] against scores [B, H_kv, G, L, T]: its requests go on the batch axis.
        if mask is not None and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)

    scores = queries @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / layer.attn_logit_softcapping)
    scores *= layer.attn_logit_softcapping

    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    scores = mx.softmax(scores, precise=True, axis=-1)
    output = scores @ values
    if layer.repeats > 1:
        output = output.reshape(B, layer.n_heads, L, layer.head_dim)
    return output
