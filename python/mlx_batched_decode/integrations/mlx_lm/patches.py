"""Turning the plug-in on and off: what is patched in the running mlx-lm, and its restoration.

``enable()`` replaces, in memory only (no file of mlx-lm is touched):

- ``mlx_lm.models.base.scaled_dot_product_attention`` and the same name in every loaded module
  that imported it (mlx-lm's model files do ``from .base import scaled_dot_product_attention``)
  with a ``DecodeRouter``; model modules imported while enabled pick the router up from ``base``;
- ``BatchKVCache.make_mask`` and ``BatchRotatingKVCache.make_mask`` with versions that call the
  originals and tag the decode masks they return (``mask_tags``);
- ``gemma2.Attention.__call__``, whose attention soft-caps its scores without calling that
  function, with one that asks the router too (``gemma2``);
- the ``__call__`` of DeepSeek-V3's and GLM-4.7-Flash's MLA layers, whose rope scores arrive as
  an additive mask, with one that keeps latent and rope keys in one row and decodes in latent
  space on the op (``latent_attention``).

``disable()`` puts every original back, in the modules patched by ``enable()`` and in those
imported since. The plug-in reads private fields of mlx-lm's batch caches (``_idx``, ``_offset``,
``rotated``), so it requires the mlx-lm version it was checked against.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, ContextManager

from ..switch import PluginSwitch
from .gemma2 import gemma2_attention
from .latent_attention import latent_attention
from .mask_tags import MaskTags, tagging_batch_kv_make_mask, tagging_batch_rotating_make_mask
from .routing import PREFIX, DecodeRouter, PluginStats

MLX_LM_VERSION = "0.32.2"
_NAME = "scaled_dot_product_attention"


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any


class _Plugin:
    """The patches in force while enabled; ``wrapped_rings`` as ``enable``'s."""

    def __init__(self, wrapped_rings: bool) -> None:
        import mlx_lm
        from mlx_lm.models import base, deepseek_v3, gemma2, glm4_moe_lite
        from mlx_lm.models.cache import (
            BatchKVCache,
            BatchRotatingKVCache,
            KVCache,
            RotatingKVCache,
        )

        if mlx_lm.__version__ != MLX_LM_VERSION:
            raise ValueError(
                f"{PREFIX} needs mlx-lm {MLX_LM_VERSION}, whose batch caches it was checked "
                f"against; found {mlx_lm.__version__}"
            )
        self.base = base
        self.original = base.scaled_dot_product_attention
        self.tags = MaskTags()
        self.router = DecodeRouter(
            self.original, self.tags, BatchKVCache, BatchRotatingKVCache, wrapped_rings
        )
        self.patches: list[_Patch] = []
        for cls, tagging in (
            (BatchKVCache, tagging_batch_kv_make_mask),
            (BatchRotatingKVCache, tagging_batch_rotating_make_mask),
        ):
            original = cls.__dict__["make_mask"]
            self._set(cls, "make_mask", original, tagging(original, self.tags))
        for module in _modules_binding(self.original):
            self._set(module, _NAME, self.original, self.router)
        attention = gemma2.Attention
        self._set(
            attention, "__call__", attention.__dict__["__call__"], gemma2_attention(self.router)
        )
        caches = (KVCache, RotatingKVCache, BatchKVCache, BatchRotatingKVCache)
        for attention in (deepseek_v3.DeepseekV3Attention, glm4_moe_lite.Glm4MoeLiteAttention):
            original = attention.__dict__["__call__"]
            self._set(
                attention, "__call__", original, latent_attention(self.router, original, caches)
            )

    def _set(self, owner: Any, name: str, original: Any, replacement: Any) -> None:
        self.patches.append(_Patch(owner, name, original))
        setattr(owner, name, replacement)

    def restore(self) -> None:
        for patch in reversed(self.patches):
            setattr(patch.owner, patch.name, patch.original)
        # Modules imported while enabled copied the router from base.
        for module in _modules_binding(self.router):
            setattr(module, _NAME, self.original)


def _modules_binding(function: Any) -> list[Any]:
    """Loaded modules whose global ``scaled_dot_product_attention`` is ``function`` (read from
    their ``__dict__``, so no module-level ``__getattr__`` runs)."""
    return [
        module
        for module in list(sys.modules.values())
        if isinstance(getattr(module, "__dict__", None), dict)
        and module.__dict__.get(_NAME) is function
    ]


_switch: PluginSwitch[_Plugin] = PluginSwitch(PREFIX)


def enable(*, wrapped_rings: bool = True) -> None:
    """Route the decode attention of mlx-lm's batched generation through
    ``batched_decode_attention`` (``BatchGenerator``, ``batch_generate``, ``mlx_lm.server``).

    ``wrapped_rings=False`` leaves the decode steps on a ``BatchRotatingKVCache`` whose ring has
    wrapped to mlx-lm (counted in ``stats().rotating_wrapped``): the plug-in as it was before it
    read rings, a baseline for benchmarks.

    Does nothing if already enabled with the same ``wrapped_rings``. Raises ``ValueError`` if
    enabled with the other one, and for an mlx-lm version other than the one the plug-in was
    checked against.
    """

    def same_rings(active: _Plugin) -> None:
        if active.router.wrapped_rings != wrapped_rings:
            raise ValueError(
                f"{PREFIX} already enabled with wrapped_rings={active.router.wrapped_rings}: "
                "disable() it first"
            )

    _switch.turn_on(lambda: _Plugin(wrapped_rings), same_rings)


def disable() -> None:
    """Restore every function and method ``enable()`` replaced. Does nothing if not enabled."""
    _switch.turn_off()


def is_enabled() -> bool:
    """Whether the plug-in is on."""
    return _switch.active is not None


def enabled(*, wrapped_rings: bool = True) -> ContextManager[None]:
    """``with enabled(): ...`` runs the block with the plug-in on (``wrapped_rings`` as
    ``enable``'s); it is turned off after the block unless it was already on before."""
    return _switch.on_during(lambda: enable(wrapped_rings=wrapped_rings))


def stats() -> PluginStats:
    """A copy of the counts since the last ``enable()``: which attention calls the op served and
    which stayed on mlx-lm's path. Raises ``ValueError`` when not enabled."""
    return replace(_switch.require("stats()").router.stats)
