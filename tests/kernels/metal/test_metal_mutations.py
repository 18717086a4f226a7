"""The harness proves itself: copies of the real kernel, each with one injected
bug, must make it fail (a reported misuse or a result off the reference).

Each mutant is made from the real source by a text substitution that the test
asserts to have applied exactly once, so a kernel edit cannot silently turn a
mutation into a no-op. Mutants instantiate only the kernel the cases run (see
metal_emu/sources.py); the unmutated kernel is the real, whole library.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.metal_emu.build import CACHE, build_library
from tests.metal_emu.cases import make_case
from tests.metal_emu.driver import EmulatedLibrary, HarnessError
from tests.metal_emu.mutants import (MUTATIONS, PAGED_ONLY, RAGGED_ONLY, RING_ONLY, SANITIZER_ONLY,
                                     TILED_NON_FINITE_ONLY, TILED_ONLY, VARLEN_ONLY, mutant_source)
from tests.metal_emu.reference import TOLERANCE, to_float64
from tests.metal_emu.sources import HEADER

# make_case arguments (float32, D = 64, G = 4, L > 1). Both launch paths, each
# with and without a window: a negative start (request 0) only reads before
# the keys without one. Lengths above T catch an unclamped length. The
# non-finite cases (see with_minus_inf_keys) score -inf on request 0's every
# key and on the first keys each simdgroup and split of request 1 takes;
# request 2 has no key. The softcap cases score well past their cap of 5
# (queries scaled by 4 / sqrt(D)), so that capping changes every row.
CASES = {
    "single_pass": dict(t=40, h_kv=2, lens=[40, 3, 0, 45], rows=3, starts=[-3, 1, 0, 2], sinks=True),
    "single_pass_window": dict(t=40, h_kv=2, lens=[40, 17, 0, 45], rows=3, window=9, sinks=True),
    "split_k": dict(t=230, h_kv=1, lens=[230, 7, 250], rows=2, starts=[-5, 0, 100]),
    "split_k_window": dict(t=230, h_kv=1, lens=[230, 199, 250], rows=2, window=150, sinks=True),
    "single_pass_minus_inf": dict(t=40, h_kv=2, lens=[5, 40, 0], rows=3),
    "split_k_minus_inf": dict(t=230, h_kv=1, lens=[9, 230, 0], rows=2),
    "single_pass_softcap": dict(t=40, h_kv=2, lens=[40, 17, 0, 45], rows=3, starts=[-3, 1, 0, 2], window=9,
                                sinks=True, scale=0.5, softcap=5.0),
    "split_k_softcap": dict(t=230, h_kv=1, lens=[230, 199, 250], rows=2, window=150, sinks=True, scale=0.5,
                            softcap=5.0),
}
# The one kernel all cases run, and all a mutant instantiates.
KERNEL = "batched_decode_attention_float32_64"
# The cases each guard of a row's range or of the sink must fail, at least.
CAUGHT_BY = {
    "removed_window_bound": {"single_pass_window", "split_k_window"},
    "removed_kv_starts_clamp": {"single_pass", "split_k"},
    "removed_sink_term": {"single_pass", "single_pass_window", "split_k_window"},
    "key_past_causal_end": set(CASES),
    "unguarded_rescale": {"single_pass_minus_inf", "split_k_minus_inf"},
    "unguarded_probability": {"single_pass_minus_inf", "split_k_minus_inf"},
    "all_minus_inf_row_gives_zeros": {"single_pass_minus_inf", "split_k_minus_inf"},
    # Without a sink a row with no key has 0/0 = NaN to zero (request 2).
    "row_without_keys_not_zeroed": {"single_pass_minus_inf"},
    # The single-pass cases' 12 rows are two row chunks sharing staged tiles (split-K's 8: one chunk).
    "tile_read_before_it_is_staged": {"single_pass", "single_pass_window", "single_pass_minus_inf"},
    "chunks_merged_across_simdgroup_sets": {"single_pass", "single_pass_window", "single_pass_minus_inf"},
    "group_keys_of_the_first_position": set(CASES),
    "softcap_dropped": {"single_pass_softcap", "split_k_softcap"},
}


def verdict(lib: EmulatedLibrary, case) -> str | None:
    """None when the harness accepts the run, else how it failed."""
    try:
        out = case.run(lib)
    except HarnessError as error:
        return f"harness error: {error}"
    tolerance = TOLERANCE[case.dtype]
    if not np.allclose(to_float64(out, case.dtype), case.reference(), atol=tolerance, rtol=tolerance, equal_nan=True):
        return "result differs from the reference"
    return None


def with_minus_inf_keys(case, lib: EmulatedLibrary):
    """Positive queries, so that a key row of -inf scores -inf for every head: all
    of request 0's keys (its rows: NaN), and the first 8 keys of each split of
    request 1, the first each simdgroup takes (its rows: finite)."""
    b, h_q, rows, d = case.queries.shape
    h_kv, t = case.keys.shape[1], case.keys.shape[2]
    plan = lib.plan(b, h_q, h_kv, t, d, case.dtype, rows=rows)
    case.queries = np.abs(case.queries)
    case.keys[0, :, :case.valid_lens[0]] = -np.inf
    for split in range(plan["num_splits"]):
        first = split * plan["split_len"]
        case.keys[1, :, first:first + 8] = -np.inf
    return case


def cases(lib: EmulatedLibrary):
    rng = np.random.default_rng(11)
    out = {name: make_case(rng, "float32", 64, g=4, **spec) for name, spec in CASES.items()}
    return {name: with_minus_inf_keys(case, lib) if name.endswith("minus_inf") else case
            for name, case in out.items()}


def test_unmutated_kernel_passes_the_same_cases():
    lib = EmulatedLibrary(build_library())
    for name, case in cases(lib).items():
        rows = case.queries.shape[2]
        plan = lib.plan(len(case.valid_lens), 4 * case.keys.shape[1], case.keys.shape[1], case.keys.shape[2], 64,
                        "float32", rows=rows, window=case.window)
        assert plan["kernel"] == KERNEL and (plan["num_splits"] > 1) == name.startswith("split_k")
    assert {name: verdict(lib, case) for name, case in cases(lib).items()} == dict.fromkeys(CASES)
    # Request 0 of the -inf cases has keys that all score -inf: NaN, as the reference's softmax.
    for name in ("single_pass_minus_inf", "split_k_minus_inf"):
        assert np.isnan(cases(lib)[name].reference()[0]).all()


@pytest.mark.parametrize("name", sorted(set(MUTATIONS) - SANITIZER_ONLY - PAGED_ONLY - RAGGED_ONLY - RING_ONLY -
                                         VARLEN_ONLY - TILED_ONLY - TILED_NON_FINITE_ONLY))
def test_mutant_fails_the_harness(name):
    lib = EmulatedLibrary(build_library(mutant_source(name, [KERNEL])))
    verdicts = {case: verdict(lib, c) for case, c in cases(lib).items()}
    # One failing case suffices for the others: e.g. the length clamp only matters past the last split's end.
    assert any(verdicts.values()), f"mutant {name} passed: {verdicts}"
    failed = {case for case, v in verdicts.items() if v}
    assert CAUGHT_BY.get(name, set()) <= failed, f"mutant {name} passed {CAUGHT_BY[name] - failed}: {verdicts}"


def source_line(name: str, text: str, after: str) -> int:
    """Line of the first ``text`` past the first ``after`` in the mutated header."""
    lines = (CACHE / "mutants" / name / HEADER).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    return next(i for i, line in enumerate(lines[start:], start=start + 1) if text in line)


@pytest.mark.parametrize(
    "name,report,at,after",
    [
        ("simd_sum_in_half_the_lanes", "mismatched collectives", "s = simd_sum(s)", "inline void bda_attend("),
        # The merge's first barrier, the next the returning simdgroup skips.
        ("simdgroup_returns_before_barrier", "a skipped barrier", "threadgroup_barrier", "threadgroup float sg_max["),
    ],
)
def test_misused_collectives_are_reported_with_source_lines(name, report, at, after):
    lib = EmulatedLibrary(build_library(mutant_source(name, [KERNEL])))
    case = cases(lib)["single_pass"]
    with pytest.raises(HarnessError, match=report) as error:
        case.run(lib)
    assert re.search(rf"{HEADER}:{source_line(name, at, after)}\b", str(error.value)), str(error.value)
