"""KV layouts: where a model's keys and values live, behind one interface (``base.KVLayout``).

``slot`` (a row per request; rings for windowed layers; quantized with ``kv_bits``), ``paged``
(block pools with prefix sharing) and ``seed`` (the pad-and-concatenate baseline).
``make_layout`` builds the one a ``CacheConfig`` names.
"""

from __future__ import annotations

import mlx.nn as nn

from ..config import CacheConfig
from .base import KVLayout
from .paged import PagedLayout
from .seed import SeedLayout
from .slot import SlotLayout


def make_layout(model: nn.Module, config: CacheConfig, lookahead: int = 0) -> KVLayout:
    """``model``'s layout as ``config`` names it; ``lookahead``: what the slot layout's rings
    make room for past a window (``SlotLayout``)."""
    if config.kv_layout == "paged":
        return PagedLayout(
            model,
            block_size=config.block_size,
            pool_layout=config.pool_layout,
            prefix_sharing=config.prefix_sharing,
            max_blocks=config.max_kv_blocks,
            max_cached_blocks=config.max_cached_blocks,
        )
    if config.kv_layout == "seed":
        return SeedLayout(model, config.kv_step)
    return SlotLayout(model, config.kv_step, config.kv_bits, config.kv_group_size, lookahead)


__all__ = ["KVLayout", "PagedLayout", "SeedLayout", "SlotLayout", "make_layout"]
