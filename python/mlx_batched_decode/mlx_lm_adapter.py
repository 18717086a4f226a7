"""How an unchanged mlx-lm model decodes through our attention: a per-layer step cache.

mlx-lm's attention layers do, per layer::

    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=..., mask=mask)

and the model builds ``mask`` with ``cache.make_mask(...)``. ``StepLayerCache`` is the ``cache``
they receive in a decode step: its ``offset`` is the context's int32 ``[B]`` ``offsets``
(``mx.fast.rope`` takes per-request offsets), ``update_and_fetch`` is the attention path's
write, and ``make_mask`` returns ``None``. The last call is a module-level function of mlx-lm
that never asks its cache to attend, so ``route_attention`` rebinds that name, in the model's
own modules and only while a decode step runs, to a function that sends ``StepLayerCache``
layers to our attention and every other cache to mlx-lm's original. The model's code is not
changed. mlx-lm is imported lazily: the core package does not need it.

Dimension legend: B = requests in the step, H_q = query heads, H_kv = key/value heads,
T = key/value positions, D = head dimension.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from .attention import DecodeAttention
from .context import BatchedDecodeContext


class StepLayerCache:
    """The ``cache`` one layer of an mlx-lm model sees during one batched decode step."""

    def __init__(self, attention: DecodeAttention, context: BatchedDecodeContext, layer: int):
        self.attention = attention
        self.context = context
        self.layer = layer

    @property
    def offset(self) -> mx.array:
        """int32 ``[B]`` RoPE offsets: the context's ``offsets``, one array shared by all layers."""
        return self.context.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """New ``[B, H_kv, 1, D]`` keys/values -> the ``[B, H_kv, max_len, D]`` attention reads."""
        if keys.shape[2] != 1:
            raise ValueError("[StepLayerCache] a decode step feeds exactly one token per request")
        return self.attention.update(self.context, self.layer, keys, values)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> None:
        """No mask: the lengths travel in the context's ``valid_lens``."""
        if N != 1 or window_size is not None:
            raise ValueError(
                "[StepLayerCache] only single-token, full-attention decode is supported"
            )
        return None

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        """``queries [B, H_q, 1, D]`` -> ``[B, H_q, 1, D]``."""
        return self.attention.attend(self.context, queries, keys, values, scale=scale)


def mlx_lm_attention_modules(model: nn.Module) -> list[Any]:
    """The Python modules of ``model``'s layers that call mlx-lm's
    ``scaled_dot_product_attention``."""
    from mlx_lm.models import base

    found = {}
    for _, module in model.named_modules():
        python_module = sys.modules.get(type(module).__module__)
        if (
            getattr(python_module, "scaled_dot_product_attention", None)
            is base.scaled_dot_product_attention
        ):
            found[python_module.__name__] = python_module
    if not found:
        raise ValueError(
            f"[BatchedDecoder] {type(model).__name__} does not call mlx-lm's "
            "scaled_dot_product_attention: it cannot be routed to batched decode attention"
        )
    return list(found.values())


@contextmanager
def route_attention(python_modules: list[Any]) -> Iterator[None]:
    """While active, ``StepLayerCache`` layers of these modules attend with our attention path."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention

    def routed(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, StepLayerCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None or mask is not None:
            raise ValueError(
                "[BatchedDecoder] attention sinks and explicit masks are not supported"
            )
        return cache.attend(queries, keys, values, scale)

    for python_module in python_modules:
        python_module.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        for python_module in python_modules:
            python_module.scaled_dot_product_attention = original


def prompt_caches(model: nn.Module) -> list[Any]:
    """mlx-lm's own per-layer caches for one prompt; raises for models we cannot serve."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    if any(type(c) is not KVCache for c in caches):
        raise ValueError(
            "[BatchedDecoder] only models whose every layer uses mlx-lm's full-attention KVCache "
            "are supported (no sliding-window, rotating, or state-space caches)"
        )
    return caches


def prefill(model: nn.Module, tokens: list[int], step_size: int) -> list[tuple[mx.array, mx.array]]:
    """Run ``tokens`` through the model with mlx-lm's own caches, ``step_size`` tokens at a time.

    Returns each layer's keys and values ``[1, H_kv, len(tokens), D]``. Like mlx-lm's
    ``generate_step``, callers prefill all but the last prompt token, which then enters decoding.
    """
    caches = prompt_caches(model)
    for start in range(0, len(tokens), step_size):
        model(mx.array(tokens[start : start + step_size], dtype=mx.int32)[None], cache=caches)
        mx.eval([c.state for c in caches])
    return [(c.keys[:, :, : c.offset], c.values[:, :, : c.offset]) for c in caches]
