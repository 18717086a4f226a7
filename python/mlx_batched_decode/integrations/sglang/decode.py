"""The ``MLXAttentionWrapper._batched_decode`` that SGLang's attention layers run while enabled.

It does what SGLang 0.5.23's method does, through the same objects, except the attention: the
wrapped module's ``q_proj``/``k_proj``/``v_proj``, the split of a gated ``q_proj`` output,
``q_norm``/``k_norm``, RoPE at the context's ``offsets`` (the wrapper's ``_rope_custom_aot``
when the context carries SGLang's AOT RoPE kernel and the layer is full-attention, the module's
``rope`` otherwise), each request's ``write_token`` into its cache, the sigmoid gate and
``o_proj``. Where SGLang then slices, pads, concatenates, builds a mask and calls
``mx.fast.scaled_dot_product_attention``, it makes one ``ragged_decode_attention`` call on the
requests' own buffers (``routing`` says which views and lengths). The context's per-step fields
(``offsets``, ``valid_lens``) are read as its ``__post_init__`` built them; nothing per step is
recomputed and nothing is read back from the device. Calls the op does not serve run SGLang's
method itself.

Dimension legend: B = requests in the step, H_q = query heads, H_kv = key/value heads,
D = head dimension.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import mlx.core as mx

import mlx_batched_decode

from .routing import DecodeRoutes


def ragged_batched_decode(original: Callable, routes: DecodeRoutes) -> Callable:
    """SGLang's ``_batched_decode`` (``original``) with its attention on
    ``ragged_decode_attention``; ``routes`` decides which calls the op serves."""

    @functools.wraps(original)
    def _batched_decode(self: Any, x: mx.array, ctx: Any) -> mx.array:
        """``x [B, 1, hidden]`` -> ``[B, 1, hidden]``: one decode step of this attention layer
        for the B requests of ``ctx`` (SGLang's ``BatchedDecodeContext``)."""
        inner = self._inner
        B = ctx.batch_size
        n_heads = self._n_heads
        n_kv_heads = self._n_kv_heads

        q_proj_output = inner.q_proj(x)
        keys = inner.k_proj(x)
        values = inner.v_proj(x)
        head_dim = self._head_dim
        if head_dim is None:
            head_dim = keys.shape[-1] // n_kv_heads

        cache_idx = ctx.attention_pool_index_by_layer[self._layer_idx]
        layer_caches = ctx.attention_layer_caches[cache_idx]
        route = routes.route(layer_caches, q_proj_output, keys, n_heads, head_dim)
        if route is None:
            # The projections above are lazy and now unused, so they never run.
            return original(self, x, ctx)

        gate = None
        if q_proj_output.shape[-1] == n_heads * head_dim:
            queries = q_proj_output.reshape(B, 1, n_heads, head_dim)
        else:
            queries, gate = mx.split(q_proj_output.reshape(B, 1, n_heads, 2 * head_dim), 2, axis=-1)
            gate = gate.reshape(B, 1, n_heads * head_dim)
        keys = keys.reshape(B, 1, n_kv_heads, head_dim)
        values = values.reshape(B, 1, n_kv_heads, head_dim)
        if self._has_q_norm:
            queries = inner.q_norm(queries)
        if self._has_k_norm:
            keys = inner.k_norm(keys)
        queries = queries.transpose(0, 2, 1, 3)
        keys = keys.transpose(0, 2, 1, 3)
        values = values.transpose(0, 2, 1, 3)

        window = self._window_size
        if ctx.aot.rope is not None and window is None:
            # SGLang's fused RoPE also scatters this layer's keys/values into its shared pool.
            queries, keys = self._rope_custom_aot(
                queries,
                keys,
                values,
                ctx.offsets,
                ctx.full_kv_pool_index_by_layer[self._layer_idx],
                ctx.aot.rope,
            )
        else:
            queries = inner.rope(queries, offset=ctx.offsets)
            keys = inner.rope(keys, offset=ctx.offsets)

        for i, cache in enumerate(layer_caches):
            cache.write_token(keys[i : i + 1], values[i : i + 1])
        cached_keys, cached_values, valid_lens = routes.views(layer_caches, route, ctx)
        output = mlx_batched_decode.ragged_decode_attention(
            queries,
            cached_keys,
            cached_values,
            valid_lens,
            scale=self._scale,
            window=window,
            sinks=self._sinks,
        )

        output = output.transpose(0, 2, 1, 3).reshape(B, 1, -1)
        if gate is not None:
            output = output * mx.sigmoid(gate)
        return inner.o_proj(output)

    return _batched_decode
