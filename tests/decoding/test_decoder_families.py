"""Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash, Kimi K2.5), per-head keys wider than
values (DeepSeek-V2, MiniCPM3) and Gemma 2's soft-capped attention through ``BatchedDecoder``:
greedy tokens equal mlx-lm's single-request decode, with the op reading what each family keeps."""

import pytest

pytest.importorskip("mlx_lm")

import mlx_batched_decode  # noqa: E402
from mlx_batched_decode.decoding.decoder import BatchedDecoder  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import (  # noqa: E402
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    DEEPSEEK_V3_WIDE,
    GEMMA2,
    GLM4_MOE_LITE,
    KIMI_K25,
    MINICPM3,
    mlx_lm_greedy,
    random_prompts,
)
from tests.support.mlx_lm_prefill import prefill  # noqa: E402

# (config, seed): seeds whose random weights give varied greedy tokens.
FAMILIES = {
    "deepseek_v3": (DEEPSEEK_V3, 1),
    "glm4_moe_lite": (GLM4_MOE_LITE, 2),
    "kimi_k25": (KIMI_K25, 2),
    "deepseek_v2": (DEEPSEEK_V2, 3),
    "minicpm3": (MINICPM3, 2),
    "gemma2": (GEMMA2, 2),
}
LATENT = ("deepseek_v3", "glm4_moe_lite", "kimi_k25")
PROMPT_LENS = [1, 7, 30, 13, 21]
MAX_TOKENS = [8, 3, 9, 1, 6]
# (latent r, rope R, query heads) of the MLA configs, (key, value) head dims of the others.
R_LATENT, R_ROPE, HEADS = 32, 8, 4
WIDTHS = {"deepseek_v2": (24, 16), "minicpm3": (24, 16), "gemma2": (32, 32)}


@pytest.fixture(scope="module")
def models():
    return {name: random_model(config, seed=seed) for name, (config, seed) in FAMILIES.items()}


@pytest.fixture(scope="module")
def references(models):
    prompts = random_prompts(PROMPT_LENS)
    return {
        name: [mlx_lm_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
        for name, model in models.items()
    }


def spy_ops(monkeypatch):
    """Record every dense and paged op call's (queries, keys, values, keywords)."""
    calls = []
    for name in ("batched_decode_attention", "paged_decode_attention"):
        real = getattr(mlx_batched_decode, name)

        def spy(queries, keys, values, *args, _real=real, **kwargs):
            calls.append((queries.shape, keys.shape, values.shape, kwargs))
            return _real(queries, keys, values, *args, **kwargs)

        monkeypatch.setattr(mlx_batched_decode, name, spy)
    return calls


def check_op_reads(family, calls, layout):
    """Every call reads what the family keeps: one latent head of r + R whose first r columns
    are the values for MLA, narrower values for DeepSeek-V2 / MiniCPM3, the cap for Gemma 2."""
    for queries, keys, values, kwargs in calls:
        # Paged pools are [NB, BS, H_kv, D], slot views [B, H_kv, T, D].
        kv_heads = keys[2] if layout == "paged" else keys[1]
        if family in LATENT:
            assert (queries[1], queries[-1]) == (HEADS, R_LATENT + R_ROPE)
            assert kv_heads == 1 and keys[-1] == R_LATENT + R_ROPE and values[-1] == R_LATENT
            assert kwargs["scale"] == 1.0
        else:
            assert (keys[-1], values[-1]) == WIDTHS[family]
        cap = GEMMA2["attn_logit_softcapping"] if family == "gemma2" else None
        assert kwargs.get("softcap") == cap


@pytest.mark.parametrize("layout", ["slot", "paged", "seed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_mlx_lm(models, references, family, layout, monkeypatch):
    # 3 rows for 5 requests (two join mid-way), prompts fed in chunks of at most 8 tokens.
    if layout == "seed" and family in LATENT:
        pytest.skip("the seed path refuses multi-head latent attention (tested below)")
    calls = spy_ops(monkeypatch)
    options = dict(kv_layout="paged", block_size=4) if layout == "paged" else {}
    if layout == "seed":
        options = dict(attention="seed")
    decoder = BatchedDecoder(models[family], kv_step=16, max_step_tokens=8, **options)
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
    assert out == references[family]
    if layout != "seed":
        # One op call per layer and step.
        assert len(calls) == decoder.stats.steps * len(models[family].layers)
        check_op_reads(family, calls, layout)


@pytest.mark.parametrize("family", LATENT)
def test_latent_cache_keeps_one_row_per_token(models, family):
    decoder = BatchedDecoder(models[family], kv_step=16)
    for prompt in random_prompts([5, 12]):
        decoder.add_request(prompt, 4)
    decoder.step()
    for cache in decoder.slot_caches:
        slots, heads, capacity, width = cache.keys.shape
        assert (heads, width) == (1, R_LATENT + R_ROPE) and cache.values is None
        assert cache.nbytes == slots * capacity * width * 4


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma2", "deepseek_v2"])
def test_prefilled_requests_continue_as_mlx_lm(models, references, family):
    # mlx-lm's own caches of all but each prompt's last token: for MLA its latent and rope keys.
    model = models[family]
    decoder = BatchedDecoder(model, kv_step=16)
    uids = []
    # The prompts of more than one token: a one-token prompt has no keys/values to give.
    for prompt, n in zip(random_prompts(PROMPT_LENS)[1:], MAX_TOKENS[1:]):
        uids.append(decoder.add_prefilled_request(prompt, n, prefill(model, prompt[:-1], 8)))
    produced = {uid: [] for uid in uids}
    while decoder.num_active:
        for uid, tokens in decoder.step().tokens.items():
            produced[uid] += tokens
    assert [produced[uid] for uid in uids] == references[family][1:]


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma2"])
def test_speculative_rounds_keep_the_greedy_tokens(models, references, family):
    config, seed = FAMILIES[family]
    decoder = BatchedDecoder(
        models[family], draft_model=random_model(config, seed=seed + 10), num_draft_tokens=2,
        kv_step=16,
    )
    out = decoder.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, max_batch_size=3)
    assert out == references[family]
    assert decoder.stats.draft_tokens > 0


def test_unsupported_combinations_are_refused(models):
    with pytest.raises(ValueError, match="multi-head latent attention .* attention='seed'"):
        BatchedDecoder(models["deepseek_v3"], attention="seed")
    # Quantized caches need group sizes dividing the rows (test_decoder_families_quantized):
    # an MLA layer's r + R = 40, DeepSeek-V2's keys of 24.
    with pytest.raises(ValueError, match="kv_group_size 32 does not divide layer 0's key head dim 40"):
        BatchedDecoder(models["glm4_moe_lite"], kv_bits=8, kv_group_size=32)
    with pytest.raises(ValueError, match="kv_group_size 32 does not divide layer 0's key head dim 24"):
        BatchedDecoder(models["deepseek_v2"], kv_bits=8, kv_group_size=32)


def test_gemma2_attention_is_replaced_only_during_a_step(models, references):
    from mlx_lm.models import gemma2

    original = gemma2.Attention.__call__
    decoder = BatchedDecoder(models["gemma2"], kv_step=16)
    decoder.add_request(random_prompts(PROMPT_LENS)[2], 2)
    decoder.step()
    assert gemma2.Attention.__call__ is original
    # mlx-lm's own decode, between the decoder's steps, is untouched.
    prompt, n = random_prompts(PROMPT_LENS)[1], MAX_TOKENS[1]
    assert mlx_lm_greedy(models["gemma2"], prompt, n) == references["gemma2"][1]


def test_gemma2_quantized_cache_reads_the_cap(models, monkeypatch):
    calls = []
    real = mlx_batched_decode.quantized_batched_decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("softcap"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mlx_batched_decode, "quantized_batched_decode_attention", spy)
    decoder = BatchedDecoder(models["gemma2"], kv_bits=8, kv_group_size=32, kv_step=16)
    out = decoder.generate(random_prompts(PROMPT_LENS[:3]), MAX_TOKENS[:3])
    assert [len(t) for t in out] == MAX_TOKENS[:3]
    assert calls and set(calls) == {GEMMA2["attn_logit_softcapping"]}


def test_latent_space_at_deepseek_widths():
    # DeepSeek-V3's latent 512 + rope 64 (576-wide keys) with 16 query heads.
    model = random_model(DEEPSEEK_V3_WIDE, seed=4)
    prompts = random_prompts([3, 17, 40])
    decoder = BatchedDecoder(model, max_step_tokens=16)
    assert decoder.generate(prompts, 6) == [mlx_lm_greedy(model, p, 6) for p in prompts]
    assert decoder.slot_caches[0].keys.shape[1:] == (1, 256, 576)


@pytest.mark.parametrize("family", ["deepseek_v3", "gemma2"])
def test_shared_prefix_blocks_serve_later_requests(models, family):
    # A 13-token prefix in blocks of 4: requests after the first take its 3 full blocks.
    model = models[family]
    prefix, tails = random_prompts([13], seed=7)[0], random_prompts([2, 5, 1], seed=8)
    prompts = [prefix + tail for tail in tails]
    decoder = BatchedDecoder(model, kv_layout="paged", block_size=4, max_step_tokens=8)
    out = decoder.generate(prompts, 4, max_batch_size=1)
    assert out == [mlx_lm_greedy(model, p, 4) for p in prompts]
    assert decoder.stats.prefix_hit_tokens == 2 * 12
