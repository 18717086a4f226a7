"""The mlx-lm plug-in: mlx-lm's own batched generation decodes through ``batched_decode_attention``.

::

    import mlx_batched_decode.mlx_lm
    mlx_batched_decode.mlx_lm.enable()   # or: with mlx_batched_decode.mlx_lm.enabled(): ...
    # batch_generate, BatchGenerator and mlx_lm.server's batched path now decode with the fused op

While enabled, the attention of every decode step of mlx-lm's batched generation (one new token
per request on a left-padded ``BatchKVCache``) runs through ``batched_decode_attention`` with
``kv_starts`` = the cache's left padding: no mask is read or computed, no padding is read.
``BatchRotatingKVCache`` (sliding-window, ``max_kv_size``) layers are served the same way, and
once their ring wraps through ``ring_offset``; values of a head dim of their own (DeepSeek-V2,
MiniCPM3) too, Gemma 2's soft-capped attention (which does not call mlx-lm's attention
function) through ``softcap``, and DeepSeek-V3's, Kimi K2 / K2.5's and GLM-4.7-Flash's latent
attention in latent space, their caches keeping latent and rope keys in one row while enabled.
Prefill, every other cache kind, additive masks and everything outside attention run mlx-lm's
code (``routing`` says why for each), unchanged but for Gemma 2's batch masks, put on the batch
axis. No file of mlx-lm is edited: ``enable()`` replaces a function and five methods in memory,
``disable()`` restores them (``patches``).
``stats()`` counts the attention calls by where they ran. mlx-lm 0.32.2 is required.
The plug-in's code lives in ``mlx_batched_decode.integrations.mlx_lm``, the model families'
attention it puts in place (shared with ``BatchedDecoder``) in ``mlx_batched_decode.families``.
"""

from .integrations.mlx_lm import (
    MLX_LM_VERSION,
    PluginStats,
    disable,
    enable,
    enabled,
    is_enabled,
    stats,
)

__all__ = ["MLX_LM_VERSION", "PluginStats", "disable", "enable", "enabled", "is_enabled", "stats"]
