"""Prefill with mlx-lm's own caches, and the attention window of every layer they imply.

A prompt runs through the unchanged model with the caches ``mlx_lm.models.cache.
make_prompt_cache`` builds for it, exactly as mlx-lm's ``generate_step`` does: ``KVCache`` for
full-attention layers and ``RotatingKVCache(max_size=window)`` for sliding-window layers, whose
masks mlx-lm builds itself. A rotating cache keeps only the last tokens, in rotated order;
``layer_keys_values`` puts them back in temporal order at their absolute positions, so every
layer's keys/values come out as one ``[1, H_kv, P, D]`` array per prompt of P tokens. The seed
path prefills its prompts this way; the zero-copy paths feed prompts through the decoder's
packed steps. mlx-lm is imported lazily: the core package does not need it.

Dimension legend: H_kv = key/value heads, P = prefilled tokens, D = head dimension.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

def prompt_caches(model: nn.Module) -> list[Any]:
    """mlx-lm's own per-layer caches for one prompt; ValueError naming any kind we cannot serve.

    Served: ``KVCache`` (full attention) and ``RotatingKVCache`` with ``keep == 0`` (a sliding
    window of ``max_size`` tokens, the token itself included).
    """
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    for layer, cache in enumerate(caches):
        if type(cache) is RotatingKVCache and cache.keep != 0:
            raise ValueError(
                f"[BatchedDecoder] layer {layer} uses a RotatingKVCache that keeps its first "
                f"{cache.keep} tokens forever: only plain sliding windows (keep=0) are supported"
            )
        if type(cache) not in (KVCache, RotatingKVCache):
            raise ValueError(
                f"[BatchedDecoder] layer {layer} uses mlx-lm's {type(cache).__name__}: only "
                "KVCache (full attention) and RotatingKVCache (sliding window) layers are "
                "supported (no state-space, quantized or other caches)"
            )
    return caches


def layer_windows(model: nn.Module) -> list[Optional[int]]:
    """Each layer's attention window: ``None`` for full attention, else the number of keys a
    decode token attends, itself included (its ``RotatingKVCache``'s ``max_size``)."""
    from mlx_lm.models.cache import RotatingKVCache

    return [
        cache.max_size if isinstance(cache, RotatingKVCache) else None
        for cache in prompt_caches(model)
    ]


def layer_keys_values(cache: Any) -> tuple[mx.array, mx.array]:
    """A prefilled mlx-lm cache's keys and values ``[1, H_kv, offset, D]`` in temporal order.

    Positions a ``RotatingKVCache`` no longer holds are zeros: they are older than its window,
    which covers every later token's window, so attention never reads them.
    """
    from mlx_lm.models.cache import RotatingKVCache

    if not isinstance(cache, RotatingKVCache):
        return cache.keys[:, :, : cache.offset], cache.values[:, :, : cache.offset]
    keys, values, offset, _, _, idx = cache.state

    def temporal(v: mx.array) -> mx.array:
        # As mlx-lm's RotatingKVCache._temporal_order with keep == 0: a buffer written past its
        # end wrapped around, and its oldest token sits at idx.
        if idx == v.shape[2]:
            held = v
        elif idx < offset:
            held = mx.concatenate([v[:, :, idx:], v[:, :, :idx]], axis=2)
        else:
            held = v[:, :, :idx]
        return mx.pad(held, [(0, 0), (0, 0), (offset - held.shape[2], 0), (0, 0)])

    return temporal(keys), temporal(values)


def prefill(
    model: nn.Module,
    tokens: list[int],
    step_size: int,
    prefix: Optional[list[tuple[mx.array, mx.array]]] = None,
) -> list[tuple[mx.array, mx.array]]:
    """Run ``tokens`` through the model with mlx-lm's own caches, ``step_size`` tokens at a time.

    ``prefix``: each layer's keys/values ``[1, H_kv, C, D]`` of C tokens already computed
    (a cached prefix): they enter the caches first, as an earlier prefill chunk would, and
    ``tokens`` sit at positions ``C ..``.

    Returns each layer's keys and values ``[1, H_kv, C + len(tokens), D]``
    (``layer_keys_values``). Like mlx-lm's ``generate_step``, callers prefill all but the last
    prompt token, which then enters decoding.
    """
    caches = prompt_caches(model)
    if prefix is not None:
        for cache, (keys, values) in zip(caches, prefix):
            cache.update_and_fetch(keys, values)
    for start in range(0, len(tokens), step_size):
        model(mx.array(tokens[start : start + step_size], dtype=mx.int32)[None], cache=caches)
        mx.eval([c.state for c in caches])
    return [layer_keys_values(c) for c in caches]
