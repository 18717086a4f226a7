"""Builds and runs a driver of the CPU kernel (its baseline build) under AddressSanitizer + UBSan.

A driver in tests/kernels/cpu/asan/ calls ``run_decode`` on exact-size heap buffers, so a read
outside one is reported (tests/support/native_drivers.py builds it). Objects are cached in
build/cpu-asan.
"""

import shutil
import sys

import pytest

from tests.support import native_drivers

ASAN = native_drivers.Target(
    "cpu-asan", "g++",
    ("-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"),
    link_flags=("-fsanitize=address,undefined",),
    env=(("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1"), ("UBSAN_OPTIONS", "print_stacktrace=1")),
)


def require_toolchain():
    if sys.platform != "linux" or shutil.which("g++") is None:
        pytest.skip("the sanitizer drivers are set up for Linux and g++")


def build_driver(name, mutant=None):
    """The driver tests/kernels/cpu/asan/<name>.cpp built with the sanitizers (see
    native_drivers.build_driver for mutant)."""
    return native_drivers.build_driver(ASAN, name, mutant)


def run_driver(driver):
    """(return code, stdout + stderr) of a driver run."""
    return native_drivers.run_driver(ASAN, driver)


def assert_clean(driver):
    """Runs a driver and returns its output, which must hold no report and start with "OK"."""
    code, output = run_driver(driver)
    assert "ERROR: AddressSanitizer" not in output and "runtime error:" not in output, output[-6000:]
    assert code == 0 and output.startswith("OK: 0 mismatches"), output[-6000:]
    return output
