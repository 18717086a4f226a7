"""Self-tests of the emulation harness: each emulated collective, built-in and
function constant behaves as Metal specifies, on threadgroups whose last
simdgroup is partial, with both lane backends."""

from __future__ import annotations


import numpy as np
import pytest

from tests.metal_emu.build import HARNESS, build_library
from tests.metal_emu.driver import EmulatedLibrary, HarnessError

SELFTEST = HARNESS / "selftest.metal"


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library(SELFTEST))


def expected(threads: int, groups: int, rotate: int) -> np.ndarray:
    rows = []
    for g in range(groups):
        for tid in range(threads):
            first = tid // 32 * 32
            lanes = np.arange(first, min(first + 32, threads)) + 0.5
            n, lane = len(lanes), tid - first
            rows.append([lanes.sum(), lanes.max(), lanes.min(), lanes[(lane ^ 1) % n], lanes[3 % n],
                         lanes[(lane + rotate) % 32 % n], g * threads + tid, tid // 32, lane,
                         (threads + 31) // 32, threads - 1 - tid + 0.5, tid + 0.5])
    return np.array(rows)


@pytest.mark.parametrize("backend", ["fibers", "threads"])
@pytest.mark.parametrize("kernel", ["collectives_float", "collectives_half"])
@pytest.mark.parametrize("threads", [32, 48, 64])
def test_collectives_and_builtins(lib, kernel, threads, backend):
    out = np.full((2 * threads, 12), np.nan, dtype=np.float32)
    lib.dispatch(kernel, [out, np.array([5], dtype=np.int32)], (2, 1, 1), (threads, 1, 1), backend=backend)
    np.testing.assert_array_equal(out, expected(threads, 2, 5))


def test_unbound_buffer_is_reported(lib):
    out = np.zeros((32, 12), dtype=np.float32)
    with pytest.raises(HarnessError, match=r"reads \[\[buffer\(1\)\]\], which the launch left unbound"):
        lib.dispatch("collectives_float", [out], (1, 1, 1), (32, 1, 1))


def test_unknown_kernel_is_reported(lib):
    with pytest.raises(HarnessError, match="no kernel named missing"):
        lib.dispatch("missing", [], (1, 1, 1), (32, 1, 1))


def test_function_constants(lib):
    out = np.zeros(32, dtype=np.int32)
    lib.dispatch("read_constant_int", [out], (1, 1, 1), (32, 1, 1), constants={3: 40})
    np.testing.assert_array_equal(out, 40 + np.arange(32))


def test_unset_function_constant_is_reported(lib):
    out = np.zeros(32, dtype=np.int32)
    with pytest.raises(HarnessError, match=r"function constant 3 \(4 bytes\) is read but the launch does not set it"):
        lib.dispatch("read_constant_int", [out], (1, 1, 1), (32, 1, 1), constants={2: 40})
