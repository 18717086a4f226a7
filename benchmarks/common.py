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
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def read_bandwidth_gbs(nbytes=1 << 29, threads=None):
    """Machine read bandwidth: all cores summing disjoint slices of a large array."""
    threads = threads or os.cpu_count() or 1
    data = np.ones(nbytes // 8, dtype=np.float64)
    parts = np.array_split(data, threads)

    def run():
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    return nbytes / median_seconds(run, warmup=2, repeats=7) / 1e9


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
