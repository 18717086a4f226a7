"""A fixture that runs a test once per CPU kernel variant this build and CPU have: import ``isa``
into a test module and take it as an argument."""

import pytest

from mlx_batched_decode import _ext


@pytest.fixture(params=_ext.cpu_isas())
def isa(request):
    """The variant forced for the test (set_cpu_isa), the previous one restored after it."""
    previous = _ext.cpu_isa()
    _ext.set_cpu_isa(request.param)
    yield request.param
    _ext.set_cpu_isa(previous)
