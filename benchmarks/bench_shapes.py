"""What each decode shape costs on the CPU: sliding windows, several query rows per request,
attention sinks and head dims, against the targets of the issue that added them.

Groups (Llama-3-8B heads, 32 query / 8 KV heads; K/V on huge pages as SlotKVCache keeps them,
rotated through distinct buffers ("layers") of at least 3x the last-level cache; each group's
calls and the floors' probes (common.Floors: read bandwidth and the peak of each instruction the
kernel computes with, common.decode_work) timed in turns,
the median of --rounds rounds):

- window: B=8, 16k keys per request, float16, window 1024 vs none. Target: at least 10x
  faster, and GB/s of the bytes read within 10% of the unwindowed call's.
- rows: B=8, 512-2048 keys, L = 1, 2, 4, 8 query rows per request over the same cache.
  Target: L=4 at most 1.5x the time of L=1, L=8 at most 2x (float16; bfloat16 and float32 too).
  On a CPU with AMX, "rows ... vector" repeats the 16-bit groups with the kernel variant that
  has no tiles (avx512bf16), to show what the tiles are worth.
- sinks: the rows cache at L=1 with and without sinks. Target: no measurable cost.
- head dims: B=8, 512-2048 keys, D = 32, 64, 256, 512 (and generic 48, 200). Target: D=32 and
  D=512 at least 70% of the GB/s of D=64 and D=256.

GB/s counts the K/V bytes each call reads (the keys its rows attend); the memory floor is those
bytes over the read probe's rate, the arithmetic floor the call's 2 x H_q x L x D multiply-adds per
key read over the peak of the instruction computing them, "of roofline" the larger over the time.
Every timed output is checked against reference_attention.

    python benchmarks/bench_shapes.py              # every group, 3 rounds (about 6 minutes)
    python benchmarks/bench_shapes.py --rounds 1   # one round
"""

import argparse

import mlx.core as mx
import numpy as np

import mlx_batched_decode as mbd
from mlx_batched_decode import _ext

from common import Floors, decode_work, describe_machine, llc_bytes, machine, print_table, rotation_sets, save

H_Q, H_KV = 32, 8
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TOLERANCE = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-4}


def kv_buffers(B, T, D, dtype):
    """Distinct K/V pairs [B, H_kv, T, D] on huge pages, as many as hold at least 3x the
    last-level cache, so that no call finds its bytes in cache; the fraction on huge pages."""
    layers = rotation_sets(2 * B * H_KV * T * D * mx.zeros((), dtype).itemsize)
    kv = [
        (mx.random.normal((B, H_KV, T, D)).astype(dtype), mx.random.normal((B, H_KV, T, D)).astype(dtype))
        for _ in range(layers)
    ]
    mx.eval(kv)
    huge = sum(mbd.advise_huge_pages(a) for pair in kv for a in pair)
    return kv, huge / sum(a.nbytes for pair in kv for a in pair)


class Call:
    """One timed configuration: queries [B, H_q, L, D] over every layer's K/V with `options`."""

    def __init__(self, name, kv, lens, L, dtype, read_keys, **options):
        B, _, _, D = kv[0][0].shape
        self.name, self.kv, self.lens, self.options = name, kv, lens, options
        self.q = mx.random.normal((B, H_Q, L, D)).astype(dtype)
        mx.eval(self.q)
        self.bytes = read_keys * H_KV * D * 2 * self.q.itemsize  # per layer
        self.work = decode_work(read_keys, H_Q, D, dtype, rows=L, group=H_Q // H_KV)
        self.rotated = sum(k.nbytes + v.nbytes for k, v in kv)

    def outputs(self):
        return [mbd.batched_decode_attention(self.q, k, v, self.lens, **self.options) for k, v in self.kv]

    def run(self):
        mx.eval(self.outputs())

    def check(self, dtype_name):
        """Max error of the timed outputs of the first two requests against the reference."""
        err = 0.0
        for out, (k, v) in zip(self.outputs(), self.kv):
            ref = mbd.reference_attention(self.q[:2], k[:2], v[:2], self.lens[:2], **self.options)
            err = max(err, mx.abs(out[:2].astype(mx.float32) - ref.astype(mx.float32)).max().item())
        assert err < TOLERANCE[dtype_name], f"{self.name}: wrong result, error {err}"
        return err


def timed(calls, floors, dtype_name):
    """Rows of `calls` timed in turns with each other and the floors' probes."""
    seconds = floors.timed([c.run for c in calls], warmup=2, repeats=9)
    rows = []
    for call, s in zip(calls, seconds):
        t = s / len(call.kv)
        gbs = call.bytes / t / 1e9
        row = dict(call=call.name, ms=t * 1e3, gbs=gbs, **floors.columns(t, call.bytes, call.work))
        rows.append(row | dict(frac_bw=gbs / row["bw_gbs"], max_err=call.check(dtype_name), layers=len(call.kv),
                               bytes_rotated=call.rotated, llc_bytes=llc_bytes(), rotated_x_llc=call.rotated / llc_bytes()))
    return rows


def uniform_lengths(B):
    return np.random.default_rng(B).integers(512, 2049, size=B)


def window_group(floors):
    B, T, D, window = 8, 16384, 128, 1024
    kv, huge = kv_buffers(B, T, D, mx.float16)
    lens = mx.array([T] * B, dtype=mx.int32)
    calls = [
        Call("no window", kv, lens, 1, mx.float16, B * T),
        Call("window 1024", kv, lens, 1, mx.float16, B * window, window=window),
    ]
    rows = timed(calls, floors, "float16")
    rows[1]["speedup"] = rows[0]["ms"] / rows[1]["ms"]
    rows[1]["gbs_vs_full"] = rows[1]["gbs"] / rows[0]["gbs"]
    return rows, huge


def rows_group(floors, dtype_name, isa=None):
    if isa is not None:
        previous = _ext.cpu_isa()
        _ext.set_cpu_isa(isa)
        try:
            return rows_group(floors, dtype_name)
        finally:
            _ext.set_cpu_isa(previous)
    B, D = 8, 128
    lens_np = uniform_lengths(B)
    kv, huge = kv_buffers(B, int(lens_np.max()), D, DTYPES[dtype_name])
    lens = mx.array(lens_np, dtype=mx.int32)
    calls = [Call(f"L={L}", kv, lens, L, DTYPES[dtype_name], int(lens_np.sum())) for L in (1, 2, 4, 8)]
    rows = timed(calls, floors, dtype_name)
    for row in rows:
        row["vs_first"] = row["ms"] / rows[0]["ms"]
    return rows, huge


def sinks_group(floors):
    B, D = 8, 128
    lens_np = uniform_lengths(B)
    kv, huge = kv_buffers(B, int(lens_np.max()), D, mx.float16)
    lens = mx.array(lens_np, dtype=mx.int32)
    sinks = mx.random.normal((H_Q,))
    calls = [
        Call("no sinks", kv, lens, 1, mx.float16, int(lens_np.sum())),
        Call("sinks", kv, lens, 1, mx.float16, int(lens_np.sum()), sinks=sinks),
    ]
    rows = timed(calls, floors, "float16")
    rows[1]["vs_first"] = rows[1]["ms"] / rows[0]["ms"]
    return rows, huge


def head_dim_group(floors):
    B = 8
    lens_np = uniform_lengths(B)
    lens = mx.array(lens_np, dtype=mx.int32)
    calls, fractions = [], []
    for D in (32, 64, 256, 512, 48, 200):
        kv, huge = kv_buffers(B, int(lens_np.max()), D, mx.float16)
        calls.append(Call(f"D={D}", kv, lens, 1, mx.float16, int(lens_np.sum())))
        fractions.append(huge)
    rows = timed(calls, floors, "float16")
    by_name = {r["call"]: r for r in rows}
    by_name["D=32"]["gbs_vs"] = by_name["D=32"]["gbs"] / by_name["D=64"]["gbs"]
    by_name["D=512"]["gbs_vs"] = by_name["D=512"]["gbs"] / by_name["D=256"]["gbs"]
    return rows, min(fractions)


GROUPS = {
    "window": window_group,
    "rows float16": lambda floors: rows_group(floors, "float16"),
    "rows bfloat16": lambda floors: rows_group(floors, "bfloat16"),
    "rows float32": lambda floors: rows_group(floors, "float32"),
    "sinks": sinks_group,
    "head dims": head_dim_group,
}
if "amx" in _ext.cpu_isas():
    GROUPS["rows float16 vector"] = lambda floors: rows_group(floors, "float16", "avx512bf16")
    GROUPS["rows bfloat16 vector"] = lambda floors: rows_group(floors, "bfloat16", "avx512bf16")
MEASURED = (
    "ms", "gbs", "bw_gbs", "frac_bw", "speedup", "gbs_vs_full", "vs_first", "gbs_vs", "max_err", "fma_gs",
    "mem_floor_ms", "arith_floor_ms", "frac_arith", "roofline",
)


def median_of_rounds(rounds):
    """One row per call: each measured figure the median over the rounds, with the range."""
    merged = []
    for same in zip(*rounds):
        row = dict(same[0])
        for key in MEASURED:
            if key in row:
                values = [r[key] for r in same]
                row[key] = float(np.median(values))
                if key in ("speedup", "gbs_vs_full", "vs_first", "gbs_vs") and len(values) > 1:
                    row[f"{key}_range"] = [min(values), max(values)]
        merged.append(row)
    return merged


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="measurements per row, median reported")
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS))
    parser.add_argument("--output", default="shapes", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    floors = Floors()
    info = machine() | floors.describe | {"rounds": args.rounds}
    print(f"{describe_machine(info)}; {args.rounds} rounds")
    print(floors.header(), flush=True)

    measured = {name: [] for name in args.groups}
    huge_pages = {}
    for r in range(args.rounds):
        for name in args.groups:
            rows, huge_pages[name] = GROUPS[name](floors)
            measured[name].append(rows)
            summary = ", ".join(f"{row['call']} {row['ms']:.3f} ms" for row in rows)
            print(f"[round {r + 1}/{args.rounds}] {name}: {summary}", flush=True)

    results = {}
    columns = [
        ("call", "call", "{}"), ("ms", "ms", "{:.3f}"), ("gbs", "GB/s", "{:.2f}"), ("bw_gbs", "bw GB/s", "{:.1f}"),
        ("frac_bw", "of bw", "{:.0%}"), ("speedup", "speedup", "{:.1f}x"), ("gbs_vs_full", "GB/s vs full", "{:.2f}"),
        ("vs_first", "time vs first", "{:.2f}"), ("gbs_vs", "GB/s vs D=64/256", "{:.2f}"), *Floors.COLUMNS,
        ("max_err", "max err", "{:.1e}"),
        ("rotated_x_llc", "x LLC", "{:.1f}"),
    ]
    for name, rounds in measured.items():
        rows = median_of_rounds(rounds)
        results[name] = {"rows": rows, "kv_on_huge_pages": huge_pages[name]}
        print(f"\n{name} (K/V {huge_pages[name]:.0%} on huge pages)")
        print_table(rows, [c for c in columns if any(c[0] in row for row in rows)])
    path = save(args.output, {"machine": info, "groups": results})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
