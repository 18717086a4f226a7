"""BatchedDecoder on real mlx-lm model classes: greedy tokens equal mlx-lm's own
single-request decode."""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.models import base, llama  # noqa: E402

import mlx_batched_decode  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.caches.context import BatchedDecodeContext  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import (  # noqa: E402
    LLAMA,
    MINISTRAL3,
    MISTRAL,
    QWEN2,
    QWEN3,
    VOCAB,
    mlx_lm_greedy,
    random_prompts,
)

# Odd small configs: GQA groups 2, 3 and 4, head dims 64 and 128, hidden != heads * head_dim.
FAMILIES = {
    "llama": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "mistral": MISTRAL,
    "ministral3": MINISTRAL3,
}
PROMPT_LENS = [1, 7, 30, 13, 55]
MAX_TOKENS = [10, 4, 12, 1, 8]


@pytest.fixture(scope="module")
def models():
    return {name: random_model(config, seed=1) for name, config in FAMILIES.items()}


@pytest.fixture(scope="module")
def references(models):
    prompts = random_prompts(PROMPT_LENS)
    return {
        name: [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
        for name, model in models.items()
    }


@pytest.mark.parametrize("path", ["slot", "seed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_mlx_lm_with_joins_and_early_leaves(models, references, family, path):
    # max_batch_size 3 of 5 requests: two join mid-way; budgets differ, so requests leave early.
    decoder = BatchedDecoder(models[family], attention=path, kv_step=16)
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
    assert out == references[family]
    assert decoder.num_active == 0


def test_requests_join_mid_decode_and_reuse_slots(models, references):
    model, expected = models["llama"], references["llama"]
    prompts = random_prompts(PROMPT_LENS)
    decoder = BatchedDecoder(model, kv_step=16)
    produced = {}
    uids = {decoder.add_request(prompts[i], MAX_TOKENS[i]): i for i in (0, 2)}
    joins = {3: [1, 3], 5: [4]}
    for step in range(40):
        for i in joins.get(step, []):
            uids[decoder.add_request(prompts[i], MAX_TOKENS[i])] = i
        if decoder.num_active == 0:
            break
        result = decoder.step()
        for uid, tokens in result.tokens.items():
            produced.setdefault(uids[uid], []).extend(tokens)
    assert [produced[i] for i in range(5)] == expected
    # Never more than 4 requests at once: freed slots were reused, not appended.
    assert decoder.slot_caches[0].slots == 4


def test_stop_token_ends_requests_early(models, references):
    model, expected = models["llama"], references["llama"]
    # A token that first appears mid-way through some request's reference decode.
    request, stop = next((i, t) for i, ref in enumerate(expected) for t in ref if ref.index(t) >= 2)
    decoder = BatchedDecoder(model, kv_step=16)
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, stop_tokens=[stop])
    truncated = [ref[: ref.index(stop)] if stop in ref else ref for ref in expected]
    assert out == truncated
    assert 2 <= len(out[request]) < len(expected[request])


def test_one_context_per_step_shared_by_all_layers(models, monkeypatch):
    """Per step: one BatchedDecodeContext (the prompts' chunks and decode tokens together), and
    every layer's RoPE and attention read its arrays."""
    model = models["mistral"]
    contexts, offsets, valid_lens = [], [], []
    post_init = BatchedDecodeContext.__post_init__

    def counting_post_init(self):
        post_init(self)
        contexts.append(self)

    real_rope, real_op = mx.fast.rope, mlx_batched_decode.batched_decode_attention

    def rope_spy(x, *args, offset, **kwargs):
        offsets.append(offset)
        return real_rope(x, *args, offset=offset, **kwargs)

    def op_spy(queries, keys, values, lens, **kwargs):
        valid_lens.append(lens)
        return real_op(queries, keys, values, lens, **kwargs)

    decoder = BatchedDecoder(model)
    for prompt in random_prompts([4, 9, 2]):
        decoder.add_request(prompt, 5)
    monkeypatch.setattr(BatchedDecodeContext, "__post_init__", counting_post_init)
    monkeypatch.setattr(mx.fast, "rope", rope_spy)
    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", op_spy)
    kernel_calls = _ext.cpu_kernel_calls()
    decoder.step()
    layers = FAMILIES["mistral"]["num_hidden_layers"]
    if mx.default_device() == mx.cpu:
        # The fused CPU kernel itself ran once per layer, not a fallback.
        assert _ext.cpu_kernel_calls() - kernel_calls == layers
    assert len(contexts) == 1
    assert len(offsets) == 2 * layers and all(o is contexts[0].offsets for o in offsets)
    assert len(valid_lens) == layers and all(v is contexts[0].valid_lens for v in valid_lens)


def test_sampling_options(models, references):
    model, expected = models["qwen3"], references["qwen3"]
    prompts = random_prompts(PROMPT_LENS)
    decoder = BatchedDecoder(model)
    # top_p this small keeps only the most likely token: sampling reduces to greedy.
    assert decoder.generate(prompts, MAX_TOKENS, temperature=1.0, top_p=1e-6, seed=3) == expected
    first = decoder.generate(prompts, 12, temperature=5.0, seed=7)
    assert decoder.generate(prompts, 12, temperature=5.0, seed=7) == first
    assert decoder.generate(prompts, 12, temperature=5.0, seed=8) != first
    assert all(0 <= t < VOCAB for tokens in first for t in tokens)


def test_attention_routing_is_scoped(models):
    decoder = BatchedDecoder(models["llama"])
    decoder.generate(random_prompts([3, 5]), 2)
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_unsupported_models_and_arguments(models, monkeypatch):
    from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache

    model = models["llama"]
    layers = FAMILIES["llama"]["num_hidden_layers"]
    unsupported = {
        "ArraysCache": lambda: ArraysCache(2),
        "QuantizedKVCache": QuantizedKVCache,
        "keeps its first 4 tokens": lambda: RotatingKVCache(max_size=8, keep=4),
    }
    for name, make in unsupported.items():
        monkeypatch.setattr(
            model, "make_cache", lambda: [make() for _ in range(layers)], raising=False
        )
        with pytest.raises(ValueError, match=rf"^\[BatchedDecoder\] layer 0 .*{name}"):
            BatchedDecoder(model)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"^\[BatchedDecoder\]"):
        BatchedDecoder(model, attention="paged")
    with pytest.raises(ValueError, match=r"^\[BatchedDecoder\]"):
        BatchedDecoder(model).add_request([], 4)


def test_decode_step_of_a_model_copies_no_cache_buffer(models):
    """A whole-model step on the slot path allocates far less than one layer's cache buffer."""
    decoder = BatchedDecoder(models["llama"], kv_step=4096)
    for prompt in random_prompts([40, 3, 25]):
        decoder.add_request(prompt, 100)
    decoder.step()
    buffer_bytes = decoder.slot_caches[0].keys.nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    decoder.step()
    assert mx.get_peak_memory() - base < buffer_bytes / 8, (
        mx.get_peak_memory() - base,
        buffer_bytes,
    )
