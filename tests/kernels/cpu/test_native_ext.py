"""The native module called directly: kernel variants, run counter, worker polling, stubs."""

import os
import pathlib
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_batched_decode import _ext
from tests.support.cpu_isa import isa  # noqa: F401  a fixture
from tests.support.numerics import DTYPES, TOLERANCE, dtype_id, make_inputs, max_abs_error, numpy_reference


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_every_cpu_variant_matches_reference(isa, dtype, D):
    lens = [0, 1, 33, 600]
    q, k, v = make_inputs(4, 8, 2, 600, D, dtype, seed=D)
    before = _ext.cpu_kernel_calls()
    out = _ext.batched_decode_attention(q, k, v, mx.array(lens))
    mx.eval(out)
    assert _ext.cpu_isa() == isa
    assert _ext.cpu_kernel_calls() == before + 1
    assert max_abs_error(out, numpy_reference(q, k, v, lens)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=dtype_id)
def test_output_rounds_like_mlx(isa, dtype):
    """16-bit outputs are rounded as MLX's own conversion rounds, ties included; NaN stays NaN.

    Zero queries weigh two keys equally, so each output is (v0 + v1) / 2 computed
    exactly in float32, one bit finer than the dtype; about half of them are ties.
    """
    B, H, D = 3, 2, 64
    bits = {mx.float16: 11, mx.bfloat16: 8}[dtype]
    rng = np.random.default_rng(bits)
    # Integers with exactly `bits` significant bits: their halved sums need one more.
    grid = rng.choice([-1, 1], size=(B, H, 2, D)) * rng.integers(2 ** (bits - 1), 2**bits, size=(B, H, 2, D)) / 2.0**5
    grid[2, 1, 0, 7] = np.nan  # one NaN value: that output is NaN
    v = mx.array(grid.astype(np.float32)).astype(dtype)
    k = mx.ones((B, H, 2, D), dtype)
    q = mx.zeros((B, H, 1, D), dtype)
    out = _ext.batched_decode_attention(q, k, v, mx.array([2] * B))
    v32 = v.astype(mx.float32)
    expected = ((v32[:, :, 0] + v32[:, :, 1]) * 0.5).astype(dtype)[:, :, None]
    nan = np.isnan(np.array(expected.astype(mx.float32)))
    assert nan.sum() == 1
    assert np.array_equal(np.isnan(np.array(out.astype(mx.float32))), nan)
    # Bit for bit elsewhere (NaN payloads are not compared).
    assert np.array_equal(np.array(out.view(mx.uint16))[~nan], np.array(expected.view(mx.uint16))[~nan])


def test_variants_list_and_selection():
    isas = _ext.cpu_isas()
    assert isas[0] == "baseline"
    assert _ext.cpu_isa() == isas[-1], "the best variant is the default"
    with pytest.raises(ValueError, match="not available"):
        _ext.set_cpu_isa("avx512-imaginary")
    assert _ext.cpu_isa() == isas[-1]


def test_thread_count_is_bounded_by_cpus():
    assert 1 <= _ext.cpu_threads() <= (os.cpu_count() or 1)


def run_with_spin(value, code):
    env = dict(os.environ, MBD_CPU_SPIN_US=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_spin_time_default():
    assert _ext.cpu_spin_us() == int(os.environ.get("MBD_CPU_SPIN_US", 5000))


@pytest.mark.parametrize("value", ["abc", "-1", "1e3", "5 ", "10000001", "99999999999999999999999"])
def test_malformed_spin_time_fails_the_import(value):
    result = run_with_spin(value, "import mlx_batched_decode")
    assert result.returncode != 0
    assert "ValueError: MBD_CPU_SPIN_US must be an integer number of microseconds" in result.stderr
    assert f"got '{value}'" in result.stderr


# One call large enough for the pool, then the process's CPU time while the
# caller sleeps: a polling worker uses it, a sleeping one does not.
POLLING = """
import time
import mlx.core as mx
import mlx_batched_decode as mbd
q = mx.random.normal((2, 8, 1, 128))
k, v = mx.random.normal((2, 2, 2, 4096, 128))
lens = mx.array([4096, 3000])
out = mbd.batched_decode_attention(q, k, v, lens)
err = mx.abs(out - mbd.reference_attention(q, k, v, lens)).max().item()
start = time.process_time()
time.sleep(0.3)
print(err, time.process_time() - start)
"""


@pytest.mark.skipif(_ext.cpu_threads() < 2, reason="the pool has no workers on one CPU")
def test_idle_workers_poll_for_the_spin_time_then_sleep():
    busy, idle = (run_with_spin(value, POLLING) for value in ("2000000", "0"))
    assert busy.returncode == 0 and idle.returncode == 0, busy.stderr + idle.stderr
    (busy_err, busy_cpu), (idle_err, idle_cpu) = (map(float, r.stdout.split()) for r in (busy, idle))
    assert busy_err < 1e-4 and idle_err < 1e-4
    assert busy_cpu > 0.1, "the worker slept instead of polling"
    assert idle_cpu < 0.05, "the worker polled with MBD_CPU_SPIN_US=0"


def test_reference_is_not_the_kernel():
    q, k, v = make_inputs(2, 4, 2, 8, 64, mx.float32)
    before = _ext.cpu_kernel_calls()
    mx.eval(_ext.reference_attention(q, k, v, mx.array([8, 2])))
    assert _ext.cpu_kernel_calls() == before


def test_type_stubs_are_shipped():
    pkg = pathlib.Path(_ext.__file__).parent
    stub = pkg / "_ext.pyi"
    assert stub.is_file(), "the build generates _ext.pyi next to the module"
    text = stub.read_text()
    assert "def batched_decode_attention(" in text and "def reference_attention(" in text
