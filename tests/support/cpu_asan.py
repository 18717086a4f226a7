"""Builds and runs a driver of the CPU kernel (its baseline build) under AddressSanitizer + UBSan.

A driver in tests/kernels/cpu/asan/ calls ``run_decode`` on exact-size heap buffers, so a read
outside one is reported (tests/support/native_drivers.py builds it). Objects are cached in
build/cpu-asan. ``ASAN_AVX512`` builds the kernel with the AVX-512 variants' instructions instead
(CMake's MBD_AVX512_FLAGS), for the paths only they take, on CPUs that have them
(``require_avx512``); its objects are cached in build/cpu-asan-avx512.
"""

import dataclasses
import shutil
import sys

import pytest

from tests.support import native_drivers
from tests.support.cpu_isa import cpu_flags

ASAN = native_drivers.Target(
    "cpu-asan", "g++",
    ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"),
    link_flags=("-fsanitize=address,undefined",),
    env=(("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1"), ("UBSAN_OPTIONS", "print_stacktrace=1")),
)


AVX512_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512bf16",
                "-mavx512vnni")
# /proc/cpuinfo's names of what AVX512_FLAGS let the compiler emit.
AVX512_CPU_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_bf16", "avx512_vnni"}
ASAN_AVX512 = dataclasses.replace(ASAN, name="cpu-asan-avx512", flags=ASAN.flags + AVX512_FLAGS)


def require_toolchain():
    if sys.platform != "linux" or shutil.which("g++") is None:
        pytest.skip("the sanitizer drivers are set up for Linux and g++")


def require_avx512():
    require_toolchain()
    flags = cpu_flags()
    if not AVX512_CPU_FLAGS <= flags:
        pytest.skip(f"this CPU lacks {sorted(AVX512_CPU_FLAGS - flags)}")


def build_driver(name, mutant=None, target=ASAN):
    """The driver tests/kernels/cpu/asan/<name>.cpp built with the sanitizers for target (see
    native_drivers.build_driver for mutant)."""
    return native_drivers.build_driver(target, name, mutant)


def run_driver(driver, target=ASAN):
    """(return code, stdout + stderr) of a driver run."""
    return native_drivers.run_driver(target, driver)


def assert_clean(driver, target=ASAN):
    """Runs a driver and returns its output, which must hold no report and start with "OK"."""
    code, output = run_driver(driver, target)
    assert "ERROR: AddressSanitizer" not in output and "runtime error:" not in output, output[-6000:]
    assert code == 0 and output.startswith("OK: 0 mismatches"), output[-6000:]
    return output
