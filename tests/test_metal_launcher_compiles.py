"""The Metal launcher (csrc/metal/batched_decode_attention_gpu.cpp) cannot be
built on Linux; this syntax-checks it with g++ against MLX's real host headers
(device.h, utils.h, array.h: the API it must match) and the project's
primitive, with metal-cpp reduced to declarations."""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

REPO = Path(__file__).resolve().parents[1]
MLX_INCLUDE = Path(mx.__file__).resolve().parent / "include"
STUB = REPO / "tests" / "metal_emu" / "metal_cpp_stub"
LAUNCHER = REPO / "csrc" / "metal" / "batched_decode_attention_gpu.cpp"


def syntax_check(source: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["g++", "-std=c++20", "-Wall", "-Wextra", "-fsyntax-only", f"-isystem{STUB}", f"-isystem{MLX_INCLUDE}",
         f"-I{REPO / 'csrc'}", str(source)],
        capture_output=True, text=True)


@pytest.mark.skipif(not (MLX_INCLUDE / "mlx" / "backend" / "metal" / "device.h").exists(),
                    reason="this MLX install ships no Metal host headers")
def test_launcher_matches_mlx_host_api(tmp_path):
    result = syntax_check(LAUNCHER)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    # The check bites: a misspelt MLX call must fail it.
    broken = tmp_path / LAUNCHER.name
    text = LAUNCHER.read_text()
    assert text.count("encoder.add_temporary(") == 1
    broken.write_text(text.replace("encoder.add_temporary(", "encoder.add_temporaries_of(").replace(
        '"../batched_decode_attention.h"', f'"{REPO / "csrc" / "batched_decode_attention.h"}"').replace(
        '"launch_plan.h"', f'"{LAUNCHER.parent / "launch_plan.h"}"'))
    assert "add_temporaries_of" in syntax_check(broken).stderr
