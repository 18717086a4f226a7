"""Layers that call mlx-lm's ``scaled_dot_product_attention``: their attention, routed.

mlx-lm's attention layers (Llama, Qwen, Mistral, Gemma 3, gpt-oss, DeepSeek-V2, ...) end with::

    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=...,
                                          mask=mask, sinks=...)

a module-level function of ``mlx_lm.models.base`` that each model file imports by name
(``from .base import scaled_dot_product_attention``). Rebinding that name in a model's module
(``modules_binding`` finds them) puts a ``RoutedAttention`` in its place: a drop-in of the same
signature that serves the calls its ``serve`` takes (windows and sinks passed on) and hands
every other call to mlx-lm's original. The decoder's router serves its step caches
(``step_cache.StepAttention``), the plug-in's the decode steps of mlx-lm's batch caches
(``integrations.mlx_lm.routing.DecodeRouter``); the Gemma 2 and MLA layers of ``gemma2`` and
``mla`` ask the same ``serve``.

Dimension legend: B = requests, H_q = query heads, H_kv = key/value heads, L = new tokens per
request, T = key/value positions, D = head dimension of queries and keys, Dv = of values.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import mlx.core as mx

# The name of mlx-lm's attention function, in mlx_lm.models.base and every model module.
ATTENTION_FUNCTION = "scaled_dot_product_attention"


class RoutedAttention:
    """mlx-lm's ``scaled_dot_product_attention`` (same signature), some calls on our attention.

    Args:
        original: mlx-lm's own function, which every call ``serve`` declines goes to.
        prefix: what errors raised on the router's behalf begin with.
    """

    def __init__(self, original: Callable, prefix: str) -> None:
        self.original = original
        self.prefix = prefix

    def serve(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Optional[mx.array] = None,
        softcap: Optional[float] = None,
    ) -> Optional[mx.array]:
        """``queries [B, H_q, L, D]`` over ``keys [B, H_kv, T, D]`` and ``values [B, H_kv, T,
        Dv]`` -> ``[B, H_q, L, Dv]``, or ``None`` for a call left to mlx-lm's code; ``mask`` as
        mlx-lm passes it, ``sinks`` ``[H_q]``, ``softcap`` the op's (Gemma 2's)."""
        raise NotImplementedError

    def __call__(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """As ``serve``, mlx-lm's ``original`` running the calls it declines."""
        output = self.serve(queries, keys, values, cache, scale, mask, sinks)
        if output is None:
            return self.original(
                queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
            )
        return output


def modules_binding(function: Any) -> list[Any]:
    """Loaded modules whose global ``scaled_dot_product_attention`` is ``function`` (read from
    their ``__dict__``, so no module-level ``__getattr__`` runs)."""
    return [
        module
        for module in list(sys.modules.values())
        if isinstance(getattr(module, "__dict__", None), dict)
        and module.__dict__.get(ATTENTION_FUNCTION) is function
    ]
