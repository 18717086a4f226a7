"""The caches mlx-lm builds for a model, and the attention window of every layer they imply.

``mlx_lm.models.cache.make_prompt_cache`` gives each layer the cache mlx-lm's ``generate_step``
uses: ``KVCache`` for full-attention layers and ``RotatingKVCache(max_size=window)`` for
sliding-window layers. ``BatchedDecoder`` reads from them which layers it serves and each one's
window. mlx-lm is imported lazily: the core package does not need it.
"""

from __future__ import annotations

from typing import Any, Optional

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
