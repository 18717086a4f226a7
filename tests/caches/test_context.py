"""BatchedDecodeContext: derived arrays, made once per step, shared by every layer."""

import mlx.core as mx
import pytest

import mlx_batched_decode
from mlx_batched_decode.attention.ring import RingSlotAttention
from mlx_batched_decode.attention.slot import SlotAttention
from mlx_batched_decode.caches.context import BatchedDecodeContext
from mlx_batched_decode.caches.kv_cache import SlotKVCache
from mlx_batched_decode.caches.ring_kv_cache import RingSlotKVCache


def test_derived_fields_with_uneven_lengths():
    ctx = BatchedDecodeContext(4, [3, 0, 17, 5], layer_caches=[])
    assert ctx.offsets.dtype == mx.int32 and ctx.offsets.tolist() == [3, 0, 17, 5]
    assert ctx.max_len == 18
    assert ctx.valid_lens.dtype == mx.int32 and ctx.valid_lens.tolist() == [4, 1, 18, 6]
    assert ctx.needs_padding is True
    assert ctx.pad_sizes == [14, 17, 0, 12]
    assert ctx.positions.tolist() == list(range(18))
    assert ctx.new_positions.dtype == mx.int32
    assert ctx.new_positions.tolist() == [[3], [0], [17], [5]]
    assert ctx.rows.tolist() == [[0], [1], [2], [3]]


def test_several_new_tokens_per_request():
    """L = 3 (a target verifying 2 draft tokens): each request's rows are its last 3 positions."""
    ctx = BatchedDecodeContext(3, [4, 0, 9], layer_caches=[], query_len=3)
    assert ctx.max_len == 12
    assert ctx.valid_lens.tolist() == [7, 3, 12]
    assert ctx.new_positions.tolist() == [[4, 5, 6], [0, 1, 2], [9, 10, 11]]
    assert ctx.pad_sizes == [5, 9, 0]
    assert ctx.positions.tolist() == list(range(12))


def test_equal_lengths_need_no_padding():
    ctx = BatchedDecodeContext(3, [7, 7, 7], layer_caches=[])
    assert ctx.needs_padding is False
    assert ctx.pad_sizes == [0, 0, 0]
    assert ctx.max_len == 8
    assert ctx.valid_lens.tolist() == [8, 8, 8]


def test_single_request():
    ctx = BatchedDecodeContext(1, [0], layer_caches=[])
    assert ctx.max_len == 1 and ctx.valid_lens.tolist() == [1]


@pytest.mark.parametrize(
    "batch_size, seq_lens, query_len", [(2, [1], 1), (0, [], 1), (2, [1, -1], 1), (1, [3], 0)]
)
def test_malformed_arguments(batch_size, seq_lens, query_len):
    with pytest.raises(ValueError, match=r"^\[BatchedDecodeContext\]"):
        BatchedDecodeContext(batch_size, seq_lens, layer_caches=[], query_len=query_len)


def test_every_layer_reads_the_same_arrays(monkeypatch):
    """One context per step: all N layers get the very same valid_lens object, no copies."""
    seen = []
    real_op = mlx_batched_decode.batched_decode_attention

    def spy(queries, keys, values, valid_lens, **kwargs):
        seen.append((valid_lens, keys.shape))
        return real_op(queries, keys, values, valid_lens, **kwargs)

    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", spy)
    num_layers, seq_lens, heads, dim = 6, [2, 9, 5], 2, 64
    caches = [SlotKVCache(step=16) for _ in range(num_layers)]
    ctx = BatchedDecodeContext(len(seq_lens), seq_lens, caches)
    attention = SlotAttention()
    x = mx.random.normal((len(seq_lens), heads, 1, dim))
    for layer in range(num_layers):
        x = attention(ctx, layer, x, x, x)
    mx.eval(x)
    assert len(seen) == num_layers
    assert all(valid_lens is ctx.valid_lens for valid_lens, _ in seen)
    assert all(shape == (3, heads, ctx.max_len, dim) for _, shape in seen)


def test_ring_steps_per_ring_size():
    """Rings of R positions: logical lengths min(len, R), offsets max(len - R, 0), write slots
    mod R, and the positions attention reads; one RingStep per size, whatever the layers."""
    ctx = BatchedDecodeContext(3, [3, 10, 20], [], query_len=2, ring_sizes=[8, 30])
    assert sorted(ctx.rings) == [8, 30]
    ring = ctx.rings[8]
    assert ring.size == 8 and ring.max_len == 8
    assert ring.valid_lens.dtype == mx.int32 and ring.valid_lens.tolist() == [5, 8, 8]
    assert ring.ring_offset.tolist() == [0, 4, 14]
    assert ring.new_slots.tolist() == [[3, 4], [2, 3], [4, 5]]
    roomy = ctx.rings[30]
    assert roomy.max_len == 22 and roomy.valid_lens.tolist() == [5, 12, 22]
    assert roomy.ring_offset.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"^\[BatchedDecodeContext\] a ring of 2 positions"):
        BatchedDecodeContext(1, [4], [], query_len=3, ring_sizes=[2])


def test_every_ring_layer_reads_the_same_ring_arrays(monkeypatch):
    seen = []
    real_op = mlx_batched_decode.batched_decode_attention

    def spy(queries, keys, values, valid_lens, **kwargs):
        seen.append((valid_lens, kwargs["ring_offset"]))
        return real_op(queries, keys, values, valid_lens, **kwargs)

    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", spy)
    caches = [RingSlotKVCache(size=4, step=4) for _ in range(3)]
    ctx = BatchedDecodeContext(2, [2, 9], caches, ring_sizes=[4])
    x = mx.random.normal((2, 2, 1, 8))
    attention = RingSlotAttention(4)
    for layer in range(3):
        x = attention(ctx, layer, x, x, x, window=4)
    mx.eval(x)
    ring = ctx.rings[4]
    assert all(lens is ring.valid_lens and offset is ring.ring_offset for lens, offset in seen)
