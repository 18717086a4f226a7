"""RingSlotKVCache: a windowed layer's last R positions per request, in a ring that the op reads
through ring_offset. Attention over the ring equals attention over a SlotKVCache that keeps every
position, step by step, with prompts longer than the ring, speculative rounds that roll back and
requests that leave; a step copies no ring; the ring never holds more than R positions."""

import random

import mlx.core as mx
import pytest

from mlx_batched_decode.attention.ring import RingSlotAttention
from mlx_batched_decode.attention.slot import SlotAttention
from mlx_batched_decode.caches.context import BatchedDecodeContext
from mlx_batched_decode.caches.kv_cache import SlotKVCache
from mlx_batched_decode.caches.ring_kv_cache import RingSlotKVCache

HEADS, DIM, WINDOW = 2, 16, 5


def _kv(batch, length, heads=HEADS, dim=DIM):
    return (
        mx.random.normal((batch, heads, length, dim)),
        mx.random.normal((batch, heads, length, dim)),
    )


def test_prompt_keeps_its_last_positions_at_p_mod_r():
    cache = RingSlotKVCache(size=7, step=4)
    short, long = _kv(1, 3), _kv(1, 19)
    cache.write_prompt(0, *short)
    assert cache.capacity == 4
    cache.write_prompt(1, *long)
    assert cache.capacity == 7 and cache.slots == 2
    assert mx.array_equal(cache.keys[0, :, :3], short[0][0]).item()
    for p in range(12, 19):
        assert mx.array_equal(cache.keys[1, :, p % 7], long[0][0, :, p]).item()
        assert mx.array_equal(cache.values[1, :, p % 7], long[1][0, :, p]).item()


def _schedule(kind, prompt_lens, rounds, k, seed):
    """``(seq_lens, L)`` per step: a target verifying k draft tokens (L = k + 1, then 1 to k + 1
    tokens accepted), or a draft feeding k + 1 single tokens per round, then rolled back to 1 to
    k + 1 of them."""
    rng = random.Random(seed)
    lens, steps = list(prompt_lens), []
    for _ in range(rounds):
        if kind == "target":
            steps.append((list(lens), k + 1))
        else:
            steps += [([n + j for n in lens], 1) for j in range(k + 1)]
        lens = [n + rng.randint(1, k + 1) for n in lens]
    return steps


def _mismatched_steps(kind, size, k=2, prompt_lens=(0, 3, 12, 30)):
    """Steps of a schedule at which a ring of ``size`` positions attends other keys than a cache
    of every position (rows within WINDOW keys)."""
    mx.random.seed(3)
    batch = len(prompt_lens)
    ring, full = RingSlotKVCache(size, step=4), SlotKVCache(step=4)
    for slot, n in enumerate(prompt_lens):
        if n:
            prompt = _kv(1, n)
            ring.write_prompt(slot, *prompt)
            full.write_prompt(slot, *prompt)
    ring_path, full_path = RingSlotAttention(size), SlotAttention()
    mismatched = 0
    for seq_lens, query_len in _schedule(kind, prompt_lens, 12, k, seed=7):
        context = BatchedDecodeContext(
            batch, seq_lens, [ring, full], query_len=query_len, ring_sizes=[size]
        )
        queries = mx.random.normal((batch, 2 * HEADS, query_len, DIM))
        new = _kv(batch, query_len)
        got = ring_path(context, 0, queries, *new, window=WINDOW, scale=0.3)
        expected = full_path(context, 1, queries, *new, window=WINDOW, scale=0.3)
        mismatched += not mx.allclose(got, expected, atol=1e-5).item()
    assert ring.capacity == size and full.capacity >= max(seq_lens) + query_len
    return mismatched


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_ring_attends_as_the_full_cache_through_rollbacks(kind):
    """R = WINDOW + k (what BatchedDecoder keeps): rejected tokens written over the ring never
    clobber a key a later step reads, and every row attends the keys a cache of every position
    gives it."""
    assert _mismatched_steps(kind, WINDOW + 2) == 0


def test_the_draft_needs_window_plus_k_minus_one():
    """The draft writes k + 1 tokens one by one before a round rolls back to as few as one of
    them: a ring of WINDOW + k - 1 still holds every key read later, one of WINDOW + k - 2 lets
    a rejected token overwrite one."""
    assert _mismatched_steps("draft", WINDOW + 1) == 0
    assert _mismatched_steps("draft", WINDOW) > 0


def test_move_copies_the_whole_ring():
    cache = RingSlotKVCache(size=6, step=8)
    for slot, n in enumerate([20, 4]):
        cache.write_prompt(slot, *_kv(1, n))
    before = mx.array(cache.keys[0])
    cache.move(0, 1, 20)
    assert mx.array_equal(cache.keys[1], before).item()


def test_decode_step_copies_no_ring():
    slots, heads, size, dim = 8, 8, 1024, 128
    seq_lens = [100, 3000, 500, 1023, 3, 7000, 250, 1024]
    like = mx.zeros((1, heads, 1, dim))
    cache = RingSlotKVCache(size, step=256)
    cache.reserve(slots, size, like, like)
    queries = mx.random.normal((slots, heads, 1, dim))
    new_keys, new_values = _kv(slots, 1, heads, dim)
    mx.eval(cache.keys, cache.values, queries, new_keys, new_values)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    context = BatchedDecodeContext(slots, seq_lens, [cache], ring_sizes=[size])
    mx.eval(RingSlotAttention(size)(context, 0, queries, new_keys, new_values, window=size))
    assert mx.get_peak_memory() - base < cache.keys.nbytes / 16
    for b, s in enumerate(seq_lens):
        assert mx.array_equal(cache.keys[b, :, s % size], new_keys[b, :, 0]).item()


def test_mismatches_are_refused():
    x = mx.random.normal((2, HEADS, 1, DIM))
    cache = RingSlotKVCache(size=8)
    no_ring = BatchedDecodeContext(2, [1, 1], [cache])
    with pytest.raises(ValueError, match=r"^\[RingSlotKVCache\] the step's context has no ring"):
        cache.update(x, x, no_ring)
    context = BatchedDecodeContext(2, [1, 1], [cache, SlotKVCache()], ring_sizes=[8])
    with pytest.raises(TypeError, match=r"^\[RingSlotAttention\] layer 1 needs"):
        RingSlotAttention(8)(context, 1, x, x, x, window=8)
    for window in (None, 9):
        with pytest.raises(ValueError, match=r"^\[RingSlotAttention\] a ring of 8 positions"):
            RingSlotAttention(8)(context, 0, x, x, x, window=window)
    with pytest.raises(ValueError, match=r"^\[RingSlotKVCache\] size"):
        RingSlotKVCache(size=0)
