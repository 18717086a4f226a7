"""A fixture that runs a test once per CPU kernel variant this build and CPU have: import ``isa``
into a test module and take it as an argument; and the CPU's flags, as Linux names them."""

import pytest

from mlx_batched_decode import _ext


@pytest.fixture(params=_ext.cpu_isas())
def isa(request):
    """The variant forced for the test (set_cpu_isa), the previous one restored after it."""
    previous = _ext.cpu_isa()
    _ext.set_cpu_isa(request.param)
    yield request.param
    _ext.set_cpu_isa(previous)


def cpu_flags():
    """The flags /proc/cpuinfo lists for the first CPU (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
