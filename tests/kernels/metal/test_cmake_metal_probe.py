"""cmake/metal.cmake on a Mac with and without Apple's Metal compiler, faked:
an ``xcrun`` on PATH that fails as it does without the Metal Toolchain, or
that answers the probe. Without it the configure step succeeds and prints one
line; with it the metallib is built from the embedded source, with
-fno-fast-math. The project configured here includes the real
cmake/metal_source.cmake and cmake/metal.cmake, with MLX's
``mlx_build_metallib`` replaced by a stand-in that records its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.repo import REPO

CMAKE = shutil.which("cmake")
FIRST_USE = "the Metal kernels will be compiled at first use"

PROJECT = """\
cmake_minimum_required(VERSION 3.27)
project(metal_probe LANGUAGES CXX)
find_package(Python COMPONENTS Interpreter REQUIRED)
add_library(_ext MODULE ext.cpp)
macro(mlx_build_metallib)
  cmake_parse_arguments(MTLLIB "" "TARGET;TITLE;OUTPUT_DIRECTORY" "SOURCES;INCLUDE_DIRS;DEPS;COMPILE_OPTIONS" ${{ARGN}})
  message(STATUS "mlx_build_metallib ${{MTLLIB_TITLE}} from ${{MTLLIB_SOURCES}} with ${{MTLLIB_COMPILE_OPTIONS}}")
  add_custom_target(${{MTLLIB_TARGET}})
endmacro()
include({repo}/cmake/metal_source.cmake)
include({repo}/cmake/metal.cmake)
"""

# As Xcode 26's xcrun without the Metal Toolchain (the message of actions/runner-images #13080).
MISSING = """#!/bin/sh
echo "error: error: cannot execute tool 'metal' due to missing Metal Toolchain; use: xcodebuild -downloadComponent MetalToolchain" >&2
exit 72
"""
# Answers exactly the probe.
WORKING = """#!/bin/sh
[ "$*" = "-sdk macosx metal --version" ] || exit 64
echo "Apple metal version 32023.404 (metalfe-32023.404.2)"
echo "Target: air64-apple-darwin25.0.0"
"""


def configure(tmp_path: Path, xcrun: str) -> subprocess.CompletedProcess:
    source, build, bin_dir = tmp_path / "src", tmp_path / "build", tmp_path / "bin"
    for d in (source, bin_dir):
        d.mkdir()
    (source / "CMakeLists.txt").write_text(PROJECT.format(repo=REPO.as_posix()))
    (source / "ext.cpp").write_text("")
    (bin_dir / "xcrun").write_text(xcrun)
    (bin_dir / "xcrun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([CMAKE, "-S", str(source), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}"],
                          capture_output=True, text=True, env=env, timeout=300)


pytestmark = pytest.mark.skipif(CMAKE is None, reason="needs cmake (pip install '.[test]')")


def test_without_the_metal_toolchain_the_build_goes_on(tmp_path):
    result = configure(tmp_path, MISSING)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "mlx_batched_decode" in line]
    assert lines == [
        "-- mlx_batched_decode: no Metal compiler (`xcrun -sdk macosx metal --version` failed): " + FIRST_USE]
    assert "mlx_build_metallib" not in result.stdout


def test_with_the_metal_toolchain_the_metallib_is_built(tmp_path):
    result = configure(tmp_path, WORKING)
    assert result.returncode == 0, result.stderr
    assert FIRST_USE not in result.stdout
    generated = tmp_path / "build" / "generated" / "mlx_batched_decode.metal"
    assert f"-- mlx_build_metallib mlx_batched_decode from {generated.as_posix()} with -std=metal3.1;-fno-fast-math" \
        in result.stdout.splitlines()
