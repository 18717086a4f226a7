"""Turning the plug-in on and off: what is patched in the running SGLang, and its restoration.

``enable()`` replaces, in memory only (no file of SGLang is touched), one method:
``MLXAttentionWrapper._batched_decode`` of SGLang's MLX backend
(``sglang.srt.hardware_backend.mlx.kv_cache.attention_wrapper``), with ``decode``'s version.
Every wrapper, those made before ``enable()`` included, looks the method up on its class, so
all of them take the new one; ``disable()`` puts SGLang's back.

The replacement reads the wrapper's private fields (``_inner``, ``_layer_idx``,
``_window_size``, ``_scale``, ``_sinks``, ...), calls its ``_rope_custom_aot`` and relies on how
SGLang's caches hold their tokens, so it requires the SGLang version it was checked against,
read from the installed distribution's metadata. SGLang's backend is imported as SGLang's
packages import it: where they do not import (torch missing), ``enable()`` raises.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from importlib import metadata
from typing import ContextManager

from ..switch import PluginSwitch
from .decode import ragged_batched_decode
from .routing import PREFIX, DecodeRoutes, PluginStats

SGLANG_VERSION = "0.5.23"
_BACKEND = "sglang.srt.hardware_backend.mlx.kv_cache"
_METHOD = "_batched_decode"


class _Plugin:
    """The patch in force while enabled."""

    def __init__(self) -> None:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            raise ModuleNotFoundError(
                f"{PREFIX} needs sglang {SGLANG_VERSION} installed", name="sglang"
            ) from None
        if version != SGLANG_VERSION:
            raise ValueError(
                f"{PREFIX} needs sglang {SGLANG_VERSION}, whose MLX backend it was checked "
                f"against; found {version}"
            )
        try:
            wrapper = importlib.import_module(f"{_BACKEND}.attention_wrapper")
            caches = importlib.import_module(f"{_BACKEND}.attention_kv_cache")
        except ImportError as exc:
            raise ImportError(
                f"{PREFIX} SGLang's MLX backend does not import here ({exc}); the plug-in "
                "runs where SGLang's MLX backend runs"
            ) from exc
        self.owner = wrapper.MLXAttentionWrapper
        self.original = self.owner.__dict__[_METHOD]
        self.routes = DecodeRoutes(
            caches.ContiguousAttentionKVCache, caches.WindowedAttentionKVCache
        )
        setattr(self.owner, _METHOD, ragged_batched_decode(self.original, self.routes))

    def restore(self) -> None:
        setattr(self.owner, _METHOD, self.original)


_switch: PluginSwitch[_Plugin] = PluginSwitch(PREFIX)


def enable() -> None:
    """Make the batched decode steps of SGLang's MLX backend attend with
    ``ragged_decode_attention``, one call per layer and step.

    Does nothing if already enabled. Raises ``ValueError`` for an SGLang version other than the
    one the plug-in was checked against, ``ImportError`` when SGLang is not installed or its MLX
    backend does not import.
    """
    _switch.turn_on(_Plugin)


def disable() -> None:
    """Restore SGLang's ``_batched_decode``. Does nothing if not enabled."""
    _switch.turn_off()


def is_enabled() -> bool:
    """Whether the plug-in is on."""
    return _switch.active is not None


def enabled() -> ContextManager[None]:
    """``with enabled(): ...`` runs the block with the plug-in on; it is turned off after the
    block unless it was already on before."""
    return _switch.on_during(enable)


def stats() -> PluginStats:
    """A copy of the counts since the last ``enable()``: which decode attention calls the op
    served and which stayed on SGLang's path. Raises ``ValueError`` when not enabled."""
    return replace(_switch.require("stats()").routes.stats)
