"""The Metal launchers (csrc/metal/decode_launch.cpp, the launch tail, and
csrc/metal/eval_gpu.cpp, the ops' eval_gpu) cannot be built on Linux; this
syntax-checks them, and the Metal side of csrc/metal_backend.cpp,
with g++ against MLX's real host headers (device.h, utils.h, array.h: the API
they must match) and the project's primitive, with metal-cpp reduced to
declarations."""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from tests.metal_emu.build import HARNESS
from tests.support.repo import REPO

MLX_INCLUDE = Path(mx.__file__).resolve().parent / "include"
STUB = HARNESS / "metal_cpp_stub"
LAUNCHER = REPO / "csrc" / "metal" / "decode_launch.cpp"


def syntax_check(source: Path) -> subprocess.CompletedProcess:
    # -iquote: a copy elsewhere finds the launcher's own headers as the original does.
    return subprocess.run(
        ["g++", "-std=c++20", "-Wall", "-Wextra", "-fsyntax-only", "-DMLX_BATCHED_DECODE_METAL",
         f"-isystem{STUB}", f"-isystem{MLX_INCLUDE}", f"-I{REPO / 'csrc'}", f"-iquote{LAUNCHER.parent}", str(source)],
        capture_output=True, text=True)


needs_headers = pytest.mark.skipif(not (MLX_INCLUDE / "mlx" / "backend" / "metal" / "device.h").exists(),
                                   reason="this MLX install ships no Metal host headers")


@needs_headers
@pytest.mark.parametrize(
    "source",
    [LAUNCHER, LAUNCHER.parent / "eval_gpu.cpp", REPO / "csrc" / "metal_backend.cpp"],
    ids=lambda p: p.name)
def test_metal_build_matches_mlx_host_api(source):
    """The launcher, and the backend choice as an Apple build compiles it."""
    result = syntax_check(source)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr


@needs_headers
@pytest.mark.parametrize(
    "original,broken,diagnostic",
    [("encoder.add_temporary(p);", "encoder.add_temporaries_of(p);", "add_temporaries_of"),
     # The run-time compile: get_library(name, CompileOptions, builder) of mlx 0.32.x, the builder giving a string.
     ("{ return kernel_source(dtype, head_dim, value_dim, bits, ragged); }", "{ return 0; }", "get_library"),
     # Ragged groups after the first register their outputs without rebinding them.
     ("encoder.register_output_array(out);", "encoder.register_output(out);", "register_output"),
     # The dense kernel's ring offsets, an input array at their own index.
     ("encoder.set_input_array(in.ring_offsets, kRingOffsets);", "encoder.set_input_array(in.ring_offsets);",
      "set_input_array"),
     ("{&vectors, MTL::DataType::DataTypeBool, MBD_FC_VECTOR_LOADS}",
      "{vectors, MTL::DataType::DataTypeBool, MBD_FC_VECTOR_LOADS}", "MTLFCList")])
def test_the_check_bites(tmp_path, original, broken, diagnostic):
    """A misspelt or mistyped MLX call fails it."""
    text = LAUNCHER.read_text()
    assert text.count(original) == 1
    copy = tmp_path / LAUNCHER.name
    copy.write_text(text.replace(original, broken))
    result = syntax_check(copy)
    assert result.returncode != 0 and diagnostic in result.stderr, result.stderr
