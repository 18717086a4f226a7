"""The CPU kernel's ring row source (ring_offset) under AddressSanitizer + UBSan.

tests/kernels/cpu/asan/ring_kernel_driver.cpp runs the kernel (its baseline build) on 300 random
calls over exact-size rings, head-major or token-major, with adversarial offsets (wild, negative,
past T), lengths and starts, so a read outside the ring is reported, and compares each output
with a float64 reference. Each guard of the ring has a mutant that ASan must report: the modulo
of the offset, and the cut of a request's keys where the ring wraps.
"""

import pytest

from tests.support.cpu_asan import assert_clean, build_driver, require_toolchain, run_driver
from tests.support.repo import REPO

MUTANTS = {
    "no modulo": ("cpu/decode_args.h", "const int64_t r = ring_offsets[b * ring_stride] % T;",
                  "const int64_t r = ring_offsets[b * ring_stride];"),
    "no cut at the wrap": ("cpu/parallel_decode.cpp", "if (t < wrap && end > wrap) {", "if (false) {"),
    "one slot past the wrap": ("cpu/parallel_decode.cpp", "const int slot = a.ring_slot(b), wrap = a.T - slot;",
                               "const int slot = a.ring_slot(b), wrap = a.T - slot + 1;"),
}


def test_ring_kernel_on_adversarial_offsets_is_clean():
    require_toolchain()
    assert_clean(build_driver("ring_kernel_driver"))


@pytest.mark.parametrize("name", MUTANTS)
def test_dropped_ring_guard_is_reported(name):
    require_toolchain()
    path, guard, broken = MUTANTS[name]
    source = (REPO / "csrc" / path).read_text()
    assert source.count(guard) == 1
    code, output = run_driver(build_driver("ring_kernel_driver", {path: source.replace(guard, broken)}))
    assert code != 0 and "ERROR: AddressSanitizer" in output, output[-3000:]
