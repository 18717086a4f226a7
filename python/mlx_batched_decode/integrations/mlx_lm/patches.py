"""Turning the plug-in on and off: what it patches in the running mlx-lm, and its restoration.

``enable()`` applies, in memory only (no file of mlx-lm is touched), ``families.patches``'
``plugin_patches`` for a ``DecodeRouter``:

- ``mlx_lm.models.base.scaled_dot_product_attention`` and the same name in every loaded module
  that imported it (mlx-lm's model files do ``from .base import scaled_dot_product_attention``)
  by the router; model modules imported while enabled pick the router up from ``base``;
- ``gemma2.Attention.__call__``, whose attention soft-caps its scores without calling that
  function, by one that asks the router too (``families.gemma2``);
- the ``__call__`` of DeepSeek-V3's and GLM-4.7-Flash's MLA layers, whose rope scores arrive as
  an additive mask, by one that keeps latent and rope keys in one row and decodes in latent
  space on the op (``families.mla``);

and its own: ``BatchKVCache.make_mask`` and ``BatchRotatingKVCache.make_mask`` by versions that
call the originals and tag the decode masks they return (``mask_tags``).

``disable()`` puts every original back, in the modules patched by ``enable()`` and in those
imported since. The plug-in reads private fields of mlx-lm's batch caches (``_idx``, ``_offset``,
``rotated``), so it requires the mlx-lm version it was checked against.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ContextManager

from ...families.patches import Patch, apply, plugin_patches, undo
from ...families.standard import ATTENTION_FUNCTION, modules_binding
from ..switch import PluginSwitch
from .mask_tags import MaskTags, tagging_batch_kv_make_mask, tagging_batch_rotating_make_mask
from .routing import PREFIX, DecodeRouter, PluginStats

MLX_LM_VERSION = "0.32.2"


class _Plugin:
    """The patches in force while enabled; ``wrapped_rings`` as ``enable``'s."""

    def __init__(self, wrapped_rings: bool) -> None:
        import mlx_lm
        from mlx_lm.models import base
        from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

        if mlx_lm.__version__ != MLX_LM_VERSION:
            raise ValueError(
                f"{PREFIX} needs mlx-lm {MLX_LM_VERSION}, whose batch caches it was checked "
                f"against; found {mlx_lm.__version__}"
            )
        self.tags = MaskTags()
        self.router = DecodeRouter(
            base.scaled_dot_product_attention,
            self.tags,
            BatchKVCache,
            BatchRotatingKVCache,
            wrapped_rings,
        )
        masks = [
            Patch(cls, "make_mask", tagging(vars(cls)["make_mask"], self.tags))
            for cls, tagging in (
                (BatchKVCache, tagging_batch_kv_make_mask),
                (BatchRotatingKVCache, tagging_batch_rotating_make_mask),
            )
        ]
        self.replaced = apply(masks + plugin_patches(self.router))

    def restore(self) -> None:
        undo(self.replaced)
        # Modules imported while enabled copied the router from base.
        original = self.router.original
        apply([Patch(m, ATTENTION_FUNCTION, original) for m in modules_binding(self.router)])


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
