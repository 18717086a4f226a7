"""ContiguousKVCache and SlotKVCache: writes land where they should, growth loses nothing,
and a decode step copies no whole buffer."""

import mlx.core as mx
import pytest

from mlx_batched_decode.attention.seed import SeedAttention
from mlx_batched_decode.attention.slot import SlotAttention
from mlx_batched_decode.caches.context import BatchedDecodeContext
from mlx_batched_decode.caches.kv_cache import ContiguousKVCache, SlotKVCache

HEADS, DIM = 2, 8


def _kv(batch, length, heads=HEADS, dim=DIM, dtype=mx.float32):
    return mx.random.normal((batch, heads, length, dim)).astype(dtype), mx.random.normal(
        (batch, heads, length, dim)
    ).astype(dtype)


@pytest.mark.parametrize(
    "chunks", [[1] * 9, [4, 1], [3, 1, 1], [3, 3, 3], [8, 1], [9], [5, 4, 7], [4, 4, 4]]
)
def test_contiguous_growth_keeps_every_token(chunks):
    cache = ContiguousKVCache(step=4)
    all_keys, all_values = [], []
    for n in chunks:
        keys, values = _kv(1, n)
        all_keys.append(keys)
        all_values.append(values)
        got_keys, got_values = cache.update_and_fetch(keys, values)
        total = sum(k.shape[2] for k in all_keys)
        assert cache.offset == total and got_keys.shape == (1, HEADS, total, DIM)
        # Grows only when a write passes the capacity, in whole chunks.
        assert cache.capacity == -(-total // 4) * 4
        assert mx.array_equal(got_keys, mx.concatenate(all_keys, axis=2)).item()
        assert mx.array_equal(got_values, mx.concatenate(all_values, axis=2)).item()


def test_contiguous_rejects_bad_step():
    with pytest.raises(ValueError, match=r"^\[ContiguousKVCache\]"):
        ContiguousKVCache(step=0)


def _prefilled_slots(prompt_lens, step):
    cache = SlotKVCache(step=step)
    history = []
    for slot, length in enumerate(prompt_lens):
        keys, values = _kv(1, length)
        cache.write_prompt(slot, keys, values)
        history.append([keys[0], values[0]])
    return cache, history


def test_slot_update_writes_each_request_at_its_offset():
    cache, history = _prefilled_slots([3, 1, 6], step=16)
    ctx = BatchedDecodeContext(3, [3, 1, 6], [cache])
    new_keys, new_values = _kv(3, 1)
    keys, values = cache.update(new_keys, new_values, ctx)
    assert keys.shape == values.shape == (3, HEADS, 7, DIM)
    for b, length in enumerate([3, 1, 6]):
        assert mx.array_equal(keys[b, :, :length], history[b][0]).item()
        assert mx.array_equal(values[b, :, :length], history[b][1]).item()
        assert mx.array_equal(keys[b, :, length], new_keys[b, :, 0]).item()
        assert mx.array_equal(values[b, :, length], new_values[b, :, 0]).item()


def test_slot_growth_at_capacity_boundary_loses_nothing():
    step = 4
    seq_lens = [2, 3, 0]
    cache, history = _prefilled_slots(seq_lens[:2], step=step)
    history.append([mx.zeros((HEADS, 0, DIM)), mx.zeros((HEADS, 0, DIM))])
    capacities = []
    for _ in range(7):
        ctx = BatchedDecodeContext(3, seq_lens, [cache])
        new_keys, new_values = _kv(3, 1)
        keys, values = cache.update(new_keys, new_values, ctx)
        capacities.append(cache.capacity)
        for b in range(3):
            history[b][0] = mx.concatenate([history[b][0], new_keys[b]], axis=1)
            history[b][1] = mx.concatenate([history[b][1], new_values[b]], axis=1)
            length = seq_lens[b] + 1
            assert mx.array_equal(keys[b, :, :length], history[b][0]).item()
            assert mx.array_equal(values[b, :, :length], history[b][1]).item()
        seq_lens = [s + 1 for s in seq_lens]
    # max_len goes 4, 5, ..., 10: the buffer fills exactly, then grows by whole chunks.
    assert capacities == [4, 8, 8, 8, 8, 12, 12]


def test_slot_count_grows_and_keeps_earlier_slots():
    cache, history = _prefilled_slots([5], step=8)
    assert cache.slots == 1
    keys, values = _kv(1, 3)
    cache.write_prompt(3, keys, values)
    assert cache.slots == 4
    assert mx.array_equal(cache.keys[0, :, :5], history[0][0]).item()
    assert mx.array_equal(cache.values[3, :, :3], values[0]).item()


def test_admitting_requests_one_by_one_doubles_the_slot_count():
    cache, history = _prefilled_slots([2], step=8)
    counts = []
    for slot in range(1, 33):
        keys, values = _kv(1, 2)
        cache.write_prompt(slot, keys, values)
        counts.append(cache.slots)
    assert sorted(set(counts)) == [2, 4, 8, 16, 32, 64]
    assert mx.array_equal(cache.keys[0, :, :2], history[0][0]).item()


def test_move_copies_one_slot_into_another():
    cache, _ = _prefilled_slots([4, 2, 7], step=8)
    before = mx.array(cache.keys)
    before_values = mx.array(cache.values)
    mx.eval(before, before_values)
    cache.move(2, 0, 7)
    assert mx.array_equal(cache.keys[0, :, :7], before[2, :, :7]).item()
    assert mx.array_equal(cache.values[0, :, :7], before_values[2, :, :7]).item()
    assert mx.array_equal(cache.keys[1:], before[1:]).item()


def test_decode_step_does_not_copy_whole_buffers():
    """MLX's memory counters: a slot-path step allocates far less than one cache buffer, while the
    seed path on the same lengths allocates at least its padded batch."""
    slots, heads, capacity, dim, layers = 8, 8, 1024, 128, 2
    seq_lens = [100, 900, 500, 1000, 3, 700, 250, 1020]
    like = mx.zeros((1, heads, 1, dim))
    caches = [SlotKVCache(step=capacity) for _ in range(layers)]
    for cache in caches:
        cache.reserve(slots, capacity, like, like)
    buffer_bytes = caches[0].keys.nbytes
    queries = mx.random.normal((slots, heads * 2, 1, dim))
    new_keys, new_values = _kv(slots, 1, heads, dim)
    mx.eval([c.keys for c in caches], [c.values for c in caches], queries, new_keys, new_values)

    mx.reset_peak_memory()
    base = mx.get_active_memory()
    ctx = BatchedDecodeContext(slots, seq_lens, caches)
    out = [SlotAttention()(ctx, layer, queries, new_keys, new_values) for layer in range(layers)]
    mx.eval(out)
    slot_extra = mx.get_peak_memory() - base
    assert slot_extra < buffer_bytes / 16, (slot_extra, buffer_bytes)
    for cache in caches:
        for b, s in enumerate(seq_lens):
            assert mx.array_equal(cache.keys[b, :, s], new_keys[b, :, 0]).item()

    seed_caches = []
    for _ in range(layers):
        per_request = []
        for s in seq_lens:
            cache = ContiguousKVCache(step=capacity)
            cache.update_and_fetch(*_kv(1, s, heads, dim))
            per_request.append(cache)
        seed_caches.append(per_request)
    mx.eval([[c.keys for c in per_request] for per_request in seed_caches])
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    ctx = BatchedDecodeContext(slots, seq_lens, seed_caches)
    out = [SeedAttention()(ctx, layer, queries, new_keys, new_values) for layer in range(layers)]
    mx.eval(out)
    padded_batch = 2 * slots * heads * ctx.max_len * dim * 4
    assert mx.get_peak_memory() - base >= padded_batch


def test_slot_update_writes_several_tokens_over_rejected_ones():
    """L = 3 new tokens per request land at seq_lens[b] .. + 2, overwriting what was there."""
    cache, history = _prefilled_slots([5, 2, 7], step=8)
    seq_lens = [3, 2, 7]  # request 0 rolled back two rejected tokens
    ctx = BatchedDecodeContext(3, seq_lens, [cache], query_len=3)
    new_keys, new_values = _kv(3, 3)
    keys, values = cache.update(new_keys, new_values, ctx)
    assert keys.shape == (3, HEADS, 10, DIM) and cache.capacity == 16
    for b, n in enumerate(seq_lens):
        assert mx.array_equal(keys[b, :, :n], history[b][0][:, :n]).item()
        assert mx.array_equal(keys[b, :, n : n + 3], new_keys[b]).item()
        assert mx.array_equal(values[b, :, n : n + 3], new_values[b]).item()


def test_contiguous_rewind_forgets_tokens():
    cache = ContiguousKVCache(step=4)
    keys, values = _kv(1, 6)
    cache.update_and_fetch(keys, values)
    cache.rewind(2)
    more_keys, more_values = _kv(1, 3)
    got_keys, _ = cache.update_and_fetch(more_keys, more_values)
    assert cache.offset == 5
    assert mx.array_equal(got_keys, mx.concatenate([keys[:, :, :2], more_keys], axis=2)).item()
    with pytest.raises(ValueError, match=r"^\[ContiguousKVCache\]"):
        cache.rewind(6)
