"""Page-size benchmark: the kernel on K/V kept on transparent huge pages (as SlotKVCache keeps
them on Linux) vs the same kind of K/V on MLX's default 4 KiB pages.

Both copies and the read-bandwidth probe are timed in turns in one process, so the machine's
drifting memory speed hits them alike. Per row: GB/s of valid K/V bytes and fraction of the
probe's read bandwidth on each kind of page, their ratio, and the fraction of K/V bytes that the
operating system actually put on huge pages. Rows are the kernel benchmark's shapes
(bench_kernel.py), each timed result checked against the reference.

    python benchmarks/bench_pages.py              # Llama-3-8B heads: B=8 512-2048 and B=1 8k
    python benchmarks/bench_pages.py --heads mha  # another head layout
"""

import argparse

import mlx.core as mx

from bench_kernel import DTYPES, HEADS, Case, finish_row
from common import ReadBandwidth, interleaved_medians, machine, print_table, save


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", choices=HEADS, default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4, help="distinct K/V buffers cycled per timing")
    parser.add_argument("--output", default="pages", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    probe = ReadBandwidth()
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores")
    rows = []
    for B, kind in ((8, "uniform"), (1, "long")):
        for dtype in DTYPES:
            small, huge = (Case(HEADS[args.heads], B, kind, dtype, args.layers, h) for h in (False, True))
            t_small, t_huge, t_probe = interleaved_medians([small.run_ours, huge.run_ours, probe.probe])
            bandwidth = probe.gbs(t_probe)
            a, b = finish_row(small, t_small, bandwidth, {}), finish_row(huge, t_huge, bandwidth, {})
            rows.append({
                "heads": args.heads, "B": B, "lengths": kind, "dtype": dtype, "bw_gbs": bandwidth,
                "small_gbs": a["gbs"], "small_frac_bw": a["frac_bw"],
                "huge_gbs": b["gbs"], "huge_frac_bw": b["frac_bw"],
                "speedup": t_small / t_huge, "kv_on_huge_pages": b["kv_on_huge_pages"],
            })
            print(f"{args.heads} B={B} {kind} {dtype}: x{rows[-1]['speedup']:.2f}", flush=True)
            del small, huge

    print()
    print_table(
        rows,
        [
            ("B", "B", "{}"), ("lengths", "lengths", "{}"), ("dtype", "dtype", "{}"), ("bw_gbs", "bw GB/s", "{:.1f}"),
            ("small_gbs", "4 KiB GB/s", "{:.2f}"), ("small_frac_bw", "of bw", "{:.0%}"),
            ("huge_gbs", "huge GB/s", "{:.2f}"), ("huge_frac_bw", "of bw", "{:.0%}"),
            ("speedup", "huge / 4 KiB", "{:.2f}x"), ("kv_on_huge_pages", "on huge", "{:.0%}"),
        ],
    )
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
