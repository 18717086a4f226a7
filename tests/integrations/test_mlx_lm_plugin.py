"""The mlx-lm plug-in: mlx-lm's own batched generation decodes through batched_decode_attention.

Greedy ``batch_generate`` output with the plug-in equals the output without it; every decode
attention call it serves equals mlx-lm's masked attention on the same cache; what it cannot serve
stays on mlx-lm's path and is counted; ``disable()`` restores everything.
"""

import gc
import importlib
import pkgutil
import sys

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import mlx_lm  # noqa: E402
import mlx_lm.models  # noqa: E402
from mlx_lm.generate import batch_generate, generate_step, generation_stream  # noqa: E402
from mlx_lm.models import base, llama  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)

import mlx_batched_decode.mlx_lm as plugin  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.integrations.mlx_lm import patches  # noqa: E402
from mlx_batched_decode.integrations.mlx_lm.routing import DecodeRouter  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import (  # noqa: E402
    GEMMA3_TEXT,
    GPT_OSS,
    LLAMA,
    QWEN3,
    WINDOW,
    random_prompts,
)

FAMILIES = {
    "llama": LLAMA,
    "qwen3": QWEN3,
    "gpt_oss": GPT_OSS,
}
# Mixed lengths (below, at and past the window), budgets that end requests early.
PROMPT_LENS = [1, 9, 60, 16, 17, 33, 2]
MAX_TOKENS = [24, 24, 24, 5, 24, 1, 12]
# Generations that wrap a ring of WINDOW slots several times (up to 5), ending at different steps.
RING_PROMPT_LENS = [3, 40, 17, 1, 26]
RING_MAX_TOKENS = [60, 50, 61, 45, 30]
# Every model family with rings: sliding layers (sinks, experts; Gemma 3's two sliding layers and
# a global one) and a model whose every layer is a ring (max_kv_size).
RING_FAMILIES = {
    "gpt_oss": (GPT_OSS, {}),
    "gemma3_text": (GEMMA3_TEXT, {}),
    "qwen3_max_kv_size": (QWEN3, {"max_kv_size": WINDOW}),
}
# All requests prefilled and decoding at once, or joining one by one while others decode.
SCHEDULES = {
    "together": {"completion_batch_size": 8, "prefill_batch_size": 8},
    "staggered": {"completion_batch_size": 2, "prefill_batch_size": 1},
}


class _Tokenizer:
    """What ``batch_generate`` uses of a tokenizer: its end tokens end requests early."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = set(eos_token_ids)

    def decode(self, tokens):
        return ""


def _batch_generate(model, eos=(), **kwargs):
    # Requests join mid-decode (3 decode at once, 2 prefill at once) and leave as they finish.
    response = batch_generate(
        model,
        _Tokenizer(eos),
        random_prompts(PROMPT_LENS),
        max_tokens=MAX_TOKENS,
        return_token_ids=True,
        completion_batch_size=3,
        prefill_batch_size=2,
        **kwargs,
    )
    return response.token_ids


@pytest.fixture(scope="module")
def models():
    built = {name: random_model(config, seed=1) for name, config in FAMILIES.items()}
    # mlx-lm starts sinks at zero; trained ones are not, and differ per head.
    for layer in built["gpt_oss"].layers:
        layer.self_attn.sinks = 2.0 * mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(built["gpt_oss"].parameters())
    return built


@pytest.fixture(autouse=True)
def plugin_off():
    """Every test starts and ends with the plug-in off, whatever happens inside."""
    plugin.disable()
    yield
    plugin.disable()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_generate_greedy_equals_mlx_lm(models, family):
    model = models[family]
    expected = _batch_generate(model)
    # A token that first appears mid-way in some request ends requests early as an end token.
    eos = next(t for tokens in expected for t in tokens[2:] if t not in tokens[:2])
    expected_eos = _batch_generate(model, eos=[eos])
    assert expected_eos != expected

    layers = FAMILIES[family]["num_hidden_layers"]
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        assert _batch_generate(model) == expected
        assert _batch_generate(model, eos=[eos]) == expected_eos
        mx.synchronize(generation_stream)
        stats = plugin.stats()
        # A mask's tag lives as long as the mask: a long-running server does not accumulate them.
        gc.collect()
        assert len(patches._switch.active.tags._tags) <= 2 * layers
    calls = _ext.cpu_kernel_calls() - kernel_calls
    # The op ran for every call it served, but the last layer of a step whose logits mlx-lm
    # never reads (the layers before it feed the cache of the next one).
    assert stats.served - 2 * layers <= calls <= stats.served
    assert stats.batch_kv > 0 and stats.prefill > 0 and stats.other == 0
    assert stats.rotating_wrapped == 0
    if family == "gpt_oss":
        # The sliding layer's ring is served before it wraps and after, through ring_offset.
        assert stats.batch_rotating > stats.batch_rotating_wrapped > 0
    else:
        assert stats.batch_rotating == 0


@pytest.fixture(scope="module")
def ring_models():
    built = {name: random_model(config, seed=2) for name, (config, _) in RING_FAMILIES.items()}
    for layer in built["gpt_oss"].layers:
        layer.self_attn.sinks = 2.0 * mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(built["gpt_oss"].parameters())
    return built


def _ring_generate(model, options):
    response = batch_generate(
        model,
        _Tokenizer(),
        random_prompts(RING_PROMPT_LENS, seed=5),
        max_tokens=RING_MAX_TOKENS,
        return_token_ids=True,
        **options,
    )
    mx.synchronize(generation_stream)
    return response.token_ids


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("family", list(RING_FAMILIES))
def test_wrapped_rings_decode_on_the_op(ring_models, family, schedule):
    """Greedy tokens equal mlx-lm's own while rings wrap several times, and every decode step
    runs on the op; ``wrapped_rings=False`` (the baseline) leaves the wrapped ones to mlx-lm."""
    model = ring_models[family]
    options = {**RING_FAMILIES[family][1], **SCHEDULES[schedule]}
    expected = _ring_generate(model, options)
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        assert _ring_generate(model, options) == expected
        stats = plugin.stats()
    calls = _ext.cpu_kernel_calls() - kernel_calls
    layers = len(model.layers)
    assert stats.rotating_wrapped == stats.other == stats.unsupported_shape == 0
    assert stats.batch_rotating_wrapped > 0 and stats.served - layers <= calls <= stats.served
    if family == "qwen3_max_kv_size":
        assert stats.batch_kv == 0
    with plugin.enabled(wrapped_rings=False):
        assert _ring_generate(model, options) == expected
        baseline = plugin.stats()
    assert baseline.rotating_wrapped == stats.batch_rotating_wrapped
    assert baseline.batch_rotating_wrapped == 0
    assert baseline.batch_rotating == stats.batch_rotating - stats.batch_rotating_wrapped


def test_enable_refuses_the_other_ring_setting():
    plugin.enable(wrapped_rings=False)
    plugin.enable(wrapped_rings=False)
    with pytest.raises(ValueError, match=r"^\[mlx_batched_decode\.mlx_lm\] already enabled"):
        plugin.enable()
    plugin.disable()


def _merged_caches(make, lens, heads, head_dim, seed):
    """Two copies of the left-padded batch cache mlx-lm builds from per-request caches of
    ``lens`` tokens when they join a batch: the first with NaN in every padding position, the
    second as mlx-lm leaves it (zeros there)."""
    singles = []
    for i, n in enumerate(lens):
        single = make()
        kv = mx.random.normal((2, 1, heads, n, head_dim), key=mx.random.key(seed + i))
        for t in range(n):
            single.update_and_fetch(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        singles.append(single)
    merged = type(singles[0]).merge(singles)
    # mlx-lm's own masked attention would turn NaN padding into NaN output; the op never reads it.
    length = merged.keys.shape[2]
    padding = mx.arange(length)[None, None, :, None] < merged.left_padding[:, None, None, None]
    merged.keys = mx.where(padding, mx.nan, merged.keys)
    merged.values = mx.where(padding, mx.nan, merged.values)
    zeros = type(singles[0]).merge(singles)
    return merged, zeros


@pytest.mark.parametrize(
    "kind, window",
    [("batch", None), ("batch", 5), ("rotating", None), ("rotating", 6)],
)
def test_each_decode_call_equals_mlx_lm_attention(kind, window):
    """Layer by layer: the op's output equals mlx-lm's masked SDPA on the same cache, where the
    padding holds zeros; the plug-in's cache holds NaN there instead. A ring wraps three times,
    and NaN padding stays in its slots until the ring overwrites them."""
    lens, heads, head_dim, steps, max_size = [3, 11, 1, 7], 2, 32, 30, 12
    if kind == "batch":
        make = KVCache
    else:
        make = lambda: RotatingKVCache(max_size=max_size)  # noqa: E731
    served, reference = _merged_caches(make, lens, heads, head_dim, seed=4)
    sinks = mx.random.normal((2 * heads,), key=mx.random.key(5))
    mask_kwargs = {} if window is None else {"window_size": window}
    plugin.enable()
    for step in range(steps):
        mask = served.make_mask(1, **mask_kwargs)
        reference_mask = reference.make_mask(1, **mask_kwargs)
        q, k, v = mx.random.normal((3, len(lens), 2 * heads, 1, head_dim), key=mx.random.key(step))
        k, v = k[:, :heads], v[:, :heads]
        keys, values = served.update_and_fetch(k, v)
        reference_keys, reference_values = reference.update_and_fetch(k, v)
        before = plugin.stats()
        out = base.scaled_dot_product_attention(
            q, keys, values, cache=served, scale=0.3, mask=mask, sinks=sinks
        )
        expected = mx.fast.scaled_dot_product_attention(
            q, reference_keys, reference_values, scale=0.3, mask=reference_mask, sinks=sinks
        )
        assert plugin.stats().served == before.served + 1
        assert mx.allclose(out, expected, atol=1e-5).item(), (kind, window, step)
    stats = plugin.stats()
    assert stats.rotating_wrapped == 0
    if kind == "batch":
        assert stats.batch_kv == steps
    else:
        # The ring of 12 is full after 12 positions: 11 (longest) + 1 step in order, then wrapped.
        assert stats.batch_rotating == steps
        assert stats.batch_rotating_wrapped == steps - (max_size - max(lens))


def test_what_stays_on_mlx_lm_path(models):
    """Single-request generation (KVCache), prefill and head dims the op does not take run
    mlx-lm's code, counted; the op never runs for them."""
    model = models["llama"]
    prompt = mx.array(random_prompts([20])[0])
    expected = [t for t, _ in generate_step(prompt, model, max_tokens=6)]
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        assert [t for t, _ in generate_step(prompt, model, max_tokens=6)] == expected
        stats = plugin.stats()
        assert stats.other > 0 and stats.served == 0

        # Keys wider than the op takes (576 at most, where values are narrower).
        cache = BatchKVCache([0, 2])
        cache.update_and_fetch(mx.zeros((2, 2, 3, 640)), mx.zeros((2, 2, 3, 8)))
        mask = cache.make_mask(1)
        keys, values = cache.update_and_fetch(mx.zeros((2, 2, 1, 640)), mx.zeros((2, 2, 1, 8)))
        q = mx.random.normal((2, 4, 1, 640))
        base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=1.0, mask=mask)
        assert plugin.stats().unsupported_shape == 1
    assert _ext.cpu_kernel_calls() == kernel_calls


def test_decode_masks_the_plugin_cannot_read_are_errors():
    cache = BatchKVCache([1, 0])
    q = mx.zeros((2, 2, 1, 8))
    keys, values = cache.update_and_fetch(mx.zeros((2, 1, 3, 8)), mx.zeros((2, 1, 3, 8)))
    stale_mask = cache.make_mask(1)  # built before the patch: not tagged

    def attend(mask):
        return base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=1.0, mask=mask)

    with plugin.enabled():
        tagged = cache.make_mask(1)
        keys, values = cache.update_and_fetch(mx.zeros((2, 1, 1, 8)), mx.zeros((2, 1, 1, 8)))
        for mask in (None, stale_mask, mx.ones((2, 1, 1, 4), dtype=mx.bool_)):
            with pytest.raises(ValueError, match=r"^\[mlx_batched_decode\.mlx_lm\] .*make_mask"):
                attend(mask)
        attend(tagged)
        # A mask built for another step of the cache.
        keys, values = cache.update_and_fetch(mx.zeros((2, 1, 1, 8)), mx.zeros((2, 1, 1, 8)))
        with pytest.raises(ValueError, match=r"^\[mlx_batched_decode\.mlx_lm\] .*built for 4"):
            attend(tagged)


def _unimported_model_module():
    """An mlx-lm model module not imported yet that binds mlx-lm's attention function."""
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        name = f"mlx_lm.models.{info.name}"
        if name in sys.modules:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:  # a model file needing a package mlx-lm does not require
            continue
        if "scaled_dot_product_attention" in vars(module):
            return module
    pytest.skip("every mlx-lm model module is already imported")


def test_disable_restores_everything():
    original = base.scaled_dot_product_attention
    patched_before = {
        "base": original,
        "llama": llama.scaled_dot_product_attention,
        "BatchKVCache.make_mask": BatchKVCache.__dict__["make_mask"],
        "BatchRotatingKVCache.make_mask": BatchRotatingKVCache.__dict__["make_mask"],
    }

    def current():
        return {
            "base": base.scaled_dot_product_attention,
            "llama": llama.scaled_dot_product_attention,
            "BatchKVCache.make_mask": BatchKVCache.__dict__["make_mask"],
            "BatchRotatingKVCache.make_mask": BatchRotatingKVCache.__dict__["make_mask"],
        }

    plugin.enable()
    plugin.enable()  # idempotent: nothing patched twice
    assert plugin.is_enabled()
    assert all(current()[k] is not v for k, v in patched_before.items())
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    imported_while_enabled = _unimported_model_module()
    assert imported_while_enabled.scaled_dot_product_attention is base.scaled_dot_product_attention
    plugin.disable()
    plugin.disable()
    assert not plugin.is_enabled()
    assert current() == patched_before and all(current()[k] is v for k, v in patched_before.items())
    assert imported_while_enabled.scaled_dot_product_attention is original
    assert not any(
        isinstance(vars(m).get("scaled_dot_product_attention"), DecodeRouter)
        for m in list(sys.modules.values())
        if isinstance(getattr(m, "__dict__", None), dict)
    )

    # The context manager turns it off after its block, also when the block raises...
    with pytest.raises(RuntimeError):
        with plugin.enabled():
            assert plugin.is_enabled()
            raise RuntimeError("inside")
    assert base.scaled_dot_product_attention is original and not plugin.is_enabled()
    # ... but leaves it on when it was on before.
    plugin.enable()
    with plugin.enabled():
        pass
    assert plugin.is_enabled()
    plugin.disable()
    with pytest.raises(ValueError, match=r"^\[mlx_batched_decode\.mlx_lm\] stats\(\)"):
        plugin.stats()


def test_other_mlx_lm_versions_are_refused(monkeypatch):
    original = base.scaled_dot_product_attention
    monkeypatch.setattr(mlx_lm, "__version__", "0.0.1")
    with pytest.raises(ValueError, match=r"^\[mlx_batched_decode\.mlx_lm\] needs mlx-lm 0\.32\.2"):
        plugin.enable()
    assert not plugin.is_enabled() and base.scaled_dot_product_attention is original
