"""Multi-head latent attention (DeepSeek-V3, Kimi K2 / K2.5, GLM-4.7-Flash) in latent space.

mlx-lm's MLA layer (``deepseek_v3.DeepseekV3Attention``, which Kimi K2 / K2.5 run too, and
``glm4_moe_lite.Glm4MoeLiteAttention``) decodes one token per request (L = 1) as::

    kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)  # [B, 1, T, r], [B, 1, T, R]
    pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)      # the rope part of the scores
    q_abs = self.embed_q(q_nope)                                  # [B, H, 1, r]
    out = scaled_dot_product_attention(q_abs, kv_latent, kv_latent, cache=cache,
                                       scale=self.scale, mask=pe_scores)
    out = self.unembed_out(out)

so its scores are ``scale * q_abs . latent + scale * q_pe . k_pe``: one attention of ``r + R``
wide queries ``[q_abs * scale, q_pe * scale]`` (``latent_queries``) over one KV head of rows
``[latent, k_pe]`` with scale 1, the values being the rows' first r columns, read in place: one
call reads each latent row once for all H query heads. Each token's ``r + R`` values are kept
once, in one row. Two ways reach that call:

- The decoder's step cache (``step_cache``) runs mlx-lm's own ``__call__``: its
  ``update_and_fetch`` concatenates the pair (the only copy) and hands the model the ``R x R``
  identity (``rope_identity``) for ``k_pe``, so that the model's own matmul yields
  ``pe_scores = q_pe * scale``, which reaches the routed attention as its ``mask``. Packed steps
  show the model one token per row, so the absorbed branch is the only one it takes.
- The plug-in cannot change mlx-lm's batch caches, so it replaces the layer's ``__call__``
  (``latent_call``): the layer's cache keeps the rows as its keys (and zero-wide values: the
  bytes of mlx-lm's pair), a decode step the router serves attends them, and every other call
  (prefill, single-request caches) runs mlx-lm's code on the two halves of the rows.

Dimension legend: B = requests (N = tokens of a packed step), H = query heads, L = new tokens
per request, T = positions, r = latent (``kv_lora_rank``), R = rope dims
(``qk_rope_head_dim``), E = hidden size.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from .standard import RoutedAttention

# mlx-lm's modules whose MLA layer has exactly the decode path of the module docstring
# (mlx-lm maps kimi_k2 onto deepseek_v3; kimi_k25 wraps its model).
LATENT_ATTENTION_MODULES = ("mlx_lm.models.deepseek_v3", "mlx_lm.models.glm4_moe_lite")


class LatentSpec(NamedTuple):
    """An MLA layer's widths: ``latent_dim`` (r), the values; ``rope_dim`` (R)."""

    latent_dim: int
    rope_dim: int

    @property
    def key_dim(self) -> int:
        """r + R: the one key row a token keeps."""
        return self.latent_dim + self.rope_dim


def latent_specs(model: nn.Module) -> list[Optional[LatentSpec]]:
    """Each layer's ``LatentSpec`` when its attention is one of ``LATENT_ATTENTION_MODULES``'
    MLA layers, else ``None``."""
    specs = []
    for layer in model.layers:
        attention = getattr(layer, "self_attn", None)
        if type(attention).__module__ in LATENT_ATTENTION_MODULES and hasattr(attention, "embed_q"):
            specs.append(LatentSpec(attention.kv_lora_rank, attention.qk_rope_head_dim))
        else:
            specs.append(None)
    return specs


_IDENTITIES: dict[tuple[int, mx.Dtype], mx.array] = {}


def rope_identity(rope_dim: int, dtype: mx.Dtype) -> mx.array:
    """The ``[1, 1, R, R]`` identity the step cache hands the model as its rope keys (module
    docstring): one array per width and dtype, shared by every layer and step."""
    identity = _IDENTITIES.get((rope_dim, dtype))
    if identity is None:
        identity = _IDENTITIES[(rope_dim, dtype)] = mx.eye(rope_dim, dtype=dtype)[None, None]
    return identity


def latent_queries(q_abs: mx.array, rope_scores: mx.array, scale: float) -> mx.array:
    """Absorbed queries ``q_abs [N, H, 1, r]`` and the rope half ``rope_scores = q_pe * scale
    [N, H, 1, R]`` -> the ``[N, H, 1, r + R]`` queries that attend the rows with scale 1."""
    # In the model's dtype, as mlx-lm's attention scales its queries.
    return mx.concatenate([q_abs * scale, rope_scores.astype(q_abs.dtype)], axis=-1)


def latent_call(router: RoutedAttention, original: Callable) -> Callable:
    """The MLA layer's ``__call__`` that keeps ``[latent, k_pe]`` rows in mlx-lm's plain and
    batch ``KVCache``/``RotatingKVCache`` and decodes through ``router``; ``original`` (mlx-lm's
    own) for every other cache (quantized ones, ...)."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

    caches = (KVCache, RotatingKVCache, BatchKVCache, BatchRotatingKVCache)

    def __call__(
        self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None
    ) -> mx.array:
        """``x [B, L, E]`` -> ``[B, L, E]``, as mlx-lm's; ``mask`` bool ``[B, 1, L, T]``,
        ``[L, T]`` or ``None``."""
        if type(cache) not in caches:
            return original(self, x, mask=mask, cache=cache)
        B, L, _ = x.shape
        r = self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [r], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)
        q_pe = self.rope(q_pe, cache.offset)
        k_pe = self.rope(k_pe, cache.offset)

        _check_rows(router, cache, r + self.qk_rope_head_dim)
        rows, _ = cache.update_and_fetch(
            mx.concatenate([latent, k_pe], axis=-1), mx.zeros((B, 1, L, 0), latent.dtype)
        )
        latent, k_pe = rows[..., :r], rows[..., r:]
        rope_scores = q_pe * self.scale
        attention = router
        if L == 1:
            q_nope = self.embed_q(q_nope)
            queries = latent_queries(q_nope, rope_scores, self.scale)
            output = router.serve(queries, rows, latent, cache, 1.0, mask)
            if output is not None:
                return _finish(self, self.unembed_out(output), B, L)
            # Counted by the router already.
            attention = router.original
            keys = values = latent
        else:
            keys = self.embed_q(latent, transpose=False)
            values = self.unembed_out(latent)
        # mlx-lm's code from here: the rope scores as an additive mask.
        pe_scores = rope_scores @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            floor = mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
            pe_scores = mx.where(mask, pe_scores, floor)
        output = attention(q_nope, keys, values, cache=cache, scale=self.scale, mask=pe_scores)
        if L == 1:
            output = self.unembed_out(output)
        return _finish(self, output, B, L)

    return __call__


def _check_rows(router: RoutedAttention, cache: Any, width: int) -> None:
    """ValueError unless ``cache`` is empty or holds ``width``-wide ``[latent, k_pe]`` rows."""
    keys = getattr(cache, "keys", None)
    if keys is not None and keys.shape[-1] != width:
        raise ValueError(
            f"{router.prefix} an MLA layer's {type(cache).__name__} holds keys {keys.shape[-1]} "
            f"wide, not the {width}-wide latent and rope rows the plug-in keeps: it was filled "
            "while the plug-in was off; start its request again"
        )


def _finish(layer: Any, output: mx.array, batch: int, rows: int) -> mx.array:
    """The heads' ``[B, H, L, v]`` outputs through the layer's output projection."""
    return layer.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, rows, -1))
