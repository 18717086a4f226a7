"""What the self-test prints: the machine, the case table, the failures, the speed table."""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata

import mlx.core as mx

from .cases import Case
from .compare import Comparison
from .speed import Speed


@dataclass(frozen=True)
class CaseResult:
    """A case's comparison, or the error its call raised instead."""

    case: Case
    comparison: Comparison | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.comparison is not None and self.comparison.ok


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Columns right-aligned under a header and a rule, two spaces apart."""
    cells = [list(header), *map(list, rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _mac_model() -> str:
    """The Mac's model identifier (``Mac14,9``), as ``sysctl`` reports it."""
    try:
        found = subprocess.run(["sysctl", "-n", "hw.model"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "an unknown model"
    return found.stdout.strip() or "an unknown model"


def machine_lines(device: mx.Device) -> list[str]:
    """The device, OS, Python, MLX and package versions: what a report needs to place a result."""
    info = mx.device_info(device)
    kind = "gpu" if device.type == mx.DeviceType.gpu else "cpu"
    name, arch = info.get("device_name", "?"), info.get("architecture", "?")
    memory = info.get("memory_size", info.get("total_memory"))
    about = f"{name}, {arch}" + (f", {memory / 2**30:.0f} GiB" if isinstance(memory, int) else "")
    if sys.platform == "darwin":
        system = f"macOS {platform.mac_ver()[0]} on {_mac_model()}"
    else:
        system = f"{platform.platform()} on {platform.machine()}"
    try:
        version = metadata.version("mlx-batched-decode")
    except metadata.PackageNotFoundError:
        version = "not installed (run from a source tree)"
    return [
        f"device: {kind} ({about}); {system}",
        f"versions: mlx-batched-decode {version}, MLX {mx.__version__}, Python {platform.python_version()}",
    ]


def case_table(results: Sequence[CaseResult]) -> str:
    """One row per op and dtype: cases, failures, the worst error, its tolerance and case."""
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for r in results:
        groups.setdefault((r.case.op, dtype_name(r.case.dtype)), []).append(r)
    rows = []
    for (op, dtype), group in groups.items():
        compared = [r for r in group if r.comparison is not None]
        worst = max(compared, key=lambda r: r.comparison.error, default=None)
        rows.append([
            op, dtype, str(len(group)), str(sum(not r.ok for r in group)),
            f"{worst.comparison.error:.2e}" if worst else "-",
            f"{worst.comparison.tolerance:.0e}" if worst else "-",
            worst.case.label if worst else "-",
        ])
    return format_table(rows, ["op", "dtype", "cases", "failed", "worst error", "tolerance", "worst case"])


def failure_lines(results: Sequence[CaseResult]) -> list[str]:
    """One line per failed case: op, dtype, the case and how it failed."""
    lines = []
    for r in results:
        if r.ok:
            continue
        why = r.error or f"error {r.comparison.error:.2e} > tolerance {r.comparison.tolerance:.0e}"
        lines.append(f"FAIL {r.case.op} {dtype_name(r.case.dtype)} {r.case.label}: {why}")
    return lines


def speed_table(speeds: Sequence[Speed]) -> str:
    """One row per op: its median, GB/s, the probe's GB/s in the same turns, the peer's median,
    the ratio, and the timed output's error."""
    rows = [
        [
            s.case.op, f"{s.seconds * 1e3:.3f}", f"{s.gbs:.1f}", f"{s.read_gbs:.1f}",
            f"{s.gbs / s.read_gbs:.0%}", f"{s.sdpa_seconds * 1e3:.3f}", f"{s.sdpa_seconds / s.seconds:.1f}x",
            f"{s.check.error:.1e}" + ("" if s.check.ok else " FAIL"),
        ]
        for s in speeds
    ]
    header = ["op", "ms", "GB/s", "read GB/s", "of read", "sdpa ms", "vs sdpa", "error"]
    return format_table(rows, header)
