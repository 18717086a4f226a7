"""Kernel benchmark: batched_decode_attention vs mx.fast SDPA with a boolean mask
(and PyTorch's SDPA when installed) on the same padded inputs, in one run.

Per row: median ms per layer call, GB/s of valid K/V bytes
(sum_b valid_lens[b] * H_kv * D * 2 * itemsize), that as a fraction of the
machine's read bandwidth measured at start, speedup over each peer, and the max
error of the timed output against the reference. Each simulated layer has its
own K/V buffers, so caches do not flatter the figures. Each skewed batch (one
request of 2048, the rest 64) is paired with a uniform one of the same total
bytes ("matched"); "/ matched" is the ratio of their times.

    python benchmarks/bench_kernel.py            # full matrix (about 20 minutes)
    python benchmarks/bench_kernel.py --quick    # the headline row only
"""

import argparse
import math

import mlx.core as mx
import numpy as np

import mlx_batched_decode as mbd
from mlx_batched_decode import _ext

from common import machine, median_seconds, print_table, read_bandwidth_gbs, save

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


def bench_case(heads, B, kind, dtype_name, layers, peers, bandwidth):
    H_q, H_kv, D = heads
    dtype = DTYPES[dtype_name]
    lens_np = lengths(kind, B)
    T = int(lens_np.max())
    lens = mx.array(lens_np, dtype=mx.int32)
    q = mx.random.normal((B, H_q, 1, D)).astype(dtype)
    kv = [
        (mx.random.normal((B, H_kv, T, D)).astype(dtype), mx.random.normal((B, H_kv, T, D)).astype(dtype))
        for _ in range(layers)
    ]
    mask = mx.arange(T)[None, None, None, :] < lens[:, None, None, None]
    mx.eval(q, kv, mask)
    scale = 1.0 / math.sqrt(D)
    valid_bytes = int(lens_np.sum()) * H_kv * D * 2 * q.itemsize

    def ours():
        return [mbd.batched_decode_attention(q, k, v, lens) for k, v in kv]

    def sdpa():
        return [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) for k, v in kv]

    row = {"heads": heads, "B": B, "lengths": kind, "dtype": dtype_name, "T": T, "valid_bytes": valid_bytes}
    t = median_seconds(lambda: mx.eval(ours())) / layers
    row.update(ms=t * 1e3, gbs=valid_bytes / t / 1e9, frac_bw=valid_bytes / t / 1e9 / bandwidth)

    # The timed output, checked against the reference on every layer's inputs.
    outs = ours()
    err = 0.0
    for out, (k, v) in zip(outs, kv):
        ref = mbd.reference_attention(q, k, v, lens)
        err = max(err, mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item())
    row["max_err"] = err
    tol = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}[dtype_name]
    assert err < tol, f"wrong result: {row}"

    if "sdpa" in peers:
        t_sdpa = median_seconds(lambda: mx.eval(sdpa()), warmup=1, repeats=3) / layers
        row.update(sdpa_ms=t_sdpa * 1e3, sdpa_gbs=valid_bytes / t_sdpa / 1e9, vs_sdpa=t_sdpa / t)
    if "torch" in peers and dtype_name != "bfloat16":
        torch, run = peers["torch"]
        tq = torch.from_numpy(np.array(q.astype(mx.float32))).to(getattr(torch, dtype_name))
        tkv = [
            tuple(torch.from_numpy(np.array(x.astype(mx.float32))).to(getattr(torch, dtype_name)) for x in pair)
            for pair in kv
        ]
        tmask = torch.from_numpy(np.array(mask))
        t_torch = median_seconds(lambda: [run(tq, k, v, tmask, scale) for k, v in tkv], warmup=1, repeats=3) / layers
        row.update(torch_ms=t_torch * 1e3, vs_torch=t_torch / t)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="headline row only: llama3-8b heads, B=8, 512-2048, all dtypes")
    parser.add_argument("--layers", type=int, default=4, help="distinct K/V buffers cycled per timing")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the mx.fast SDPA peer (slow on CPU)")
    parser.add_argument("--output", default="kernel", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    bandwidth = read_bandwidth_gbs()
    info = machine() | {"read_bandwidth_gbs": bandwidth, "cpu_isa": _ext.cpu_isa(), "threads": _ext.cpu_threads()}
    print(f"{info['cpu']}, {info['cores']} cores, kernel {info['cpu_isa']}; read bandwidth {bandwidth:.1f} GB/s")

    peers = {} if args.no_sdpa else {"sdpa": True}
    torch = torch_sdpa()
    if torch is not None:
        peers["torch"] = torch

    if args.quick:
        cases = [("llama3-8b", 8, "uniform", d) for d in DTYPES]
    else:
        cases = [
            (h, B, kind, d)
            for h in HEADS
            for B in (1, 4, 8, 16, 32)
            for kind in ("uniform",) + (("skewed", "matched") if B > 1 else ("long",))
            for d in DTYPES
        ]
    rows = []
    for i, (h, B, kind, d) in enumerate(cases, 1):
        row = bench_case(HEADS[h], B, kind, d, args.layers, peers, bandwidth)
        row["heads"] = h
        rows.append(row)
        print(f"[{i}/{len(cases)}] {h} B={B} {kind} {d}: {row['ms']:.3f} ms, {row['gbs']:.2f} GB/s", flush=True)

    # Skewed vs uniform at the same total bytes: the cost should follow the bytes.
    matched = {(r["heads"], r["B"], r["dtype"]): r["ms"] for r in rows if r["lengths"] == "matched"}
    for r in rows:
        if r["lengths"] == "skewed":
            r["vs_matched"] = r["ms"] / matched[(r["heads"], r["B"], r["dtype"])]

    print()
    print_table(
        rows,
        [
            ("heads", "heads", "{}"), ("B", "B", "{}"), ("lengths", "lengths", "{}"), ("dtype", "dtype", "{}"),
            ("ms", "ms", "{:.3f}"), ("gbs", "GB/s", "{:.2f}"), ("frac_bw", "of bw", "{:.0%}"),
            ("vs_matched", "/ matched", "{:.2f}"),
            ("sdpa_ms", "sdpa ms", "{:.2f}"), ("sdpa_gbs", "sdpa GB/s", "{:.2f}"), ("vs_sdpa", "x sdpa", "{:.1f}"),
            ("torch_ms", "torch ms", "{:.2f}"), ("vs_torch", "x torch", "{:.1f}"), ("max_err", "max err", "{:.1e}"),
        ],
    )
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
