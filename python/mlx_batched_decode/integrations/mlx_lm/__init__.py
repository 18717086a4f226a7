"""The mlx-lm plug-in's code; its public entry is ``mlx_batched_decode.mlx_lm``, which documents it.

``patches`` (``enable``/``disable``: what the plug-in puts in mlx-lm's place, in memory, through
``families.patches``), ``routing`` (``DecodeRouter``: which attention calls the op serves),
``mask_tags`` (which keys a decode mask allows), ``server`` (``python -m
mlx_batched_decode.serve``) and ``listen_backlog`` (its listen queue). The model families'
attention (Gemma 2's soft cap, MLA's latent space) lives in ``families``, shared with the decoder.
"""

from .patches import MLX_LM_VERSION, disable, enable, enabled, is_enabled, stats
from .routing import PluginStats

__all__ = ["MLX_LM_VERSION", "PluginStats", "disable", "enable", "enabled", "is_enabled", "stats"]
