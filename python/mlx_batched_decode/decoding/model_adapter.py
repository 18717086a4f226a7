"""How an unchanged mlx-lm model decodes through our attention: a per-layer step cache.

mlx-lm's attention layers do, per layer::

    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=..., mask=mask,
                                          sinks=...)

and the model builds ``mask`` with ``cache.make_mask(...)`` (with ``window_size`` for its
sliding-window layers). ``StepLayerCache`` is the ``cache`` they receive in a decode step: its
``offset`` is the context's int32 ``[B]`` ``offsets`` (``mx.fast.rope`` takes per-request
offsets, also with L > 1 tokens per request), ``update_and_fetch`` is the attention path's write,
and ``make_mask`` returns ``None``: the causal order of the L rows, each request's length and the
layer's window travel as the context's ``valid_lens`` and the cache's ``window``. The last call
is a module-level function of mlx-lm that never asks its cache to attend, so ``route_attention``
rebinds that name, in the model's own modules and only while a step runs, to a function that
sends ``StepLayerCache`` layers (with their sinks) to our attention; every other cache goes to
mlx-lm's original. The model's code is not changed. mlx-lm is imported lazily: the core
package does not need it.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
H_q = query heads, H_kv = key/value heads, T = key/value positions, D = head dimension.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..attention.base import DecodeAttention
from ..caches.context import BatchedDecodeContext


class StepLayerCache:
    """The ``cache`` one layer of an mlx-lm model sees during one batched decode step.

    Args:
        attention: the decode attention path.
        context: the step's context, shared by every layer.
        layer: the layer's index into ``context.layer_caches``.
        window: the layer's sliding window (keys a token attends, itself included), ``None``
            for full attention.
    """

    def __init__(
        self,
        attention: DecodeAttention,
        context: BatchedDecodeContext,
        layer: int,
        window: Optional[int] = None,
    ):
        self.attention = attention
        self.context = context
        self.layer = layer
        self.window = window
        self.new_keys_values: Optional[tuple[mx.array, mx.array]] = None

    @property
    def offset(self) -> mx.array:
        """int32 ``[B]`` RoPE offsets: the context's ``offsets``, one array shared by all layers."""
        return self.context.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """New ``[B, H_kv, L, D]`` keys/values -> the ``[B, H_kv, max_len, D]`` attention reads."""
        if keys.shape[2] != self.context.query_len:
            raise ValueError(
                f"[StepLayerCache] this step feeds {self.context.query_len} tokens per request, "
                f"the layer got {keys.shape[2]}"
            )
        # Kept for attend: a quantized cache's first prompt chunks attend them unquantized.
        self.new_keys_values = (keys, values)
        return self.attention.update(self.context, self.layer, keys, values)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: Optional[int] = None
    ) -> None:
        """No mask: the lengths travel in the context's ``valid_lens``, the window in ``window``.

        A ``window_size`` the model asks for must be this layer's window (mlx-lm's rotating
        cache of ``max_size`` tokens bounds a decode token to ``max_size`` keys whatever the
        mask says, so a larger ``window_size`` means the same).
        """
        if N != self.context.query_len:
            raise ValueError(
                f"[StepLayerCache] this step feeds {self.context.query_len} tokens per request, "
                f"the model asks for a mask of {N}"
            )
        if window_size is not None and (self.window is None or window_size < self.window):
            raise ValueError(
                f"[BatchedDecoder] the model masks layer {self.layer} to a window of "
                f"{window_size} tokens but its cache holds a window of {self.window}"
            )
        return None

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """``queries [B, H_q, L, D]`` -> ``[B, H_q, L, D]``; ``sinks`` ``[H_q]`` or ``None``."""
        return self.attention.attend(
            self.context,
            queries,
            keys,
            values,
            scale=scale,
            window=self.window,
            sinks=sinks,
            new_keys_values=self.new_keys_values,
        )


def routed_forward(
    model: nn.Module,
    tokens: mx.array,
    context: BatchedDecodeContext,
    attentions: Sequence[DecodeAttention],
    windows: list[Optional[int]],
    routed_modules: list[Any],
    logit_rows: Optional[Sequence[int]] = None,
) -> mx.array:
    """One step's forward pass of ``model``: int32 ``tokens [B, L]`` -> logits ``[B, L, V]``
    (lazy), layer ``i`` attending through ``attentions[i]`` within ``windows[i]``, every layer
    reading the one ``context``. With ``logit_rows`` only those rows' logits, ``[R, L, V]``:
    the model's head runs on their hidden states alone (``head_on_rows``)."""
    step_caches = [
        StepLayerCache(attention, context, layer, window)
        for layer, (attention, window) in enumerate(zip(attentions, windows))
    ]
    if logit_rows is None:
        with route_attention(routed_modules):
            return model(tokens, cache=step_caches)
    rows = mx.array(list(logit_rows), dtype=mx.int32)
    with route_attention(routed_modules), head_on_rows(model, rows) as selected:
        logits = model(tokens, cache=step_caches)
    return logits if selected else logits[rows]


class _Rows(nn.Module):
    """``body``, its output cut to rows ``rows``; its other attributes are ``body``'s."""

    def __init__(self, body: nn.Module, rows: mx.array):
        super().__init__()
        self.body = body
        self.rows = rows

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self.body(*args, **kwargs)[self.rows]

    def __getattr__(self, name: str) -> Any:
        if name in ("body", "rows"):
            return super().__getattr__(name)
        return getattr(self.body, name)


@contextmanager
def head_on_rows(model: nn.Module, rows: mx.array) -> Iterator[bool]:
    """While active, the model body (mlx-lm's ``model.model``, whose output its ``__call__``
    hands to the head) returns only the hidden states of ``rows``, so that the head (the
    vocabulary projection, the costliest matmul of a chunk) runs on those alone. Yields whether
    the model has such a body; without one, nothing changes."""
    body = getattr(model, "model", None)
    if not isinstance(body, nn.Module):
        yield False
        return
    model.model = _Rows(body, rows)
    try:
        yield True
    finally:
        model.model = body


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
    """While active, ``StepLayerCache`` layers of these modules attend with our attention
    path."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention

    def routed(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, StepLayerCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if mask is not None:
            raise ValueError("[BatchedDecoder] explicit attention masks are not supported")
        return cache.attend(queries, keys, values, scale, sinks)

    for python_module in python_modules:
        python_module.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        for python_module in python_modules:
            python_module.scaled_dot_product_attention = original
