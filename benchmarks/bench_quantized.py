"""Quantized KV cache benchmark: quantized_batched_decode_attention (8- and 4-bit, group 64,
float16 scales) against batched_decode_attention on the same float16 cache before
quantization, and against mlx-lm's quantized_scaled_dot_product_attention (mx.quantized_matmul
with a boolean mask) on the same quantized inputs. mlx-lm's path takes tens of seconds per call
on MLX's CPU backend here, so it is timed once, on one layer, outside the turns.

Cases (Llama-3-8B heads: 32 query heads, 8 KV heads, D = 128, float16 queries, one query row
per request, unless said):
  b8      B = 8, lengths 512-2048 (the same draw as bench_kernel.py)
  b1-8k   B = 1, 8192 keys
  b8-mha  as b8 with 16 query and 16 KV heads of D = 64
  b8-l4   as b8 with L = 4 query rows per request (a token and 3 drafts: 16 rows per KV head)

Per row: median ms per layer call; GB/s of the valid cache bytes each kernel reads
(sum_b len_b * H_kv * 2 * bytes per row: D * 2 for float16; D * bits / 8 packed plus
2 * D / 64 scales and biases of 2 bytes each when quantized); that as a fraction of the
machine's read bandwidth, probed in turns with the kernels in the same seconds; the two floors
(common.Floors: those bytes over the read rate, and 2 x H_q x D multiply-adds per key over the
peak of the instruction that computes them, common.decode_work: scores on vpdpwssd's int16 dot
product where the AVX-512 variants score integers, values on float32 FMAs; dequantization is the
kernel's overhead, not part of the floor) and the share
of the roofline (the larger floor over the time); the speedup
over the float16 op and over mlx-lm; "hot ms", the same call on one layer whose cache stays
in the last-level cache (what the arithmetic alone costs: when hot ms is close to ms, the
kernel is bound by arithmetic, not by memory); the max error of the timed output against
reference_attention on the dequantized keys and values.

Out-of-cache rotation: each kernel runs over copies of the case's cache ("layers", as a
model's layers) that together hold at least 3x the last-level cache, so that no call finds
its bytes in cache; the JSON records the LLC size and the bytes each kernel rotates.
The read bandwidth and FMA peak are benchmarks/common.py's Floors (the extension's native probes).

Every layer's arrays (packed words, scales and biases; the float16 cache alike) live on
transparent huge pages, as QuantizedKVCache and SlotKVCache keep them on Linux
(mlx_batched_decode.advise_huge_pages); --small-pages leaves them on MLX's default 4 KiB pages,
where each new page of a stream can cost a page walk. Each row records the fraction of its bytes
that sat on huge pages.

    python benchmarks/bench_quantized.py            # both cases (a few minutes)
    python benchmarks/bench_quantized.py --quick    # 128 MiB rotation, 3 repeats, no mlx-lm (< 1 minute)
    python benchmarks/bench_quantized.py --quick --small-pages   # the same on 4 KiB pages
"""

import argparse
import math

import mlx.core as mx
import numpy as np

import mlx_batched_decode as mbd

from common import (
    Floors,
    decode_work,
    describe_machine,
    interleaved_medians,
    llc_bytes,
    machine,
    median_seconds,
    print_table,
    save,
)

GROUP = 64
LLAMA3_8B, MHA = (32, 8, 128), (16, 16, 64)
# Per case: heads (H_q, H_kv, D), query rows per request L and the speedups over float16 each
# width must reach.
CASES = {
    "b8": (LLAMA3_8B, 1, {8: 1.3, 4: 1.5}),
    "b1-8k": (LLAMA3_8B, 1, {8: 1.3, 4: 1.5}),
    "b8-mha": (MHA, 1, {8: 1.7, 4: 2.5}),
    "b8-l4": (LLAMA3_8B, 4, {8: 1.3, 4: 1.5}),
}


def lengths(case):
    if case.startswith("b8"):
        return np.random.default_rng(8).integers(512, 2049, size=8)
    return np.array([8192])


def copies(arrays, n):
    """n distinct copies of a list of arrays (rotation layers); the first is the original."""
    out = [arrays]
    for _ in range(n - 1):
        out.append([a * mx.array(1, a.dtype) for a in arrays])
        mx.eval(out[-1])
    return out


def nbytes(arrays):
    return sum(a.nbytes for a in arrays)


def on_huge_pages(layers, huge_pages):
    """Advise every layer's arrays onto huge pages where asked; the fraction of their bytes placed."""
    placed = sum(mbd.advise_huge_pages(a) for arrays in layers for a in arrays) if huge_pages else 0
    return placed / sum(nbytes(arrays) for arrays in layers)


def mlx_lm_attention():
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    return quantized_scaled_dot_product_attention


def run_case(case, rotate_bytes, repeats, floors, with_peer, huge_pages):
    (H_Q, H_KV, D), L, targets = CASES[case]
    lens_np = lengths(case)
    B, T = len(lens_np), int(lens_np.max())
    lens = mx.array(lens_np, dtype=mx.int32)
    scale = 1.0 / math.sqrt(D)
    q = mx.random.normal((B, H_Q, L, D)).astype(mx.float16)
    k = mx.random.normal((B, H_KV, T, D)).astype(mx.float16)
    v = mx.random.normal((B, H_KV, T, D)).astype(mx.float16)
    # Row l of L sits at position len - L + l and sees the keys up to it.
    ends = lens[:, None, None] - L + 1 + mx.arange(L)[None, :, None]
    mask = (mx.arange(T)[None, None, :] < ends)[:, None]
    mx.eval(q, k, v, mask)
    peer = mlx_lm_attention()
    valid = int(lens_np.sum()) * H_KV * 2  # K and V rows read

    # Each kernel's layers: copies of one cache, together at least rotate_bytes.
    dense = copies([k, v], max(1, math.ceil(rotate_bytes / (k.nbytes + v.nbytes))))
    quantized = {}
    for bits in (8, 4):
        triple = [*mx.quantize(k, group_size=GROUP, bits=bits), *mx.quantize(v, group_size=GROUP, bits=bits)]
        mx.eval(triple)
        quantized[bits] = copies(triple, max(1, math.ceil(rotate_bytes / nbytes(triple))))
    huge = {"float16": on_huge_pages(dense, huge_pages),
            **{f"q{bits}": on_huge_pages(quantized[bits], huge_pages) for bits in (8, 4)}}

    def ours(bits, layers):
        return [mbd.quantized_batched_decode_attention(q, tuple(a[:3]), tuple(a[3:]), lens, group_size=GROUP,
                                                       bits=bits) for a in layers]

    def theirs(bits, layers):
        # mlx-lm scales the queries it is given in place (queries *= scale): each call gets its own.
        return [peer(mx.array(q), tuple(a[:3]), tuple(a[3:]), scale, mask, group_size=GROUP, bits=bits)
                for a in layers]

    fns = {
        "float16": lambda: mx.eval([mbd.batched_decode_attention(q, a[0], a[1], lens) for a in dense]),
        "q8": lambda: mx.eval(ours(8, quantized[8])),
        "q4": lambda: mx.eval(ours(4, quantized[4])),
    }
    layers = {"float16": len(dense), "q8": len(quantized[8]), "q4": len(quantized[4])}
    seconds = dict(zip(fns, floors.timed(list(fns.values()), warmup=2, repeats=repeats)))
    # mlx-lm's path takes seconds per call on MLX's CPU backend: one call on one layer each.
    if with_peer:
        for bits in (8, 4):
            name = f"mlx-lm q{bits}"
            layers[name] = 1
            seconds[name] = median_seconds(lambda: mx.eval(theirs(bits, quantized[bits][:1])), warmup=0, repeats=1)

    # Cache-resident: one layer, called again and again.
    hot = {
        "float16": lambda: mx.eval(mbd.batched_decode_attention(q, k, v, lens)),
        "q8": lambda: mx.eval(ours(8, quantized[8][:1])),
        "q4": lambda: mx.eval(ours(4, quantized[4][:1])),
    }
    hot_seconds = dict(zip(hot, interleaved_medians(list(hot.values()), warmup=3, repeats=repeats)))

    # Every timed kernel's output against reference_attention on the dequantized cache.
    def dequantized(bits, side):
        a = quantized[bits][0][3 * side:3 * side + 3]
        return mx.dequantize(a[0], a[1].astype(mx.float32), a[2].astype(mx.float32), group_size=GROUP, bits=bits)

    q32 = q.astype(mx.float32)
    want = {"float16": mbd.reference_attention(q32, k.astype(mx.float32), v.astype(mx.float32), lens)}
    for bits in (8, 4):
        want[f"q{bits}"] = want[f"mlx-lm q{bits}"] = mbd.reference_attention(
            q32, dequantized(bits, 0), dequantized(bits, 1), lens)
    got = {"float16": mbd.batched_decode_attention(q, k, v, lens), "q8": ours(8, quantized[8][:1])[0],
           "q4": ours(4, quantized[4][:1])[0]}
    if with_peer:
        got.update({f"mlx-lm q{bits}": theirs(bits, quantized[bits][:1])[0] for bits in (8, 4)})

    rows = []
    for name in layers:
        bits = 16 if name == "float16" else int(name[-1])
        row_bytes = D * 2 if bits == 16 else D * bits // 8 + 2 * (D // GROUP) * 2
        t = seconds[name] / layers[name]
        err = mx.abs(got[name].astype(mx.float32) - want[name]).max().item()
        row = {
            "case": case, "heads": [H_Q, H_KV, D], "B": B, "L": L, "kernel": name, "ms": t * 1e3,
            "gbs": valid * row_bytes / t / 1e9, "valid_bytes": valid * row_bytes, "layers": layers[name],
            "bytes_rotated": nbytes(dense[0]) * len(dense) if bits == 16 else nbytes(quantized[bits][0]) * layers[name],
            "kv_on_huge_pages": huge["float16" if bits == 16 else f"q{bits}"], "max_err": err,
        }
        work = decode_work(int(lens_np.sum()), H_Q, D, q.dtype, rows=L, group=H_Q // H_KV,
                           bits=None if bits == 16 else bits)
        row |= floors.columns(t, valid * row_bytes, work)
        row["frac_bw"] = row["gbs"] / row["bw_gbs"]
        if name in hot:
            row["hot_ms"] = hot_seconds[name] * 1e3
        if name in ("q8", "q4"):
            row["vs_float16"] = seconds["float16"] / layers["float16"] / t
            if with_peer:
                row["vs_mlx_lm"] = seconds[f"mlx-lm {name}"] / t
            row["target"] = targets[bits]
            row["met"] = row["vs_float16"] >= targets[bits]
        # The op's tolerances (float16 output); mlx-lm's masked softmax in float16 is looser.
        assert err < (4e-3 if name in hot else 3e-2), f"wrong result: {row}"
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="rotate 1x the LLC (at most 128 MiB), 3 repeats, no mlx-lm peer (seconds per call)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--small-pages", action="store_true",
                        help="leave the caches on 4 KiB pages (no advise_huge_pages)")
    parser.add_argument("--output", help="results/<name>.json (default quantized, or quantized_quick)")
    args = parser.parse_args()
    llc = llc_bytes()
    rotate = min(llc, 128 << 20) if args.quick else 3 * llc
    repeats = 3 if args.quick else 11
    floors = Floors()
    info = machine() | {"kv_pages": "small" if args.small_pages else "huge"} | floors.describe
    print(describe_machine(info))
    print(floors.header(), flush=True)
    rows = []
    for case in args.cases:
        rows += run_case(case, rotate, repeats, floors, with_peer=not args.quick, huge_pages=not args.small_pages)
        print(f"{case}: " + ", ".join(f"{r['kernel']} {r['ms']:.3f} ms" for r in rows if r["case"] == case), flush=True)
        mx.clear_cache()
    print_table(rows, [
        ("case", "case", "{}"), ("kernel", "kernel", "{}"), ("ms", "ms", "{:.3f}"), ("hot_ms", "hot ms", "{:.3f}"),
        ("gbs", "GB/s", "{:.1f}"), ("bw_gbs", "bw GB/s", "{:.1f}"), ("frac_bw", "of bw", "{:.0%}"), *Floors.COLUMNS,
        ("vs_float16", "vs float16", "{:.2f}x"), ("target", "target", "{:.1f}x"), ("vs_mlx_lm", "vs mlx-lm", "{:.2f}x"),
        ("layers", "layers", "{}"), ("max_err", "max err", "{:.1e}"),
    ])
    print(describe_machine(info))
    print(f"LLC {llc / 2**20:.0f} MiB, rotated >= {rotate / 2**20:.0f} MiB")
    path = save(args.output or ("quantized_quick" if args.quick else "quantized"), {
        "machine": info, "cpu_isa": mbd._ext.cpu_isa(), "threads": mbd._ext.cpu_threads(),
        "llc_bytes": llc, "rotate_bytes": rotate, "floors": "benchmarks/common.py Floors",
        "group_size": GROUP, "rows": rows,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
