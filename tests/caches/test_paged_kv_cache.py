"""BlockAllocator and PagedKVCache: reference counts, prefix sharing, copy before write, the budget,
and a soak of joins and leaves that must give every block and byte back.

Cache contents are checked against what each request wrote, read back through its block table
with plain MLX indexing (logical position j = row j % block_size of block table[j // block_size]).
"""

import random

import mlx.core as mx
import numpy as np
import pytest

from mlx_batched_decode.caches.block_allocator import BlockAllocator, BlockBudgetError
from mlx_batched_decode.caches.paged_kv_cache import POOL_LAYOUTS, PagedKVCache
from mlx_batched_decode.caches.prefix_hashes import block_hashes

H_KV, D = 2, 4


# -- allocator ----------------------------------------------------------------------------------


def test_reference_counts_free_and_reuse():
    alloc = BlockAllocator(max_blocks=4, initial_blocks=4, max_cached_blocks=0)
    a, b = alloc.allocate(), alloc.allocate()
    assert (a, b) == (0, 1) and alloc.refcount(a) == 1 and alloc.num_in_use == 2
    alloc.retain(a)
    alloc.release(a)
    assert alloc.refcount(a) == 1 and alloc.num_in_use == 2
    alloc.release(a)
    assert alloc.refcount(a) == 0 and alloc.num_free == 3
    # The freed block is handed out again before a never-used one.
    assert alloc.allocate() == a
    with pytest.raises(ValueError, match=r"^\[BlockAllocator\] block 3 is not in use"):
        alloc.release(3)
    with pytest.raises(ValueError, match=r"^\[BlockAllocator\] block 3 is free"):
        alloc.retain(3)


def test_growth_up_to_the_budget_then_exhaustion():
    alloc = BlockAllocator(max_blocks=5, initial_blocks=2)
    held = [alloc.allocate() for _ in range(5)]
    assert held == [0, 1, 2, 3, 4]
    # Capacity doubled 2 -> 4, then stopped at the budget.
    assert alloc.capacity == 5
    with pytest.raises(BlockBudgetError):
        alloc.allocate()
    assert not alloc.reserve(1) and alloc.reserved == 0
    alloc.release(held[2])
    assert alloc.reserve(1) and alloc.available() == 0
    with pytest.raises(BlockBudgetError):
        alloc.allocate()
    # The reservation holds the freed block for its owner.
    assert alloc.allocate(reserved=True) == held[2]
    assert [alloc.refcount(b) for b in range(5)] == [1] * 5


def test_cached_blocks_are_kept_within_their_budget_lru_first():
    alloc = BlockAllocator(max_blocks=8, initial_blocks=8, max_cached_blocks=2)
    blocks = [alloc.allocate() for _ in range(3)]
    for block, h in zip(blocks, (10, 11, 12)):
        alloc.register(block, h)
    for block in blocks:
        alloc.release(block)
    # Three cached, budget two: the least recently released (hash 10) went back to the free list.
    assert alloc.lookup(10) is None and alloc.lookup(11) == blocks[1]
    assert alloc.num_cached == 2 and alloc.num_in_use == 0
    alloc.retain(blocks[1])
    assert alloc.num_cached == 1 and alloc.refcount(blocks[1]) == 1
    alloc.clear_cached()
    assert alloc.num_cached == 0 and alloc.lookup(12) is None and alloc.lookup(11) == blocks[1]


def test_cached_blocks_are_evicted_before_the_budget_refuses():
    alloc = BlockAllocator(max_blocks=2, initial_blocks=2, max_cached_blocks=2)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.register(a, 1)
    alloc.release(a)
    assert alloc.available() == 1
    assert alloc.allocate() == a and alloc.lookup(1) is None


# -- cache --------------------------------------------------------------------------------------


# A head's offset in the values fill writes: a pool layout that mixed up heads and rows shows.
HEAD = 100_000.0


def fill(tokens_len, start, tag):
    """[1, H_kv, P, D] keys whose every value encodes (tag, head, position): traceable after
    reads."""
    pos = np.arange(start, start + tokens_len, dtype=np.float32)
    heads = HEAD * np.arange(H_KV, dtype=np.float32)[:, None, None]
    rows = tag * 1000.0 + pos[None, :, None] + heads + np.zeros((1, H_KV, 1, D), np.float32)
    return mx.array(rows)


def gather(cache, rid, length, layer=0):
    """Request rid's first length keys [H_kv, length, D], read through its block table."""
    table = cache.tables[rid]
    j = np.arange(length)
    blocks = mx.array([table[p] for p in j // cache.block_size], dtype=mx.int32)
    rows = mx.array(j % cache.block_size, dtype=mx.int32)
    return np.array(cache.pools(layer)[0][blocks, rows]).swapaxes(0, 1)


def expected(tags_by_position):
    pos = np.arange(len(tags_by_position), dtype=np.float32)
    values = np.array(tags_by_position, np.float32) * 1000.0 + pos
    heads = HEAD * np.arange(H_KV, dtype=np.float32)[:, None, None]
    return np.broadcast_to(values[None, :, None] + heads, (H_KV, len(pos), D))


def admit_and_prefill(cache, rid, tokens, total_len, tag):
    hit = cache.admit(rid, tokens, total_len)
    if hit is None:
        return None
    rest = len(tokens) - hit
    if rest:
        kv = fill(rest, hit, tag)
        cache.write_prompt(rid, hit, [(kv, kv)] * cache.num_layers)
    cache.register_prompt(rid, tokens)
    return hit


def decode_step(cache, rids, seq_lens, tags):
    """Write one token per request at seq_lens[b] through the context's slot mapping."""
    context = cache.context(rids, seq_lens)
    new = mx.concatenate([fill(1, s, t) for s, t in zip(seq_lens, tags)], axis=0)
    for layer in range(cache.num_layers):
        cache.write(layer, new, new, context)
    return context


def test_block_hashes_chain_prefixes():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    b = block_hashes([1, 2, 3, 9, 5, 6], 3)
    c = block_hashes([4, 5, 6], 3)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    # Same tokens, different prefix: a different block.
    assert c[0] != a[1]


@pytest.mark.parametrize("pool_layout", POOL_LAYOUTS)
def test_prefix_blocks_are_shared_and_never_written(pool_layout):
    cache = PagedKVCache(2, block_size=4, max_blocks=16, initial_blocks=2, pool_layout=pool_layout)
    prompt = list(range(10))  # two full blocks and a partial one
    assert admit_and_prefill(cache, "a", prompt, 12, tag=1) == 0
    assert cache.blocks_in_use == 3
    # Shares the two full blocks of the same first 8 tokens, not the partial third.
    other = prompt[:8] + [50, 51, 52]
    assert admit_and_prefill(cache, "b", other, 13, tag=2) == 8
    assert cache.tables["b"][:2] == cache.tables["a"][:2]
    assert [cache.allocator.refcount(blk) for blk in cache.tables["a"]] == [2, 2, 1]
    # A prefix that differs in block 2: one block shared.
    assert admit_and_prefill(cache, "c", prompt[:4] + [9] * 6, 10, tag=3) == 4
    decode_step(cache, ["a", "b", "c"], [10, 11, 10], [1, 2, 3])
    mx.eval(cache.keys, cache.values)
    np.testing.assert_array_equal(gather(cache, "a", 11, layer=1), expected([1] * 11))
    np.testing.assert_array_equal(gather(cache, "b", 12), expected([1] * 8 + [2] * 4))
    np.testing.assert_array_equal(gather(cache, "c", 11), expected([1] * 4 + [3] * 7))
    cache.free("a")
    cache.free("b")
    cache.free("c")
    # Registered full blocks stay cached; the rest is free.
    assert cache.blocks_in_use == 0 and cache.allocator.num_cached == 3
    assert admit_and_prefill(cache, "d", prompt, 11, tag=4) == 8
    np.testing.assert_array_equal(gather(cache, "d", 10), expected([1] * 8 + [4] * 2))


@pytest.mark.parametrize("pool_layout", POOL_LAYOUTS)
def test_copy_before_writing_a_shared_partial_block(pool_layout):
    cache = PagedKVCache(1, block_size=4, max_blocks=8, pool_layout=pool_layout)
    admit_and_prefill(cache, "a", list(range(6)), 8, tag=1)
    assert cache.fork("a", "b", 6)
    shared = cache.tables["a"][1]
    assert cache.allocator.refcount(shared) == 2
    # b writes first: b copies the partial block, a keeps writing into the original.
    decode_step(cache, ["b"], [6], [2])
    assert cache.tables["b"][1] != shared and cache.tables["b"][0] == cache.tables["a"][0]
    assert cache.allocator.refcount(shared) == 1
    decode_step(cache, ["a", "b"], [6, 7], [1, 2])
    mx.eval(cache.keys)
    assert cache.tables["a"][1] == shared
    np.testing.assert_array_equal(gather(cache, "a", 7), expected([1] * 7))
    np.testing.assert_array_equal(gather(cache, "b", 8), expected([1] * 6 + [2] * 2))
    cache.free("a")
    cache.free("b")
    assert cache.blocks_in_use == 0 and cache.allocator.reserved == 0


def test_copy_reservation_returns_when_a_sharer_leaves_first():
    cache = PagedKVCache(1, block_size=4, max_blocks=8, max_cached_blocks=0)
    admit_and_prefill(cache, "a", list(range(6)), 8, tag=1)
    assert cache.fork("a", "b", 6) and cache.fork("a", "c", 6)
    cache.free("b")
    cache.free("c")
    # a alone again: it writes its partial block in place, no copy reserved any more.
    assert cache.allocator.reserved == 0
    decode_step(cache, ["a"], [6], [1])
    cache.free("a")
    assert cache.blocks_in_use == 0 and cache.allocator.num_free == cache.num_blocks


def test_budget_exhaustion_makes_a_request_wait_and_never_overwrites():
    cache = PagedKVCache(1, block_size=4, max_blocks=4, max_cached_blocks=0)
    assert admit_and_prefill(cache, "a", list(range(7)), 12, tag=1) == 0  # 3 blocks
    # 2 blocks needed, 1 left: b waits, nothing taken.
    assert cache.admit("b", [90, 91, 92], 8) is None
    assert "b" not in cache.tables and cache.allocator.reserved == 1
    decode_step(cache, ["a"], [7], [1])
    decode_step(cache, ["a"], [8], [1])  # a's reserved third block
    mx.eval(cache.keys)
    np.testing.assert_array_equal(gather(cache, "a", 9), expected([1] * 9))
    # The one block a does not hold is all there is; a second allocation is refused.
    spare = cache.allocator.allocate()
    with pytest.raises(BlockBudgetError):
        cache.allocator.allocate()
    assert cache.admit("b", [90, 91, 92], 8) is None
    cache.allocator.release(spare)
    cache.free("a")
    assert admit_and_prefill(cache, "b", [90, 91, 92], 8, tag=2) == 0
    mx.eval(cache.keys)
    np.testing.assert_array_equal(gather(cache, "b", 3), expected([2] * 3))
    for position in range(3, 8):
        decode_step(cache, ["b"], [position], [2])
    with pytest.raises(ValueError, match=r"^\[PagedKVCache\] request 'b' writes past"):
        decode_step(cache, ["b"], [8], [2])


@pytest.mark.parametrize("pool_layout", POOL_LAYOUTS)
def test_pools_grow_keeping_block_ids_and_contents(pool_layout):
    cache = PagedKVCache(1, block_size=2, initial_blocks=1, pool_layout=pool_layout)
    admit_and_prefill(cache, "a", list(range(9)), 9, tag=1)
    mx.eval(cache.keys)
    assert cache.num_blocks == 8 and cache.pools(0)[0].shape == (8, 2, H_KV, D)
    np.testing.assert_array_equal(gather(cache, "a", 9), expected([1] * 9))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"^\[PagedKVCache\] block_size"):
        PagedKVCache(1, block_size=0)
    with pytest.raises(ValueError, match=r"^\[PagedKVCache\] pool_layout must be one of"):
        PagedKVCache(1, pool_layout="page-major")
    with pytest.raises(ValueError, match=r"^\[BlockAllocator\] max_blocks"):
        PagedKVCache(1, max_blocks=0)
    cache = PagedKVCache(1)
    cache.admit("a", [1, 2], 4)
    with pytest.raises(ValueError, match=r"^\[PagedKVCache\] request 'a' is already"):
        cache.admit("a", [1, 2], 4)
    with pytest.raises(ValueError, match=r"^\[PagedKVCache\] total_len 1"):
        cache.admit("b", [1, 2], 1)


@pytest.mark.parametrize("pool_layout", POOL_LAYOUTS)
def test_soak_joins_and_leaves_give_every_block_and_byte_back(pool_layout):
    """Thousands of requests with shared prefixes join (some as forks of running ones, sharing
    a partly filled block), decode a few tokens and leave under a tight budget; contents are checked along the way, then every block is free again and MLX's
    active memory is back to where it was with the pools at their budget."""
    rng = random.Random(0)
    block_size, budget = 4, 24
    cache = PagedKVCache(
        2, block_size=block_size, max_blocks=budget, max_cached_blocks=8, pool_layout=pool_layout
    )
    system = [rng.randrange(50) for _ in range(3 * block_size)]
    # Grow the pools to the budget once, then measure.
    admit_and_prefill(cache, "warm", list(range(budget * block_size)), budget * block_size, 0)
    cache.free("warm")
    cache.clear_prefix_cache()
    mx.eval(cache.keys, cache.values)
    mx.clear_cache()
    baseline = mx.get_active_memory()

    active, tags, joined, waited, hits, forks = {}, {}, 0, 0, 0, 0
    for step in range(4000):
        if rng.random() < 0.8 and len(active) < 8:
            shared = system[: rng.choice([0, 1, 4, 8, 11, 12])]
            prompt = shared + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            total = len(prompt) + rng.randrange(1, 16)
            hit = admit_and_prefill(cache, joined, prompt, total, tag=joined + 1)
            if hit is None:
                waited += 1
            else:
                hits += hit
                # Shared prefix positions keep the tag of whoever wrote them first.
                first = gather(cache, joined, max(hit, 1))[0, :hit, 0] // 1000
                tags[joined] = list(first.astype(int)) + [joined + 1] * (len(prompt) - hit)
                active[joined] = (len(prompt), total)
            joined += 1
        elif active and rng.random() < 0.3 and len(active) < 8:
            # Parallel sampling: a copy of a running request shares all its blocks.
            src = rng.choice(list(active))
            if cache.fork(src, joined, active[src][0]):
                active[joined], tags[joined] = active[src], list(tags[src])
                forks += 1
            joined += 1
        if active:
            rids = list(active)
            lens = [active[r][0] for r in rids]
            decode_step(cache, rids, lens, [r + 1 for r in rids])
            for r in rids:
                tags[r].append(r + 1)
                length, total = active[r]
                active[r] = (length + 1, total)
            if step % 31 == 0:
                mx.eval(cache.keys, cache.values)
                for r in rids:
                    np.testing.assert_array_equal(
                        gather(cache, r, active[r][0], layer=1), expected(tags[r])
                    )
            for r in [r for r in rids if active[r][0] == active[r][1]]:
                cache.free(r)
                del active[r], tags[r]
    for r in list(active):
        cache.free(r)
    assert joined > 2000 and waited > 100 and hits > 1000 and forks > 100, (joined, waited, hits, forks)
    assert cache.blocks_in_use == 0 and cache.allocator.reserved == 0
    cache.clear_prefix_cache()
    assert cache.allocator.num_free == cache.num_blocks == budget
    mx.eval(cache.keys, cache.values)
    mx.clear_cache()
    assert mx.get_active_memory() == baseline
