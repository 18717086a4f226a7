"""Wall-clock medians of calls timed in turns, for benchmarks and the self-test."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def median_seconds(fn: Callable[[], object], warmup: int = 3, repeats: int = 15) -> float:
    """Median wall time of fn() after warm-up; fn must block until done."""
    return interleaved_medians([fn], warmup, repeats)[0]


def interleaved_medians(
    fns: Sequence[Callable[[], object]], warmup: int = 3, repeats: int = 15, pause: float = 0.0
) -> list[float]:
    """Median wall time of each fn, timed in turns (f0, f1, f2, f2, f1, f0, ...).

    Memory speed on a shared machine drifts from second to second; timed in
    turns, the functions see the same drift, so their ratios are fair. The
    order flips every round, so each fn follows each other one equally often
    (what ran before leaves caches and sleeping threads behind).

    pause: seconds slept, untimed, before each timed call, so that threads a
    library leaves polling after its call (the CPU kernel's pool polls for
    MBD_CPU_SPIN_US) are asleep before the next one starts.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    turns = list(zip(fns, times))
    for round_ in range(repeats):
        for fn, ts in turns if round_ % 2 == 0 else turns[::-1]:
            if pause:
                time.sleep(pause)
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]
