"""The paged layout: every request's keys/values in the blocks of one ``PagedKVCache``.

The scheduler's side is the cache's bookkeeping: a request is admitted when blocks for its
whole length can be reserved, taking the cached blocks its prompt starts with (prefix sharing),
and its prompt's full blocks become shareable as soon as they are written. ``prepare`` takes
the blocks a step writes and puts the rows' block tables in the plan, so that the runner (or a
tensor-parallel follower, which keeps no bookkeeping) builds the step's context from the plan
alone; every layer attends with ``paged_decode_attention``. Nothing moves when a request leaves.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ...attention.paged import PagedAttention
from ...caches.context import BatchedDecodeContext
from ...caches.paged_kv_cache import PagedKVCache
from ...caches.prefix_hashes import block_hashes
from ..plan import StepPlan
from ..request import Request
from .base import KVLayout


class PagedLayout(KVLayout):
    """``model``'s keys/values in block pools.

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
        super().__init__(model)
        self.cache = PagedKVCache(
            self.num_layers,
            block_size=block_size,
            pool_layout=pool_layout,
            max_blocks=max_blocks,
            max_cached_blocks=max_cached_blocks,
            prefix_sharing=prefix_sharing,
        )
        self.attentions = [PagedAttention()] * self.num_layers

    # -- the scheduler's side -----------------------------------------------------------------

    def check(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        total_len = prompt_len - 1 + max(max_tokens, 1)
        needed = self.cache.blocks_for(total_len) + (n - 1) * self._fork_blocks(
            prompt_len, total_len
        )
        budget = self.cache.allocator.max_blocks
        if budget is not None and needed > budget:
            raise ValueError(
                f"[BatchedDecoder] a request of {prompt_len} prompt tokens, max_tokens="
                f"{max_tokens} and {n} choices needs {needed} blocks, more than "
                f"max_kv_blocks={budget}"
            )

    def _fork_blocks(self, prompt_len: int, total_len: int) -> int:
        """The blocks a fork reserves (``PagedKVCache.fork``): those its parent holds reserved
        once the prompt is written, and one for a copy of a partly filled last block."""
        partial = prompt_len % self.cache.block_size != 0
        return self.cache.blocks_for(total_len) - self.cache.blocks_for(prompt_len) + partial

    def admit(self, request: Request) -> Optional[int]:
        # A request asking for its prompt's logprobs computes every position itself.
        shared = request.prompt[:-1] if request.prompt_logprobs is None else []
        hit = self.cache.admit(request.uid, shared, request.total_len)
        if hit is None or not request.forks:
            return hit
        kept = len(request.forks) * self._fork_blocks(len(request.prompt), request.total_len)
        if not self.cache.allocator.reserve(kept):
            self.cache.free(request.uid)
            return None
        return hit

    def fork(self, parent: Request, fork: Request) -> None:
        self.drop_fork(parent)
        if not self.cache.fork(parent.uid, fork.uid, parent.num_cached):
            raise RuntimeError("[BatchedDecoder] a fork found no room kept for it")

    def drop_fork(self, parent: Request) -> None:
        self.cache.allocator.unreserve(self._fork_blocks(len(parent.prompt), parent.total_len))

    def free(self, uid: int) -> None:
        self.cache.free(uid)

    def register(self, request: Request) -> None:
        if self.cache.prefix_sharing:
            written = min(request.num_cached, len(request.prompt) - 1)
            full = written // self.cache.block_size
            self.cache.register_blocks(request.uid, self._block_names(request)[:full])

    def awaits_shared_blocks(self, request: Request, feeding: Sequence[Request]) -> bool:
        """With prefix sharing: whether a prompt being fed now holds the next block of
        ``request``'s prompt that no cached block holds yet; it then waits for that block
        (cached as soon as it is written) instead of computing it again."""
        if not self.cache.prefix_sharing or request.prompt_logprobs is not None:
            return False
        names = self._block_names(request)
        cached = len(self.cache.cached_blocks(names))
        if cached == len(names):
            return False
        return any(names[cached] in self._block_names(r) for r in feeding)

    def _block_names(self, request: Request) -> list[int]:
        """The names of the full blocks of ``request``'s prompt but its last token."""
        if request.block_names is None:
            request.block_names = block_hashes(request.prompt[:-1], self.cache.block_size)
        return request.block_names

    def prepare(self, plan: StepPlan) -> None:
        counts = [1 if t is not None else len(c) for t, c in zip(plan.next_tokens, plan.chunks)]
        tables = self.cache.prepare_step(plan.uids, plan.seq_lens, counts)
        plan.block_tables = [list(table) for table in tables]

    def usage(self) -> tuple[int, int]:
        capacity = self.cache.allocator.max_blocks or self.cache.num_blocks
        return self.cache.blocks_in_use, max(capacity, 1)

    # -- the runner's side --------------------------------------------------------------------

    def load(self, row: int, layers_kv: Optional[Sequence[tuple[mx.array, mx.array]]]) -> None:
        if layers_kv is not None:
            raise ValueError("[BatchedDecoder] add_prefilled_request needs kv_layout='slot'")

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Nothing moves: a fork's table, sharing its parent's blocks, comes with each plan."""

    def release(self, row: int, last: int, length: int) -> None:
        """Nothing moves: the rows' tables come with each plan."""

    def context(self, plan, seq_lens, query_lens, first_chunks) -> BatchedDecodeContext:
        return BatchedDecodeContext.packed_step(
            seq_lens,
            query_lens,
            [self.cache] * self.num_layers,
            first_chunks=first_chunks,
            tables=plan.block_tables,
            block_size=self.cache.block_size,
        )

    def cache_arrays(self) -> list[mx.array]:
        return [a for a in self.cache.keys + self.cache.values if a is not None]
