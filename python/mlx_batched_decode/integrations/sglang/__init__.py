"""The SGLang plug-in's code; its public entry is ``mlx_batched_decode.sglang``, which documents it.

``patches`` (``enable``/``disable``: what is replaced in SGLang, in memory), ``decode`` (the
decode step SGLang's attention layers run while enabled) and ``routing`` (which calls the op
serves, on which views of the caches).
"""

from .patches import SGLANG_VERSION, disable, enable, enabled, is_enabled, stats
from .routing import PluginStats

__all__ = ["SGLANG_VERSION", "PluginStats", "disable", "enable", "enabled", "is_enabled", "stats"]
