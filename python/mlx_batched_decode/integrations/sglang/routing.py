"""Which of SGLang's decode attention calls the op serves, and which views of the caches it reads.

SGLang's ``MLXAttentionWrapper._batched_decode`` runs once per attention layer and decode step:
each request's new token goes into that request's own cache of the layer (``write_token``),
then SGLang attends what ``get_kv(window)`` returns, padded to the longest and concatenated.
``ragged_decode_attention`` reads the caches' buffers in place instead:

- every cache of the layer a ``ContiguousAttentionKVCache`` (full-attention layers): ``keys`` /
  ``values`` are each request's whole ``[1, H_kv, capacity, D]`` buffer after the step's write,
  and ``valid_lens`` is the step's ``BatchedDecodeContext.valid_lens`` (``seq_lens + 1``, built
  once per step by its ``__post_init__``): the tokens each buffer holds. Nothing is sliced, and
  a buffer that grew during the write is read where it now lives;
- a layer with ``WindowedAttentionKVCache`` caches (sliding-window layers): such a buffer drops
  old tokens, so its positions are not the context's absolute ones; the op reads the
  ``get_kv(None)`` views (every token it holds, in temporal order) with their own lengths;
- the wrapper's ``_window_size`` reaches the op as ``window``: each request then attends its
  last ``window`` keys, the ones ``get_kv(window)`` returns; its ``_scale`` and ``_sinks`` too.

Heads of a width the op does not take (D > 512, or a ``q_proj`` output SGLang does not split),
dtypes it does not take (or that differ between the queries, the new keys and a cache) and
caches of other kinds stay on SGLang's path. ``PluginStats`` counts every call by where it ran.

Dimension legend: B = requests in the step, H_q = query heads, H_kv = key/value heads,
D = head dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx

PREFIX = "[mlx_batched_decode.sglang]"
_OP_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_MAX_HEAD_DIM = 512
CONTIGUOUS = "contiguous"
WINDOWED = "windowed"


@dataclass
class PluginStats:
    """Calls of SGLang's ``MLXAttentionWrapper._batched_decode`` (one per attention layer and
    decode step) since ``enable()``, by where they ran. Prefill does not call it.

    Through ``ragged_decode_attention``:
        contiguous: layers whose requests all hold a ``ContiguousAttentionKVCache``.
        windowed: layers holding ``WindowedAttentionKVCache`` caches (sliding-window layers).

    On SGLang's path:
        unsupported_shape: head dims or dtypes the op does not take.
        other: caches of every other kind.
    """

    contiguous: int = 0
    windowed: int = 0
    unsupported_shape: int = 0
    other: int = 0

    @property
    def served(self) -> int:
        """Calls that ran through ``ragged_decode_attention``."""
        return self.contiguous + self.windowed


class DecodeRoutes:
    """Decides, per call, whether the op serves it, and gives the op its cache views.

    Args:
        contiguous: SGLang's ``ContiguousAttentionKVCache`` class.
        windowed: SGLang's ``WindowedAttentionKVCache`` class.
    """

    def __init__(self, contiguous: type, windowed: type) -> None:
        self.contiguous = contiguous
        self.windowed = windowed
        self.stats = PluginStats()

    def route(
        self,
        layer_caches: Sequence[Any],
        q_proj_output: mx.array,
        keys: mx.array,
        n_heads: int,
        head_dim: int,
    ) -> Optional[str]:
        """``CONTIGUOUS`` or ``WINDOWED`` for the op, ``None`` for SGLang's path (counted).

        ``q_proj_output``: ``[B, 1, H_q * D]`` (or ``2 * H_q * D`` with a gate);
        ``keys``: the step's new keys ``[B, 1, H_kv * D]``, before any norm.
        """
        stats = self.stats
        route = CONTIGUOUS
        for cache in layer_caches:
            if isinstance(cache, self.windowed):
                route = WINDOWED
            elif not isinstance(cache, self.contiguous):
                stats.other += 1
                return None
        dtype = q_proj_output.dtype
        if (
            not 1 <= head_dim <= _MAX_HEAD_DIM
            or q_proj_output.shape[-1] not in (n_heads * head_dim, 2 * n_heads * head_dim)
            or dtype not in _OP_DTYPES
            or keys.dtype != dtype
            # A fresh windowed cache allocates its buffer in the new keys' dtype.
            or any(getattr(cache.keys, "dtype", dtype) != dtype for cache in layer_caches)
        ):
            stats.unsupported_shape += 1
            return None
        if route == CONTIGUOUS:
            stats.contiguous += 1
        else:
            stats.windowed += 1
        return route

    @staticmethod
    def views(
        layer_caches: Sequence[Any], route: str, ctx: Any
    ) -> tuple[list[mx.array], list[mx.array], Optional[mx.array]]:
        """``(keys, values, valid_lens)`` for the op, read after the step's writes: B arrays
        ``[1, H_kv, T_b, D]`` each, and int32 ``[B]`` (``None``: each T_b)."""
        if route == CONTIGUOUS:
            return (
                [cache.keys for cache in layer_caches],
                [cache.values for cache in layer_caches],
                ctx.valid_lens,
            )
        held = [cache.get_kv(None) for cache in layer_caches]
        return [k for k, _ in held], [v for _, v in held], None
