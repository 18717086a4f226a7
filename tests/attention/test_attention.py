"""The attention wrapper: both paths against per-request SDPA on each request's unpadded keys."""

import math

import mlx.core as mx
import pytest

import mlx_batched_decode
from mlx_batched_decode.attention.seed import SeedAttention
from mlx_batched_decode.attention.slot import SlotAttention
from mlx_batched_decode.caches.context import BatchedDecodeContext
from mlx_batched_decode.caches.kv_cache import ContiguousKVCache, SlotKVCache

TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}


def _expected(queries, history_keys, history_values, scale):
    """Each request alone: SDPA over exactly its own keys (computed in float32)."""
    rows = []
    for b in range(queries.shape[0]):
        rows.append(
            mx.fast.scaled_dot_product_attention(
                queries[b : b + 1].astype(mx.float32),
                history_keys[b].astype(mx.float32),
                history_values[b].astype(mx.float32),
                scale=scale,
            )
        )
    return mx.concatenate(rows, axis=0)


def _prompt(heads_kv, length, dim, dtype):
    return (
        mx.random.normal((1, heads_kv, length, dim)).astype(dtype),
        mx.random.normal((1, heads_kv, length, dim)).astype(dtype),
    )


@pytest.mark.parametrize("path", ["slot", "seed"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(
    "dim, heads_q, heads_kv", [(64, 4, 4), (64, 8, 2), (128, 8, 1), (128, 4, 2)]
)
@pytest.mark.parametrize("prompt_lens", [[0, 1, 17, 97], [5, 5, 5]])
def test_paths_match_per_request_attention(path, dtype, dim, heads_q, heads_kv, prompt_lens):
    mx.random.seed(0)
    batch, layers, steps = len(prompt_lens), 2, 3
    history = [[list(_prompt(heads_kv, n, dim, dtype)) for n in prompt_lens] for _ in range(layers)]
    if path == "slot":
        attention = SlotAttention()
        caches = [SlotKVCache(step=32) for _ in range(layers)]
        for layer, cache in enumerate(caches):
            for b, n in enumerate(prompt_lens):
                if n:
                    cache.write_prompt(b, *history[layer][b])
    else:
        attention = SeedAttention()
        caches = [[ContiguousKVCache(step=32) for _ in prompt_lens] for _ in range(layers)]
        for layer in range(layers):
            for b, n in enumerate(prompt_lens):
                if n:
                    caches[layer][b].update_and_fetch(*history[layer][b])
    seq_lens = list(prompt_lens)
    scale = 1.0 / math.sqrt(dim)
    for _ in range(steps):
        ctx = BatchedDecodeContext(batch, seq_lens, caches)
        queries = mx.random.normal((batch, heads_q, 1, dim)).astype(dtype)
        for layer in range(layers):
            new_keys, new_values = _prompt(heads_kv, batch, dim, dtype)
            new_keys, new_values = new_keys.swapaxes(0, 2), new_values.swapaxes(0, 2)
            out = attention(ctx, layer, queries, new_keys, new_values)
            assert out.shape == queries.shape and out.dtype == dtype
            for b in range(batch):
                for i in (0, 1):
                    new = (new_keys, new_values)[i][b : b + 1]
                    history[layer][b][i] = mx.concatenate([history[layer][b][i], new], axis=2)
            expected = _expected(
                queries, [h[0] for h in history[layer]], [h[1] for h in history[layer]], scale
            )
            assert mx.allclose(
                out.astype(mx.float32), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
            ).item()
        seq_lens = [s + 1 for s in seq_lens]


def test_slot_path_calls_the_primitive(monkeypatch):
    calls = []
    real_op = mlx_batched_decode.batched_decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("scale"))
        return real_op(*args, **kwargs)

    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", spy)
    ctx = BatchedDecodeContext(2, [1, 4], [SlotKVCache()])
    x = mx.random.normal((2, 2, 1, 64))
    mx.eval(SlotAttention()(ctx, 0, x, x, x, scale=0.5))
    assert calls == [0.5]


def test_seed_mask_only_when_lengths_differ():
    """With equal lengths the seed path attends without a mask and still matches the reference."""
    ctx = BatchedDecodeContext(2, [0, 0], [[ContiguousKVCache(), ContiguousKVCache()]])
    assert not ctx.needs_padding
    queries = mx.random.normal((2, 4, 1, 64))
    keys, values = mx.random.normal((2, 2, 1, 64)), mx.random.normal((2, 2, 1, 64))
    out = SeedAttention()(ctx, 0, queries, keys, values)
    expected = _expected(queries, [keys[:1], keys[1:]], [values[:1], values[1:]], 1 / 8)
    assert mx.allclose(out, expected, atol=1e-5).item()


def test_wrong_cache_kind_is_rejected():
    x = mx.random.normal((2, 2, 1, 64))
    with pytest.raises(TypeError, match=r"^\[SlotAttention\]"):
        SlotAttention()(BatchedDecodeContext(2, [1, 1], [[ContiguousKVCache()] * 2]), 0, x, x, x)
    with pytest.raises(TypeError, match=r"^\[SeedAttention\]"):
        SeedAttention()(BatchedDecodeContext(2, [1, 1], [SlotKVCache()]), 0, x, x, x)


@pytest.mark.parametrize("path", ["slot", "seed"])
@pytest.mark.parametrize(
    "query_len, window, with_sinks", [(1, 4, False), (3, None, True), (4, 5, True)]
)
def test_several_rows_windows_and_sinks(path, query_len, window, with_sinks):
    """L new tokens per request over a window, with sinks, written over stale (rejected) tokens:
    each request matches SDPA with the causal window mask on its own unpadded keys."""
    mx.random.seed(1)
    dim, heads_q, heads_kv, seq_lens = 32, 4, 2, [0, 3, 11, 6]
    batch = len(seq_lens)
    stale = 2  # positions past each seq_len already hold tokens that must be overwritten
    full = [_prompt(heads_kv, n + stale, dim, mx.float32) for n in seq_lens]
    if path == "slot":
        attention, cache = SlotAttention(), SlotKVCache(step=8)
        for b, (keys, values) in enumerate(full):
            cache.write_prompt(b, keys, values)
    else:
        attention, cache = SeedAttention(), [ContiguousKVCache(step=8) for _ in seq_lens]
        for c, (keys, values) in zip(cache, full):
            c.update_and_fetch(keys, values)
    ctx = BatchedDecodeContext(batch, seq_lens, [cache], query_len=query_len)
    queries = mx.random.normal((batch, heads_q, query_len, dim))
    new_keys = mx.random.normal((batch, heads_kv, query_len, dim))
    new_values = mx.random.normal((batch, heads_kv, query_len, dim))
    sinks = mx.random.normal((heads_q,)) if with_sinks else None
    out = attention(ctx, 0, queries, new_keys, new_values, scale=0.3, window=window, sinks=sinks)
    for b, n in enumerate(seq_lens):
        keys = mx.concatenate([full[b][0][:, :, :n], new_keys[b : b + 1]], axis=2)
        values = mx.concatenate([full[b][1][:, :, :n], new_values[b : b + 1]], axis=2)
        rows = mx.arange(n, n + query_len)[:, None]
        cols = mx.arange(n + query_len)[None]
        visible = (cols <= rows) & ((cols > rows - window) if window else True)
        expected = mx.fast.scaled_dot_product_attention(
            queries[b : b + 1], keys, values, scale=0.3, mask=visible, sinks=sinks
        )
        assert mx.allclose(out[b : b + 1], expected, atol=2e-5).item(), b
