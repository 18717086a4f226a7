"""Sanitizer builds of the emulated kernel, run at small sizes.

AddressSanitizer + UBSan (fiber lanes) and ThreadSanitizer (lanes as OS
threads): the real kernel must run clean, and a mutant with the matching bug
must be reported, which shows each sanitizer is really watching. Under
AddressSanitizer the K/V positions no query row attends are poisoned, so a
read of one is reported even where it stays inside the allocation.

Each build instantiates only the kernels its cases run (metal_emu/sources.py);
the kernel header is the real one, or a mutant's.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.metal_emu.build import CXX, build_library
from tests.metal_emu.check_cases import CASE_SETS, RAGGED_CASE_SETS
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.mutants import mutant_source
from tests.metal_emu.sources import subset_source
from tests.support.repo import REPO

RUNTIMES = {"address": "libasan.so", "thread": "libtsan.so"}
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "WARNING: ThreadSanitizer")


@functools.cache
def kernels() -> tuple[str, ...]:
    """The main kernels the launch plan picks for every case of check_cases (ragged ones for its
    ragged cases)."""
    lib = EmulatedLibrary(build_library())

    def plan(c: dict, b: int, t: int) -> dict:
        rows = sum(c["query_rows"]) if "query_rows" in c else c.get("rows", 1)
        return lib.plan(b, c["h_kv"] * c["g"], c["h_kv"], t, c["d"], c["dtype"], rows=rows, window=c.get("window"),
                        dv=c.get("dv"), packed="query_rows" in c)

    dense = {plan(c, len(c["lens"]), c["t"])["kernel"] for cases in CASE_SETS.values() for c in cases}
    ragged = {plan(c, len(c["lengths"]), max(c["lengths"]))["kernel"].replace("batched_", "ragged_")
              for cases in RAGGED_CASE_SETS.values() for c in cases}
    return tuple(sorted(dense | ragged))


def run_sanitized(sanitizer: str, library: Path, *args: str) -> subprocess.CompletedProcess:
    """check_cases in a fresh interpreter with the sanitizer runtime loaded first."""
    runtime = subprocess.run([CXX, f"-print-file-name={RUNTIMES[sanitizer]}"],
                             capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0", TSAN_OPTIONS="halt_on_error=1")
    if sanitizer == "thread":
        # Two simdgroups per threadgroup: cross-simdgroup sync, 64 OS threads, not 256.
        args = (*args, "--backend", "threads", "--max-threads", "64")
    return subprocess.run([sys.executable, "-m", "tests.metal_emu.check_cases", str(library), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("sanitizer", sorted(RUNTIMES))
def test_kernel_runs_clean(sanitizer):
    poison = ("--poison-unread",) if sanitizer == "address" else ()
    result = run_sanitized(sanitizer, build_library(subset_source(kernels()), sanitize=sanitizer), *poison)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not [r for r in REPORTS if r in result.stderr], result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(CASE_SETS["small"])


def test_clamped_positions_stay_in_bounds():
    """Lengths and starts far outside [0, T], windows wider than T, with allocations
    ending at the views and every unattended position poisoned: no report."""
    result = run_sanitized("address", build_library(subset_source(kernels()), sanitize="address"),
                           "--cases", "adversarial", "--no-nan-margins", "--poison-unread")
    assert result.returncode == 0 and "ERROR: AddressSanitizer" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(CASE_SETS["adversarial"])


def test_packed_rows_stay_in_bounds():
    """Packed queries with lengths, starts and rows far outside their ranges, MLA's latent, and
    malformed query_starts (zeros, not one K/V read: every position poisoned), in allocations
    ending at the views: no report, and each case right."""
    result = run_sanitized("address", build_library(subset_source(kernels()), sanitize="address"),
                           "--cases", "packed_adversarial", "--no-nan-margins", "--poison-unread")
    assert result.returncode == 0 and not [r for r in REPORTS if r in result.stderr], result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(CASE_SETS["packed_adversarial"])


def test_ragged_requests_stay_in_their_buffers():
    """Requests in buffers of exactly their size, lengths far above T_b, T_b = 0, several groups,
    every unattended position poisoned: no report, and each case right."""
    result = run_sanitized("address", build_library(subset_source(kernels()), sanitize="address"),
                           "--cases", "ragged_adversarial", "--no-nan-margins", "--poison-unread")
    assert result.returncode == 0 and not [r for r in REPORTS if r in result.stderr], result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(RAGGED_CASE_SETS["ragged_adversarial"])


def test_ragged_length_past_its_buffer_is_a_heap_buffer_overflow():
    """A length clamped to the longest T_b, not the request's own, reads past its buffer."""
    library = build_library(mutant_source("ragged_length_unclamped", kernels()), sanitize="address")
    result = run_sanitized("address", library, "--cases", "ragged_adversarial", "--no-nan-margins")
    assert result.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_unaligned_views_take_no_misaligned_vector_load():
    """Views off the vector width (dense, and ragged requests) run clean under UBSan, which
    reports any misaligned vector load: with vector loads forced whatever the views, it does."""
    library = build_library(subset_source(kernels()), sanitize="address")
    mutant = build_library(mutant_source("vector_loads_whatever_the_alignment", kernels()), sanitize="address")
    for cases, count in (("unaligned", len(CASE_SETS["unaligned"])),
                         ("ragged_unaligned", len(RAGGED_CASE_SETS["ragged_unaligned"]))):
        result = run_sanitized("address", library, "--cases", cases, "--poison-unread")
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert result.stdout.count("ok ") == count
        result = run_sanitized("address", mutant, "--cases", cases)
        assert result.returncode != 0
        assert re.search(r"batched_decode_attention\.h:\d+:\d+: runtime error: .* misaligned address",
                         result.stderr), result.stderr[-3000:]


@pytest.mark.parametrize("mutation", ["removed_length_clamp", "removed_kv_starts_clamp"])
def test_unclamped_position_is_a_heap_buffer_overflow(mutation):
    """A length past T reads past the K/V allocations, a negative start before them."""
    library = build_library(mutant_source(mutation, kernels()), sanitize="address")
    result = run_sanitized("address", library, "--cases", "adversarial", "--no-nan-margins")
    assert result.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_read_outside_every_range_is_reported():
    """Without the window bound, rows read keys inside the allocation that no row attends."""
    library = build_library(mutant_source("removed_window_bound", kernels()), sanitize="address")
    result = run_sanitized("address", library, "--poison-unread")
    assert result.returncode != 0
    assert "AddressSanitizer: use-after-poison" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("mutation", ["removed_threadgroup_barrier", "tile_overwritten_while_read"])
def test_missing_barrier_is_a_data_race(mutation):
    """The merge's barrier, and the one that keeps a staged tile until every simdgroup read it
    (the small cases of G x L = 24 and 9 rows: row chunks sharing tiles)."""
    library = build_library(mutant_source(mutation, kernels()), sanitize="thread")
    result = run_sanitized("thread", library)
    assert result.returncode != 0
    assert "WARNING: ThreadSanitizer: data race" in result.stderr, result.stderr[-3000:]
    assert "batched_decode_attention.h:" in result.stderr
