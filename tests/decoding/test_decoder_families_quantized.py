"""BatchedDecoder with ``kv_bits`` on the families whose values have a head dim of their own:
multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash, Kimi K2.5) keeping one quantized ``r + R``
row per token whose first ``r`` columns are the values, and DeepSeek-V2 / MiniCPM3 (keys 64,
values 32).

DeepSeek-V2 and MiniCPM3 are compared with mlx-lm's single-request decode with its cache quantized
from the start. mlx-lm's quantized cache cannot run MLA, so MLA is compared with mlx-lm's decode
over caches that store every row dequantized as its quantized cache would (``RoundedKVCache``),
and, batched, with the dense decoder fed the dequantized rows (``tests.support.dequantized_decoder``).
At 4 bits the MLA tokens differ from the unquantized ones, so the comparisons tell the two apart.
Tokens may part from a reference at a near tie only (``assert_tokens_match``).
"""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import mlx_batched_decode  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.caches.quantized_kv_cache import QuantizedSlotKVCache  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.dequantized_decoder import (  # noqa: E402
    RoundedKVCache,
    assert_tokens_match,
    dense_top_two,
    dequantized_dense_caches,
    dequantized_reference,
    mlx_lm_top_two,
)
from tests.support.mlx_lm_models import (  # noqa: E402
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    DEEPSEEK_V3_WIDE,
    GLM4_MOE_LITE,
    KIMI_K25,
    MINICPM3,
    mlx_lm_greedy,
    random_prompts,
)
from tests.support.mlx_lm_prefill import prefill  # noqa: E402

# Widths the group size 32 divides: latent r = 64 + rope R = 32 (96-wide rows), keys of
# 32 + 32 and values of 32 per head for DeepSeek-V2 and MiniCPM3 (values = hidden / heads).
R_LATENT, R_ROPE, GROUP_SIZE = 64, 32, 32
_WIDTHS = dict(kv_lora_rank=R_LATENT, qk_rope_head_dim=R_ROPE, qk_nope_head_dim=32, v_head_dim=32)
LATENT_FAMILIES = {
    "deepseek_v3": dict(DEEPSEEK_V3, **_WIDTHS),
    "glm4_moe_lite": dict(GLM4_MOE_LITE, **_WIDTHS),
    "kimi_k25": dict(KIMI_K25, text_config=dict(KIMI_K25["text_config"], **_WIDTHS)),
}
NARROW_FAMILIES = {
    "deepseek_v2": dict(DEEPSEEK_V2, **_WIDTHS),
    "minicpm3": dict(MINICPM3, **{k: v for k, v in _WIDTHS.items() if k != "v_head_dim"},
                     hidden_size=128),
}
PROMPT_LENS = [1, 7, 30, 13, 21]
MAX_TOKENS = [8, 3, 9, 1, 6]


@pytest.fixture(scope="module")
def models():
    configs = {**LATENT_FAMILIES, **NARROW_FAMILIES}
    return {name: random_model(config, seed=2) for name, config in configs.items()}


def spy_quantized_op(monkeypatch):
    """Record every quantized op call's (queries, keys, values, keywords); the dense op may run
    only for a prompt's first chunk, which attends its own keys unquantized."""
    calls = []
    real = mlx_batched_decode.quantized_batched_decode_attention

    def spy(queries, keys, values, *args, **kwargs):
        calls.append((queries.shape, [x.shape for x in keys], [x.shape for x in values], kwargs))
        return real(queries, keys, values, *args, **kwargs)

    monkeypatch.setattr(mlx_batched_decode, "quantized_batched_decode_attention", spy)
    return calls


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", list(LATENT_FAMILIES))
def test_latent_rows_match_the_dequantized_dense_decoder(models, family, bits, monkeypatch):
    model = models[family]
    prompts = random_prompts(PROMPT_LENS)
    want = dequantized_reference(model, prompts, MAX_TOKENS, bits, GROUP_SIZE, monkeypatch)
    if bits == 4:
        assert want != [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    calls = spy_quantized_op(monkeypatch)
    kernel_calls = _ext.cpu_kernel_calls()
    # As the reference: 3 rows for 5 requests, prompts fed in chunks of at most 16 tokens.
    decoder = BatchedDecoder(
        model, kv_step=16, kv_bits=bits, kv_group_size=GROUP_SIZE, max_step_tokens=16
    )
    out = decoder.generate(prompts, MAX_TOKENS, max_batch_size=3)
    assert_tokens_match(
        out, want, dense_top_two(model, prompts, bits, GROUP_SIZE, monkeypatch, kv_step=16,
                                 max_step_tokens=16)
    )
    layers = len(decoder.slot_caches)
    assert len(calls) == decoder.stats.steps * layers
    if mx.default_device() == mx.cpu:
        # The fused kernel ran for each quantized call (the first chunks' dense calls add more).
        assert _ext.cpu_kernel_calls() - kernel_calls >= len(calls)
    row, latent = R_LATENT + R_ROPE, R_LATENT
    for queries, keys, values, kwargs in calls:
        # One KV head of r + R quantized columns; the values its first r, in place.
        assert queries[-1] == row and keys[0][1] == 1 and kwargs["scale"] == 1.0
        assert [k[-1] for k in keys] == [row * bits // 32, row // GROUP_SIZE, row // GROUP_SIZE]
        groups = latent // GROUP_SIZE
        assert [v[-1] for v in values] == [latent * bits // 32, groups, groups]
    for cache in decoder.slot_caches:
        assert isinstance(cache, QuantizedSlotKVCache) and cache.values is None
        slots, heads, capacity, _ = cache.keys[0].shape
        # Words, then float32 scales and biases per group of the one row.
        per_row = row * bits // 8 + 2 * 4 * row // GROUP_SIZE
        assert heads == 1 and cache.nbytes == slots * capacity * per_row


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", list(LATENT_FAMILIES))
def test_latent_rows_match_mlx_lm_over_rounded_caches(models, family, bits):
    """One request at a time, prompts in chunks of 8 at mlx-lm's prefill boundaries: each
    prompt's first chunk attends itself unrounded, the later ones and the decode steps the
    rounded rows, in mlx-lm and here. Prompts have two tokens or more (mlx-lm attends a
    one-token prompt's token over a cache it has not quantized yet)."""
    model = models[family]
    prompts = random_prompts([2, 7, 30, 13, 21])

    def caches():
        return [RoundedKVCache(bits, GROUP_SIZE) for _ in model.layers]

    want = [
        mlx_lm_greedy(model, p, n, prefill_step_size=8, prompt_cache=caches())
        for p, n in zip(prompts, MAX_TOKENS)
    ]
    decoder = BatchedDecoder(
        model, kv_step=16, kv_bits=bits, kv_group_size=GROUP_SIZE, max_step_tokens=8
    )
    out = decoder.generate(prompts, MAX_TOKENS, max_batch_size=1)
    assert_tokens_match(out, want, mlx_lm_top_two(model, prompts, prefill_step_size=8, caches=caches))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", list(NARROW_FAMILIES))
def test_narrower_values_match_mlx_lm(models, family, bits, monkeypatch):
    model = models[family]
    prompts = random_prompts([2, 7, 30, 13, 21])
    quantized = dict(kv_bits=bits, kv_group_size=GROUP_SIZE, quantized_kv_start=0)
    want = [mlx_lm_greedy(model, p, n, **quantized) for p, n in zip(prompts, MAX_TOKENS)]
    calls = spy_quantized_op(monkeypatch)
    decoder = BatchedDecoder(model, kv_step=16, kv_bits=bits, kv_group_size=GROUP_SIZE)
    out = decoder.generate(prompts, MAX_TOKENS, max_batch_size=3)
    assert_tokens_match(out, want, mlx_lm_top_two(model, prompts, **quantized))
    assert len(calls) == decoder.stats.steps * len(decoder.slot_caches)
    for _, keys, values, _ in calls:
        assert (keys[0][-1], values[0][-1]) == (64 * bits // 32, 32 * bits // 32)


def test_prefilled_latent_requests_match_the_dequantized_dense_decoder(models, monkeypatch):
    """mlx-lm's own caches of each prompt but its last token, quantized as they are stored."""
    model = models["deepseek_v3"]
    prompts, budgets = random_prompts(PROMPT_LENS)[1:], MAX_TOKENS[1:]

    def run(**options):
        decoder = BatchedDecoder(model, kv_step=16, **options)
        uids = [
            decoder.add_prefilled_request(p, n, prefill(model, p[:-1], 8))
            for p, n in zip(prompts, budgets)
        ]
        produced = {uid: [] for uid in uids}
        while decoder.num_active:
            for uid, tokens in decoder.step().tokens.items():
                produced[uid] += tokens
        return [produced[uid] for uid in uids]

    with dequantized_dense_caches(4, GROUP_SIZE, monkeypatch):
        want = run()
    # Near ties judged on the prompts whole: the reference's prefill, not the given caches.
    assert_tokens_match(
        run(kv_bits=4, kv_group_size=GROUP_SIZE), want,
        dense_top_two(model, prompts, 4, GROUP_SIZE, monkeypatch, kv_step=16),
    )


def test_latent_rows_at_deepseek_widths():
    """DeepSeek-V3's latent 512 + rope 64 (576-wide quantized rows, 9 groups of 64) with 16
    query heads, against the dense decoder fed the dequantized rows."""
    model = random_model(DEEPSEEK_V3_WIDE, seed=4)
    prompts, budgets = random_prompts([3, 17, 40]), [6, 6, 6]
    decoder = BatchedDecoder(model, kv_step=16, kv_bits=8, kv_group_size=64, max_step_tokens=16)
    out = decoder.generate(prompts, budgets, max_batch_size=3)
    with pytest.MonkeyPatch.context() as monkeypatch:
        want = dequantized_reference(model, prompts, budgets, 8, 64, monkeypatch)
        assert_tokens_match(
            out, want, dense_top_two(model, prompts, 8, 64, monkeypatch, kv_step=16, max_step_tokens=16)
        )
    assert [x.shape[-1] for x in decoder.slot_caches[0].keys] == [576 // 4, 9, 9]


def test_group_sizes_that_do_not_divide_the_rows_are_refused(models):
    # The rows are 96 wide: groups of 64 do not divide them.
    with pytest.raises(ValueError, match="kv_group_size 64 does not divide layer 0's key head dim 96"):
        BatchedDecoder(models["deepseek_v3"], kv_bits=8, kv_group_size=64)
    with pytest.raises(ValueError, match="kv_group_size 64 does not divide layer 0's value head dim 32"):
        BatchedDecoder(models["deepseek_v2"], kv_bits=8, kv_group_size=64)
