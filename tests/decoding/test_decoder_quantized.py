"""BatchedDecoder with kv_bits: a quantized slot cache read by quantized_batched_decode_attention.

Greedy tokens are compared with mlx-lm's own single-request decode at the same settings,
``generate_step(kv_bits=..., kv_group_size=..., quantized_kv_start=0)``, on float32 random-weight
models built in place: identical at 8 and at 4 bits (on these models mlx-lm's 4-bit tokens
differ from its unquantized ones, so the comparison tells the two apart). Prompts have two tokens
or more: with nothing to prefill, mlx-lm attends its first token over a cache it has not
quantized yet. Sliding windows and sinks, which mlx-lm's quantized cache refuses, are compared
with the dense decoder fed the dequantized keys/values. benchmarks/quantized_tokens.py measures
the shares on more prompts, group sizes and dtypes.
"""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import mlx_batched_decode  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.caches.quantized_kv_cache import QuantizedSlotKVCache  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.dequantized_decoder import (  # noqa: E402
    assert_tokens_match,
    dense_top_two,
    dequantized_reference,
)
from tests.support.mlx_lm_models import mlx_lm_greedy, random_prompts  # noqa: E402
from tests.decoding.test_decoder import FAMILIES  # noqa: E402
from tests.decoding.test_decoder_windows import FAMILIES as WINDOW_FAMILIES  # noqa: E402
from tests.decoding.test_decoder_windows import build as build_windowed  # noqa: E402

PROMPT_LENS = [2, 7, 30, 13, 55]
MAX_TOKENS = [10, 4, 12, 1, 8]


@pytest.fixture(scope="module")
def models():
    return {name: random_model(config, seed=1) for name, config in FAMILIES.items()}


def mlx_lm_quantized(model, bits, group_size=64, lens=PROMPT_LENS, budgets=MAX_TOKENS, **options):
    """mlx-lm's single-request greedy decode of each prompt with its cache quantized from the
    start."""
    return [
        mlx_lm_greedy(
            model, p, n, kv_bits=bits, kv_group_size=group_size, quantized_kv_start=0, **options
        )
        for p, n in zip(random_prompts(lens), budgets)
    ]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_mlx_lm_with_joins_and_early_leaves(models, family, bits):
    # max_batch_size 3 of 5 requests: two join mid-way; budgets differ, so requests leave early.
    decoder = BatchedDecoder(models[family], kv_step=16, kv_bits=bits, kv_group_size=64)
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
    assert out == mlx_lm_quantized(models[family], bits)
    assert decoder.num_active == 0
    assert all(isinstance(c, QuantizedSlotKVCache) for c in decoder.slot_caches)


@pytest.mark.parametrize("family,bits,group_size", [("llama", 8, 32), ("qwen3", 4, 128)])
def test_other_group_sizes_match_mlx_lm(models, family, bits, group_size):
    decoder = BatchedDecoder(models[family], kv_step=16, kv_bits=bits, kv_group_size=group_size)
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
    assert out == mlx_lm_quantized(models[family], bits, group_size)


@pytest.mark.parametrize("bits", [8, 4])
def test_chunked_prefill_matches_mlx_lm(models, bits):
    """Prefill in chunks of 8: every chunk after the first attends the quantized keys of the
    earlier ones, in mlx-lm and here."""
    model = models["ministral3"]
    # One request at a time, so that every chunk is 8 tokens, at mlx-lm's chunk boundaries.
    decoder = BatchedDecoder(model, kv_step=16, kv_bits=bits, max_step_tokens=8)
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=1)
    assert out == mlx_lm_quantized(model, bits, prefill_step_size=8)


@pytest.mark.parametrize("bits", [8, 4])
def test_float16_models_keep_float16_scales_and_mostly_match_mlx_lm(bits):
    """float16: mlx-lm's quantized attention rounds scores and weights to float16, the op keeps
    float32, so tokens may part. Measured: 25/25 requests equal at 8 bits, 24/25 at 4 bits (5
    families x 5 prompts); the floor leaves room for another thread count's rounding."""
    same = 0
    for config in FAMILIES.values():
        model = random_model(config, seed=1, dtype=mx.float16)
        decoder = BatchedDecoder(model, kv_step=16, kv_bits=bits)
        out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
        assert all(x.dtype == mx.float16 for x in decoder.slot_caches[0].keys[1:])
        same += sum(a == b for a, b in zip(out, mlx_lm_quantized(model, bits)))
    assert same >= 22, same


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text", "llama"])
def test_windows_and_sinks_match_the_dequantized_dense_decoder(family, bits, monkeypatch):
    """Sliding-window layers (prefilled with mlx-lm's rotating cache, quantized once at the end)
    and sinks, past the window of 16, at 8 and 4 bits; gpt-oss and Llama have head dim 64 and
    32, Gemma 3 256."""
    model = build_windowed(family)
    lens, budgets = [2, 9, 60, 16, 17, 33], [24, 24, 24, 5, 24, 1]
    prompts = random_prompts(lens)
    decoder = BatchedDecoder(model, kv_step=16, kv_bits=bits, kv_group_size=32, max_step_tokens=16)
    out = decoder.generate(prompts, budgets, max_batch_size=3)
    want = dequantized_reference(model, prompts, budgets, bits, 32, monkeypatch)
    assert_tokens_match(
        out, want, dense_top_two(model, prompts, bits, 32, monkeypatch, kv_step=16, max_step_tokens=16)
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_4bit_and_8bit_match_the_dequantized_dense_decoder(models, bits, monkeypatch):
    """The same reference on a full-attention model, including a one-token prompt."""
    model = models["qwen2"]
    prompts, budgets = random_prompts([1, 7, 30]), [12, 12, 12]
    decoder = BatchedDecoder(model, kv_step=16, kv_bits=bits, max_step_tokens=16)
    out = decoder.generate(prompts, budgets, max_batch_size=3)
    want = dequantized_reference(model, prompts, budgets, bits, 64, monkeypatch)
    assert_tokens_match(
        out, want, dense_top_two(model, prompts, bits, 64, monkeypatch, kv_step=16, max_step_tokens=16)
    )


@pytest.mark.parametrize("num_draft_tokens", [1, 3])
def test_speculative_8bit_equals_decoding_without_draft(models, num_draft_tokens):
    """The target verifies k + 1 tokens per request over its quantized cache (L = k + 1); the
    draft's cache is quantized too, as in mlx-lm's speculative_generate_step."""
    model = models["llama"]
    plain = mlx_lm_quantized(model, 8)
    for draft in (model, random_model(FAMILIES["llama"], seed=2)):
        decoder = BatchedDecoder(
            model, draft_model=draft, num_draft_tokens=num_draft_tokens, kv_step=16, kv_bits=8
        )
        out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
        assert out == plain
        assert all(isinstance(c, QuantizedSlotKVCache) for c in decoder.draft_slot_caches)
        if draft is model:
            assert decoder.stats.acceptance_rate == 1.0


def test_each_layer_calls_the_quantized_op_once_per_step(models, monkeypatch):
    model = models["mistral"]
    decoder = BatchedDecoder(model, kv_bits=4, kv_group_size=32)
    for prompt in random_prompts([4, 9, 2]):
        decoder.add_request(prompt, 5)
    decoder.step()  # the prompts, whose first chunks also attend themselves with the dense op
    calls = []
    real_op = mlx_batched_decode.quantized_batched_decode_attention

    def spy(queries, keys, values, lens, **kwargs):
        calls.append((keys, values, kwargs))
        return real_op(queries, keys, values, lens, **kwargs)

    def dense(*args, **kwargs):
        raise AssertionError("the dense op ran on a quantized cache")

    monkeypatch.setattr(mlx_batched_decode, "quantized_batched_decode_attention", spy)
    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", dense)
    kernel_calls = _ext.cpu_kernel_calls()
    decoder.step()
    layers = FAMILIES["mistral"]["num_hidden_layers"]
    assert len(calls) == layers
    if mx.default_device() == mx.cpu:
        # The fused CPU kernel itself ran once per layer, not the op's plain-MLX fallback.
        assert _ext.cpu_kernel_calls() - kernel_calls == layers
    for (keys, values, kwargs), cache in zip(calls, decoder.slot_caches):
        assert kwargs["bits"] == 4 and kwargs["group_size"] == 32
        # The keys are views of the cache's own buffers: [B, H_kv, max_len, *] of them.
        assert [x.shape[:3] for x in (*keys, *values)] == 6 * [(3, 2, 10)]
        assert [x.shape[3] for x in keys] == [64 * 4 // 32, 2, 2]
        assert all(x.shape[2] == cache.capacity for x in cache.buffers())


def test_decode_step_of_a_model_copies_no_cache_buffer(models):
    """A whole-model step allocates far less than the smallest of one layer's six buffers."""
    decoder = BatchedDecoder(models["llama"], kv_step=4096, kv_bits=8, kv_group_size=32)
    for prompt in random_prompts([40, 3, 25]):
        decoder.add_request(prompt, 100)
    decoder.step()
    smallest = min(x.nbytes for x in decoder.slot_caches[0].buffers())
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    decoder.step()
    assert mx.get_peak_memory() - base < smallest / 2, (mx.get_peak_memory() - base, smallest)


def test_cache_is_smaller_than_the_dense_one(models):
    """8 bits with float32 scales and biases per 64 elements: 9/32 of float32; 4 bits: 5/32."""
    prompts = random_prompts(PROMPT_LENS)
    sizes = {}
    for bits in (None, 8, 4):
        decoder = BatchedDecoder(models["llama"], kv_step=16, kv_bits=bits)
        for prompt in prompts:
            decoder.add_request(prompt, 4)
        sizes[bits] = sum(c.nbytes for c in decoder.slot_caches)
    assert sizes[8] * 32 == sizes[None] * 9 and sizes[4] * 32 == sizes[None] * 5


def test_rejects_bad_quantization_arguments(models):
    model = models["llama"]
    for bits, group_size in [(3, 64), (2, 64), (16, 64), (8, 16), (4, 256), (8, 0)]:
        with pytest.raises(ValueError, match=r"^\[BatchedDecoder\] kv_"):
            BatchedDecoder(model, kv_bits=bits, kv_group_size=group_size)
    with pytest.raises(ValueError, match=r"^\[BatchedDecoder\] kv_bits needs attention='slot'"):
        BatchedDecoder(model, kv_bits=8, attention="seed")
    # Head dim 48: groups of 32 do not divide it.
    windowed = random_model(WINDOW_FAMILIES["ministral3"], seed=1)
    with pytest.raises(
        ValueError,
        match=r"^\[BatchedDecoder\] kv_group_size 32 does not divide layer 0's key head dim 48",
    ):
        BatchedDecoder(windowed, kv_bits=8, kv_group_size=32)
