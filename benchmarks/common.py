"""Shared benchmark helpers: machine description, cache sizes, the two floors of a CPU call,
tables, JSON; timing and the read-bandwidth and arithmetic probes come from the package's tools
(shared with the self-test)."""

import json
import math
import os
import pathlib
import platform
import threading

import numpy as np

from mlx_batched_decode import _ext
from mlx_batched_decode.tools.arithmetic import ArithmeticPeak, arithmetic_peaks
from mlx_batched_decode.tools.bandwidth import ReadBandwidth  # noqa: F401  benchmarks take them from here
from mlx_batched_decode.tools.timing import interleaved_medians, median_seconds  # noqa: F401

RESULTS = pathlib.Path(__file__).parent / "results"


def llc_bytes():
    """Bytes of last-level cache in the machine (sysfs; the extension's fallback elsewhere)."""
    return _ext.last_level_cache_bytes()


def rotation_sets(bytes_per_set, factor=3):
    """How many distinct K/V buffer sets of `bytes_per_set` bytes to cycle through so that the
    bytes cycled are at least `factor` times the last-level cache: each call then reads from
    memory, not from what the previous calls left in the cache."""
    return max(1, math.ceil(factor * llc_bytes() / bytes_per_set))


def decode_multiply_adds(keys, heads_q, head_dim, rows=1):
    """Multiply-adds of a decode call's arithmetic floor: a score and a weighted value, D each, per
    key and query row, so 2 x H_q x rows x D per key (2 x G x rows x D per key and KV head).
    keys: keys attended per query head summed over the batch (valid lengths, or the window)."""
    return 2 * keys * heads_q * rows * head_dim


class Floors:
    """The two floors of a CPU call and its share of the roofline, from probes timed in turns with
    the calls: the memory floor (bytes / the read probe's bandwidth) and the arithmetic floor
    (multiply-adds / the float32 FMA peak of the kernel variant's vectors). A call's share of the
    roofline is max(memory floor, arithmetic floor) / its time; a share above 100% of the
    arithmetic floor alone means a dot-product or tile unit beat float32 FMAs."""

    COLUMNS = [
        ("mem_floor_ms", "mem floor", "{:.3f}"), ("arith_floor_ms", "fma floor", "{:.3f}"),
        ("roofline", "of roofline", "{:.0%}"),
    ]

    def __init__(self, huge_pages=True, read=None):
        self.read = read or ReadBandwidth(huge_pages)
        self.fma = ArithmeticPeak()
        self.describe = self.read.describe | self.fma.describe
        self.gbs = self.fma_rate = None

    def timed(self, calls, **turns):
        """Median seconds of each of `calls` timed in turns with each other and the two probes
        (interleaved_medians' warmup and repeats); the probes' rates are kept for columns()."""
        *seconds, t_read, t_fma = interleaved_medians(list(calls) + [self.read.probe, self.fma.probe], **turns)
        self.gbs, self.fma_rate = self.read.gbs(t_read), self.fma.rate(t_fma)
        return seconds

    def columns(self, seconds, nbytes, multiply_adds):
        """A row's floor figures for one call of `seconds` that reads `nbytes` and needs
        `multiply_adds`, against the rates of the last timed()."""
        memory, arith = nbytes / (self.gbs * 1e9), multiply_adds / self.fma_rate
        return {
            "bw_gbs": self.gbs, "fma_gs": self.fma_rate / 1e9, "mem_floor_ms": memory * 1e3,
            "arith_floor_ms": arith * 1e3, "frac_arith": arith / seconds, "roofline": max(memory, arith) / seconds,
        }

    def header(self):
        """What the floors are measured with, and every arithmetic unit's peak, for a table's top."""
        peaks = ", ".join(f"{unit} {g:.0f}" for unit, g in arithmetic_peaks().items())
        return f"floors: {self.read.label}; {self.fma.label}; peaks (G multiply-adds/s): {peaks}"


class NumpyReadBandwidth:
    """The former probe, kept as a second column: all cores running numpy.sum over disjoint slices
    of a float64 array. On CPUs where that sum is bound by arithmetic (the Intel Xeon target
    machine) it reads below the memory's rate, so it is no yardstick on its own."""

    def __init__(self, nbytes=1 << 29, threads=None):
        self.nbytes = nbytes
        data = np.ones(nbytes // 8, dtype=np.float64)
        self.parts = np.array_split(data, threads or os.cpu_count() or 1)

    def probe(self):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in self.parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def gbs(self, seconds):
        return self.nbytes / seconds / 1e9


# The /proc/cpuinfo flags the CPU kernel's variants and the probe choose between.
KERNEL_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
    "amx_fp16",
)


def machine():
    """CPU model, its flags that matter to the kernel, last-level cache, kernel variant, threads."""
    cpu, model, flags = platform.processor(), None, set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name" and cpu in ("", platform.processor()):
                    cpu = value
                elif key == "model" and model is None:
                    model = int(value)
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {
        "platform": platform.platform(), "cpu": cpu, "cpu_model": model, "cores": os.cpu_count(),
        "flags": [f for f in KERNEL_FLAGS if f in flags], "llc_bytes": llc_bytes(),
        "cpu_isa": _ext.cpu_isa(), "threads": _ext.cpu_threads(),
    }


def describe_machine(info):
    """One line for the top of a table: what the figures under it ran on."""
    model = f" (model {info['cpu_model']})" if info.get("cpu_model") is not None else ""
    return (
        f"{info['cpu']}{model}, {info['cores']} cores, LLC {info['llc_bytes'] / 2**20:.0f} MiB, "
        f"flags {' '.join(info['flags']) or '-'}; kernel {info['cpu_isa']} on {info['threads']} threads"
    )


def save(name, payload):
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(rows, columns):
    """rows: list of dicts; columns: list of (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([f.format(r[k]) if r.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for i, line in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
