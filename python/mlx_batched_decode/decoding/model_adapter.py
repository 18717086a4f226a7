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
mlx-lm's original. Two kinds of layer take more: multi-head latent attention layers keep one
latent row per token and attend in latent space (``latent_attention``), and layers that attend
by hand (Gemma 2's soft-capped attention) have their class's ``__call__`` replaced for the step
(``gemma2_attention``). The model's code is not changed. mlx-lm is imported lazily: the core
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
from .gemma2_attention import STEP_CALLS
from .latent_attention import LatentSpec, latent_queries, rope_identity


class StepLayerCache:
    """The ``cache`` one layer of an mlx-lm model sees during one batched decode step.

    Args:
        attention: the decode attention path.
        context: the step's context, shared by every layer.
        layer: the layer's index into ``context.layer_caches``.
        window: the layer's sliding window (keys a token attends, itself included), ``None``
            for full attention.
        latent: the widths of a multi-head latent attention layer (``latent_attention``),
            ``None`` for any other.
    """

    def __init__(
        self,
        attention: DecodeAttention,
        context: BatchedDecodeContext,
        layer: int,
        window: Optional[int] = None,
        latent: Optional[LatentSpec] = None,
    ):
        self.attention = attention
        self.context = context
        self.layer = layer
        self.window = window
        self.latent = latent
        self.new_keys_values: Optional[tuple[mx.array, mx.array]] = None
        self.latent_keys: Optional[mx.array] = None

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
        if self.latent is not None:
            return self._update_latent(keys, values)
        # Kept for attend: a quantized cache's first prompt chunks attend them unquantized.
        self.new_keys_values = (keys, values)
        return self.attention.update(self.context, self.layer, keys, values)

    def _update_latent(self, latent: mx.array, rope_keys: mx.array) -> tuple[mx.array, mx.array]:
        """An MLA layer's ``[N, 1, L, r]`` latent and ``[N, 1, L, R]`` rope keys -> the
        ``[N, 1, max_len, r + R]`` keys it attends (as its ``kv_latent``) and the rope identity
        in place of its rope keys (``latent_attention``)."""
        spec = self.latent
        if latent.shape[-1] != spec.latent_dim or rope_keys.shape[-1] != spec.rope_dim:
            raise ValueError(
                f"[BatchedDecoder] MLA layer {self.layer} writes a latent of "
                f"{latent.shape[-1]} and rope keys of {rope_keys.shape[-1]}, expected "
                f"{spec.latent_dim} and {spec.rope_dim}"
            )
        keys = mx.concatenate([latent, rope_keys.astype(latent.dtype)], axis=-1)
        # As update_and_fetch keeps them: the rows and their latent, the values.
        self.new_keys_values = (keys, latent)
        self.latent_keys, _ = self.attention.update(self.context, self.layer, keys, None)
        return self.latent_keys, rope_identity(spec.rope_dim, latent.dtype)

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
        softcap: Optional[float] = None,
    ) -> mx.array:
        """``queries [B, H_q, L, D]`` -> ``[B, H_q, L, Dv]``; ``sinks`` ``[H_q]`` or ``None``,
        ``softcap`` as the op's."""
        return self.attention.attend(
            self.context,
            queries,
            keys,
            values,
            scale=scale,
            window=self.window,
            sinks=sinks,
            softcap=softcap,
            new_keys_values=self.new_keys_values,
        )

    def attend_latent(
        self, queries: mx.array, keys: mx.array, rope_scores: Optional[mx.array], scale: float
    ) -> mx.array:
        """An MLA layer's routed call: absorbed ``queries [N, H, 1, r]`` over the ``keys`` its
        ``update_and_fetch`` returned, ``rope_scores`` (the call's ``mask``) ``[N, H, 1, R]``
        -> ``[N, H, 1, r]``, one KV head read once for all H query heads."""
        if keys is not self.latent_keys:
            raise ValueError(
                f"[BatchedDecoder] MLA layer {self.layer} attends keys other than the latent "
                "rows its cache returned"
            )
        queries = latent_queries(self.latent, queries, rope_scores, scale)
        return self.attention.attend_latent(
            self.context, queries, keys, self.latent.latent_dim, scale=1.0, window=self.window,
            new_keys_values=self.new_keys_values,
        )


def routed_forward(
    model: nn.Module,
    tokens: mx.array,
    context: BatchedDecodeContext,
    attentions: Sequence[DecodeAttention],
    windows: list[Optional[int]],
    routed_modules: list[Any],
    logit_rows: Sequence[int],
    latents: Sequence[Optional[LatentSpec]],
) -> mx.array:
    """One packed step's forward pass of ``model``: int32 ``tokens [N]`` (one per row, as the
    packed ``context`` places them) -> the logits ``[R, V]`` (lazy) of rows ``logit_rows``,
    layer ``i`` attending through ``attentions[i]`` within ``windows[i]`` (in latent space with
    ``latents[i]``), every layer reading the one ``context``. The model's head runs on those
    rows' hidden states alone (``head_on_rows``)."""
    step_caches = [
        StepLayerCache(attention, context, layer, window, latent)
        for layer, (attention, window, latent) in enumerate(zip(attentions, windows, latents))
    ]
    rows = mx.array(list(logit_rows), dtype=mx.int32)
    with route_attention(routed_modules), head_on_rows(model, rows) as selected:
        logits = model(tokens[:, None], cache=step_caches)[:, 0]
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
    the model has such a body; without one, nothing changes. A wrapper whose ``model`` is a
    read-only property (Kimi K2.5's, over its ``language_model``) has it set on the owner."""
    owner = model
    while isinstance(getattr(type(owner), "model", None), property):
        owner = getattr(owner, "language_model", None)
    body = getattr(owner, "model", None)
    if not isinstance(body, nn.Module):
        yield False
        return
    owner.model = _Rows(body, rows)
    try:
        yield True
    finally:
        owner.model = body


def mlx_lm_attention_modules(model: nn.Module) -> list[Any]:
    """The Python modules of ``model``'s layers that call mlx-lm's
    ``scaled_dot_product_attention`` or whose attention class has a step forward pass
    (``STEP_CALLS``)."""
    from mlx_lm.models import base

    found = {}
    for _, module in model.named_modules():
        python_module = sys.modules.get(type(module).__module__)
        if python_module is not None and (
            python_module.__name__ in STEP_CALLS
            or getattr(python_module, "scaled_dot_product_attention", None)
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
    path: their ``scaled_dot_product_attention`` name is rebound, or their attention class's
    ``__call__`` replaced by its step forward pass (``STEP_CALLS``)."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention

    def routed(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, StepLayerCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if cache.latent is not None and sinks is None:
            return cache.attend_latent(queries, keys, mask, scale)
        if mask is not None:
            raise ValueError("[BatchedDecoder] explicit attention masks are not supported")
        return cache.attend(queries, keys, values, scale, sinks)

    replaced = []
    for python_module in python_modules:
        if python_module.__name__ in STEP_CALLS:
            class_name, step = STEP_CALLS[python_module.__name__]
            cls = getattr(python_module, class_name)
            replaced.append((cls, cls.__call__))
            cls.__call__ = _step_call(cls.__call__, step)
        else:
            python_module.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        for python_module in python_modules:
            if python_module.__name__ not in STEP_CALLS:
                python_module.scaled_dot_product_attention = original
        for cls, call in replaced:
            cls.__call__ = call


def _step_call(original: Any, step: Any) -> Any:
    """An attention class's ``__call__`` that runs ``step`` for a ``StepLayerCache`` and
    ``original`` for every other cache."""

    def call(self, x, mask=None, cache=None):
        if isinstance(cache, StepLayerCache):
            return step(self, x, mask, cache)
        return original(self, x, mask=mask, cache=cache)

    return call
