"""The Metal kernel on an Apple GPU against the reference (``pytest -m gpu``).

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, T positions, D head dim.
Skipped where Metal is absent; there, tests/test_metal_emulated.py runs the same
kernel source on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not mx.metal.is_available(),
        reason="needs a Metal GPU (Apple silicon, macOS); the Metal kernel runs under the emulation harness here",
    ),
]

mbd = pytest.importorskip("mlx_batched_decode")

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
HEAD_DIMS = [64, 80, 96, 128, 256]
# Against a float32 reference: output rounding plus the GPU's exp.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def inputs(b, h_kv, g, t, d, dtype, lens, capacity=None, seed=0):
    """Queries [B, H_q, 1, D]; keys/values ``cache[:, :, :T]`` of a cache with
    ``capacity`` positions whose padding holds NaN (keys) and inf (values)."""
    rng = np.random.default_rng(seed)
    capacity = capacity or t
    k = rng.standard_normal((b, h_kv, capacity, d)).astype(np.float32)
    v = rng.standard_normal((b, h_kv, capacity, d)).astype(np.float32)
    for i, n in enumerate(lens):
        k[i, :, max(0, min(n, t)) :] = np.nan
        v[i, :, max(0, min(n, t)) :] = np.inf
    q = mx.array(rng.standard_normal((b, h_kv * g, 1, d)).astype(np.float32)).astype(dtype)
    keys = mx.array(k).astype(dtype)[:, :, :t]
    values = mx.array(v).astype(dtype)[:, :, :t]
    return q, keys, values, mx.array(lens, dtype=mx.int32)


def check(q, k, v, lens):
    out = mbd.batched_decode_attention(q, k, v, lens, stream=mx.gpu)
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    expected = mbd.reference_attention(*f32, lens, stream=mx.cpu)
    got = np.array(out.astype(mx.float32))
    tol = TOLERANCE[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.array(expected), atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_pass(dtype, d, g):
    lens = [0, 1, 5, 48, 51, -2, 17, 33]
    got = check(*inputs(len(lens), 16, g, 48, d, dtype, lens, capacity=64))
    assert not got[[0, 5]].any()


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_long_context(dtype, d):
    """One or two requests with long contexts take the split-K path."""
    check(*inputs(2, 2, 4, 3000, d, dtype, [3000, 17], capacity=4096))
    check(*inputs(1, 1, 8, 8192, d, dtype, [5000]))


def test_wide_groups():
    check(*inputs(3, 2, 16, 200, 128, mx.float16, [200, 0, 99]))


def test_capture_of_one_decode_step(tmp_path):
    """metal_capture writes a .gputrace (needs MTL_CAPTURE_ENABLED=1 at process start)."""
    trace = tmp_path / "decode_step.gputrace"
    code = (
        "import mlx.core as mx, mlx_batched_decode as mbd\n"
        "from mlx_batched_decode.profiling import metal_capture\n"
        "q = mx.random.normal((4, 32, 1, 128)).astype(mx.float16)\n"
        "k = mx.random.normal((4, 8, 1024, 128)).astype(mx.float16)\n"
        "lens = mx.array([1024, 7, 300, 0])\n"
        f"with metal_capture({str(trace)!r}):\n"
        "    mx.eval(mbd.batched_decode_attention(q, k, k, lens, stream=mx.gpu))\n"
    )
    env = dict(os.environ, MTL_CAPTURE_ENABLED="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert trace.exists()


def test_capture_without_capture_enabled_raises(tmp_path):
    from mlx_batched_decode.profiling import metal_capture

    if os.environ.get("MTL_CAPTURE_ENABLED") == "1":
        pytest.skip("this process was started with captures enabled")
    with pytest.raises(RuntimeError, match="MTL_CAPTURE_ENABLED=1"):
        with metal_capture(tmp_path / "x.gputrace"):
            pass
