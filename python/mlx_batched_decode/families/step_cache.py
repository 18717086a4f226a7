"""The decoder's step cache: what each layer of an unchanged mlx-lm model sees in one step.

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
goes to ``StepAttention``, the router the step puts in mlx-lm's place (``step_forward``), which
sends ``StepLayerCache`` layers to the cache's attention (with their sinks, Gemma 2's soft cap,
or in latent space for MLA layers: ``mla``) and every other cache to mlx-lm's original.

Dimension legend: B = requests in the step (N = tokens of a packed step), L = new tokens per
request, H_q = query heads, H_kv = key/value heads, T = key/value positions, D = head
dimension; for MLA layers H = query heads, r = latent, R = rope dims.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

from ..attention.base import DecodeAttention
from ..caches.context import BatchedDecodeContext
from .mla import LatentSpec, latent_queries, rope_identity
from .standard import RoutedAttention

PREFIX = "[BatchedDecoder]"


class StepLayerCache:
    """The ``cache`` one layer of an mlx-lm model sees during one batched decode step.

    Args:
        attention: the decode attention path.
        context: the step's context, shared by every layer.
        layer: the layer's index into ``context.layer_caches``.
        window: the layer's sliding window (keys a token attends, itself included), ``None``
            for full attention.
        latent: the widths of a multi-head latent attention layer (``mla``), ``None`` for any
            other.
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
        in place of its rope keys (``mla``)."""
        spec = self.latent
        if latent.shape[-1] != spec.latent_dim or rope_keys.shape[-1] != spec.rope_dim:
            raise ValueError(
                f"{PREFIX} MLA layer {self.layer} writes a latent of "
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
                f"{PREFIX} the model masks layer {self.layer} to a window of "
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
        ``update_and_fetch`` returned, ``rope_scores`` (the call's ``mask``, ``q_pe * scale``)
        ``[N, H, 1, R]`` -> ``[N, H, 1, r]``, one KV head read once for all H query heads."""
        spec = self.latent
        if keys is not self.latent_keys:
            raise ValueError(
                f"{PREFIX} MLA layer {self.layer} attends keys other than the latent "
                "rows its cache returned"
            )
        expected = (*queries.shape[:-1], spec.rope_dim)
        if queries.shape[-1] != spec.latent_dim or rope_scores is None or (
            rope_scores.shape != expected
        ):
            got = None if rope_scores is None else rope_scores.shape
            raise ValueError(
                f"{PREFIX} an MLA layer attends queries {queries.shape} with rope scores "
                f"{got}: expected queries of the latent width {spec.latent_dim} and rope scores "
                f"{expected}"
            )
        return self.attention.attend_latent(
            self.context, latent_queries(queries, rope_scores, scale), keys, spec.latent_dim,
            scale=1.0, window=self.window, new_keys_values=self.new_keys_values,
        )


class StepAttention(RoutedAttention):
    """The router of a decoder step: ``StepLayerCache`` layers attend through their cache,
    every other cache through mlx-lm's ``original``."""

    def __init__(self, original: Callable) -> None:
        super().__init__(original, PREFIX)

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
        """As ``RoutedAttention.serve``: a ``StepLayerCache``'s calls, which carry no mask but
        an MLA layer's rope scores."""
        if not isinstance(cache, StepLayerCache):
            return None
        if cache.latent is not None and sinks is None:
            return cache.attend_latent(queries, keys, mask, scale)
        if mask is not None:
            raise ValueError(f"{PREFIX} explicit attention masks are not supported")
        return cache.attend(queries, keys, values, scale, sinks, softcap)
