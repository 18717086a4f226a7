"""The harness proves itself: copies of the real kernel, each with one injected
bug, must make it fail (a reported misuse or a result off the reference).

Each mutant is made from the real source by a text substitution that the test
asserts to have applied exactly once, so a kernel edit cannot silently turn a
mutation into a no-op.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness package lives next to the tests

from metal_emu.build import CACHE, build_library  # noqa: E402
from metal_emu.cases import make_case  # noqa: E402
from metal_emu.driver import EmulatedLibrary, HarnessError  # noqa: E402
from metal_emu.mutants import HEADER, MUTATIONS, mutant_source  # noqa: E402
from metal_emu.reference import TOLERANCE, to_float64  # noqa: E402

# Both launch paths; lengths above T catch an unclamped length.
CASES = {"single_pass": (40, 2, [40, 3, 0, 45]), "split_k": (230, 1, [230, 7, 250])}


def verdict(lib: EmulatedLibrary, case) -> str | None:
    """None when the harness accepts the run, else how it failed."""
    try:
        out = lib.attention(case.queries, case.keys, case.values, case.valid_lens, case.dtype, case.scale)
    except HarnessError as error:
        return f"harness error: {error}"
    tolerance = TOLERANCE[case.dtype]
    if not np.allclose(to_float64(out, case.dtype), case.reference(), atol=tolerance, rtol=tolerance):
        return "result differs from the reference"
    return None


def cases():
    rng = np.random.default_rng(11)
    return {path: make_case(rng, "float32", 64, h_kv, 4, t, lens) for path, (t, h_kv, lens) in CASES.items()}


def test_unmutated_kernel_passes_the_same_cases():
    lib = EmulatedLibrary(build_library())
    assert {path: verdict(lib, case) for path, case in cases().items()} == {"single_pass": None, "split_k": None}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutant_fails_the_harness(name):
    lib = EmulatedLibrary(build_library(mutant_source(name)))
    verdicts = {path: verdict(lib, case) for path, case in cases().items()}
    # One failing path suffices: e.g. the clamp only matters past the last split's end.
    assert any(verdicts.values()), f"mutant {name} passed: {verdicts}"


def source_line(name: str, text: str) -> int:
    """Line of ``text`` in the mutated header."""
    lines = (CACHE / "mutants" / name / HEADER).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if text in line)


@pytest.mark.parametrize(
    "name,report,at",
    [
        ("simd_sum_in_half_the_lanes", "mismatched collectives", "s = simd_sum(s)"),
        ("simdgroup_returns_before_barrier", "a skipped barrier", "threadgroup_barrier"),
    ],
)
def test_misused_collectives_are_reported_with_source_lines(name, report, at):
    lib = EmulatedLibrary(build_library(mutant_source(name)))
    case = cases()["single_pass"]
    with pytest.raises(HarnessError, match=report) as error:
        lib.attention(case.queries, case.keys, case.values, case.valid_lens, case.dtype, case.scale)
    assert re.search(rf"{HEADER}:{source_line(name, at)}\b", str(error.value)), str(error.value)
