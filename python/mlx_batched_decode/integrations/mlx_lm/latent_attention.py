"""DeepSeek-V3's multi-head latent attention while the plug-in is enabled: decode on the op.

mlx-lm's MLA layer (``deepseek_v3.DeepseekV3Attention``, which Kimi K2 / K2.5 run too, and
``glm4_moe_lite.Glm4MoeLiteAttention``) keeps the latent ``[B, 1, T, r]`` as its cache's keys
and the rope keys ``[B, 1, T, R]`` as its values, and adds the rope scores ``(q_pe * scale) .
k_pe`` to its latent attention as a float mask. The op takes no score term and reads one key
array, so ``latent_attention`` replaces the layer's ``__call__``: while enabled, the layer's
cache keeps one ``r + R`` row per token, ``[latent, k_pe]``, as its keys (and zero-wide values:
the same bytes as mlx-lm's pair), and a decode step of a batch cache that the router serves
attends ``[q_abs * scale, q_pe * scale]`` over those rows with scale 1, the values being the
rows' first r columns read in place: one call reads each latent row once for all H query
heads. Every other call (prefill, single-request caches) runs mlx-lm's code on the two halves
of the rows. A cache filled while the plug-in was off (r-wide keys) is refused with a
``ValueError``; quantized and other caches keep mlx-lm's own ``__call__``.

Dimension legend: B = requests, H = query heads, L = new tokens per request, T = positions,
r = latent (``kv_lora_rank``), R = rope dims (``qk_rope_head_dim``), E = hidden size.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

import mlx_batched_decode

from .routing import PREFIX, DecodeRouter


def latent_attention(router: DecodeRouter, original: Callable, caches: tuple) -> Callable:
    """The MLA layer's ``__call__`` that keeps ``[latent, k_pe]`` rows in the ``caches`` kinds
    (mlx-lm's plain and batch ``KVCache``/``RotatingKVCache``) and decodes batch caches through
    ``router``'s plan; ``original`` (mlx-lm's own) for every other cache."""

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

        _check_rows(cache, r + self.qk_rope_head_dim)
        rows, _ = cache.update_and_fetch(
            mx.concatenate([latent, k_pe], axis=-1), mx.zeros((B, 1, L, 0), latent.dtype)
        )
        latent, k_pe = rows[..., :r], rows[..., r:]
        attention = router
        if L == 1:
            q_nope = self.embed_q(q_nope)
            queries = mx.concatenate([q_nope * self.scale, q_pe * self.scale], axis=-1)
            call = router.plan(queries, rows, latent, cache, mask)
            if call is not None:
                output = mlx_batched_decode.batched_decode_attention(
                    queries, rows, latent, call.valid_lens, scale=1.0, kv_starts=call.kv_starts,
                    window=call.window, ring_offset=call.ring_offset,
                )
                return _finish(self, self.unembed_out(output), B, L)
            # Counted by the plan already.
            attention = router.original
            keys = values = latent
        else:
            keys = self.embed_q(latent, transpose=False)
            values = self.unembed_out(latent)
        # mlx-lm's code from here: the rope scores as an additive mask.
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            floor = mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
            pe_scores = mx.where(mask, pe_scores, floor)
        output = attention(
            q_nope, keys, values, cache=cache, scale=self.scale, mask=pe_scores
        )
        if L == 1:
            output = self.unembed_out(output)
        return _finish(self, output, B, L)

    return __call__


def _check_rows(cache: Any, width: int) -> None:
    """ValueError unless ``cache`` is empty or holds ``width``-wide ``[latent, k_pe]`` rows."""
    keys = getattr(cache, "keys", None)
    if keys is not None and keys.shape[-1] != width:
        raise ValueError(
            f"{PREFIX} an MLA layer's {type(cache).__name__} holds keys {keys.shape[-1]} wide, "
            f"not the {width}-wide latent and rope rows the plug-in keeps: it was filled while "
            "the plug-in was off; start its request again"
        )


def _finish(layer: Any, output: mx.array, batch: int, rows: int) -> mx.array:
    """The heads' ``[B, H, L, v]`` outputs through the layer's output projection."""
    return layer.o_proj(output.transpose(0, 2, 1, 3).reshape(batch, rows, -1))
