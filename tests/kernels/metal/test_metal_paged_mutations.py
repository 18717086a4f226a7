"""What guards the Metal kernel's paged row source is proven by mutants: a copy of the
kernel that dereferences out-of-pool table entries, or that leaves a row with only such
entries unzeroed, must fail the paged cases of tests/kernels/metal/test_metal_paged_emulated.py.

Reads outside the pools land in the NaN margins the harness puts around every buffer.
"""

from __future__ import annotations


import numpy as np
import pytest

from tests.metal_emu.build import build_library
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.mutants import PAGED_ONLY, mutant_source
from tests.metal_emu.reference import TOLERANCE
from tests.kernels.metal.test_metal_paged_emulated import paged_case, run  # noqa: E402

KERNEL = "batched_decode_attention_float32_64"


def passes(lib) -> bool:
    """Both key loops: G x L = 2 rows (one chunk, each simdgroup loading its keys) and 12 rows
    (two chunks sharing staged tiles)."""
    for block_size in (7, 16):
        for g, rows in ((1, 2), (4, 3)):
            q, k, v, tables, lens, expected = paged_case("float32", 64, g, rows, block_size, None, seed=block_size)
            out = run(lib, "float32", q, k, v, tables, lens)
            if not np.allclose(out, expected, atol=TOLERANCE["float32"], rtol=TOLERANCE["float32"]):
                return False
    return True


def test_cases_take_both_key_loops():
    lib = EmulatedLibrary(build_library())
    assert [lib.plan(7, 2 * g, 2, 80, 64, "float32", rows=rows)["row_chunks"] for g, rows in ((1, 2), (4, 3))] == [1, 2]


def test_unmutated_kernel_passes():
    assert passes(EmulatedLibrary(build_library()))


@pytest.mark.parametrize("name", sorted(PAGED_ONLY))
def test_paged_mutant_fails(name):
    assert not passes(EmulatedLibrary(build_library(mutant_source(name, [KERNEL])))), name
