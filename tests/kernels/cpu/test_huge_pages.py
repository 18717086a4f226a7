"""advise_huge_pages and the slot cache's buffers: whole huge pages move, contents stay, and the
pages outlive the in-place writes of decode steps. Checked in /proc/self/smaps."""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_batched_decode
from mlx_batched_decode.caches.context import BatchedDecodeContext
from mlx_batched_decode.caches.kv_cache import SlotKVCache

THP = Path("/sys/kernel/mm/transparent_hugepage")
MIB = 1 << 20
# Buffers above glibc's largest mmap threshold (32 MiB) get a mapping of their own, so smaps
# shows their pages apart from the heap's.
OWN_MAPPING = 40 * MIB


def _thp_page_size():
    try:
        enabled = (THP / "enabled").read_text()
        size = int((THP / "hpage_pmd_size").read_text())
    except OSError:
        return 0
    return 0 if "[never]" in enabled else size


PAGE = _thp_page_size()
needs_thp = pytest.mark.skipif(PAGE == 0, reason="no transparent huge pages on this system")


def isolated(test):
    """Runs `test` in a fresh interpreter. smaps counts huge pages per mapping, and in a process
    that has allocated much before, Linux may merge an array's mapping with a neighbour of the
    same flags, which then no longer lies inside the array."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("MBD_ISOLATED_TEST") == test.__name__:
            return test(*args, **kwargs)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test.__name__}"],
            env=dict(os.environ, MBD_ISOLATED_TEST=test.__name__), capture_output=True, text=True,
            timeout=300,
        )
        assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]

    return run


def _address(array):
    """Start of a float32 array's memory (numpy views it without a copy)."""
    return np.asarray(array).__array_interface__["data"][0]


def _huge_page_bytes(array):
    """Bytes that smaps shows on huge pages in the mappings lying inside `array`'s memory
    (which must be a mapping of its own: OWN_MAPPING bytes or more)."""
    assert array.nbytes >= OWN_MAPPING
    start = _address(array)
    end = start + array.nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            low, high = (int(x, 16) for x in span.groups())
            inside = start <= low and high <= end
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@needs_thp
@isolated
def test_whole_pages_move_and_contents_stay():
    a = mx.random.normal((OWN_MAPPING // 4 + 123,))  # float32, not a whole number of pages
    mx.eval(a)
    copy = np.array(a)
    start = _address(a)
    interior = (start + a.nbytes) // PAGE * PAGE - -(-start // PAGE) * PAGE
    assert mlx_batched_decode.advise_huge_pages(a) == interior
    assert interior >= OWN_MAPPING - 2 * PAGE
    assert _huge_page_bytes(a) >= interior
    assert np.array_equal(np.array(a), copy)


@needs_thp
def test_less_than_a_page_moves_nothing():
    a = mx.ones((PAGE // 8,))
    mx.eval(a)
    assert mlx_batched_decode.advise_huge_pages(a) == 0


@pytest.mark.skipif(sys.platform == "linux", reason="the no-op answer is for systems without THP")
def test_other_systems_move_nothing():
    a = mx.ones((4 * MIB,))
    mx.eval(a)
    assert mlx_batched_decode.advise_huge_pages(a) == 0


def test_unevaluated_array_is_refused():
    with pytest.raises(ValueError, match="evaluate"):
        mlx_batched_decode.advise_huge_pages(mx.ones((4,)) + 1)


@needs_thp
@isolated
def test_slot_cache_buffers_stay_on_huge_pages_across_steps():
    """New buffers are placed on huge pages; decode steps write in place and keep them there;
    growing the cache places the new buffers too."""
    heads, dim, step = 8, 128, 4096  # float32: 64 MiB per buffer of 4 slots
    cache = SlotKVCache(step=step)
    like = mx.zeros((1, heads, 1, dim))
    cache.reserve(4, step, like, like)
    buffers = {"keys": cache.keys, "values": cache.values}
    placed = {name: _huge_page_bytes(b) for name, b in buffers.items()}
    assert all(bytes_ >= 60 * MIB for bytes_ in placed.values()), placed
    addresses = {name: _address(b) for name, b in buffers.items()}

    seq_lens = [10, 500, 0, 4000]
    for _ in range(3):
        ctx = BatchedDecodeContext(4, seq_lens, [cache])
        new = mx.random.normal((4, heads, 1, dim))
        mx.eval(cache.update(new, new, ctx))
        assert mx.array_equal(cache.keys[3, :, seq_lens[3]], new[3, :, 0]).item()
        seq_lens = [s + 1 for s in seq_lens]
    for name in buffers:
        now = getattr(cache, name)
        assert _address(now) == addresses[name], f"{name} moved: the step copied the buffer"
        assert _huge_page_bytes(now) >= placed[name]

    cache.reserve(8, step, like, like)
    assert _huge_page_bytes(cache.keys) >= 120 * MIB
    assert _huge_page_bytes(cache.values) >= 120 * MIB
