"""Page-size benchmark, and the target table of the Intel Xeon target machine: the kernel on K/V
kept on transparent huge pages (as SlotKVCache keeps them on Linux) vs the same kind of K/V on
MLX's default 4 KiB pages, both against the native read-bandwidth probe (common.ReadBandwidth,
on huge pages).

Both copies and the probe are timed in turns in one process, so the machine's drifting memory
speed hits them alike. Each copy cycles through enough distinct K/V buffers that the bytes read
per timing are at least 3x the last-level cache (common.rotation_sets). Per row: GB/s of valid K/V
bytes and fraction of the probe's GB/s on each kind of page, their ratio, and the fraction of
K/V bytes that the operating system actually put on huge pages, and the two floors (memory and
arithmetic, common.Floors) with each page size's share of the roofline; with --small-probe, also the
probe on 4 KiB pages (does streaming itself care about the page size on this machine?). Rows are
the kernel benchmark's shapes (bench_kernel.py), each timed result checked against the reference.
Targets: huge pages >= 85% of the probe, 4 KiB >= 75%, none above 100%.

    python benchmarks/bench_pages.py           # Llama-3-8B and Qwen3-0.6B heads, B=8 512-2048 and B=1 8k, 3 dtypes
    python benchmarks/bench_pages.py --quick   # Llama-3-8B heads, B=8, 3 dtypes
"""

import argparse

import mlx.core as mx
import numpy as np

from mlx_batched_decode import _ext

from bench_kernel import DTYPES, HEADS, Case, finish_row
from common import Floors, ReadBandwidth, describe_machine, machine, print_table, save

SHAPES = ((8, "uniform"), (1, "long"))
MEASURED = (
    "bw_gbs", "small_probe_gbs", "small_gbs", "small_frac_bw", "huge_gbs", "huge_frac_bw", "speedup", "fma_gs",
    "mem_floor_ms", "arith_floor_ms", "small_roofline", "huge_roofline",
)


def measure(heads, B, kind, dtype, floors, small_probe, repeats, memory_gb):
    """One row: 4 KiB and huge-page K/V of one shape timed in turns with the floors' probes (and the
    probe on 4 KiB pages, when given)."""
    small, huge = (Case(HEADS[heads], B, kind, dtype, None, h, memory_gb=memory_gb / 2) for h in (False, True))
    t_small, t_huge, *t_small_probe = floors.timed(
        [small.run_ours, huge.run_ours] + ([small_probe.probe] if small_probe else []), warmup=2, repeats=repeats
    )
    a, b = finish_row(small, t_small, floors, {}), finish_row(huge, t_huge, floors, {})
    return {
        "heads": heads, "B": B, "lengths": kind, "dtype": dtype, "bw_gbs": b["bw_gbs"],
        "small_probe_gbs": small_probe.gbs(t_small_probe[0]) if small_probe else None,
        "small_gbs": a["gbs"], "small_frac_bw": a["frac_bw"], "huge_gbs": b["gbs"], "huge_frac_bw": b["frac_bw"],
        "fma_gs": b["fma_gs"], "mem_floor_ms": b["mem_floor_ms"], "arith_floor_ms": b["arith_floor_ms"],
        "small_roofline": a["roofline"], "huge_roofline": b["roofline"],
        "speedup": t_small / t_huge, "kv_on_huge_pages": b["kv_on_huge_pages"], "small_kv_on_huge_pages":
        a["kv_on_huge_pages"], "layers": b["layers"], "bytes_rotated": b["bytes_rotated"],
        "rotated_x_llc": min(a["rotated_x_llc"], b["rotated_x_llc"]), "llc_bytes": b["llc_bytes"],
        "max_err": max(a["max_err"], b["max_err"]),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=["llama3-8b", "qwen3-0.6b"])
    parser.add_argument("--quick", action="store_true", help="llama3-8b heads, B=8 512-2048 only, 1 round")
    parser.add_argument("--rounds", type=int, default=1, help="measurements per row, median reported")
    parser.add_argument("--repeats", type=int, default=9, help="timings in turns per measurement")
    parser.add_argument("--memory-gb", type=float, default=6.0, help="most GB of K/V buffers per row (default 6)")
    parser.add_argument("--small-probe", action="store_true", help="also time the probe on 4 KiB pages")
    parser.add_argument("--isa", choices=_ext.cpu_isas(), help="CPU kernel variant (default: the best this CPU runs)")
    parser.add_argument("--output", default="pages", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    if args.isa:
        _ext.set_cpu_isa(args.isa)
    floors = Floors(huge_pages=True)
    small_probe = ReadBandwidth(huge_pages=False) if args.small_probe else None
    info = machine() | floors.describe | {"rounds": args.rounds, "repeats": args.repeats}
    print(describe_machine(info))
    print(floors.header(), flush=True)
    cases = [
        (h, B, kind, d)
        for h in (["llama3-8b"] if args.quick else args.heads)
        for B, kind in (SHAPES[:1] if args.quick else SHAPES)
        for d in DTYPES
    ]
    measured = [[] for _ in cases]
    for r in range(args.rounds):
        for i, case in enumerate(cases):
            row = measure(*case, floors, small_probe, args.repeats, args.memory_gb)
            measured[i].append(row)
            print(
                f"[round {r + 1}/{args.rounds}, {i + 1}/{len(cases)}] {row['heads']} B={row['B']} {row['lengths']} "
                f"{row['dtype']}: 4 KiB {row['small_frac_bw']:.0%}, huge {row['huge_frac_bw']:.0%} of "
                f"{row['bw_gbs']:.1f} GB/s; of roofline {row['small_roofline']:.0%} and {row['huge_roofline']:.0%} "
                f"({row['layers']} layers, {row['rotated_x_llc']:.1f}x LLC)",
                flush=True,
            )
    rows = []
    for same_case in measured:
        row = dict(same_case[0])
        for key in MEASURED:
            if row.get(key) is not None:
                row[key] = float(np.median([r[key] for r in same_case]))
        if len(same_case) > 1:
            row["rounds"] = {
                key: [r[key] for r in same_case] for key in ("small_frac_bw", "huge_frac_bw", "small_roofline", "huge_roofline")
            }
        rows.append(row)

    print()
    print(describe_machine(info))
    print_table(
        rows,
        [
            ("heads", "heads", "{}"), ("B", "B", "{}"), ("lengths", "lengths", "{}"), ("dtype", "dtype", "{}"),
            ("bw_gbs", "probe GB/s", "{:.1f}"), ("small_probe_gbs", "4 KiB probe", "{:.1f}"),
            ("small_gbs", "4 KiB GB/s", "{:.2f}"), ("small_frac_bw", "of probe", "{:.0%}"),
            ("huge_gbs", "huge GB/s", "{:.2f}"), ("huge_frac_bw", "of probe", "{:.0%}"),
            ("speedup", "huge / 4 KiB", "{:.2f}x"), ("mem_floor_ms", "mem floor", "{:.3f}"),
            ("arith_floor_ms", "arith floor", "{:.3f}"), ("small_roofline", "4 KiB roofline", "{:.0%}"),
            ("huge_roofline", "huge roofline", "{:.0%}"), ("kv_on_huge_pages", "on huge", "{:.0%}"),
            ("rotated_x_llc", "x LLC", "{:.1f}"),
        ],
    )
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
