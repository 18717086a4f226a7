"""Shared benchmark helpers: machine description, cache sizes, the two floors of a CPU call,
tables, JSON; timing and the read-bandwidth and arithmetic probes come from the package's tools
(shared with the self-test)."""

import json
import math
import os
import pathlib
import platform
import threading

import mlx.core as mx
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


# Head dims with kernels of their own (csrc/head_dims.h); others run the generic kernel.
FAST_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256, 512)


def decode_work(keys, heads_q, head_dim, dtype, rows=1, group=1, bits=None, isa=None):
    """decode_multiply_adds split by the instruction the CPU kernel variant `isa` (default: the one
    in use) computes them with, {unit: multiply-adds}, half scores and half weighted values, as
    csrc/cpu/decode_kernel.cpp dispatches them: on avx512bf16, bfloat16 scores on the AVX512_BF16
    dot product (`bf16_dot`) and so its values where the head dim is a fast one and a multiple of
    32; on the AMX variant, 16-bit items of at least 12 (float16) or 8 (bfloat16) query rows
    (group x rows) on `amx_bf16`; quantized keys (`bits`) with 16-bit queries scored on
    `int16_dot` (vpdpwssd) in the AVX-512 variants below the rows that dequantize blocks (32 at 8
    bits, 24 at 4 there); everything else on float32 FMAs (`fma32`). dtype: the queries' (an mx
    dtype)."""
    isa = isa or _ext.cpu_isa()
    half = decode_multiply_adds(keys, heads_q, head_dim, rows) // 2
    item_rows = group * rows
    sixteen_bit = dtype in (mx.float16, mx.bfloat16)
    scores = values = "fma32"
    if bits is not None:
        if sixteen_bit and isa in ("avx512bf16", "avx512fp16", "amx") and item_rows < (32 if bits == 8 else 24):
            scores = "int16_dot"
    elif isa == "amx" and sixteen_bit and item_rows >= (12 if dtype == mx.float16 else 8):
        scores = values = "amx_bf16"
    elif isa == "avx512bf16" and dtype == mx.bfloat16:
        scores = "bf16_dot"
        if head_dim in FAST_HEAD_DIMS and head_dim % 32 == 0:
            values = "bf16_dot"
    work = {scores: half}
    work[values] = work.get(values, 0) + half
    return work


# The units each CPU kernel variant computes on (decode_work), fma32 first. AVX2's and AVX-VNNI's
# 8-lane integer dot products are counted as fma32 (the probe has no 256-bit one).
KERNEL_UNITS = {
    "baseline": ("fma32",), "avx2": ("fma32",), "avxvnni": ("fma32",),
    "avx512bf16": ("fma32", "bf16_dot", "int16_dot"),
    "avx512fp16": ("fma32", "int16_dot"), "amx": ("fma32", "int16_dot", "amx_bf16"),
}


class Floors:
    """The two floors of a CPU call and its share of the roofline, from probes timed in turns with
    the calls: the memory floor (bytes / the read probe's bandwidth) and the arithmetic floor, the
    multiply-adds over the peak of the instruction that computes them (decode_work: float32 FMAs
    on the kernel variant's vectors, or a dot-product or tile unit), each unit's probe timed in
    the same turns. A call's share of the roofline is max(memory floor, arithmetic floor) / its
    time."""

    COLUMNS = [
        ("mem_floor_ms", "mem floor", "{:.3f}"), ("arith_floor_ms", "arith floor", "{:.3f}"),
        ("roofline", "of roofline", "{:.0%}"),
    ]

    def __init__(self, huge_pages=True, read=None):
        self.read = read or ReadBandwidth(huge_pages)
        available = set(_ext.available_arithmetic_units())
        units = [u for u in KERNEL_UNITS[_ext.cpu_isa()] if u in available]
        self.units = {u: ArithmeticPeak(u) for u in units}
        self.fma = self.units["fma32"]
        self.describe = self.read.describe | self.fma.describe | {"arith_units": units}
        self.gbs = self.fma_rate = None
        self.rates = {}

    def timed(self, calls, **turns):
        """Median seconds of each of `calls` timed in turns with each other and the probes
        (interleaved_medians' warmup and repeats); the probes' rates are kept for columns()."""
        probes = [self.read.probe] + [u.probe for u in self.units.values()]
        times = interleaved_medians(list(calls) + probes, **turns)
        seconds, t_read, t_units = times[: len(calls)], times[len(calls)], times[len(calls) + 1:]
        self.gbs = self.read.gbs(t_read)
        self.rates = {name: unit.rate(t) for (name, unit), t in zip(self.units.items(), t_units)}
        self.fma_rate = self.rates["fma32"]
        return seconds

    def columns(self, seconds, nbytes, work):
        """A row's floor figures for one call of `seconds` that reads `nbytes` and computes `work`:
        multiply-adds on float32 FMAs, or decode_work's {unit: multiply-adds}, against the rates
        of the last timed()."""
        work = work if isinstance(work, dict) else {"fma32": work}
        memory = nbytes / (self.gbs * 1e9)
        arith = sum(n / self.rates[unit] for unit, n in work.items())
        return {
            "bw_gbs": self.gbs, "fma_gs": self.fma_rate / 1e9, "mem_floor_ms": memory * 1e3,
            "arith_floor_ms": arith * 1e3, "arith_units": sorted(work), "frac_arith": arith / seconds,
            "roofline": max(memory, arith) / seconds,
        } | {f"{unit}_gs": self.rates[unit] / 1e9 for unit in work}

    def header(self):
        """What the floors are measured with, and every arithmetic unit's peak, for a table's top."""
        peaks = ", ".join(f"{unit} {g:.0f}" for unit, g in arithmetic_peaks().items())
        return (f"floors: {self.read.label}; {self.fma.label} and the units the kernel computes on "
                f"({', '.join(self.units)}); peaks (G multiply-adds/s): {peaks}")


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
    "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512vl", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile",
    "amx_bf16", "amx_fp16",
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
