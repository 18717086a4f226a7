"""Small random-weight mlx-lm model configs and helpers shared by the decoder, plug-in, server,
SGLang and tensor-parallel tests: the same shapes are checked on every path. A config that
differs from another in a few fields is built from it; the tests' reference tokens depend on
every value here.

Dimension legend: V = vocabulary size (VOCAB but for the served models and Qwen3-Next).
"""

import random

import mlx.core as mx

VOCAB = 128
WINDOW = 16

# GQA group 2, head dim 64, hidden != heads * head_dim.
LLAMA = dict(
    model_type="llama",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
)
# LLAMA's heads at GQA group 4 and head dim 32: head counts divisible by 2 ranks.
LLAMA_GQA4 = dict(LLAMA, num_attention_heads=8, head_dim=32)
# GQA group 2, no head_dim (D = hidden / heads = 128), tied embeddings.
QWEN2 = dict(
    model_type="qwen2",
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    tie_word_embeddings=True,
)
# GQA group 4, head dim 128, q/k norms.
QWEN3 = dict(
    model_type="qwen3",
    hidden_size=96,
    num_hidden_layers=2,
    intermediate_size=192,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
# GQA group 3, head dim 64, 3 layers; mlx-lm runs model_type "mistral" with its Llama code, as
# mlx_lm.load does.
MISTRAL = dict(
    model_type="mistral",
    hidden_size=192,
    num_hidden_layers=3,
    intermediate_size=320,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
)
# Ministral 3 scales queries by position (llama-4 style): a short original context makes
# that scale differ between requests, so per-request offsets must reach it too.
MINISTRAL3 = dict(
    model_type="ministral3",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=128,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e6,
        "llama_4_scaling_beta": 0.5,
        "original_max_position_embeddings": 16,
    },
)
# Ministral 3 at half width, head dim 48, its full layer first, then a sliding one.
MINISTRAL3_SLIDING = dict(
    MINISTRAL3,
    hidden_size=64,
    intermediate_size=128,
    head_dim=48,
    layer_types=["full_attention", "sliding_attention"],
    sliding_window=WINDOW,
)
# Sinks, a sliding-window layer then a full one, a mixture of experts.
GPT_OSS = dict(
    model_type="gpt_oss",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=64,
    head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    vocab_size=VOCAB,
    rms_norm_eps=1e-5,
)
# Two sliding layers, then a global one; D = 256; query scale 64 ** -0.5, not D ** -0.5.
GEMMA3_TEXT = dict(
    model_type="gemma3_text",
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=128,
    head_dim=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    query_pre_attn_scalar=64,
    sliding_window=WINDOW,
    sliding_window_pattern=3,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
)


# GQA group 2, head dim 32.
SMALL_LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
)
# Llama's windowed layers chosen by layer_types: a sliding-window layer, then a full one.
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
SMALL_LLAMA_SLIDING = dict(SMALL_LLAMA, layer_types=SLIDING_THEN_FULL, sliding_window=WINDOW)
# The model the server tests serve: 160 token ids, model_folder's word tokenizer's.
SERVED_LLAMA = dict(SMALL_LLAMA, vocab_size=160)
SERVED_LLAMA_SLIDING = dict(SERVED_LLAMA, layer_types=SLIDING_THEN_FULL, sliding_window=48)
# DeepSeek-V3's multi-head latent attention: latent 32 + rope 8 keys per token, one KV head
# in latent space; a query LoRA, a yarn rope whose mscale enters the scale, a MoE layer.
_MLA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
    vocab_size=VOCAB,
)
DEEPSEEK_V3 = dict(
    _MLA,
    model_type="deepseek_v3",
    q_lora_rank=24,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=128,
        beta_fast=32,
        beta_slow=1,
    ),
)
# DeepSeek-V3's latent 512 + rope 64 (576-wide keys) with 16 query heads, no query
# LoRA, no routed experts.
DEEPSEEK_V3_WIDE = dict(
    DEEPSEEK_V3, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
    num_attention_heads=16, hidden_size=128, q_lora_rank=None, n_routed_experts=None,
)
# GLM-4.7-Flash: DeepSeek-V3's attention, values narrower than the no-rope key part.
GLM4_MOE_LITE = dict(
    _MLA,
    model_type="glm4_moe_lite",
    q_lora_rank=None,
    qk_nope_head_dim=24,
    v_head_dim=12,
    n_routed_experts=None,
    first_k_dense_replace=99,
)
# Kimi K2.5: DeepSeek-V3's text model inside a multimodal wrapper.
KIMI_K25 = dict(model_type="kimi_k25", text_config=dict(_MLA, model_type="deepseek_v3"))
# DeepSeek-V2: per-head keys of 16 + 8 and values of 16, rope keys copied into every head.
DEEPSEEK_V2 = dict(_MLA, model_type="deepseek_v2", q_lora_rank=None, rope_scaling={"factor": 1.0})
# MiniCPM3: DeepSeek-V2's layout (keys 24, values 16 = hidden / heads), a query LoRA.
MINICPM3 = dict(
    {k: v for k, v in _MLA.items() if k != "v_head_dim"},
    model_type="minicpm3",
    q_lora_rank=16,
    dim_model_base=64,
    scale_depth=1.0,
    scale_emb=1.0,
    rms_norm_eps=1e-5,
    rope_scaling={},
)
# Gemma 2: GQA group 2, logits soft-capped at 5 (small enough to bite at random weights),
# query scale 20 ** -0.5, not D ** -0.5.
GEMMA2 = dict(
    model_type="gemma2",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    attn_logit_softcapping=5.0,
    query_pre_attn_scalar=20,
)
# Qwen3-Next's full-attention layer: a gated q_proj (2 x H_q x D), q/k norms, RoPE on a quarter
# of the head dim; one layer, 64 token ids.
QWEN3_NEXT = dict(
    model_type="qwen3_next",
    hidden_size=64,
    num_hidden_layers=1,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=2,
    num_experts_per_tok=1,
    decoder_sparse_step=1,
    shared_expert_intermediate_size=64,
    mlp_only_layers=[],
    moe_intermediate_size=64,
    rms_norm_eps=1e-6,
    vocab_size=64,
    rope_theta=10000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=4096,
)


def random_prompts(lens, seed=0):
    """One prompt of random token ids per length in ``lens``, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]


def mlx_lm_greedy(model, prompt, max_tokens, **options):
    """mlx-lm's own single-request greedy decode (``generate_step``) of ``prompt``; ``options``
    go to ``generate_step`` (e.g. ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, **options)
    return [token for token, _ in steps]


def direct_logprobs(model, ids):
    """float64 ``[len(ids), V]``: the log-softmax of ``model``'s logits at every position of
    ``ids``, from one forward pass of its own (the reference for reported logprobs)."""
    import numpy as np

    logits = np.array(model(mx.array(ids)[None]).astype(mx.float32)[0], dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
