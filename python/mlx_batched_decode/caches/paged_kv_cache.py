"""A paged KV cache: per-layer pools of fixed-size blocks, block tables per request, shared prefixes.

Every layer has a key pool and a value pool, which the op reads as ``[N, block_size, H_kv, D]``
(``pools``); a request's tokens live in the blocks of its block table, and block ``i`` means the
same logical positions in every layer, so one table per request serves all layers. Blocks come
from a ``BlockAllocator`` (reference counts, a budget, cached prefixes); the pools grow with the
allocator's capacity.

Prefix sharing (as vLLM's automatic prefix caching): each full block of prompt tokens is named by
a hash of its tokens chained with the hash of the blocks before it, so equal hashes mean equal
prefixes. A request whose prompt starts with blocks already cached takes them (reference count
+ 1) instead of computing them. A request writes only into blocks it holds alone: before its
first write into a block another request also holds (a partly filled block shared by ``fork``),
the block is copied into a fresh one (copy on write). Blocks registered as prefixes are full, so
no request writes them again.

Pool layout: ``"token-major"`` (the default) stores ``[N, block_size, H_kv, D]`` itself (vLLM's
and SGLang's layout); ``"head-major"`` stores each pool as ``[N, H_kv, block_size, D]`` (one
head's rows of a block together) and hands the op a view with its axes 1 and 2 swapped, read in
place. Both hold the same bytes.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
N = blocks in each pool, H_kv = key/value heads, P = positions, D = head dimension.
"""

from __future__ import annotations

import math
from typing import Hashable, Optional, Sequence

import mlx.core as mx

from .block_allocator import BlockAllocator
from .buffers import place_on_huge_pages
from .context import BatchedDecodeContext
from .prefix_hashes import block_hashes


POOL_LAYOUTS = ("token-major", "head-major")
# The two layouts measured alike, within this machine's noise, end to end (bench_paged_decode,
# no sharing: 0.98x and 1.02x the slot layout's decode) and in the kernel (bench_paged); the
# default is the one engines keep, so their pools and this cache's are read alike.
DEFAULT_POOL_LAYOUT = "token-major"


class PagedKVCache:
    """Keys and values of many requests in per-layer block pools, with prefix sharing.

    Args:
        num_layers: pools to keep, one key and one value pool per layer.
        block_size: positions per block.
        max_blocks: the budget, the most blocks per pool (``None``: grow without bound).
        max_cached_blocks: the most unreferenced full prompt blocks kept for later requests.
        initial_blocks: blocks the pools start with; they double when full, up to the budget.
        prefix_sharing: whether ``admit`` reuses and ``register_prompt`` records cached blocks.
        pool_layout: ``"token-major"`` or ``"head-major"``, how each pool is stored (module
            docstring).

    Requests are named by any hashable id. Their lifecycle: ``admit`` (takes the cached prefix
    blocks and reserves the rest), ``prefix_keys_values`` / ``write_prompt`` /
    ``register_prompt`` (prefill), ``prepare_step`` + ``write`` per decode step, ``free``.
    """

    def __init__(
        self,
        num_layers: int,
        *,
        block_size: int = 16,
        max_blocks: Optional[int] = None,
        max_cached_blocks: int = 256,
        initial_blocks: int = 64,
        prefix_sharing: bool = True,
        pool_layout: str = DEFAULT_POOL_LAYOUT,
    ):
        if pool_layout not in POOL_LAYOUTS:
            raise ValueError(
                f"[PagedKVCache] pool_layout must be one of {POOL_LAYOUTS}, got {pool_layout!r}"
            )
        if num_layers < 1:
            raise ValueError(f"[PagedKVCache] num_layers must be >= 1, got {num_layers}")
        if block_size < 1:
            raise ValueError(f"[PagedKVCache] block_size must be >= 1, got {block_size}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.pool_layout = pool_layout
        self.allocator = BlockAllocator(max_blocks, initial_blocks, max_cached_blocks)
        self.keys: list[Optional[mx.array]] = [None] * num_layers
        self.values: list[Optional[mx.array]] = [None] * num_layers
        self.tables: dict[Hashable, list[int]] = {}
        self._reserved: dict[Hashable, int] = {}
        # Partly filled blocks shared by ``fork`` -> blocks reserved for their copies.
        self._copies: dict[int, int] = {}

    # -- sizes --------------------------------------------------------------------------------

    def blocks_for(self, length: int) -> int:
        """Blocks that ``length`` positions take."""
        return math.ceil(length / self.block_size)

    @property
    def num_blocks(self) -> int:
        """N, blocks in each pool (the allocator's capacity)."""
        return self.allocator.capacity

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by at least one request."""
        return self.allocator.num_in_use

    @property
    def nbytes(self) -> int:
        """Bytes of every pool."""
        return sum(a.nbytes for a in self.keys + self.values if a is not None)

    # -- requests -----------------------------------------------------------------------------

    def cached_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest run of ``tokens``' leading full blocks."""
        return self.cached_blocks(block_hashes(tokens, self.block_size))

    def cached_blocks(self, names: Sequence[int]) -> list[int]:
        """As ``cached_prefix``, from the full blocks' names (``block_hashes``) a caller kept."""
        if not self.prefix_sharing:
            return []
        blocks = []
        for block_hash in names:
            block = self.allocator.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def admit(self, rid: Hashable, tokens: Sequence[int], total_len: int) -> Optional[int]:
        """Start request ``rid`` whose first tokens are ``tokens`` and that will hold at most
        ``total_len`` positions: take the cached blocks of its prefix and reserve the others.

        Returns the number of leading ``tokens`` whose keys/values are already cached (a
        multiple of ``block_size``), or ``None`` when the budget cannot hold the request now
        (nothing taken; admit it again once others have left).
        """
        if rid in self.tables:
            raise ValueError(f"[PagedKVCache] request {rid!r} is already admitted")
        if total_len < len(tokens):
            raise ValueError(
                f"[PagedKVCache] total_len {total_len} is shorter than the {len(tokens)} tokens"
            )
        hits = self.cached_prefix(tokens)
        needed = self.blocks_for(total_len) - len(hits)
        # Taking a cached hit makes it unavailable to the reservation.
        taken = sum(self.allocator.is_cached(b) for b in hits)
        if needed + taken > self.allocator.available():
            return None
        for block in hits:
            self.allocator.retain(block)
        self.allocator.reserve(needed)
        self.tables[rid] = list(hits)
        self._reserved[rid] = needed
        return len(hits) * self.block_size

    def fork(self, src: Hashable, dst: Hashable, length: int) -> bool:
        """Start ``dst`` sharing every block of ``src``'s first ``length`` positions (parallel
        sampling of one prompt); ``dst`` reserves as many further blocks as ``src`` holds
        reserved. A shared, partly filled last block is copied by the first of its holders to
        write into it; one block is reserved for that copy. Returns False (nothing done) when
        the budget cannot hold ``dst``."""
        if dst in self.tables:
            raise ValueError(f"[PagedKVCache] request {dst!r} is already admitted")
        shared = self.tables[src][: self.blocks_for(length)]
        partial = length % self.block_size != 0
        if not self.allocator.reserve(self._reserved[src] + partial):
            return False
        for block in shared:
            self.allocator.retain(block)
        if partial:
            self._copies[shared[-1]] = self._copies.get(shared[-1], 0) + 1
        self.tables[dst] = list(shared)
        self._reserved[dst] = self._reserved[src]
        return True

    def free(self, rid: Hashable) -> None:
        """Request ``rid`` leaves: release its blocks and give back what it left reserved."""
        for block in self.tables.pop(rid):
            self.allocator.release(block)
            # A partly filled block held by r requests needs r - 1 copies at most.
            excess = self._copies.get(block, 0) - max(self.allocator.refcount(block) - 1, 0)
            if excess > 0:
                self.allocator.unreserve(excess)
                self._take_copies(block, excess)
        self.allocator.unreserve(self._reserved.pop(rid))

    def clear_prefix_cache(self) -> None:
        """Free every cached prefix block no request holds."""
        self.allocator.clear_cached()

    # -- prefill ------------------------------------------------------------------------------

    def prefix_keys_values(self, rid: Hashable, length: int) -> list[tuple[mx.array, mx.array]]:
        """Each layer's keys/values ``[1, H_kv, length, D]`` of ``rid``'s first ``length``
        positions (a gather of its blocks; the cached prefix a prefill continues from)."""
        blocks = mx.array(self.tables[rid][: self.blocks_for(length)], dtype=mx.int32)

        def gather(pool: mx.array) -> mx.array:
            rows = self._view(pool[blocks])
            return rows.reshape(-1, *rows.shape[2:])[:length].swapaxes(0, 1)[None]

        return [
            (gather(k), None if v is None else gather(v)) for k, v in zip(self.keys, self.values)
        ]

    def write_prompt(
        self, rid: Hashable, start: int, layers_kv: Sequence[tuple[mx.array, mx.array]]
    ) -> None:
        """Write each layer's ``[1, H_kv, P, D]`` keys/values at positions ``start ..
        start + P - 1`` of ``rid``: one scatter per pool."""
        length = layers_kv[0][0].shape[2]
        if length == 0:
            return
        positions = range(start, start + length)
        self._take_blocks(rid, start, start + length)
        table = self.tables[rid]
        blocks = mx.array([table[p // self.block_size] for p in positions], dtype=mx.int32)
        rows = mx.array([p % self.block_size for p in positions], dtype=mx.int32)
        for layer, (keys, values) in enumerate(layers_kv):
            self._ensure_pools(layer, keys, values)
            self._scatter(self.keys[layer], blocks, rows, keys[0].swapaxes(0, 1))
            if values is not None:
                self._scatter(self.values[layer], blocks, rows, values[0].swapaxes(0, 1))

    def register_prompt(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Record ``rid``'s full blocks of ``tokens`` (written at positions 0..) as cached
        prefixes that later requests may share."""
        self.register_blocks(rid, block_hashes(tokens, self.block_size))

    def register_blocks(self, rid: Hashable, names: Sequence[int]) -> None:
        """As ``register_prompt``, from the names of ``rid``'s leading full blocks."""
        if not self.prefix_sharing:
            return
        for block, block_hash in zip(self.tables[rid], names):
            self.allocator.register(block, block_hash)

    # -- decode steps -------------------------------------------------------------------------

    def prepare_step(
        self, rids: Sequence[Hashable], seq_lens: Sequence[int], query_lens: Sequence[int]
    ) -> list[list[int]]:
        """Make positions ``seq_lens[b] .. seq_lens[b] + query_lens[b] - 1`` of every request
        writable (new blocks from its reservation, copies of shared blocks) and return the B
        block tables."""
        for rid, start, count in zip(rids, seq_lens, query_lens):
            self._take_blocks(rid, start, start + count)
        return [self.tables[rid] for rid in rids]

    def context(
        self,
        rids: Sequence[Hashable],
        seq_lens: Sequence[int],
        query_len: int = 1,
        query_lens: Optional[Sequence[int]] = None,
    ) -> BatchedDecodeContext:
        """The step's context with its block tables (``prepare_step`` done), every layer
        reading this cache: every request feeding ``query_len`` tokens, or with
        ``query_lens`` a packed step."""
        counts = [query_len] * len(rids) if query_lens is None else query_lens
        tables = self.prepare_step(rids, seq_lens, counts)
        return BatchedDecodeContext(
            len(rids),
            seq_lens,
            [self] * self.num_layers,
            query_len,
            query_lens=query_lens,
            tables=tables,
            block_size=self.block_size,
        )

    def write(
        self,
        layer: int,
        keys: mx.array,
        values: Optional[mx.array],
        context: BatchedDecodeContext,
    ) -> tuple[mx.array, Optional[mx.array]]:
        """Write the step's new ``[B, H_kv, L, D]`` keys/values of ``layer`` at the context's
        slots (one scatter per pool, in place; a packed context's ``[N, H_kv, 1, D]``
        tokens alike); return the layer's pools as the op reads them,
        ``[N, block_size, H_kv, D]``. A layer written with ``values=None`` keeps a key pool
        only (multi-head latent attention: its values are the keys' first columns)."""
        self._ensure_pools(layer, keys, values)
        # Updates [B, L, H_kv, D] for the broadcast [B, L] (block, row) pairs.
        blocks, rows = context.blocks.write_blocks, context.blocks.write_rows
        self._scatter(self.keys[layer], blocks, rows, keys.swapaxes(1, 2))
        if values is not None:
            self._scatter(self.values[layer], blocks, rows, values.swapaxes(1, 2))
        return self.pools(layer)

    def pools(self, layer: int) -> tuple[mx.array, Optional[mx.array]]:
        """The key and value pools of ``layer`` as the op reads them, ``[N, block_size, H_kv, D]``
        (views of head-major storage); ``None`` for a layer that keeps no values."""
        values = self.values[layer]
        return self._view(self.keys[layer]), None if values is None else self._view(values)

    # -- internals ----------------------------------------------------------------------------

    def _view(self, stored: mx.array) -> mx.array:
        """Blocks as stored -> ``[n, block_size, H_kv, D]``."""
        return stored.swapaxes(1, 2) if self.pool_layout == "head-major" else stored

    def _scatter(self, pool: mx.array, blocks: mx.array, rows: mx.array, updates: mx.array) -> None:
        """``updates [..., H_kv, D]`` into ``pool`` at the broadcast (block, row) pairs, in place."""
        if self.pool_layout == "head-major":
            pool[blocks, :, rows] = updates
        else:
            pool[blocks, rows] = updates

    def _take_blocks(self, rid: Hashable, start: int, end: int) -> None:
        """Give ``rid`` a block it holds alone for every position in ``start .. end - 1``."""
        table = self.tables[rid]
        for index in range(start // self.block_size, self.blocks_for(end)):
            while index >= len(table):
                table.append(self._allocate(rid))
            if self.allocator.refcount(table[index]) > 1:
                table[index] = self._copy_block(rid, table[index])

    def _allocate(self, rid: Hashable) -> int:
        if self._reserved[rid] < 1:
            raise ValueError(
                f"[PagedKVCache] request {rid!r} writes past the length it was admitted with"
            )
        self._reserved[rid] -= 1
        return self.allocator.allocate(reserved=True)

    def _copy_block(self, rid: Hashable, shared: int) -> int:
        if self._copies.get(shared, 0) > 0:
            self._take_copies(shared, 1)
            block = self.allocator.allocate(reserved=True)
        else:
            block = self._allocate(rid)
        self._grow_pools()
        pools = [pool for pool in self.keys + self.values if pool is not None]
        pieces = [pool[shared] for pool in pools]
        # Evaluate the copies first: a live view of a pool would make the write below copy
        # the whole pool instead of updating it in place.
        mx.eval(pieces)
        for pool, piece in zip(pools, pieces):
            pool[block] = piece
        self.allocator.release(shared)
        return block

    def _take_copies(self, block: int, count: int) -> None:
        self._copies[block] -= count
        if self._copies[block] == 0:
            del self._copies[block]

    def _ensure_pools(self, layer: int, keys: mx.array, values: Optional[mx.array]) -> None:
        if self.keys[layer] is None:
            rows = (self.block_size, keys.shape[1])
            if self.pool_layout == "head-major":
                rows = rows[::-1]
            self.keys[layer] = mx.zeros((self.num_blocks, *rows, keys.shape[3]), keys.dtype)
            if values is not None:
                shape = (self.num_blocks, *rows, values.shape[3])
                self.values[layer] = mx.zeros(shape, values.dtype)
            made = (self.keys[layer], self.values[layer])
            place_on_huge_pages([pool for pool in made if pool is not None])
        self._grow_pools()

    def _grow_pools(self) -> None:
        # Block ids are kept: the pools grow at their end, to the allocator's capacity.
        grown = []
        for pools in (self.keys, self.values):
            for layer, pool in enumerate(pools):
                if pool is not None and pool.shape[0] < self.num_blocks:
                    widths = [(0, self.num_blocks - pool.shape[0])] + [(0, 0)] * 3
                    pools[layer] = mx.pad(pool, widths)
                    grown.append(pools[layer])
        if grown:
            place_on_huge_pages(grown)
