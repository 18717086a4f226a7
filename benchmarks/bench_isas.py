"""What the arithmetic alone costs in each of the CPU kernel's instruction-set variants: the
headline shape (B=8, every request cut to 512 keys so that its K/V, 16-32 MB, stay in the
last-level cache) read over and over, each dtype, the variants timed in turns.

The figure is CPU time (all threads, time.process_time) per call, so that other processes on a
shared machine inflate it little; idle workers sleep at once (MBD_CPU_SPIN_US=0, set here) so
that polling does not count. Reported per (key, query head) in ns and as the GB/s that the
machine's threads would reach if arithmetic were the only bound (bytes / CPU seconds x threads):
a variant's ceiling, to set against the native probe's GB/s (bench_pages.py).

    python benchmarks/bench_isas.py                       # Llama-3-8B heads (G=4)
    python benchmarks/bench_isas.py --heads qwen3-0.6b    # G=2
"""

import argparse
import os
import time

os.environ["MBD_CPU_SPIN_US"] = "0"  # read once, at the first kernel call

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import mlx_batched_decode as mbd  # noqa: E402
from bench_kernel import DTYPES, HEADS, Case  # noqa: E402
from common import describe_machine, machine, print_table, save  # noqa: E402

_ext = mbd._ext
KEYS = 512


def cpu_seconds(fns, warmup=3, repeats=15):
    """Median CPU time of each fn, timed in turns as common.interleaved_medians does."""
    for fn in fns * warmup:
        fn()
    times = [[] for _ in fns]
    for round_ in range(repeats):
        order = list(zip(fns, times))
        for fn, ts in order if round_ % 2 == 0 else order[::-1]:
            start = time.process_time()
            fn()
            ts.append(time.process_time() - start)
    return [float(np.median(ts)) for ts in times]


def in_variant(isa, case):
    def run():
        _ext.set_cpu_isa(isa)
        case.run_ours()

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", choices=HEADS, default="llama3-8b")
    parser.add_argument("--isas", nargs="+", default=[i for i in _ext.cpu_isas() if i != "baseline"])
    parser.add_argument("--repeats", type=int, default=15, help="timings in turns per figure")
    parser.add_argument("--output", default="isas", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    default = _ext.cpu_isa()
    info = machine()
    print(describe_machine(info), flush=True)
    H_q, H_kv, D = HEADS[args.heads]
    rows = []
    for dtype in DTYPES:
        case = Case(HEADS[args.heads], 8, "uniform", dtype, 1, True)
        case.lens = mx.array(np.minimum(case.lens_np, KEYS), dtype=mx.int32)
        keys = int(np.minimum(case.lens_np, KEYS).sum())
        nbytes = keys * H_kv * D * 2 * case.q.itemsize
        seconds = cpu_seconds([in_variant(i, case) for i in args.isas], repeats=args.repeats)
        for isa, t in zip(args.isas, seconds):
            rows.append({
                "heads": args.heads, "dtype": dtype, "isa": isa, "keys": keys, "bytes": nbytes, "cpu_s": t,
                "ns_per_key_head": t / (keys * H_q) * 1e9, "ceiling_gbs": nbytes / t * _ext.cpu_threads() / 1e9,
            })
            print(f"{dtype} {isa}: {rows[-1]['ns_per_key_head']:.2f} ns per (key, query head)", flush=True)
    _ext.set_cpu_isa(default)

    print()
    print(describe_machine(info) + "; K/V in cache, CPU time")
    print_table(
        rows,
        [
            ("heads", "heads", "{}"), ("dtype", "dtype", "{}"), ("isa", "variant", "{}"),
            ("ns_per_key_head", "ns / (key, head)", "{:.2f}"), ("ceiling_gbs", "arithmetic ceiling GB/s", "{:.1f}"),
        ],
    )
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
