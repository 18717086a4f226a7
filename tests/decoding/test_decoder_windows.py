"""BatchedDecoder on models with sliding-window layers, attention sinks and any head dim: greedy
tokens equal mlx-lm's own single-request decode, with prompts and generations crossing the window.
"""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import KVCache, RotatingKVCache  # noqa: E402

import mlx_batched_decode  # noqa: E402
from mlx_batched_decode.caches.kv_cache import SlotKVCache  # noqa: E402
from mlx_batched_decode.caches.ring_kv_cache import RingSlotKVCache  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.decoding.mlx_lm_caches import layer_windows  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_prefill import prefill  # noqa: E402
from tests.support.mlx_lm_models import (  # noqa: E402
    GEMMA3_TEXT,
    GPT_OSS,
    MINISTRAL3_SLIDING,
    SMALL_LLAMA_SLIDING,
    WINDOW,
    mlx_lm_greedy,
    random_prompts,
)

# Each family with its own way of choosing windowed layers; small odd shapes.
FAMILIES = {
    "gpt_oss": GPT_OSS,
    "gemma3_text": GEMMA3_TEXT,
    "llama": SMALL_LLAMA_SLIDING,
    "ministral3": MINISTRAL3_SLIDING,
}
EXPECTED_WINDOWS = {
    "gpt_oss": [WINDOW, None],
    "gemma3_text": [WINDOW, WINDOW, None],
    "llama": [WINDOW, None],
    "ministral3": [None, WINDOW],
}
# Prompts below, at and past the window; budgets that end some requests early.
PROMPT_LENS = [1, 9, 60, 16, 17, 33, 2]
MAX_TOKENS = [24, 24, 24, 5, 24, 1, 12]


def build(family, seed=1):
    model = random_model(FAMILIES[family], seed=seed)
    if family == "gpt_oss":
        # mlx-lm starts sinks at zero; trained ones are not, and differ per head.
        for layer in model.layers:
            layer.self_attn.sinks = 2.0 * mx.random.normal(layer.self_attn.sinks.shape)
        mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def models():
    return {family: build(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(models):
    prompts = random_prompts(PROMPT_LENS)
    return {
        family: [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
        for family, model in models.items()
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_windows_follow_mlx_lm_caches(models, family):
    assert layer_windows(models[family]) == EXPECTED_WINDOWS[family]


@pytest.mark.parametrize("path", ["slot", "seed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_mlx_lm_across_the_window(models, references, family, path):
    # 7 requests, at most 3 at once: requests join as others finish, several of them early.
    decoder = BatchedDecoder(models[family], attention=path, kv_step=16)
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
    assert out == references[family]
    assert decoder.num_active == 0


@pytest.mark.parametrize("num_draft_tokens", [None, 3])
def test_windowed_layers_keep_a_ring_of_their_window(models, num_draft_tokens):
    """A sliding-window layer's cache holds window + chunk - 1 positions per request (a prompt
    chunk is at most the window, 16 here; with k draft tokens at least window + k) however long
    the requests run; a full-attention layer's holds them all."""
    model = models["gemma3_text"]
    draft = None if num_draft_tokens is None else model
    decoder = BatchedDecoder(model, draft_model=draft, num_draft_tokens=num_draft_tokens or 1)
    decoder.generate(random_prompts([70, 3]), [40, 40])
    ring = WINDOW + max(WINDOW - 1, num_draft_tokens or 0)
    for cache, window in zip(decoder.slot_caches, EXPECTED_WINDOWS["gemma3_text"]):
        if window is None:
            assert isinstance(cache, SlotKVCache) and cache.capacity >= 110
        else:
            assert isinstance(cache, RingSlotKVCache) and cache.size == cache.capacity == ring


def test_chunked_prefill_keeps_what_mlx_lm_keeps(models, references):
    """Steps of 7 tokens and of 1 (a prompt waits while others decode; a ring then wraps
    around within a prompt)."""
    for step in (7, 1):
        decoder = BatchedDecoder(models["gpt_oss"], kv_step=16, max_step_tokens=step)
        out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
        assert out == references["gpt_oss"]


@pytest.mark.parametrize("step", [1, 7])
def test_prefill_returns_every_layer_in_temporal_order(models, step):
    """Windowed layers: the positions mlx-lm's rotating cache still holds equal a one-chunk
    prefill's (which keeps them all, in order); older positions are zeros."""
    model = models["llama"]
    tokens = random_prompts([40], seed=3)[0]
    whole = prefill(model, tokens, step_size=len(tokens))
    chunked = prefill(model, tokens, step_size=step)
    for window, (keys, values), (whole_keys, whole_values) in zip(
        layer_windows(model), chunked, whole
    ):
        assert keys.shape == whole_keys.shape == (1, 2, 40, 32)
        start = 0 if window is None else 40 - window
        assert mx.allclose(keys[:, :, start:], whole_keys[:, :, start:], atol=1e-5).item()
        assert mx.allclose(values[:, :, start:], whole_values[:, :, start:], atol=1e-5).item()
        if window is not None and step == 1:
            # One token at a time, the rotating cache holds exactly its window.
            assert not mx.any(keys[:, :, :start]).item()


@pytest.mark.parametrize("head_dim", [8, 32, 72, 160])
def test_any_head_dim(head_dim):
    config = dict(
        FAMILIES["llama"], head_dim=head_dim, num_attention_heads=3, num_key_value_heads=1
    )
    model = random_model(config, seed=2)
    prompts, budgets = random_prompts([1, 20, 5], seed=head_dim), [20, 8, 20]
    expected = [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    decoder = BatchedDecoder(model, kv_step=16)
    assert decoder.generate(prompts, budgets, max_batch_size=2) == expected


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_text"])
def test_each_layer_gets_its_window_sinks_and_scale(models, family, monkeypatch):
    model = models[family]
    calls = []
    real_op = mlx_batched_decode.batched_decode_attention

    def spy(queries, keys, values, lens, **kwargs):
        calls.append(kwargs)
        return real_op(queries, keys, values, lens, **kwargs)

    decoder = BatchedDecoder(model)
    for prompt in random_prompts([30, 3]):
        decoder.add_request(prompt, 4)
    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", spy)
    decoder.step()
    assert [c["window"] for c in calls] == EXPECTED_WINDOWS[family]
    if family == "gpt_oss":
        assert all(c["sinks"] is layer.self_attn.sinks for c, layer in zip(calls, model.layers))
        assert all(c["scale"] == 64**-0.5 for c in calls)
    else:
        # Gemma 3 scales queries by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
        assert all(c["sinks"] is None and c["scale"] == 64**-0.5 for c in calls)


def test_mask_narrower_than_the_cache_window_is_refused(models, monkeypatch):
    """A model that masks a layer to fewer keys than its rotating cache holds cannot be served."""
    model = models["llama"]
    monkeypatch.setattr(
        model, "make_cache", lambda: [RotatingKVCache(max_size=2 * WINDOW), KVCache()]
    )
    decoder = BatchedDecoder(model)
    decoder.add_request([1, 2, 3], 4)
    with pytest.raises(
        ValueError, match=r"^\[BatchedDecoder\] the model masks layer 0 to a window"
    ):
        decoder.step()
