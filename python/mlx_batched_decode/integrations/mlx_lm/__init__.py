"""The mlx-lm plug-in's code; its public entry is ``mlx_batched_decode.mlx_lm``, which documents it.

``patches`` (``enable``/``disable``: what is replaced in mlx-lm, in memory), ``routing`` (which
attention calls the op serves), ``gemma2`` (Gemma 2's attention, which soft-caps by hand),
``mask_tags`` (which keys a decode mask allows), ``server`` (``python -m
mlx_batched_decode.serve``) and ``listen_backlog`` (its listen queue).
"""

from .patches import MLX_LM_VERSION, disable, enable, enabled, is_enabled, stats
from .routing import PluginStats

__all__ = ["MLX_LM_VERSION", "PluginStats", "disable", "enable", "enabled", "is_enabled", "stats"]
