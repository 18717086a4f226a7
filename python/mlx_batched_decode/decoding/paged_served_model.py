"""One mlx-lm model as ``BatchedDecoder(kv_layout="paged")`` runs it: keys/values in block pools.

The counterpart of ``ServedModel`` for the paged layout: every request's keys/values live in
the blocks of one ``PagedKVCache`` shared by all layers, a decode step's block tables and write
slots are built once (``PagedPackedContext``) and every layer attends with
``paged_decode_attention``. A request whose prompt starts with cached blocks takes them, and the
steps feed only the rest of its prompt, with the cached prefix as its context.

Dimension legend: N = tokens of a packed step, V = vocabulary size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..attention.paged import PagedAttention
from ..caches.paged_kv_cache import PagedKVCache
from ..families.mla import latent_specs
from ..families.patches import mlx_lm_attention_modules
from ..families.step_forward import routed_forward
from .mlx_lm_caches import layer_windows


class PagedServedModel:
    """An mlx-lm model decoding from a ``PagedKVCache``; row ``b`` of a step is ``rows[b]``.

    Args:
        model: the mlx-lm model.
        block_size: positions per block.
        pool_layout: how the pools are stored (``PagedKVCache``).
        prefix_sharing: reuse cached prompt blocks (every layer's, sliding-window ones too: the
            steps write every position's keys/values into the blocks).
        max_blocks: the block budget of the pools (``None``: unbounded).
        max_cached_blocks: the most unreferenced prompt blocks kept for later requests.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int,
        pool_layout: str,
        prefix_sharing: bool,
        max_blocks: Optional[int],
        max_cached_blocks: int,
    ):
        self.model = model
        self.attention = PagedAttention()
        self.routed_modules = mlx_lm_attention_modules(model)
        self.windows = layer_windows(model)
        self.latents = latent_specs(model)
        self.cache = PagedKVCache(
            len(self.windows),
            block_size=block_size,
            pool_layout=pool_layout,
            max_blocks=max_blocks,
            max_cached_blocks=max_cached_blocks,
            prefix_sharing=prefix_sharing,
        )
        # rows[b]: the request id decoding in row b of every step.
        self.rows: list[int] = []

    def admit(self, uid: int, prefix: Sequence[int], total_len: int) -> Optional[int]:
        """Give request ``uid`` the next row, reserving blocks for ``total_len`` positions in
        all, and the cached blocks of the longest start of ``prefix`` (token ids) they hold.

        Returns how many leading tokens came from cached blocks (the steps feed the rest), or
        ``None`` when the block budget cannot hold the request now (nothing done).
        """
        hit = self.cache.admit(uid, list(prefix), total_len)
        if hit is not None:
            self.rows.append(uid)
        return hit

    def register(self, uid: int, names: Sequence[int]) -> None:
        """``uid``'s leading full blocks, named ``names`` (``block_hashes``) and now written,
        become cached prefixes later requests may share."""
        self.cache.register_blocks(uid, names)

    def release(self, row: int, last: int) -> None:
        """Request of row ``row`` leaves (its blocks go back); row ``last``'s request moves
        there, so the active requests fill rows ``0..B-1``. No keys/values move."""
        self.cache.free(self.rows[row])
        self.rows[row] = self.rows[last]
        self.rows.pop()

    def forward_packed(
        self,
        tokens: mx.array,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        logit_rows: Sequence[int],
        first_chunks: Sequence[tuple[int, int]] = (),
        reserve_len: int = 0,
    ) -> mx.array:
        """As ``ServedModel.forward_packed``, the tokens' keys/values written into the rows'
        blocks (``reserve_len`` is not needed: blocks come as positions fill)."""
        context = self.cache.packed_context(self.rows, seq_lens, query_lens, first_chunks)
        attentions = [self.attention] * len(self.windows)
        return routed_forward(
            self.model, tokens, context, attentions, self.windows, self.routed_modules,
            logit_rows, self.latents,
        )

    def cache_arrays(self) -> list[mx.array]:
        """Every pool: evaluating them runs pending writes."""
        return [a for a in self.cache.keys + self.cache.values if a is not None]
