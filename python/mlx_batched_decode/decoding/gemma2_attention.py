"""Gemma 2's attention layer in a decode step: its manual, soft-capped attention on the op.

mlx-lm's ``gemma2.Attention.__call__`` computes attention by hand (scores, ``softcap * tanh(s /
softcap)``, mask, softmax, values) and never calls ``scaled_dot_product_attention``, so the
name rebinding of ``route_attention`` cannot reach it. ``gemma2_step`` is the layer's forward
pass for a ``StepLayerCache``: the same projections, rope and cache write, then the cache's
attention with the layer's ``attn_logit_softcapping`` as the op's ``softcap`` and its
``query_pre_attn_scalar ** -0.5`` scale. ``route_attention`` puts it in the class's place
while a step runs (``STEP_CALLS``); every other cache goes to mlx-lm's own ``__call__``.

Dimension legend: N = tokens of a packed step (one per row, L = 1), H_q = query heads,
H_kv = key/value heads, D = head dimension.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn


def project(layer: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``layer``'s (a ``gemma2.Attention``) projections of ``x [B, L, hidden]``: queries
    ``[B, H_q, L, D]``, keys and values ``[B, H_kv, L, D]``, before rope."""
    batch, rows, _ = x.shape
    queries = layer.q_proj(x).reshape(batch, rows, layer.n_heads, -1).transpose(0, 2, 1, 3)
    keys = layer.k_proj(x).reshape(batch, rows, layer.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = layer.v_proj(x).reshape(batch, rows, layer.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return queries, keys, values


def gemma2_step(layer: nn.Module, x: mx.array, mask: Optional[mx.array], cache: Any) -> mx.array:
    """``layer`` (a ``gemma2.Attention``) on hidden states ``x [N, L, hidden]`` with the step's
    ``cache`` -> ``[N, L, hidden]``. ``mask`` is the step cache's ``make_mask``'s ``None``."""
    if mask is not None:
        raise ValueError("[BatchedDecoder] explicit attention masks are not supported")
    batch, rows, _ = x.shape
    queries, keys, values = project(layer, x)
    queries = layer.rope(queries, offset=cache.offset)
    keys = layer.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    # GQA is the op's: H_q / H_kv query heads per KV head, no repeated keys.
    out = cache.attend(queries, keys, values, layer.scale, softcap=layer.attn_logit_softcapping)
    return layer.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, rows, -1))


# mlx-lm modules -> (their attention class, its step forward pass).
STEP_CALLS = {"mlx_lm.models.gemma2": ("Attention", gemma2_step)}
