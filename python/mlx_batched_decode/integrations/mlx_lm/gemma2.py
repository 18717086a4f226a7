"""Gemma 2's attention while the plug-in is enabled.

mlx-lm's ``gemma2.Attention.__call__`` does not call ``scaled_dot_product_attention``: it
soft-caps its scores by hand (``cap * tanh(scores / cap)``, ``cap = attn_logit_softcapping``)
with ``scale = query_pre_attn_scalar ** -0.5``, so ``DecodeRouter`` never sees it. With GQA it
also reshapes the queries to ``[B, H_kv, G, L, D]`` and the scores to ``[B, H_kv, G, L, T]``,
against which a batch cache's ``[B, 1, L, T]`` mask broadcasts with its requests on the
``H_kv`` axis: an error unless ``B`` is 1 or ``H_kv``, and other requests' padding masked when
``B == H_kv``.

``gemma2_attention`` is the replacement ``enable()`` installs. Each call asks
``DecodeRouter.plan`` whether the op serves it (decode steps on batch caches, counted as the
router counts its own); those run ``batched_decode_attention`` with ``softcap`` and the layer's
scale on the ``[B, H_q, 1, D]`` queries, the op pairing query head ``h`` with key head
``h // G``. Every other call runs mlx-lm's code with the mask put on the batch axis
(``[B, 1, 1, L, T]``), so each request gets its single-request result.

Dimension legend: B = requests, H_q = query heads, H_kv = key/value heads, G = H_q / H_kv,
L = new tokens per request, T = key/value positions, D = head dimension, E = hidden size.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

import mlx_batched_decode

from ...decoding.gemma2_attention import project
from .routing import DecodeRouter


def gemma2_attention(router: DecodeRouter) -> Callable:
    """``gemma2.Attention.__call__`` that serves decode steps through ``router``'s plan."""

    def __call__(
        self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None
    ) -> mx.array:
        """``x [B, L, E]`` -> ``[B, L, E]``; ``mask`` bool or additive, ``[L, T]`` or
        ``[B, 1, L, T]`` (a batch cache's), or ``None``; ``cache`` any mlx-lm cache or ``None``."""
        B, L, _ = x.shape
        queries, keys, values = project(self, x)

        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

        call = router.plan(queries, keys, values, cache, mask)
        if call is None:
            output = _mlx_lm_attention(self, queries, keys, values, mask)
        else:
            output = mlx_batched_decode.batched_decode_attention(
                queries,
                keys,
                values,
                call.valid_lens,
                scale=self.scale,
                kv_starts=call.kv_starts,
                window=call.window,
                ring_offset=call.ring_offset,
                softcap=self.attn_logit_softcapping,
            )
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output)

    return __call__


def _mlx_lm_attention(
    layer: Any, queries: mx.array, keys: mx.array, values: mx.array, mask: Optional[mx.array]
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
