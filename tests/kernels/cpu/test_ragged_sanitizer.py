"""The CPU kernel's ragged row source (one buffer per request) under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/ragged_kernel_driver.cpp runs the kernel (its baseline build) on 300 random
calls whose requests each own exact-size key and value allocations (head-major or token-major,
some empty) with adversarial lengths and starts (wild, past the request's buffer, negative), so
a read outside a request's buffer is reported, and compares each output with a float64
reference; tests/kernels/cpu/test_sanitizers.py also runs the op's Python tests on the sanitized
extension.
"""

from tests.support.cpu_asan import assert_clean, build_driver, require_toolchain, run_driver
from tests.support.repo import REPO


def test_ragged_kernel_on_adversarial_lengths_is_clean():
    require_toolchain()
    assert_clean(build_driver("ragged_kernel_driver"))


def test_dropped_request_length_bound_is_reported():
    # A kernel that clamps lengths to the longest buffer only, not the request's own, must be
    # reported: the driver's lengths pass their buffers.
    require_toolchain()
    guard = "return requests ? std::min(len, std::max(requests[b].length, 0)) : len;"
    source = (REPO / "csrc" / "cpu" / "decode_args.h").read_text()
    assert source.count(guard) == 1
    mutant = {"cpu/decode_args.h": source.replace(guard, "return len;")}
    code, output = run_driver(build_driver("ragged_kernel_driver", mutant))
    assert code != 0 and "ERROR: AddressSanitizer" in output, output[-3000:]
