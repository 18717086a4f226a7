"""One attention layer's decode step, with the plug-in and with SGLang's own method, on copies of
the same caches: the outputs agree within each dtype's tolerance, the caches end up alike, and
what the op does not serve runs SGLang's method, counted.

Requests of deliberately uneven lengths; ``ContiguousAttentionKVCache`` buffers whose unused
positions hold NaN (the op gets whole buffers and must read only each request's length) and
that grow during the steps; a window on such buffers; ``WindowedAttentionKVCache`` buffers that
compact during the steps; sinks in every case.
"""

import mlx.core as mx
import pytest

from tests.support.sglang_backend import skip_reason

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)
pytest.importorskip("mlx_lm")

import mlx_batched_decode.sglang as plugin  # noqa: E402
from mlx_batched_decode import _ext  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.mlx_lm_models import GPT_OSS, LLAMA, QWEN3_NEXT  # noqa: E402

LENS = [1, 30, 97, 5]
STEPS = 3
WINDOW = 6
# Capacity 32: the 97-token buffer grows in prefill, the 30-token one during the steps.
CAPACITY = 32
TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}


def _attention(config, dtype, seed):
    """A random-weight attention module of mlx-lm's ``config`` model, as its layers hold it."""
    if config is QWEN3_NEXT:
        from mlx_lm.models import qwen3_next

        mx.random.seed(seed)
        inner = qwen3_next.Qwen3NextAttention(qwen3_next.ModelArgs.from_dict(config))
        inner.set_dtype(dtype)
        mx.eval(inner.parameters())
        return inner
    inner = random_model(config, seed=seed, dtype=dtype).layers[0].self_attn
    if hasattr(inner, "sinks"):
        # Trained sinks differ per head; a scale other than 1/sqrt(D) shows SGLang's reaches the
        # op. Both set before wrapping: the wrapper keeps what it finds.
        sinks = 2.0 * mx.random.normal(inner.sinks.shape, key=mx.random.key(seed))
        inner.sinks = sinks.astype(dtype)
        inner.sm_scale = 0.3
    return inner


def _wrapper(backend, config, dtype, window, seed=3):
    inner = _attention(config, dtype, seed)
    return backend.attention_wrapper.MLXAttentionWrapper(inner, 0, window_size=window)


def _caches(backend, kind, config, dtype, seed=4):
    """Two identical sets of one cache per request of ``LENS`` tokens, as prefill leaves them;
    contiguous buffers hold NaN past their tokens."""
    kv = backend.attention_kv_cache
    heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    sets = []
    for _ in range(2):
        caches = []
        for i, n in enumerate(LENS):
            kv_shape = (2, 1, heads, n, head_dim)
            k, v = mx.random.normal(kv_shape, key=mx.random.key(seed + i)).astype(dtype)
            if kind == "windowed":
                cache = kv.WindowedAttentionKVCache(WINDOW)
                cache.update_and_fetch(k, v)
            else:
                cache = kv.ContiguousAttentionKVCache(max_seq_len=CAPACITY)
                cache.update_and_fetch(k, v)
                cache.keys[:, :, n:, :] = mx.nan
                cache.values[:, :, n:, :] = mx.nan
            caches.append(cache)
        mx.eval([c.state for c in caches])
        sets.append(caches)
    return sets


def _context(backend, caches):
    return backend.attention_wrapper.BatchedDecodeContext(
        batch_size=len(caches), seq_lens=[c.offset for c in caches], attention_layer_caches=[caches]
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize(
    "model, kind, window",
    [
        ("gpt_oss", "contiguous", None),
        ("gpt_oss", "contiguous", WINDOW),
        ("gpt_oss", "windowed", WINDOW),
        ("qwen3_next", "contiguous", None),
    ],
)
def test_each_step_equals_sglang(backend, dtype, model, kind, window):
    config = {"gpt_oss": GPT_OSS, "qwen3_next": QWEN3_NEXT}[model]
    wrapper = _wrapper(backend, config, dtype, window)
    original = type(wrapper)._batched_decode
    served, reference = _caches(backend, kind, config, dtype)
    capacities = [c.keys.shape[2] for c in served]
    tolerance = TOLERANCE[dtype]
    plugin.enable()
    for step in range(STEPS):
        x = mx.random.normal((len(LENS), 1, config["hidden_size"]), key=mx.random.key(step))
        x = x.astype(dtype)
        expected = original(wrapper, x, _context(backend, reference))
        out = wrapper._batched_decode(x, _context(backend, served))
        assert out.dtype == expected.dtype == dtype
        close = mx.allclose(out, expected, atol=tolerance, rtol=tolerance).item()
        assert close, (kind, window, step)
        for got, want in zip(served, reference):
            assert got.offset == want.offset
            assert mx.array_equal(got.get_kv(window)[0], want.get_kv(window)[0]).item()
    stats = plugin.stats()
    assert stats.served == STEPS and stats.windowed == (STEPS if kind == "windowed" else 0)
    if kind == "contiguous":
        # The 30-token buffer filled up during the steps.
        assert [c.keys.shape[2] for c in served] != capacities


class _OtherCache:
    """A cache of a kind the plug-in does not know, with the interface SGLang's path uses."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def offset(self):
        return self.cache.offset

    def write_token(self, k, v):
        self.cache.write_token(k, v)

    def get_kv(self, window=None):
        return self.cache.get_kv(window)


def test_what_stays_on_sglang_path(backend):
    """Head dims above 512 and caches of other kinds run SGLang's method, counted; the op does
    not run for them."""
    wide_config = dict(LLAMA, head_dim=640)
    wide = _wrapper(backend, wide_config, mx.float32, None)
    narrow = _wrapper(backend, GPT_OSS, mx.float32, None)
    original = type(narrow)._batched_decode
    plain = _caches(backend, "contiguous", GPT_OSS, mx.float32)
    other = [[_OtherCache(c) for c in caches] for caches in plain]
    cases = [(wide, _caches(backend, "contiguous", wide_config, mx.float32)), (narrow, other)]
    kernel_calls = _ext.cpu_kernel_calls()
    with plugin.enabled():
        for wrapper, (served, reference) in cases:
            x = mx.random.normal((len(LENS), 1, wrapper._inner.q_proj.weight.shape[1]))
            expected = original(wrapper, x, _context(backend, reference))
            out = wrapper._batched_decode(x, _context(backend, served))
            assert mx.array_equal(out, expected).item()
        stats = plugin.stats()
    assert _ext.cpu_kernel_calls() == kernel_calls
    assert stats.unsupported_shape == 1 and stats.other == 1 and stats.served == 0
