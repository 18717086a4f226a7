"""The block allocator of a paged KV cache: block ids, reference counts, a budget, cached prefixes.

A block is ``block_size`` consecutive positions of one request's keys/values, in every layer's
pool at the same index. The allocator only hands out ids; the pools are the cache's
(``paged_kv_cache.py``). Every block is in exactly one of these states:

- free: on the free list, holds nothing anyone may read;
- in use: ``refcount >= 1`` requests hold it in their block tables; never handed out again
  until its last user releases it;
- cached: ``refcount == 0`` but it holds a full block of prompt tokens whose chained hash is
  known (``register``); a later request with the same prefix takes it back (``lookup``). At
  most ``max_cached_blocks`` blocks are cached; the least recently released goes first, and
  a cached block is also evicted when an allocation finds no free block within the budget.

Ids ``0 .. capacity - 1`` exist; ``capacity`` grows (doubling) up to ``max_blocks``, the
user's budget, when no free block is left; the cache grows its pools to match. Requests may
``reserve`` blocks ahead: a reservation succeeds only when that many blocks can be had
without touching any block in use, so a request admitted with a reservation never waits.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional


class BlockBudgetError(RuntimeError):
    """No block can be had: every block within the budget is in use or reserved."""


class BlockAllocator:
    """Free list, per-block reference counts, reservations and an LRU of cached prefix blocks.

    Args:
        max_blocks: the budget, the most block ids that ever exist (``None``: no bound).
        initial_blocks: ids that exist from the start (capacity), at most ``max_blocks``.
        max_cached_blocks: the most unreferenced blocks kept as cached prefixes.
    """

    def __init__(
        self,
        max_blocks: Optional[int] = None,
        initial_blocks: int = 64,
        max_cached_blocks: int = 256,
    ):
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"[BlockAllocator] max_blocks must be >= 1 or None, got {max_blocks}")
        if initial_blocks < 1:
            raise ValueError(f"[BlockAllocator] initial_blocks must be >= 1, got {initial_blocks}")
        if max_cached_blocks < 0:
            raise ValueError(
                f"[BlockAllocator] max_cached_blocks must be >= 0, got {max_cached_blocks}"
            )
        self.max_blocks = max_blocks
        self.max_cached_blocks = max_cached_blocks
        self.capacity = 0
        self._refcounts: list[int] = []
        self._free: list[int] = []
        # Cached blocks, least recently released first: block id -> its hash.
        self._cached: OrderedDict[int, int] = OrderedDict()
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self.reserved = 0
        self._grow(initial_blocks if max_blocks is None else min(initial_blocks, max_blocks))

    # -- counts -------------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        """How many requests hold ``block``."""
        return self._refcounts[block]

    @property
    def num_in_use(self) -> int:
        """Blocks held by at least one request."""
        return self.capacity - len(self._free) - len(self._cached)

    @property
    def num_free(self) -> int:
        """Blocks on the free list (not counting ids the budget still allows to create)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept as cached prefixes."""
        return len(self._cached)

    def available(self) -> float:
        """Blocks that can be handed out without touching a block in use or reserved: free,
        cached (evictable) and not yet created within the budget, less the reservations
        (``math.inf`` without a budget)."""
        headroom = math.inf if self.max_blocks is None else self.max_blocks - self.capacity
        return len(self._free) + len(self._cached) + headroom - self.reserved

    # -- allocation ---------------------------------------------------------------------------

    def reserve(self, count: int) -> bool:
        """Promise ``count`` future ``allocate(reserved=True)`` calls a block; False (nothing
        reserved) when fewer than ``count`` blocks are available."""
        if count < 0:
            raise ValueError(f"[BlockAllocator] cannot reserve {count} blocks")
        if count > self.available():
            return False
        self.reserved += count
        return True

    def unreserve(self, count: int) -> None:
        """Give back ``count`` reserved blocks that will not be allocated."""
        if not 0 <= count <= self.reserved:
            raise ValueError(f"[BlockAllocator] {self.reserved} blocks reserved, cannot return {count}")
        self.reserved -= count

    def allocate(self, *, reserved: bool = False) -> int:
        """A block id with reference count 1: from the free list, else a new id within the
        budget, else the least recently released cached block. ``reserved`` draws on an earlier
        ``reserve``. Raises ``BlockBudgetError`` when none can be had."""
        if reserved:
            if self.reserved < 1:
                raise ValueError("[BlockAllocator] allocate(reserved=True) without a reservation")
            self.reserved -= 1
        elif self.available() < 1:
            raise BlockBudgetError(
                f"[BlockAllocator] all {self.capacity} blocks of the budget are in use or reserved"
            )
        if not self._free and (self.max_blocks is None or self.capacity < self.max_blocks):
            self._grow(self.capacity)
        if not self._free:
            self._evict_oldest()
        block = self._free.pop()
        self._refcounts[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more request holds ``block`` (in use or cached)."""
        if self._refcounts[block] == 0:
            if block not in self._cached:
                raise ValueError(f"[BlockAllocator] block {block} is free: nothing to share")
            del self._cached[block]
        self._refcounts[block] += 1

    def release(self, block: int) -> None:
        """One request lets go of ``block``; its last user leaving caches it (if registered,
        within the cache budget) or frees it."""
        if self._refcounts[block] < 1:
            raise ValueError(f"[BlockAllocator] block {block} is not in use")
        self._refcounts[block] -= 1
        if self._refcounts[block] > 0:
            return
        if block in self._hash_of and self.max_cached_blocks > 0:
            self._cached[block] = self._hash_of[block]
            if len(self._cached) > self.max_cached_blocks:
                self._evict_oldest()
        else:
            self._forget(block)
            self._free.append(block)

    # -- prefix cache -------------------------------------------------------------------------

    def register(self, block: int, block_hash: int) -> None:
        """Record that in-use ``block`` holds the full block of tokens hashed ``block_hash``
        (``lookup`` finds it from now on). A hash already held by another block is left there."""
        if self._refcounts[block] < 1:
            raise ValueError(f"[BlockAllocator] block {block} is not in use")
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def lookup(self, block_hash: int) -> Optional[int]:
        """The block holding ``block_hash`` (in use or cached), or ``None``; call ``retain``
        to use it."""
        return self._block_of.get(block_hash)

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is unreferenced but kept as a cached prefix."""
        return block in self._cached

    def clear_cached(self) -> None:
        """Free every cached prefix block."""
        while self._cached:
            self._evict_oldest()

    # -- internals ----------------------------------------------------------------------------

    def _grow(self, count: int) -> None:
        if self.max_blocks is not None:
            count = min(count, self.max_blocks - self.capacity)
        new = range(self.capacity, self.capacity + count)
        self._refcounts += [0] * count
        # Lowest ids on top of the stack: blocks are handed out in increasing order.
        self._free = list(reversed(new)) + self._free
        self.capacity += count

    def _evict_oldest(self) -> None:
        block, _ = self._cached.popitem(last=False)
        self._forget(block)
        self._free.append(block)

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
