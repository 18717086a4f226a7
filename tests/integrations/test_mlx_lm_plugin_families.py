"""The mlx-lm plug-in on the multi-head latent attention families and Gemma 2.

With the plug-in, greedy ``batch_generate`` of prompts of different lengths gives every request
its single-request tokens (mlx-lm's own ``generate_step``): DeepSeek-V2 and MiniCPM3 (values of
a head dim of their own) decode on the op; DeepSeek-V3, Kimi K2.5 and GLM-4.7-Flash (rope scores
passed as an additive mask) decode on the op in latent space; Gemma 2 (soft-capped attention mlx-lm
writes by hand, whose batched GQA masks mlx-lm puts on the wrong axis) decodes on the op and
prefills on a corrected copy of mlx-lm's code. Head dims the op refuses stay on mlx-lm's path.
"""

import copy

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from mlx_lm.generate import batch_generate, generation_stream  # noqa: E402
from mlx_lm.models import base, gemma2  # noqa: E402
from mlx_lm.models.base import create_causal_mask  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

import mlx_batched_decode.mlx_lm as plugin  # noqa: E402
import mlx_batched_decode  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import (  # noqa: E402
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    GEMMA2,
    GLM4_MOE_LITE,
    KIMI_K25,
    MINICPM3,
    mlx_lm_greedy,
    random_prompts,
)

PROMPT_LENS = [5, 1, 9]
MAX_TOKENS = 6
LAYERS = 2  # num_hidden_layers of every config here
# Attention calls per layer of mlx-lm 0.32.2's batch_generate schedule: one prefill of the
# prompts but their last tokens, then a decode step per new token and one step ahead; the
# 1-token prompt needs no prefill and takes its first two steps alone, before the others join.
DECODE_STEPS = {(5, 1, 9): MAX_TOKENS + 3, (9, 2): MAX_TOKENS + 1}
# Multi-head latent attention: latent 32 + rope 8, 4 query heads.
LATENT_FAMILIES = {"deepseek_v3": DEEPSEEK_V3, "glm4_moe_lite": GLM4_MOE_LITE, "kimi_k25": KIMI_K25}
# Keys of qk_nope + qk_rope per head, values of a head dim of their own.
OWN_VALUE_DIM_FAMILIES = {"deepseek_v2": DEEPSEEK_V2, "minicpm3": MINICPM3}
# (model seed, prompt lengths, prompt seed): with B == H_kv = 2, mlx-lm's own batching gives
# wrong tokens here (checked below), so the test sees a mask put on the wrong axis.
GEMMA2_BATCHES = {"B_equals_kv_heads": (1, [9, 2], 1), "B_3": (1, PROMPT_LENS, 3)}


class _Tokenizer:
    """What ``batch_generate`` uses of a tokenizer: no end tokens, every request runs its budget."""

    eos_token_ids: set = set()

    def decode(self, tokens):
        return ""


def _batch_generate(model, prompts, max_tokens=MAX_TOKENS, **options):
    response = batch_generate(
        model, _Tokenizer(), prompts, max_tokens=max_tokens, return_token_ids=True, **options
    )
    mx.synchronize(generation_stream)
    return response.token_ids


def _single_request_tokens(model, prompts):
    """mlx-lm's own single-request greedy tokens of each prompt, the plug-in off."""
    assert not plugin.is_enabled()
    return [mlx_lm_greedy(model, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.fixture(autouse=True)
def plugin_off():
    """Every test starts and ends with the plug-in off, whatever happens inside."""
    plugin.disable()
    yield
    plugin.disable()


@pytest.mark.parametrize("family", list(LATENT_FAMILIES))
def test_latent_attention_decodes_on_the_op(family, monkeypatch):
    model = random_model(LATENT_FAMILIES[family], seed=1)
    prompts = random_prompts(PROMPT_LENS, seed=3)
    expected = _single_request_tokens(model, prompts)
    calls = []
    real = mlx_batched_decode.batched_decode_attention

    def spy(queries, keys, values, *args, **kwargs):
        calls.append((queries.shape, keys.shape, values.shape))
        return real(queries, keys, values, *args, **kwargs)

    monkeypatch.setattr(mlx_batched_decode, "batched_decode_attention", spy)
    with plugin.enabled():
        assert _batch_generate(model, prompts) == expected
        # Single-request decoding keeps the plug-in's rows in mlx-lm's KVCache: same tokens.
        assert [mlx_lm_greedy(model, p, MAX_TOKENS) for p in prompts] == expected
        stats = plugin.stats()
    # Every batch decode step, each layer, reads one latent head of r + R, values its first r.
    assert stats.batch_kv == len(calls) == DECODE_STEPS[tuple(PROMPT_LENS)] * LAYERS
    for queries, keys, values in calls:
        assert queries[1:] == (4, 1, 40) and keys[1] == 1 and keys[-1] == 40
        assert values == (*keys[:3], 32)
    assert stats.prefill == LAYERS and stats.other > 0
    assert stats.additive_mask == stats.unsupported_shape == 0


def test_latent_cache_filled_with_the_plug_in_off_is_refused():
    from mlx_lm.models.cache import make_prompt_cache

    model = random_model(DEEPSEEK_V3, seed=1)
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=caches)
    with plugin.enabled(), pytest.raises(ValueError, match="filled while the plug-in was off"):
        model(mx.array([[4]]), cache=caches)


@pytest.mark.parametrize("family", list(OWN_VALUE_DIM_FAMILIES))
def test_values_of_their_own_head_dim_decode_on_the_op(family):
    config = OWN_VALUE_DIM_FAMILIES[family]
    model = random_model(config, seed=1)
    prompts = random_prompts(PROMPT_LENS, seed=3)
    expected = _single_request_tokens(model, prompts)
    # mlx-lm's own batching of these models (left padding included) gives the same tokens.
    assert _batch_generate(model, prompts) == expected
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        assert _batch_generate(model, prompts) == expected
        stats = plugin.stats()
    calls = _ext.cpu_kernel_calls() - kernel_calls
    assert stats.batch_kv == DECODE_STEPS[tuple(PROMPT_LENS)] * LAYERS
    assert stats.prefill == LAYERS
    assert stats.unsupported_shape == stats.additive_mask == stats.other == 0
    # The last layer of the last step feeds logits nobody reads, so the op may not run for it.
    assert stats.served - 1 <= calls <= stats.served


@pytest.mark.parametrize("batch", list(GEMMA2_BATCHES))
def test_gemma2_batches_get_single_request_tokens(batch):
    model_seed, lens, prompt_seed = GEMMA2_BATCHES[batch]
    model = random_model(GEMMA2, seed=model_seed)
    prompts = random_prompts(lens, seed=prompt_seed)
    expected = _single_request_tokens(model, prompts)
    if len(prompts) == GEMMA2["num_key_value_heads"]:
        # mlx-lm's masks [B, 1, L, T] land on the KV-head axis: requests see others' padding.
        assert _batch_generate(model, prompts) != expected
    else:
        with pytest.raises(ValueError, match="broadcast"):
            _batch_generate(model, prompts)
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        assert _batch_generate(model, prompts) == expected
        stats = plugin.stats()
    calls = _ext.cpu_kernel_calls() - kernel_calls
    assert stats.batch_kv == DECODE_STEPS[tuple(lens)] * LAYERS and stats.prefill == LAYERS
    assert stats.batch_rotating == stats.unsupported_shape == stats.other == 0
    assert stats.served - 1 <= calls <= stats.served


def test_gemma2_wrapped_rings_on_the_op_equal_mlx_lm_code():
    """With ``max_kv_size`` every layer is a ring that wraps; the op reads the wrapped rings
    (softcap, ``ring_offset``) and gives the tokens of the corrected mlx-lm code, which
    ``wrapped_rings=False`` runs for them."""
    model = random_model(GEMMA2, seed=1)
    prompts = random_prompts([3, 20, 9], seed=5)
    options = {"max_tokens": 30, "max_kv_size": 16}
    with plugin.enabled():
        served = _batch_generate(model, prompts, **options)
        stats = plugin.stats()
    with plugin.enabled(wrapped_rings=False):
        assert _batch_generate(model, prompts, **options) == served
        baseline = plugin.stats()
    # The 20-token prompt wraps its ring in the prefill: every decode step reads a wrapped ring.
    assert stats.batch_rotating == stats.batch_rotating_wrapped == (30 + 1) * LAYERS
    assert baseline.rotating_wrapped == stats.batch_rotating_wrapped and baseline.served == 0
    assert stats.batch_kv == stats.other == baseline.other == 0


def test_gemma2_single_request_and_disable_restore_mlx_lm_attention():
    original = gemma2.Attention.__dict__["__call__"]
    model = random_model(GEMMA2, seed=2)
    prompt = random_prompts([7], seed=1)[0]
    expected = mlx_lm_greedy(model, prompt, MAX_TOKENS)
    with plugin.enabled():
        assert gemma2.Attention.__dict__["__call__"] is not original
        assert mlx_lm_greedy(model, prompt, MAX_TOKENS) == expected
        stats = plugin.stats()
    # The prompt, then a step per token and one ahead, on a single-request KVCache.
    assert stats.other == (MAX_TOKENS + 2) * LAYERS and stats.served == stats.prefill == 0
    assert gemma2.Attention.__dict__["__call__"] is original


@pytest.mark.parametrize("head_dim, served", [(32, True), (640, False)])
def test_gemma2_decode_step_equals_each_request_alone(head_dim, served):
    """One Gemma 2 layer, one decode step of 3 left-padded requests (GQA group 2, queries large
    enough that the soft cap bites): each request's output equals mlx-lm's layer on that request
    alone, whether the op serves the step or (head dim 640) the corrected mlx-lm code runs it."""
    model = random_model(dict(GEMMA2, head_dim=head_dim), seed=3)
    layer = model.model.layers[0].self_attn
    layer.q_proj.weight = 8.0 * layer.q_proj.weight
    lens, hidden = [3, 11, 1], GEMMA2["hidden_size"]
    steps = [mx.random.normal((1, n + 1, hidden), key=mx.random.key(n)) for n in lens]
    singles = [KVCache() for _ in lens]
    for x, cache in zip(steps, singles):
        layer(x[:, :-1], create_causal_mask(x.shape[1] - 1), cache)
    batch = KVCache.merge(singles)
    new_tokens = mx.concatenate([x[:, -1:] for x in steps])
    # The cap changes the result: the same step of the longest request with a cap far away.
    cap, layer.attn_logit_softcapping = layer.attn_logit_softcapping, 1e6
    uncapped = layer(steps[1][:, -1:], None, copy.deepcopy(singles[1]))
    layer.attn_logit_softcapping = cap
    expected = [layer(x[:, -1:], None, cache) for x, cache in zip(steps, singles)]
    assert not mx.allclose(uncapped, expected[1], atol=1e-2).item()
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        out = layer(new_tokens, batch.make_mask(1, return_array=True), batch)
        mx.eval(out)
        stats = plugin.stats()
    for b, want in enumerate(expected):
        assert mx.allclose(out[b : b + 1], want, atol=1e-5).item(), b
    assert _ext.cpu_kernel_calls() - kernel_calls == int(served)
    assert (stats.batch_kv, stats.unsupported_shape) == ((1, 0) if served else (0, 1))


def _decode_call(head_dim, value_dim):
    """One decode step on a left-padded ``BatchKVCache`` of 2 requests (3 and 1 keys before the
    step), one KV head for 4 query heads, float32: (queries, keys, values, cache, mask)."""
    cache = BatchKVCache([0, 2])
    k = mx.random.normal((2, 1, 4, head_dim), key=mx.random.key(1))
    v = mx.random.normal((2, 1, 4, value_dim), key=mx.random.key(2))
    q = mx.random.normal((2, 4, 1, head_dim), key=mx.random.key(3))
    cache.update_and_fetch(k[:, :, :3], v[:, :, :3])
    mask = cache.make_mask(1)
    keys, values = cache.update_and_fetch(k[:, :, 3:], v[:, :, 3:])
    return q, keys, values, cache, mask


@pytest.mark.parametrize(
    "head_dim, value_dim, served",
    [
        (24, 16, True),  # DeepSeek-V2's layout
        (16, 24, True),  # values wider than keys
        (576, 512, True),  # MLA's latent + rope keys, the latent as values
        (512, 512, True),
        (576, 576, False),  # wider than 512 only where values are narrower
        (640, 512, False),
        (64, 640, False),
    ],
)
def test_head_dims_the_op_refuses_stay_on_mlx_lm(head_dim, value_dim, served):
    """A decode call is served exactly when the op takes its head dims, and gives mlx-lm's
    masked attention either way."""
    with plugin.enabled():
        q, keys, values, cache, mask = _decode_call(head_dim, value_dim)
        expected = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.1, mask=mask)
        kernel_calls = _ext.cpu_kernel_calls()
        out = base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=0.1, mask=mask)
        mx.eval(out)
        stats = plugin.stats()
    assert out.shape == (2, 4, 1, value_dim)
    assert mx.allclose(out, expected, atol=1e-5).item()
    assert _ext.cpu_kernel_calls() - kernel_calls == int(served)
    assert (stats.batch_kv, stats.unsupported_shape) == ((1, 0) if served else (0, 1))


def test_additive_masks_of_other_layers_stay_on_mlx_lm():
    """An untagged float mask (a score term an MLA layer not replaced adds, as DeepSeek-V3.2's)
    runs mlx-lm's attention with it, counted, instead of raising."""
    with plugin.enabled():
        q, keys, values, cache, mask = _decode_call(32, 32)
        scores = mx.where(mask, mx.random.normal((2, 4, 1, keys.shape[2])), -1e9)
        expected = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.1, mask=scores)
        kernel_calls = _ext.cpu_kernel_calls()
        out = base.scaled_dot_product_attention(
            q, keys, values, cache=cache, scale=0.1, mask=scores
        )
        mx.eval(out)
        stats = plugin.stats()
    assert mx.allclose(out, expected, atol=1e-5).item()
    assert _ext.cpu_kernel_calls() == kernel_calls
    assert (stats.additive_mask, stats.batch_kv) == (1, 0)
