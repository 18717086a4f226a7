"""SGLang's MLX backend decoding random-weight mlx-lm models with the plug-in and without it.

The driver (``tests.support.sglang_runner``) runs SGLang's attention wrappers the way its model
runner does: one ``BatchedDecodeContext`` per step, ``AttentionOffsetCache`` shims, requests
prefilled alone and joining the batch at different steps, ``ContiguousAttentionKVCache`` buffers
of 8 positions that double while decoding, ``WindowedAttentionKVCache`` on sliding layers. With
the plug-in every request's greedy tokens equal SGLang's own, and every decode step attends with
one ``ragged_decode_attention`` call per layer, calling neither
``mx.fast.scaled_dot_product_attention`` nor ``mx.concatenate``.
"""

import mlx.core as mx
import pytest

from tests.support.sglang_backend import skip_reason

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)
pytest.importorskip("mlx_lm")

import mlx_batched_decode  # noqa: E402
import mlx_batched_decode.sglang as plugin  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import GPT_OSS, LLAMA, QWEN3, random_prompts  # noqa: E402
from tests.support.sglang_runner import AOTRoPE, SGLangRunner  # noqa: E402

FAMILIES = {"llama": LLAMA, "qwen3": QWEN3, "gpt_oss": GPT_OSS}
# Mixed lengths (below, at and past gpt-oss's window of 16), budgets that end requests early,
# requests joining at different steps.
PROMPT_LENS = [1, 9, 60, 16, 17, 33, 2]
MAX_TOKENS = [24, 24, 24, 5, 24, 1, 12]
JOIN_AT = [0, 0, 2, 3, 5, 5, 9]
# Small first capacity: buffers double during prefill and during decode.
CAPACITY = 8


@pytest.fixture(scope="module")
def models():
    built = {name: random_model(config, seed=1) for name, config in FAMILIES.items()}
    # mlx-lm starts sinks at zero; trained ones are not, and differ per head.
    for layer in built["gpt_oss"].layers:
        layer.self_attn.sinks = 2.0 * mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(built["gpt_oss"].parameters())
    return built


def _generate(runner):
    return runner.generate(random_prompts(PROMPT_LENS), MAX_TOKENS, JOIN_AT)


def _spies(decode_calls):
    return {
        "sdpa": decode_calls(mx.fast, "scaled_dot_product_attention"),
        "concatenate": decode_calls(mx, "concatenate"),
        "op": decode_calls(mlx_batched_decode, "ragged_decode_attention"),
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_sglang(backend, models, decode_calls, family):
    runner = SGLangRunner(models[family], backend, max_seq_len=CAPACITY)
    layers = runner.layout.num_attention_layers
    spies = _spies(decode_calls)
    expected = _generate(runner)
    steps = runner.decode_steps
    # SGLang's own path pads and concatenates per layer and request, and calls SDPA per layer.
    assert spies["sdpa"].count == steps * layers
    assert spies["concatenate"].count >= 2 * steps * layers
    assert spies["op"].count == 0

    for spy in spies.values():
        spy.count = 0
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        assert _generate(runner) == expected
        stats = plugin.stats()
    assert runner.decode_steps == 2 * steps and runner.decode_growths > 0
    assert spies["sdpa"].count == 0 and spies["concatenate"].count == 0
    # One op call per layer and step, and the kernel ran for each.
    assert spies["op"].count == steps * layers == stats.served
    assert _ext.cpu_kernel_calls() - kernel_calls == stats.served
    assert stats.unsupported_shape == stats.other == 0
    if family == "gpt_oss":
        # The sliding layer (WindowedAttentionKVCache) and the full one, every step.
        assert stats.windowed == stats.contiguous == steps
    else:
        assert stats.contiguous == steps * layers and stats.windowed == 0

    # disable(): SGLang's path again, the same tokens.
    for spy in spies.values():
        spy.count = 0
    assert _generate(runner) == expected
    assert spies["op"].count == 0 and spies["sdpa"].count == steps * layers


def _rope_pool_fused(calls):
    """A stand-in of sgl_kernel.metal's ``rope_pool_fused`` (absent off Apple GPUs) with its
    signature and results: RoPE on the queries and keys at ``positions``, and the rotated keys
    and the values scattered into the pool's ``[pool_size, H_kv, D]`` buffers at ``slots``."""

    def rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads,
        rope_base,
    ):
        calls.append(num_qo_heads)

        def rope(x):
            rotated = mx.fast.rope(
                x[:, :, None, :], head_dim, traditional=False, base=rope_base, scale=1.0,
                offset=positions,
            )
            return rotated[:, :, 0, :]

        q_rot, k_rot = rope(q), rope(k)
        k_pool, v_pool = mx.array(k_pool), mx.array(v_pool)
        k_pool[slots] = k_rot
        v_pool[slots] = v
        return q_rot, k_rot, k_pool, v_pool

    return rope_pool_fused


def test_aot_rope_path(backend, models):
    """With SGLang's AOT RoPE kernel in the context, the plug-in still rotates through it and
    it still fills the shared pool; the tokens and the pool equal SGLang's own."""
    model = models["llama"]
    config = FAMILIES["llama"]
    heads, kv_heads, head_dim = (
        config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    )
    prompts = random_prompts(PROMPT_LENS)
    width = max(n + t for n, t in zip(PROMPT_LENS, MAX_TOKENS))
    # Slot 0 is the pool's padding: request i's position p lives at 1 + i * width + p.
    req_to_token = 1 + mx.arange(len(prompts) * width).reshape(len(prompts), width)

    def run():
        calls = []
        kernel = backend.aot.MlxAOTRoPEKernel(
            base=10000.0,
            config={"head_dim": head_dim, "num_qo_heads": heads, "num_kv_heads": kv_heads},
            rope_pool_fused=_rope_pool_fused(calls),
        )
        pool = backend.attention_kv_pool.MlxAttentionKVPool(
            1 + req_to_token.size, config["num_hidden_layers"], kv_heads, head_dim, dtype=mx.float32
        )
        aot = AOTRoPE(
            backend.aot.MlxAOTKernelSet(rope=kernel), pool, req_to_token,
            {str(i): i for i in range(len(prompts))},
        )
        runner = SGLangRunner(model, backend, max_seq_len=CAPACITY, aot=aot)
        tokens = runner.generate(prompts, MAX_TOKENS, JOIN_AT)
        return tokens, len(calls), runner.decode_steps, pool.all_buffers()

    expected, calls, steps, pool = run()
    assert calls == steps * config["num_hidden_layers"] > 0
    # The stand-in kernel rotates as the model's own RoPE does: the same tokens without it.
    assert expected == SGLangRunner(model, backend, max_seq_len=CAPACITY).generate(
        prompts, MAX_TOKENS, JOIN_AT
    )
    with plugin.enabled():
        tokens, plugin_calls, _, plugin_pool = run()
        assert plugin.stats().served == calls
    assert tokens == expected and plugin_calls == calls
    # The first layer's keys/values are computed alike; later layers' follow attention outputs
    # that differ from SGLang's by rounding (float32 accumulation in another order).
    layers = config["num_hidden_layers"]
    for index, (got, want) in enumerate(zip(plugin_pool, pool)):
        if index % layers == 0:
            assert mx.array_equal(got, want).item()
        else:
            assert mx.allclose(got, want, atol=1e-5).item()
