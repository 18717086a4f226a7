"""One packed decode step's forward pass through an unchanged mlx-lm model.

Every layer gets a ``StepLayerCache`` over the step's one context; while the model runs, its
modules' attention is routed to those caches (``route_attention``: the ``step_patches`` of
``patches``, undone after the step, so mlx-lm's own decoding between steps is untouched), and
the model's head runs on the rows whose logits are asked for alone (``head_on_rows``). mlx-lm is
imported lazily: the core package does not need it.

Dimension legend: N = tokens of a packed step, R = rows whose logits are returned,
V = vocabulary size.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..attention.base import DecodeAttention
from ..caches.context import BatchedDecodeContext
from .mla import LatentSpec
from .patches import apply, step_patches, undo
from .step_cache import StepAttention, StepLayerCache


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
    ``latents[i]``), every layer reading the one ``context``; ``routed_modules`` as
    ``mlx_lm_attention_modules`` lists them. The model's head runs on those rows' hidden states
    alone (``head_on_rows``)."""
    step_caches = [
        StepLayerCache(attention, context, layer, window, latent)
        for layer, (attention, window, latent) in enumerate(zip(attentions, windows, latents))
    ]
    rows = mx.array(list(logit_rows), dtype=mx.int32)
    with route_attention(routed_modules), head_on_rows(model, rows) as selected:
        logits = model(tokens[:, None], cache=step_caches)[:, 0]
    return logits if selected else logits[rows]


@contextmanager
def route_attention(python_modules: list[Any]) -> Iterator[None]:
    """While active, ``StepLayerCache`` layers of these modules attend with our attention
    path (``step_patches``); every other cache goes to mlx-lm's code."""
    from mlx_lm.models import base

    replaced = apply(step_patches(StepAttention(base.scaled_dot_product_attention), python_modules))
    try:
        yield
    finally:
        undo(replaced)


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
