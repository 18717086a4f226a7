"""Where the Metal kernels come from: the prebuilt metallib next to the
extension when it is on disk, else the embedded source compiled at first use,
and nothing without Metal. The choice (csrc/metal/backend_choice.h) is checked
through the emulation harness, which compiles that header unchanged; eval_gpu
and ``mlx_batched_decode.metal_backend()`` both take it."""

from __future__ import annotations


import mlx.core as mx
import pytest

from tests.metal_emu.build import REPO, build_library
from tests.metal_emu.driver import EmulatedLibrary

mbd = pytest.importorskip("mlx_batched_decode")


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


@pytest.mark.parametrize(
    "metal_present,metallib_on_disk,backend",
    [(True, True, "metallib"), (True, False, "source"), (False, True, None), (False, False, None)])
def test_choice(lib, metal_present, metallib_on_disk, backend):
    assert lib.metal_backend(metal_present, metallib_on_disk) == backend


def test_this_process():
    if mx.metal.is_available():
        assert mbd.metal_backend() in ("metallib", "source")
    else:
        assert mbd.metal_backend() is None


def test_eval_gpu_takes_the_choice():
    """The launcher loads the metallib only on the choice's word, and compiles the
    embedded source through MLX's run-time compiler otherwise."""
    source = (REPO / "csrc" / "metal" / "decode_launch.cpp").read_text()
    assert "switch (metal_backend())" in source
    assert "d.get_library(kMetallibName, module_dir())" in source
    assert ("d.get_library(name, mx::CompileOptions{}, [&] { return kernel_source(dtype, head_dim, value_dim, bits, "
            "ragged); })") in source
    assert ": library_source(metal_source(), dtype, head_dim, value_dim)" in source
