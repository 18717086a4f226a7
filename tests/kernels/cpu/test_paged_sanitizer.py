"""The CPU kernel's paged row source and shared-block scheduler under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/paged_kernel_driver.cpp runs the kernel (its baseline build) on 300 random
adversarial block tables and lengths (wild entries inside the length, garbage past it,
lengths below 0 and past the tables, copied tables whose blocks are shared), with every
buffer an exact-size heap allocation, so a read outside a pool or a table is reported, and
compares each output with a float64 reference (tests/support/cpu_asan.py builds it);
tests/kernels/cpu/test_sanitizers.py also runs the paged op's Python tests on the sanitized extension.
"""

from tests.support.cpu_asan import assert_clean, build_driver, require_toolchain, run_driver
from tests.support.repo import REPO


def test_paged_kernel_on_adversarial_tables_is_clean():
    require_toolchain()
    output = assert_clean(build_driver("paged_kernel_driver"))
    # The shared path ran: copied tables put shared blocks in most rounds.
    assert int(output.split(",")[1].split()[0]) > 0, output


def test_dropped_pool_bound_is_reported():
    # A copy of the kernel whose row source dereferences table entries past the pool must be
    # reported: the driver's tables hold such entries inside the lengths.
    require_toolchain()
    guard = "const bool valid = entry >= 0 && entry < num_blocks;"
    source = (REPO / "csrc" / "cpu" / "row_source.h").read_text()
    assert source.count(guard) == 1
    mutant = {"cpu/row_source.h": source.replace(guard, "const bool valid = entry >= 0;")}
    code, output = run_driver(build_driver("paged_kernel_driver", mutant))
    assert code != 0 and "ERROR: AddressSanitizer" in output, output[-3000:]
