"""The machine's arithmetic peak, measured in the run that compares a kernel's speed with it.

``ArithmeticPeak`` computes the way the CPU kernel computes (the extension's native
``ArithmeticProbe``: independent chains of one instruction on the kernel's worker pool, no memory
traffic). Like ``bandwidth.ReadBandwidth`` it has ``probe()`` (one run, blocking; time it in turns
with the code it is compared to), ``label`` and ``describe``; ``rate(seconds)`` is multiply-adds
per second. ``arithmetic_peaks()`` rates every unit this CPU has, once each.
"""

from __future__ import annotations

import statistics

from .. import _ext

# The float32 vector width of each CPU kernel variant's arithmetic (csrc/cpu/lanes.h): 16 lanes
# in every AVX-512 variant, 8 in the AVX2 and AVX-VNNI ones.
KERNEL_FMA_WIDTH = {
    "baseline": "baseline", "avx2": "avx2", "avxvnni": "avx2", "avx512bf16": "avx512", "avx512fp16": "avx512",
    "amx": "avx512",
}


def kernel_fma_width(isa: str | None = None) -> str:
    """The ``fma32`` width the CPU kernel variant ``isa`` (default: the one in use) computes on."""
    return KERNEL_FMA_WIDTH[isa or _ext.cpu_isa()]


class ArithmeticPeak:
    """Multiply-adds per second of one unit on all of the kernel's threads.

    unit: one of ``_ext.available_arithmetic_units()``; ``"fma32"`` (the default, the unit the
    arithmetic floor is counted in) runs on the vectors of the kernel variant in use unless
    ``isa`` names a width (``"avx512"``, ``"avx2"``, ``"baseline"``).
    """

    def __init__(self, unit: str = "fma32", isa: str | None = None):
        width = (isa or kernel_fma_width()) if unit == "fma32" else ""
        self.prober = _ext.ArithmeticProbe(unit, width)
        self.unit = unit
        self.multiply_adds = self.prober.multiply_adds
        self.label = f"{unit} on {width} vectors" if width else unit
        self.describe = {"arith_unit": unit, "arith_isa": width, "arith_multiply_adds": self.multiply_adds}

    def probe(self) -> None:
        self.prober.run()

    def rate(self, seconds: float) -> float:
        """Multiply-adds per second of a probe() that took ``seconds``."""
        return self.multiply_adds / seconds


def arithmetic_peaks(repeats: int = 5) -> dict[str, float]:
    """G multiply-adds per second of every unit this CPU runs (``fma32`` on every width it runs,
    keyed ``fma32/<width>``), each the median of ``repeats`` runs after one warm-up."""
    peaks = {}
    widths = [w for w in ("avx512", "avx2", "baseline") if _width_runs(w)]
    for unit in _ext.available_arithmetic_units():
        for width in widths if unit == "fma32" else [None]:
            peak = ArithmeticPeak(unit, width)
            peak.probe()
            seconds = statistics.median(peak.prober.run() for _ in range(repeats))
            peaks[f"{unit}/{width}" if width else unit] = peak.rate(seconds) / 1e9
    return peaks


def _width_runs(width: str) -> bool:
    try:
        _ext.ArithmeticProbe("fma32", width)
    except ValueError:
        return False
    return True

