"""QuantizedSlotKVCache: every position holds exactly what mx.quantize makes of the dense keys and
values written there, growth loses nothing, and a step's write copies no whole buffer."""

import mlx.core as mx
import pytest

from mlx_batched_decode.caches.context import BatchedDecodeContext
from mlx_batched_decode.caches.quantized_kv_cache import QuantizedSlotKVCache

HEADS, DIM = 2, 128


def _kv(batch, length, heads=HEADS, dim=DIM, dtype=mx.float32):
    return (
        mx.random.normal((batch, heads, length, dim)).astype(dtype),
        mx.random.normal((batch, heads, length, dim)).astype(dtype),
    )


def _quantized(x, cache):
    return mx.quantize(x, group_size=cache.group_size, bits=cache.bits)


def _assert_holds(triple, dense, cache):
    """``triple`` (views ``[H_kv, n, *]``) equals mx.quantize of ``dense [H_kv, n, D]``, bit for
    bit, and its members have mx.quantize's dtypes."""
    for got, want in zip(triple, _quantized(dense, cache)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item()


def _slot(triple, b, positions):
    return tuple(x[b, :, positions] for x in triple)


def _prefilled(prompt_lens, step, bits=8, group_size=64, dtype=mx.float32):
    cache = QuantizedSlotKVCache(group_size, bits, step)
    history = []
    for slot, length in enumerate(prompt_lens):
        keys, values = _kv(1, length, dtype=dtype)
        cache.write_prompt(slot, _quantized(keys, cache), _quantized(values, cache))
        history.append([keys[0], values[0]])
    return cache, history


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 64), (8, 32), (4, 128)])
def test_update_writes_the_quantized_tokens_at_each_offset(bits, group_size, dtype):
    seq_lens = [3, 1, 6]
    cache, history = _prefilled(seq_lens, 16, bits, group_size, dtype)
    ctx = BatchedDecodeContext(3, seq_lens, [cache])
    new_keys, new_values = _kv(3, 1, dtype=dtype)
    keys, values = cache.update(new_keys, new_values, ctx)
    words, groups = DIM * bits // 32, DIM // group_size
    assert [x.shape for x in keys] == [(3, HEADS, 7, words)] + 2 * [(3, HEADS, 7, groups)]
    assert keys[0].dtype == mx.uint32 and keys[1].dtype == keys[2].dtype == dtype
    for b, length in enumerate(seq_lens):
        _assert_holds(_slot(keys, b, slice(0, length)), history[b][0], cache)
        _assert_holds(_slot(values, b, slice(0, length)), history[b][1], cache)
        _assert_holds(_slot(keys, b, slice(length, length + 1)), new_keys[b], cache)
        _assert_holds(_slot(values, b, slice(length, length + 1)), new_values[b], cache)


def test_views_are_read_in_place():
    cache, _ = _prefilled([5, 2], 16)
    keys, values = cache.update(*_kv(2, 1), BatchedDecodeContext(2, [5, 2], [cache]))
    for view, buffer in zip((*keys, *values), cache.buffers()):
        # A strided view of the buffer: row stride = the buffer's capacity, not max_len.
        assert view.shape[2] == 6 and buffer.shape[2] == 16


def test_growth_at_capacity_boundary_loses_nothing():
    seq_lens = [2, 3, 0]
    cache, history = _prefilled(seq_lens[:2], step=4)
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
            _assert_holds(_slot(keys, b, slice(0, length)), history[b][0], cache)
            _assert_holds(_slot(values, b, slice(0, length)), history[b][1], cache)
        seq_lens = [s + 1 for s in seq_lens]
    assert capacities == [4, 8, 8, 8, 8, 12, 12]
    assert all(x.shape[2] == 12 for x in cache.buffers())


def test_slot_count_grows_and_keeps_earlier_slots():
    cache, history = _prefilled([5], step=8, bits=4)
    counts = []
    for slot in range(1, 9):
        keys, values = _kv(1, 3)
        cache.write_prompt(slot, _quantized(keys, cache), _quantized(values, cache))
        counts.append(cache.slots)
    assert counts == [2, 4, 4, 8, 8, 8, 8, 16]
    _assert_holds(_slot(cache.keys, 0, slice(0, 5)), history[0][0], cache)
    _assert_holds(_slot(cache.values, 0, slice(0, 5)), history[0][1], cache)
    _assert_holds(_slot(cache.values, 8, slice(0, 3)), values[0], cache)


def test_several_tokens_overwrite_rejected_ones():
    """L = 3 new tokens per request land at seq_lens[b] .. + 2, over what was there."""
    cache, history = _prefilled([5, 2, 7], step=8)
    seq_lens = [3, 2, 7]  # request 0 rolled back two rejected tokens
    ctx = BatchedDecodeContext(3, seq_lens, [cache], query_len=3)
    new_keys, new_values = _kv(3, 3)
    keys, values = cache.update(new_keys, new_values, ctx)
    assert keys[0].shape[2] == 10 and cache.capacity == 16
    for b, n in enumerate(seq_lens):
        _assert_holds(_slot(keys, b, slice(0, n)), history[b][0][:, :n], cache)
        _assert_holds(_slot(keys, b, slice(n, n + 3)), new_keys[b], cache)
        _assert_holds(_slot(values, b, slice(n, n + 3)), new_values[b], cache)


def test_move_copies_one_slot_into_another():
    cache, history = _prefilled([4, 2, 7], step=8)
    before = [mx.array(x) for x in cache.buffers()]
    mx.eval(before)
    cache.move(2, 0, 7)
    _assert_holds(_slot(cache.keys, 0, slice(0, 7)), history[2][0], cache)
    _assert_holds(_slot(cache.values, 0, slice(0, 7)), history[2][1], cache)
    for x, old in zip(cache.buffers(), before):
        assert mx.array_equal(x[1:], old[1:]).item()


def test_write_copies_no_whole_buffer():
    """A step's quantize + six scatters allocate far less than one buffer: the writes are in
    place."""
    slots, heads, capacity, dim = 8, 8, 1024, 128
    seq_lens = [100, 900, 500, 1000, 3, 700, 250, 1020]
    cache = QuantizedSlotKVCache(64, 8, step=capacity)
    like = _quantized(mx.zeros((1, heads, 1, dim)), cache)
    cache.reserve(slots, capacity, like, like)
    smallest = min(x.nbytes for x in cache.buffers())
    new_keys, new_values = _kv(slots, 1, heads, dim)
    mx.eval(new_keys, new_values)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    context = BatchedDecodeContext(slots, seq_lens, [cache])
    keys, values = cache.update(new_keys, new_values, context)
    mx.eval(cache.buffers())
    assert mx.get_peak_memory() - base < smallest / 8, (mx.get_peak_memory() - base, smallest)
    for b, s in enumerate(seq_lens):
        _assert_holds(_slot(keys, b, slice(s, s + 1)), new_keys[b], cache)


def test_rejects_bad_arguments():
    for bits, group_size in [(3, 64), (2, 64), (16, 64), (8, 16), (4, 256)]:
        with pytest.raises(ValueError, match=r"^\[QuantizedSlotKVCache\] kv_"):
            QuantizedSlotKVCache(group_size, bits)
    with pytest.raises(ValueError, match=r"^\[QuantizedSlotKVCache\] step"):
        QuantizedSlotKVCache(64, 8, step=0)
    cache = QuantizedSlotKVCache(64, 8)
    keys = mx.quantize(mx.zeros((1, HEADS, 3, DIM)), group_size=32, bits=8)
    with pytest.raises(ValueError, match=r"^\[QuantizedSlotKVCache\] .*not quantized with"):
        cache.write_prompt(0, keys, keys)
    assert cache.keys is None
