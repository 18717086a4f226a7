"""Kernel benchmark: batched_decode_attention vs mx.fast SDPA with a boolean mask
(and PyTorch's SDPA when installed) on the same padded inputs, in one run.

Per row: median ms per layer call, GB/s of valid K/V bytes
(sum_b valid_lens[b] * H_kv * D * 2 * itemsize), that as a fraction of the
machine's read bandwidth, speedup over each peer, and the max error of the
timed output against the reference. Each simulated layer has its own K/V
buffers, and there are enough layers that the bytes cycled through are at
least 3x the last-level cache (common.rotation_sets; capped by --memory-gb,
the row then says by how much it fell short), so no call finds its K/V in
cache. Each skewed batch (one request of 2048, the rest 64) is paired with a
uniform one of the same total bytes ("matched"), padded to the same length so
that their buffers are alike (a small buffer has fewer whole huge pages);
"/ matched" is the ratio of their times.

K/V live on transparent huge pages, as SlotKVCache keeps them on Linux
(mlx_batched_decode.advise_huge_pages); --small-pages leaves them on MLX's
default 4 KiB pages. Each row records the fraction that sat on huge pages.

"of bw" is the kernel's GB/s over the native read-bandwidth probe's
(common.ReadBandwidth: the kernel's threads streaming 4x the last-level cache,
on huge pages), the two timed in turns so that a shared machine's drifting
memory speed hits both alike; "numpy bw" is the former numpy probe, timed in
the same turns, for comparison only. The two floors (common.Floors) come from
the same turns: "mem floor" is the valid bytes over the read probe's rate,
"arith floor" the call's 2 x H_q x D multiply-adds per key over the peak of
the instruction the kernel variant computes them with (common.decode_work:
float32 FMAs on its vectors, or the AVX512_BF16 dot product for bfloat16),
"of roofline" the larger over the time. With --rounds N every row is
measured N times, on fresh buffers, the rounds spread over the run; each
figure is the median of its N values (peers: first round).

    python benchmarks/bench_kernel.py --quick    # Llama-3-8B heads, B=8 512-2048, 3 dtypes (under a minute)
    python benchmarks/bench_kernel.py --quick --softcap 50    # the same with Gemma 2's softcap (no peers)
    python benchmarks/bench_kernel.py            # full matrix (long)

The page-size targets on the Intel Xeon target machine (both page sizes against the same probe)
are bench_pages.py's table.
"""

import argparse
import math

import mlx.core as mx
import numpy as np

import mlx_batched_decode as mbd
from mlx_batched_decode import _ext

from common import (
    Floors, NumpyReadBandwidth, decode_work, describe_machine, llc_bytes, machine, median_seconds,
    print_table, rotation_sets, save,
)

HEADS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "mha": (32, 32, 128)}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def lengths(kind, B):
    if kind == "uniform":  # 512-2048, as in the project's headline case; same per B
        return np.random.default_rng(B).integers(512, 2049, size=B)
    if kind == "long":  # every request 8k: one request alone must still use all cores
        return np.full(B, 8192)
    skewed = np.array([2048] + [64] * (B - 1))[:B]  # one long request, the rest short
    if kind == "matched":  # uniform, with the skewed batch's total bytes
        return np.full(B, round(skewed.sum() / B))
    return skewed


def torch_sdpa():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None

    def run(q, k, v, mask, scale):
        with torch.no_grad():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )

    return torch, run


class Case:
    """Padded inputs of one row: q [B, H_q, 1, D] and `layers` pairs of K/V [B, H_kv, T, D]
    (default: enough that their valid bytes are >= 3x the last-level cache, at most
    `memory_gb` GB of buffers), T the longest length unless given."""

    def __init__(self, heads, B, kind, dtype_name, layers, huge_pages, T=None, memory_gb=6.0, softcap=None):
        H_q, H_kv, D = heads
        self.softcap = softcap
        self.dtype_name = dtype_name
        dtype = DTYPES[dtype_name]
        self.lens_np = lengths(kind, B)
        T = T or int(self.lens_np.max())
        self.lens = mx.array(self.lens_np, dtype=mx.int32)
        self.q = mx.random.normal((B, H_q, 1, D)).astype(dtype)
        valid_bytes = int(self.lens_np.sum()) * H_kv * D * 2 * self.q.itemsize
        buffer_bytes = B * H_kv * T * D * 2 * self.q.itemsize
        if layers is None:
            layers = min(rotation_sets(valid_bytes), max(1, int(memory_gb * 1e9 // buffer_bytes)))
        k, v = (mx.random.normal((B, H_kv, T, D)).astype(dtype) for _ in range(2))
        # Each layer its own buffers; odd layers negated (exact), so that the check sees two contents.
        self.kv = [(k, v) if i == 0 else (k * (-1) ** i, v * (-1) ** i) for i in range(layers)]
        self.mask = mx.arange(T)[None, None, None, :] < self.lens[:, None, None, None]
        mx.eval(self.q, self.kv, self.mask)
        on_huge = sum(mbd.advise_huge_pages(a) for kv in self.kv for a in kv) if huge_pages else 0
        self.scale = 1.0 / math.sqrt(D)
        self.row = {
            "heads": heads, "B": B, "lengths": kind, "dtype": dtype_name, "T": T, "valid_bytes": valid_bytes,
            "work": decode_work(int(self.lens_np.sum()), H_q, D, dtype, group=H_q // H_kv),
            "layers": layers, "bytes_rotated": valid_bytes * layers, "llc_bytes": llc_bytes(),
            "rotated_x_llc": valid_bytes * layers / llc_bytes(),
            "kv_on_huge_pages": on_huge / (buffer_bytes * layers), "softcap": softcap,
        }

    def ours(self, layers=None):
        return [mbd.batched_decode_attention(self.q, k, v, self.lens, softcap=self.softcap) for k, v in self.kv[:layers]]

    def run_ours(self):
        mx.eval(self.ours())

    def sdpa(self):
        return [mx.fast.scaled_dot_product_attention(self.q, k, v, scale=self.scale, mask=self.mask) for k, v in self.kv]


def finish_row(case, seconds, floors, peers, numpy_bandwidth=None):
    """The row of a case timed at `seconds` per call of all layers, against the floors of the probes
    timed in the same turns (and the numpy probe's `numpy_bandwidth` GB/s, when timed)."""
    row, layers = case.row, len(case.kv)
    t = seconds / layers
    gbs = row["valid_bytes"] / t / 1e9
    row.update(ms=t * 1e3, gbs=gbs, **floors.columns(t, row["valid_bytes"], row["work"]))
    row["frac_bw"] = gbs / row["bw_gbs"]
    if numpy_bandwidth is not None:
        row.update(numpy_bw_gbs=numpy_bandwidth, frac_numpy_bw=gbs / numpy_bandwidth)

    # The timed output, checked against the reference on both contents the layers hold.
    err = 0.0
    for out, (k, v) in zip(case.ours(2), case.kv[:2]):
        ref = mbd.reference_attention(case.q, k, v, case.lens, softcap=case.softcap)
        err = max(err, mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item())
    row["max_err"] = err
    tol = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}[case.dtype_name]
    assert err < tol, f"wrong result: {row}"

    if "sdpa" in peers:
        t_sdpa = median_seconds(lambda: mx.eval(case.sdpa()), warmup=1, repeats=3) / layers
        row.update(sdpa_ms=t_sdpa * 1e3, sdpa_gbs=row["valid_bytes"] / t_sdpa / 1e9, vs_sdpa=t_sdpa / t)
    if "torch" in peers and case.dtype_name != "bfloat16":
        torch, run = peers["torch"]
        tdtype = getattr(torch, case.dtype_name)

        def to_torch(x):
            return torch.from_numpy(np.array(x.astype(mx.float32))).to(tdtype)

        tq, tmask = to_torch(case.q), torch.from_numpy(np.array(case.mask))
        tkv = [(to_torch(k), to_torch(v)) for k, v in case.kv]
        t_torch = median_seconds(lambda: [run(tq, k, v, tmask, case.scale) for k, v in tkv], warmup=1, repeats=3) / layers
        row.update(torch_ms=t_torch * 1e3, vs_torch=t_torch / t)
    return row


def bench_group(heads, B, kinds, dtype_name, layers, huge_pages, peers, floors, numpy_probe, memory_gb, softcap=None):
    """Rows for `kinds` of one shape, timed in turns with each other, the floors' probes and the
    numpy probe (when given)."""
    T = max(int(lengths(kind, B).max()) for kind in kinds)
    cases = [Case(heads, B, kind, dtype_name, layers, huge_pages, T, memory_gb / len(kinds), softcap) for kind in kinds]
    seconds = floors.timed([c.run_ours for c in cases] + ([numpy_probe.probe] if numpy_probe else []))
    numpy_bw = numpy_probe.gbs(seconds[-1]) if numpy_probe else None
    rows = [finish_row(c, t, floors, peers, numpy_bw) for c, t in zip(cases, seconds)]
    if kinds == ("skewed", "matched"):
        rows[0]["vs_matched"] = rows[0]["ms"] / rows[1]["ms"]
    return rows


MEASURED = (
    "ms", "gbs", "bw_gbs", "frac_bw", "numpy_bw_gbs", "frac_numpy_bw", "vs_matched", "max_err", "fma_gs", "mem_floor_ms",
    "arith_floor_ms", "frac_arith", "roofline",
)


def median_of_rounds(rounds):
    """One row per case from `rounds` (each a list of rows of the same cases): the first round's
    row (with its peers) with every measured figure replaced by its median over the rounds."""
    merged = []
    for same_case in zip(*rounds):
        row = dict(same_case[0])
        for key in MEASURED:
            if key in row:
                row[key] = float(np.median([r[key] for r in same_case]))
        for peer in ("sdpa", "torch"):
            if f"{peer}_ms" in row:  # the speedup over the median time
                row[f"vs_{peer}"] = row[f"{peer}_ms"] / row["ms"]
        if len(same_case) > 1:
            row["rounds"] = {key: [r[key] for r in same_case] for key in ("frac_bw", "roofline", "vs_matched") if key in row}
        merged.append(row)
    return merged


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="llama3-8b heads, B=8 512-2048, all dtypes, no peers")
    parser.add_argument("--rounds", type=int, default=1, help="measurements per row, median reported")
    parser.add_argument("--layers", type=int, help="distinct K/V buffers cycled per timing (default: >= 3x the LLC)")
    parser.add_argument("--memory-gb", type=float, default=6.0, help="most GB of K/V buffers per group (default 6)")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the mx.fast SDPA peer (slow on CPU)")
    parser.add_argument("--no-numpy-probe", action="store_true", help="skip the numpy read-bandwidth column")
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS), help="head layouts of the full matrix")
    parser.add_argument("--small-pages", action="store_true", help="leave K/V on 4 KiB pages (no advise_huge_pages)")
    parser.add_argument("--isa", choices=_ext.cpu_isas(), help="CPU kernel variant (default: the best this CPU runs)")
    parser.add_argument("--softcap", type=float, help="cap scores at c * tanh(s / c) (the peers cannot: none run)")
    parser.add_argument("--output", default="kernel", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    if args.isa:
        _ext.set_cpu_isa(args.isa)
    floors = Floors()
    numpy_probe = None if args.no_numpy_probe else NumpyReadBandwidth()
    info = machine() | {"kv_pages": "small" if args.small_pages else "huge"} | floors.describe
    print(f"{describe_machine(info)}; K/V on {info['kv_pages']} pages")
    print(floors.header(), flush=True)

    peers = {} if args.no_sdpa or args.quick or args.softcap else {"sdpa": True}
    torch = torch_sdpa()
    if torch is not None and "sdpa" in peers:
        peers["torch"] = torch

    if args.quick:
        groups = [("llama3-8b", 8, ("uniform",), d) for d in DTYPES]
    else:
        groups = [
            (h, B, kinds, d)
            for h in args.heads
            for B in (1, 4, 8, 16, 32)
            for kinds in (("uniform",), ("skewed", "matched") if B > 1 else ("long",))
            for d in DTYPES
        ]
    rounds = args.rounds
    info["rounds"] = rounds
    measured = [[] for _ in groups]  # per group, one list of rows per round
    for r in range(rounds):
        for i, (h, B, kinds, d) in enumerate(groups):
            group_rows = bench_group(
                HEADS[h], B, kinds, d, args.layers, not args.small_pages, peers if r == 0 else {}, floors, numpy_probe,
                args.memory_gb, args.softcap,
            )
            measured[i].append(group_rows)
            for row in group_rows:
                row["heads"] = h
                print(
                    f"[round {r + 1}/{rounds}, {i + 1}/{len(groups)}] {h} B={B} {row['lengths']} {d}: {row['ms']:.3f} ms, "
                    f"{row['gbs']:.2f} GB/s, {row['frac_bw']:.0%} of {row['bw_gbs']:.1f} GB/s, "
                    f"{row['roofline']:.0%} of roofline, "
                    f"{row['layers']} layers = {row['rotated_x_llc']:.1f}x LLC",
                    flush=True,
                )
    rows = [row for group_rounds in measured for row in median_of_rounds(group_rounds)]
    info["read_bandwidth_gbs"] = float(np.median([r["bw_gbs"] for r in rows]))

    print()
    print(describe_machine(info))
    print_table(
        rows,
        [
            ("heads", "heads", "{}"), ("B", "B", "{}"), ("lengths", "lengths", "{}"), ("dtype", "dtype", "{}"),
            ("ms", "ms", "{:.3f}"), ("gbs", "GB/s", "{:.2f}"), ("bw_gbs", "bw GB/s", "{:.1f}"), ("frac_bw", "of bw", "{:.0%}"),
            ("numpy_bw_gbs", "numpy bw", "{:.1f}"), ("frac_numpy_bw", "of numpy", "{:.0%}"), *Floors.COLUMNS,
            ("rotated_x_llc", "x LLC", "{:.1f}"), ("vs_matched", "/ matched", "{:.2f}"),
            ("sdpa_ms", "sdpa ms", "{:.2f}"), ("sdpa_gbs", "sdpa GB/s", "{:.2f}"), ("vs_sdpa", "x sdpa", "{:.1f}"),
            ("torch_ms", "torch ms", "{:.2f}"), ("vs_torch", "x torch", "{:.1f}"), ("max_err", "max err", "{:.1e}"),
        ],
    )
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
