"""mlx-lm's own prefill, the reference the decoder's cached keys/values are checked against.

A prompt runs through the unchanged model with the caches ``mlx_lm.models.cache.
make_prompt_cache`` builds for it, exactly as mlx-lm's ``generate_step`` does. A rotating cache
keeps only the last tokens, in rotated order; ``layer_keys_values`` puts them back in temporal
order at their absolute positions, so every layer's keys/values come out as one
``[1, H_kv, P, D]`` array per prompt of P tokens.

Dimension legend: H_kv = key/value heads, P = prefilled tokens, D = head dimension.
"""

from typing import Any

import mlx.core as mx

from mlx_batched_decode.decoding.mlx_lm_caches import prompt_caches


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


def prefill(model: Any, tokens: list[int], step_size: int) -> list[tuple[mx.array, mx.array]]:
    """Run ``tokens`` through the model with mlx-lm's own caches, ``step_size`` tokens at a time.

    Returns each layer's keys and values ``[1, H_kv, len(tokens), D]``
    (``layer_keys_values``). Like mlx-lm's ``generate_step``, callers prefill all but the last
    prompt token, which then enters decoding.
    """
    caches = prompt_caches(model)
    for start in range(0, len(tokens), step_size):
        model(mx.array(tokens[start : start + step_size], dtype=mx.int32)[None], cache=caches)
        mx.eval([c.state for c in caches])
    return [layer_keys_values(c) for c in caches]
