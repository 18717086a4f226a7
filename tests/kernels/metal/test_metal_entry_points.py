"""Without Metal (Linux), every Metal-only entry point raises a clear error
instead of silently doing nothing."""

from __future__ import annotations

import mlx.core as mx
import pytest

pytestmark = pytest.mark.skipif(mx.metal.is_available(), reason="Metal is available: tests/kernels/metal/test_gpu.py covers it")

mbd = pytest.importorskip("mlx_batched_decode")
from mlx_batched_decode.tools.profiling import metal_capture  # noqa: E402


def test_metal_capture_raises_instead_of_recording_nothing(tmp_path):
    trace = tmp_path / "step.gputrace"
    with pytest.raises(RuntimeError, match=r"\[metal_capture\] Metal is not available"):
        with metal_capture(trace):
            pytest.fail("the block must not run without Metal")
    assert not trace.exists()


def test_gpu_stream_raises():
    q = mx.zeros((1, 2, 1, 64))
    kv = mx.zeros((1, 1, 8, 64))
    with pytest.raises(ValueError, match="(?i)gpu|metal"):
        mbd.batched_decode_attention(q, kv, kv, mx.array([3]), stream=mx.gpu)
