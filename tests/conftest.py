"""Shared fixtures. The helpers tests import live in ``tests.support`` (numerics, model configs,
paged cases, the server simulation, the tensor-parallel worker) and ``tests.metal_emu`` (the
Metal emulation harness); ``tests`` is a package, so pytest puts the repository root on
``sys.path`` and every test imports them by their full names.
"""

import pytest


@pytest.fixture
def kernel_calls():
    """Returns a function giving the fused CPU kernel's run count since the test began."""
    from mlx_batched_decode import _ext

    start = _ext.cpu_kernel_calls()
    return lambda: _ext.cpu_kernel_calls() - start
