"""The native module called directly: kernel variants, run counter, stubs."""

import pathlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_batched_decode import _ext
from conftest import DTYPES, TOLERANCE, dtype_id, make_inputs, max_abs_error, numpy_reference


@pytest.fixture(params=_ext.cpu_isas())
def isa(request):
    previous = _ext.cpu_isa()
    _ext.set_cpu_isa(request.param)
    yield request.param
    _ext.set_cpu_isa(previous)


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
    import os

    assert 1 <= _ext.cpu_threads() <= (os.cpu_count() or 1)


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
