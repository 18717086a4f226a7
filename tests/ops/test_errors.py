"""Every malformed call raises ValueError naming the problem, before any work."""

import mlx.core as mx
import pytest

import mlx_batched_decode as mbd

B, H_q, H_kv, T, D = 2, 8, 2, 16, 64


def args(**over):
    a = dict(
        queries=mx.zeros((B, H_q, 1, D)),
        keys=mx.zeros((B, H_kv, T, D)),
        values=mx.zeros((B, H_kv, T, D)),
        valid_lens=mx.array([3, 4], dtype=mx.int32),
    )
    a.update(over)
    return a


CASES = [
    ("queries rank", dict(queries=mx.zeros((B, H_q, D))), "queries must have shape [B, H_q, L, D]"),
    ("no query rows", dict(queries=mx.zeros((B, H_q, 0, D))), "at least one row per request (L >= 1)"),
    ("keys rank", dict(keys=mx.zeros((B, H_kv, T))), "keys must have shape [B, H_kv, T, D]"),
    ("values shape", dict(values=mx.zeros((B, H_kv, T + 1, D))), "values must have the shape of keys"),
    ("batch mismatch", dict(keys=mx.zeros((B + 1, H_kv, T, D)), values=mx.zeros((B + 1, H_kv, T, D))), "keys have batch size 3 but queries have 2"),
    ("head dim mismatch", dict(keys=mx.zeros((B, H_kv, T, 128)), values=mx.zeros((B, H_kv, T, 128))), "keys have head dim 128 but queries have 64"),
    ("GQA ratio", dict(keys=mx.zeros((B, 3, T, D)), values=mx.zeros((B, 3, T, D))), "must be a positive multiple of the number of key/value heads (3)"),
    ("no kv heads", dict(keys=mx.zeros((B, 0, T, D)), values=mx.zeros((B, 0, T, D))), "positive multiple"),
    ("no query heads", dict(queries=mx.zeros((B, 0, 1, D))), "positive multiple"),
    ("head dim 0", dict(queries=mx.zeros((B, H_q, 1, 0)), keys=mx.zeros((B, H_kv, T, 0)), values=mx.zeros((B, H_kv, T, 0))), "head dim 0 is not supported; head dims 1 to 512 are"),
    ("head dim 513", dict(queries=mx.zeros((B, H_q, 1, 513)), keys=mx.zeros((B, H_kv, T, 513)), values=mx.zeros((B, H_kv, T, 513))), "head dim 513 is not supported"),
    ("integer queries", dict(queries=mx.zeros((B, H_q, 1, D), mx.int32), keys=mx.zeros((B, H_kv, T, D), mx.int32), values=mx.zeros((B, H_kv, T, D), mx.int32)), "queries must be float16, bfloat16 or float32"),
    ("mixed dtypes", dict(keys=mx.zeros((B, H_kv, T, D), mx.float16)), "must share one dtype"),
    ("lens rank", dict(valid_lens=mx.array([[3, 4]])), "valid_lens must have shape [B] = (2,)"),
    ("lens length", dict(valid_lens=mx.array([3])), "valid_lens must have shape [B] = (2,)"),
    ("lens dtype", dict(valid_lens=mx.array([3.0, 4.0])), "valid_lens must have an integer dtype"),
    ("starts rank", dict(kv_starts=mx.array([[0, 1]])), "kv_starts must have shape [B] = (2,)"),
    ("starts length", dict(kv_starts=mx.array([0, 1, 2])), "kv_starts must have shape [B] = (2,)"),
    ("starts dtype", dict(kv_starts=mx.array([0.0, 1.0])), "kv_starts must have an integer dtype"),
    ("window 0", dict(window=0), "window must be >= 1, got 0"),
    ("negative window", dict(window=-4), "window must be >= 1, got -4"),
    ("sinks shape", dict(sinks=mx.zeros((H_kv,))), "sinks must have shape [H_q] = (8,), got (2,)"),
    ("sinks rank", dict(sinks=mx.zeros((1, H_q))), "sinks must have shape [H_q] = (8,)"),
    ("sinks dtype", dict(sinks=mx.zeros((H_q,), mx.int32)), "sinks must have a floating dtype"),
]


@pytest.mark.parametrize("fn", [mbd.batched_decode_attention, mbd.reference_attention])
@pytest.mark.parametrize("name,over,message", CASES, ids=[c[0] for c in CASES])
def test_value_errors(fn, name, over, message):
    with pytest.raises(ValueError) as info:
        fn(**args(**over))
    text = str(info.value)
    assert text.startswith("[batched_decode_attention] ")
    assert message in text


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_non_finite_scale(scale):
    with pytest.raises(ValueError, match=r"^\[batched_decode_attention\] scale must be finite"):
        mbd.batched_decode_attention(**args(), scale=scale)


def test_errors_are_raised_before_work_is_queued(kernel_calls):
    for bad in (dict(valid_lens=mx.array([1])), dict(window=0), dict(sinks=mx.zeros((3,)))):
        with pytest.raises(ValueError):
            mbd.batched_decode_attention(**args(**bad))
    mx.synchronize()
    assert kernel_calls() == 0


def test_window_must_be_an_int():
    with pytest.raises(TypeError):
        mbd.batched_decode_attention(**args(), window=2.5)


def test_stream_is_keyword_only():
    a = args()
    with pytest.raises(TypeError):
        mbd.batched_decode_attention(*a.values(), None, mx.cpu)
    out = mbd.batched_decode_attention(**a, stream=mx.cpu)
    assert out.shape == (B, H_q, 1, D)


@pytest.mark.skipif(mx.metal.is_available(), reason="checks a machine without Metal")
def test_gpu_stream_without_metal_is_rejected():
    with pytest.raises(ValueError, match="gpu"):
        mbd.batched_decode_attention(**args(), stream=mx.gpu)
