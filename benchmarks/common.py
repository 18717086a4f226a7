"""Shared benchmark helpers: timing, machine description, read bandwidth, JSON."""

import json
import os
import pathlib
import platform
import threading
import time

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"


def median_seconds(fn, warmup=3, repeats=15):
    """Median wall time of fn() after warm-up; fn must block until done."""
    return interleaved_medians([fn], warmup, repeats)[0]


def interleaved_medians(fns, warmup=3, repeats=15):
    """Median wall time of each fn, timed in turns (f0, f1, f2, f2, f1, f0, ...).

    Memory speed on a shared machine drifts from second to second; timed in
    turns, the functions see the same drift, so their ratios are fair. The
    order flips every round, so each fn follows each other one equally often
    (what ran before leaves caches and sleeping threads behind).
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    turns = list(zip(fns, times))
    for round_ in range(repeats):
        for fn, ts in turns if round_ % 2 == 0 else turns[::-1]:
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [float(np.median(ts)) for ts in times]


class ReadBandwidth:
    """Machine read bandwidth: all cores summing disjoint slices of a large array.

    probe() reads it once (call it in turns with the code it is compared to);
    gbs(seconds) converts a probe's time to GB/s.
    """

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


def machine():
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count()}


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
