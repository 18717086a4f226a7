"""Multi-head latent attention (DeepSeek-V3, Kimi K2 / K2.5, GLM-4.7-Flash) in latent space.

mlx-lm's MLA layer (``DeepseekV3Attention``, ``Glm4MoeLiteAttention``) decodes one token per
request (L = 1) as::

    kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)  # [B, 1, 1, r], [B, 1, 1, R]
    pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)      # the rope part of the scores
    q_abs = self.embed_q(q_nope)                                  # [B, H, 1, r]
    out = scaled_dot_product_attention(q_abs, kv_latent, kv_latent, cache=cache,
                                       scale=self.scale, mask=pe_scores)
    out = self.unembed_out(out)

so its scores are ``scale * q_abs . latent + scale * q_pe . k_pe``: one attention of 576-wide
queries ``[q_abs * scale, q_pe * scale]`` over one KV head of 576-wide keys ``[latent, k_pe]``
with ``scale = 1``, the values being the keys' first r columns (the latent). A step's cache
keeps each token's ``r + R`` values once (``update_and_fetch`` concatenates the pair, the only
copy) and hands the model the ``R x R`` identity for ``k_pe``: its own matmul then yields
``pe_scores = q_pe * scale``, the rope half of the queries, which reaches the routed attention
as its ``mask``. Our packed steps show the model one token per row, so the absorbed branch is
the only one it takes, prompt chunks included.

Dimension legend: N = tokens of a packed step, H = query heads, r = latent (``kv_lora_rank``),
R = rope dims (``qk_rope_head_dim``), T = positions.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

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
    """The ``[1, 1, R, R]`` identity handed to the model as its rope keys (module docstring):
    one array per width and dtype, shared by every layer and step."""
    identity = _IDENTITIES.get((rope_dim, dtype))
    if identity is None:
        identity = _IDENTITIES[(rope_dim, dtype)] = mx.eye(rope_dim, dtype=dtype)[None, None]
    return identity


def latent_queries(
    spec: LatentSpec, queries: mx.array, rope_scores: Optional[mx.array], scale: float
) -> mx.array:
    """The routed call's absorbed ``queries [N, H, 1, r]`` and ``rope_scores`` (its ``mask``,
    ``q_pe * scale`` ``[N, H, 1, R]``) -> the ``[N, H, 1, r + R]`` queries to attend with
    scale 1. ValueError for a call that is not the MLA decode path."""
    expected = (*queries.shape[:-1], spec.rope_dim)
    if queries.shape[-1] != spec.latent_dim or rope_scores is None or (
        rope_scores.shape != expected
    ):
        got = None if rope_scores is None else rope_scores.shape
        raise ValueError(
            f"[BatchedDecoder] an MLA layer attends queries {queries.shape} with rope scores "
            f"{got}: expected queries of the latent width {spec.latent_dim} and rope scores "
            f"{expected}"
        )
    # In the model's dtype, as mlx-lm's attention scales its queries.
    return mx.concatenate([queries * scale, rope_scores.astype(queries.dtype)], axis=-1)
