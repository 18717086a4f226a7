"""The native module called directly: kernel variants, run counter, stubs."""

import pathlib

import mlx.core as mx
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
