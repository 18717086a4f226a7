"""``python -m mlx_batched_decode.selftest [--quick] [--ops OP ...]``: every op against the reference.

On the default device (the GPU where Metal is present, else the CPU), every public op (dense,
paged, quantized, one buffer per request) runs the grid of ``cases`` and is compared in float32
with ``reference_attention`` (on the CPU) on the same inputs; then one shape per op is timed
against ``mx.fast.scaled_dot_product_attention`` and the device's read bandwidth. Prints the
machine, the backend that ran, the first call's time, a table of the worst error per op and
dtype, every failed case, and the speed table. Exits with status 1 when any case or timed
output is off by more than its dtype's tolerance, or an op raises.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from ... import ops
from ..bandwidth import device_read_bandwidth
from ..progress import ProgressBar
from . import speed
from .backend import FIRST_CALL_CASE, backend_line, backend_name, first_call_note, first_call_seconds
from .cases import OPS, grid
from .compare import compare
from .layouts import Prepared, prepare
from .report import CaseResult, case_table, failure_lines, machine_lines, speed_table

Reference = Callable[..., mx.array]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_batched_decode.selftest",
        description="Checks every op of mlx-batched-decode against the reference here, then times it.",
    )
    parser.add_argument("--quick", action="store_true", help="the small grid (462 cases, seconds)")
    parser.add_argument(
        "--ops", nargs="+", choices=OPS, default=list(OPS), help="the ops to run (default: all)"
    )
    return parser.parse_args(argv)


def expected_of(reference: Reference) -> Callable[[Prepared], mx.array]:
    """What a prepared case must give: ``reference`` on its float32 truth, on the CPU."""

    def expected(prepared: Prepared) -> mx.array:
        t = prepared.truth
        return reference(t.queries, t.keys, t.values, t.lens, **t.options, stream=mx.cpu)

    return expected


def run_cases(
    quick: bool, op_names: Sequence[str], expected: Callable[[Prepared], mx.array]
) -> list[CaseResult]:
    """Every case of the grid, each compared with ``expected``; progress on stderr."""
    cases = grid(quick, tuple(op_names))
    progress = ProgressBar(len(cases), label="cases")
    results = []
    for case in cases:
        try:
            prepared = prepare(case)
            results.append(CaseResult(case, compare(prepared.run(), expected(prepared), case.dtype)))
        except Exception as e:  # an op that raises is a failed case, reported with its message
            results.append(CaseResult(case, error=f"{type(e).__name__}: {e}"))
        progress.update()
    progress.close()
    return results


def main(argv: Sequence[str] | None = None, *, reference: Reference = ops.reference_attention) -> int:
    """Runs the self-test and returns its exit status (0: every case within tolerance).

    ``reference`` is the ground truth, ``reference_attention``'s signature; it is a parameter
    for the self-test's own tests, which pass a wrong one and expect status 1.
    """
    args = parse_args(argv)
    device = mx.default_device()
    mode = "quick" if args.quick else "full"
    print(f"mlx-batched-decode self-test ({mode}): {', '.join(args.ops)}")
    for line in machine_lines(device):
        print(line)
    print(f"backend: {backend_line(device)}")
    failed = 0
    c = FIRST_CALL_CASE
    what = f"first call (dense, float16, D={c.head_dim}, H_q={c.kv_heads * c.group}, H_kv={c.kv_heads})"
    try:
        first, warm = first_call_seconds()
        note = first_call_note(backend_name(device))
        print(f"{what}: {first * 1e3:.1f} ms, then {warm * 1e3:.2f} ms warm ({note})", flush=True)
    except Exception as e:  # reported, and the grid still runs: its cases tell what else fails
        print(f"FAIL {what}: {type(e).__name__}: {e}", flush=True)
        failed += 1

    expected = expected_of(reference)
    start = time.perf_counter()
    results = run_cases(args.quick, args.ops, expected)
    seconds = time.perf_counter() - start
    print(f"\n{len(results)} cases against reference_attention in float32, {seconds:.1f} s:")
    print(case_table(results))
    failures = failure_lines(results)
    for line in failures:
        print(line)
    failed += len(failures)

    probe = device_read_bandwidth(device)
    shape = speed.speed_case(args.ops[0])
    print(
        f"\nspeed, float16, B={len(shape.lens)}, H_q={shape.kv_heads * shape.group}, H_kv={shape.kv_heads}, "
        f"D={shape.head_dim}, lens {','.join(map(str, shape.lens))}; median ms, in turns with "
        f"mx.fast.scaled_dot_product_attention (mask) and the read probe ({probe.label}):",
        flush=True,
    )
    speeds, speed_errors = [], []
    for op in args.ops:
        try:
            speeds.append(speed.measure(op, args.quick, probe, expected))
        except Exception as e:  # as in the grid: a failed op, reported
            speed_errors.append(f"FAIL speed {op}: {type(e).__name__}: {e}")
    print(speed_table(speeds))
    for line in speed_errors:
        print(line)
    failed += len(speed_errors) + sum(not s.check.ok for s in speeds)

    if failed:
        print(f"\nFAIL: {failed} check(s) failed; please report the whole output above")
        return 1
    print(f"\nOK: {len(results)} cases and {len(speeds)} timed outputs within tolerance")
    return 0
