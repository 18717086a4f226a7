"""The native read-bandwidth probe (ReadProbe) and the last-level cache size the benchmarks size
their working sets by: every word read once by each kind of load this CPU runs, a plausible rate,
the page size asked for, and the sysfs parsing with its fallback."""

import platform
import sys
from pathlib import Path

import pytest

from mlx_batched_decode import _ext
from tests.support.repo import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import common  # noqa: E402

MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage")
LOADS = ("avx512", "avx2", "baseline")


def _xor_upto(n):
    """XOR of the integers 0 .. n - 1."""
    m = n - 1
    return (m, 1, m + 1, 0)[m % 4] if n > 0 else 0


def _cpu_runs(loads):
    try:
        _ext.ReadProbe(4 * MIB, False, loads)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("loads", LOADS)
def test_every_word_is_read_once(loads):
    if not _cpu_runs(loads):
        pytest.skip(f"this CPU does not run {loads} loads")
    probe = _ext.ReadProbe(40 * MIB + 1, False, loads)
    assert probe.isa == loads
    assert probe.nbytes == 44 * MIB, "rounded up to whole 4 MiB pieces"
    seconds = probe.read()
    # Word i holds i: a checksum of XOR(0 .. n-1) means each word was loaded an odd number of
    # times, and the pieces claimed by the pool's threads together cover the buffer.
    assert probe.checksum == _xor_upto(probe.nbytes // 8)
    assert 0.1 < probe.nbytes / seconds / 1e9 < 10_000, "a read rate no machine has"


def test_default_loads_are_the_widest_the_cpu_runs():
    widest = next(loads for loads in LOADS if _cpu_runs(loads))
    assert _ext.ReadProbe(4 * MIB).isa == widest


def test_unknown_loads_are_refused():
    with pytest.raises(ValueError, match=r"\[ReadProbe\] loads 'sse9'"):
        _ext.ReadProbe(4 * MIB, True, "sse9")


def _has_thp():
    try:
        return platform.system() == "Linux" and "[never]" not in (THP / "enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_thp(), reason="no transparent huge pages on this system")
def test_page_sizes_are_the_ones_asked_for():
    small = _ext.ReadProbe(64 * MIB, False)
    huge = _ext.ReadProbe(64 * MIB, True)
    assert small.huge_page_bytes == 0, "MADV_NOHUGEPAGE keeps the 4 KiB probe off huge pages"
    assert huge.huge_page_bytes > 0, "the huge-page probe got no huge page"
    assert huge.huge_page_bytes <= huge.nbytes


def _cache(root, cpu, index, level, kind, size, shared):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(f"{value}\n")


def test_llc_counts_each_instance_of_the_highest_level_once(tmp_path):
    # Two core complexes of two CPUs each, one 32 MiB L3 per complex (as on AMD EPYC), and an
    # instruction cache that is bigger than any data cache, which must not count.
    for cpu in range(4):
        _cache(tmp_path, cpu, 0, 1, "Data", "48K", cpu)
        _cache(tmp_path, cpu, 1, 1, "Instruction", "1G", cpu)
        _cache(tmp_path, cpu, 2, 2, "Unified", "2048K", cpu)
        _cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    (tmp_path / "cpufreq").mkdir()  # not a CPU directory
    assert _ext.last_level_cache_bytes(str(tmp_path)) == 64 * MIB


def test_llc_reads_units_and_a_single_shared_cache(tmp_path):
    for cpu in range(2):
        _cache(tmp_path, cpu, 0, 2, "Unified", "2M", cpu)
        _cache(tmp_path, cpu, 1, 3, "Unified", "480M", "0-1")
    assert _ext.last_level_cache_bytes(str(tmp_path)) == 480 * MIB


def test_llc_falls_back_where_sysfs_lists_none(tmp_path):
    assert _ext.last_level_cache_bytes(str(tmp_path / "missing")) == _ext.LLC_FALLBACK_BYTES
    (tmp_path / "cpu0" / "cache").mkdir(parents=True)
    assert _ext.last_level_cache_bytes(str(tmp_path)) == _ext.LLC_FALLBACK_BYTES
    assert _ext.LLC_FALLBACK_BYTES >= 32 * MIB


def test_llc_of_this_machine_is_positive():
    assert _ext.last_level_cache_bytes() > 0
    assert common.llc_bytes() == _ext.last_level_cache_bytes()


@pytest.mark.parametrize("set_bytes", [1, 3 * MIB, 257_000_000, 10 << 30])
def test_rotation_covers_three_times_the_llc(set_bytes):
    n = common.rotation_sets(set_bytes)
    llc = common.llc_bytes()
    assert n * set_bytes >= 3 * llc
    assert n == 1 or (n - 1) * set_bytes < 3 * llc, "no more sets than needed"


def test_benchmark_probe_reports_its_buffer():
    probe = common.ReadBandwidth(huge_pages=False, nbytes=8 * MIB)
    probe.probe()
    assert probe.reader.checksum == _xor_upto(probe.nbytes // 8)
    assert probe.describe["probe_bytes"] == 8 * MIB
    assert probe.gbs(0.5) == pytest.approx(8 * MIB / 0.5 / 1e9)
