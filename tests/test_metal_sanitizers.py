"""Sanitizer builds of the emulated kernel, run at small sizes.

AddressSanitizer + UBSan (fiber lanes) and ThreadSanitizer (lanes as OS
threads): the real kernel must run clean, and a mutant with the matching bug
must be reported, which shows each sanitizer is really watching.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # the harness package lives next to the tests

from metal_emu.build import CXX, build_library  # noqa: E402
from metal_emu.mutants import mutant_source  # noqa: E402

RUNTIMES = {"address": "libasan.so", "thread": "libtsan.so"}
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "WARNING: ThreadSanitizer")


def run_sanitized(sanitizer: str, library: Path, *args: str) -> subprocess.CompletedProcess:
    """check_cases in a fresh interpreter with the sanitizer runtime loaded first."""
    runtime = subprocess.run([CXX, f"-print-file-name={RUNTIMES[sanitizer]}"],
                             capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0", TSAN_OPTIONS="halt_on_error=1")
    if sanitizer == "thread":
        # Two simdgroups per threadgroup: cross-simdgroup sync, 64 OS threads, not 256.
        args = (*args, "--backend", "threads", "--max-threads", "64")
    return subprocess.run([sys.executable, "-m", "metal_emu.check_cases", str(library), *args],
                          cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("sanitizer", sorted(RUNTIMES))
def test_kernel_runs_clean(sanitizer):
    result = run_sanitized(sanitizer, build_library(sanitize=sanitizer))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not [r for r in REPORTS if r in result.stderr], result.stderr[-3000:]
    assert result.stdout.count("ok ") == 4


def test_clamped_lengths_stay_in_bounds():
    """Lengths far past T with allocations ending at the views: no overflow report."""
    result = run_sanitized("address", build_library(sanitize="address"), "--cases", "overlong", "--no-nan-tail")
    assert result.returncode == 0 and "ERROR: AddressSanitizer" not in result.stderr, result.stderr[-3000:]


def test_unclamped_length_is_a_heap_buffer_overflow():
    library = build_library(mutant_source("removed_length_clamp"), sanitize="address")
    result = run_sanitized("address", library, "--cases", "overlong", "--no-nan-tail")
    assert result.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_missing_barrier_is_a_data_race():
    library = build_library(mutant_source("removed_threadgroup_barrier"), sanitize="thread")
    result = run_sanitized("thread", library)
    assert result.returncode != 0
    assert "WARNING: ThreadSanitizer: data race" in result.stderr, result.stderr[-3000:]
    assert "batched_decode_attention.h:" in result.stderr
