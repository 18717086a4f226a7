"""What guards the Metal kernel's ragged row source is proven by mutants: a copy of the kernel that
clamps a length to the longest T_b instead of the request's own, reads values through the keys'
slot, picks a wrong slot, drops a group's first request, or drops a request's offset in its
buffer, must fail the ragged cases of tests/kernels/metal/test_metal_ragged_emulated.py.

Reads past a request's positions land in NaN (capacity and other requests' unread rows of its
buffer) or in the NaN margins the harness puts around every buffer.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.metal_emu.build import build_library
from tests.metal_emu.driver import EmulatedLibrary, HarnessError
from tests.metal_emu.mutants import RAGGED_ONLY, mutant_source
from tests.metal_emu.ragged_cases import make_ragged_case
from tests.metal_emu.reference import TOLERANCE, to_float64

KERNEL = "ragged_decode_attention_float32_64"
# make_ragged_case arguments (float32, D = 64). "groups": 24 requests of their own buffers in 3
# groups, single pass, lengths above T_b and T_b = 0 with a positive length; "shared": views of
# one buffer at offsets of their own, and others, split-K.
CASES = {
    "groups": dict(h_kv=2, g=2, lengths=[9, 30, 0, 4, 17, 1] * 4, valid_lens=[12, 30, 5, 4, 40, 2] * 4,
                   layouts=("slice", "exact", "3d"), rows=2),
    "shared": dict(h_kv=1, g=4, lengths=[150, 20, 70, 0, 133], valid_lens=[150, 25, 70, 3, 140],
                   layouts=("shared", "shared", "token_major", "shared", "3d"), rows=2, window=140),
}
CAUGHT_BY = {
    "ragged_length_unclamped": set(CASES),
    "ragged_values_in_the_keys_slot": set(CASES),
    "ragged_wrong_slot": {"groups"},
    "ragged_group_offset_ignored": {"groups"},
    "ragged_request_offset_ignored": {"shared"},
}


def cases():
    return {name: make_ragged_case(np.random.default_rng(len(name)), "float32", 64, **spec)
            for name, spec in CASES.items()}


def verdict(lib: EmulatedLibrary, case) -> str | None:
    """None when the harness accepts the run, else how it failed."""
    try:
        out = case.run(lib)
    except HarnessError as error:
        return f"harness error: {error}"
    if not np.allclose(to_float64(out, "float32"), case.reference(), atol=TOLERANCE["float32"],
                       rtol=TOLERANCE["float32"]):
        return "result differs from the reference"
    return None


def test_unmutated_kernel_passes_the_same_cases():
    lib = EmulatedLibrary(build_library())
    assert {name: verdict(lib, case) for name, case in cases().items()} == dict.fromkeys(CASES)
    case = cases()["groups"]
    case.run(lib)
    assert lib.dispatches() == 3
    b, h_q, rows, d = case.queries.shape
    assert lib.plan(5, 4, 1, 150, 64, "float32", rows=2, window=140)["num_splits"] > 1


@pytest.mark.parametrize("name", sorted(RAGGED_ONLY))
def test_ragged_mutant_fails(name):
    lib = EmulatedLibrary(build_library(mutant_source(name, [KERNEL])))
    verdicts = {case: verdict(lib, c) for case, c in cases().items()}
    failed = {case for case, v in verdicts.items() if v}
    assert CAUGHT_BY[name] <= failed, f"mutant {name} passed {CAUGHT_BY[name] - failed}: {verdicts}"
