"""``DecodeAttention``: the interface of every decode attention path (see the package docstring).

Shapes use the dimension legend of the package docstring (``mlx_batched_decode.attention``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Optional

import mlx.core as mx

from ..caches.context import BatchedDecodeContext


class AttendOptions(NamedTuple):
    """What ``DecodeAttention.attend`` takes besides the arrays, named as the fused ops name it
    (``**options._asdict()`` passes it on)."""

    scale: Optional[float] = None
    window: Optional[int] = None
    sinks: Optional[mx.array] = None
    softcap: Optional[float] = None
    query_starts: Optional[mx.array] = None


class DecodeAttention(ABC):
    """A decode attention path: ``update`` writes the step's new K/V into the layer's cache and
    returns what attention reads, ``attend`` computes attention over it."""

    @abstractmethod
    def update(
        self,
        context: BatchedDecodeContext,
        layer: int,
        keys: mx.array,
        values: Optional[mx.array],
    ) -> tuple[Any, Any]:
        """New ``[B, H_kv, L, D]`` keys/values -> the ``[B, H_kv, T, D]`` keys/values to attend
        (on the quantized path, their ``(packed, scales, biases)`` triples). ``values=None``:
        the layer keeps no values (multi-head latent attention, ``attend_latent``), and
        ``None`` comes back in their place."""

    def attend(
        self,
        context: BatchedDecodeContext,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: Optional[float] = None,
        window: Optional[int] = None,
        sinks: Optional[mx.array] = None,
        softcap: Optional[float] = None,
        new_keys_values: Optional[tuple[mx.array, mx.array]] = None,
    ) -> mx.array:
        """``queries [B, H_q, L, D]`` over what ``update`` returned -> ``[B, H_q, L, Dv]``;
        ``window`` (int >= 1) bounds each row to its last keys, ``sinks`` is ``[H_q]`` float,
        ``softcap`` (> 0) caps each score ``s`` at ``softcap * tanh(s / softcap)``.
        With a packed context the queries are its N tokens, ``[N, H_q, 1, D]``, and the op
        takes them packed with the context's ``query_starts`` (or, when every request feeds L
        of them, as ``[B, H_q, L, D]``). ``new_keys_values``: the
        step's new keys/values as ``update`` got them, which only the quantized path reads
        (``QuantizedSlotAttention``)."""
        options = AttendOptions(scale, window, sinks, softcap)
        if not context.packed:
            return self._attend(context, queries, keys, values, options)
        n, heads, _, dim = queries.shape
        rows = context.uniform_query_len
        if rows is not None:
            # Every request feeds L tokens: the plain [B, H_q, L, D] layout, no starts.
            batched = queries.reshape(n // rows, rows, heads, dim).swapaxes(1, 2)
            out = self._attend(context, batched, keys, values, options)
            return out.swapaxes(1, 2).reshape(n, heads, 1, -1)
        options = options._replace(query_starts=context.query_starts)
        return self._attend(context, queries[:, :, 0], keys, values, options)[:, :, None]

    def attend_latent(
        self,
        context: BatchedDecodeContext,
        queries: mx.array,
        keys: Any,
        latent_dim: int,
        **options: Any,
    ) -> mx.array:
        """Multi-head latent attention: ``queries [B, H_q, L, D]`` over the one-head keys
        ``update`` returned for ``values=None``, whose first ``latent_dim`` columns are the
        values (MLA's latent, read in place) -> ``[B, H_q, L, latent_dim]``; ``options`` are
        ``attend``'s keywords."""
        return self.attend(context, queries, keys, keys[..., :latent_dim], **options)

    @abstractmethod
    def _attend(
        self,
        context: BatchedDecodeContext,
        queries: mx.array,
        keys: Any,
        values: Any,
        options: AttendOptions,
    ) -> mx.array:
        """This path's ``attend``: the options in one tuple, as the fused ops take them."""

    def __call__(
        self,
        context: BatchedDecodeContext,
        layer: int,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        **options: Any,
    ) -> mx.array:
        """One layer's decode attention: ``queries [B, H_q, L, D]``, new ``keys``/``values``
        ``[B, H_kv, L, D]`` (RoPE already applied) -> ``[B, H_q, L, D]``; ``options`` are
        ``attend``'s keywords (``scale``, ``window``, ``sinks``, ``softcap``)."""
        all_keys, all_values = self.update(context, layer, keys, values)
        return self.attend(context, queries, all_keys, all_values, **options)
