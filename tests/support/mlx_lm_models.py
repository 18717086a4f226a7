"""Small random-weight mlx-lm model configs and helpers shared by the decoder, plug-in and
tensor-parallel tests: the same shapes are checked on every path.

Dimension legend: V = vocabulary size (VOCAB for every config here).
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
