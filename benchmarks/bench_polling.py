"""Worker-polling benchmark: the op at several poll times of its thread pool (MBD_CPU_SPIN_US: how
long an idle worker polls for the next call before it sleeps), each poll time in its own process,
since the variable is read once.

Per poll time, on bench_kernel's headline row (Llama-3-8B heads, B=8, lengths 512-2048, K/V on
huge pages, distinct buffers per layer, enough layers that the bytes cycled are at least 3x the
last-level cache); all rates are GB/s of valid K/V bytes, the probe is the native one
(common.ReadBandwidth):

- steady: calls back to back, as the layers of a decode step;
- in turns with the probe: the kernel's rate and its fraction of the probe's (bench_kernel's
  "of bw"), and the probe's rate over that of the probe timed alone just before (below 1: the
  polling workers took time from the probe's threads);
- after idle: one layer's call after 20 ms of sleep, as the first call after a pause.

The processes of the poll times run in turns, --rounds times; each figure is the median of its
rounds.

    python benchmarks/bench_polling.py                        # 0, 5000 (the default), 20000 us
    python benchmarks/bench_polling.py --quick                # 0 and 5000 us, one round
    python benchmarks/bench_polling.py --spins 0 1000 5000 --dtype bfloat16
"""

import argparse
import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np

import mlx_batched_decode as mbd

from bench_kernel import DTYPES, HEADS, Case
from common import ReadBandwidth, describe_machine, interleaved_medians, machine, median_seconds, print_table, save

IDLE_S = 0.02


def measure(dtype_name, layers):
    """One process's figures (its MBD_CPU_SPIN_US is set by the parent)."""
    mx.set_default_device(mx.cpu)
    probe = ReadBandwidth()
    case = Case(HEADS["llama3-8b"], 8, "uniform", dtype_name, layers, True)
    gigabytes = case.row["bytes_rotated"] / 1e9

    steady = median_seconds(case.run_ours)
    probe_alone = median_seconds(probe.probe)
    in_turns, probe_in_turns = interleaved_medians([case.run_ours, probe.probe])

    def after_idle(layer):
        # One layer's call, each time another layer's buffers, so none comes from cache.
        k, v = case.kv[layer % len(case.kv)]
        time.sleep(IDLE_S)
        start = time.perf_counter()
        mx.eval(mbd.batched_decode_attention(case.q, k, v, case.lens))
        return time.perf_counter() - start

    idle = float(np.median([after_idle(i) for i in range(15)]))
    return {
        "steady_gbs": gigabytes / steady,
        "in_turns_gbs": gigabytes / in_turns,
        "frac_bw": (gigabytes / in_turns) / probe.gbs(probe_in_turns),
        "probe_gbs": probe.gbs(probe_in_turns),
        "probe_vs_alone": probe_alone / probe_in_turns,
        "after_idle_gbs": case.row["valid_bytes"] / 1e9 / idle,
        "layers": case.row["layers"],
        "bytes_rotated": case.row["bytes_rotated"],
        "llc_bytes": case.row["llc_bytes"],
    }


def run_child(spin_us, dtype_name, layers):
    env = dict(os.environ, MBD_CPU_SPIN_US=str(spin_us))
    command = [sys.executable, __file__, "--child", "--dtype", dtype_name] + (["--layers", str(layers)] if layers else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spins", type=int, nargs="+", default=[0, 5000, 20000], help="poll times, microseconds")
    parser.add_argument("--dtype", choices=DTYPES, default="float16")
    parser.add_argument("--layers", type=int, help="distinct K/V buffers cycled per timing (default: >= 3x the LLC)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per poll time, run in turns")
    parser.add_argument("--output", default="polling", help="results/<name>.json")
    parser.add_argument("--quick", action="store_true", help="poll times 0 and 5000 us, one round")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.spins, args.rounds = [0, 5000], 1
    if args.child:
        print(json.dumps(measure(args.dtype, args.layers)))
        return

    info = machine() | {"dtype": args.dtype, "rounds": args.rounds}
    print(f"{describe_machine(info)}; Llama-3-8B heads, B=8 512-2048, {args.dtype}")
    measured = {spin: [] for spin in args.spins}
    for r in range(args.rounds):
        for spin in args.spins:
            result = run_child(spin, args.dtype, args.layers)
            measured[spin].append(result)
            print(
                f"[round {r + 1}/{args.rounds}] {spin} us: steady {result['steady_gbs']:.1f} GB/s, "
                f"in turns {result['frac_bw']:.0%} of {result['probe_gbs']:.1f} GB/s, "
                f"after idle {result['after_idle_gbs']:.1f} GB/s ({result['bytes_rotated'] / 1e9:.2f} GB rotated)",
                flush=True,
            )

    rows = []
    for spin, results in measured.items():
        row = {"spin_us": spin}
        for key in results[0]:
            row[key] = float(np.median([x[key] for x in results]))
        row["rounds"] = results
        rows.append(row)
    print()
    print(describe_machine(info))
    print_table(
        rows,
        [
            ("spin_us", "poll us", "{}"), ("steady_gbs", "steady GB/s", "{:.1f}"),
            ("in_turns_gbs", "in turns GB/s", "{:.1f}"), ("probe_gbs", "probe GB/s", "{:.1f}"), ("frac_bw", "of bw", "{:.0%}"),
            ("probe_vs_alone", "probe / alone", "{:.2f}"), ("after_idle_gbs", "after 20 ms idle GB/s", "{:.1f}"),
        ],
    )
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
