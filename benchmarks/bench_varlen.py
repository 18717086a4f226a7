"""Packed queries (query_starts) and MLA: one call for a whole serving step, against its peers on the
same inputs in the same run.

Four tables, each row timed in turns with the read-bandwidth and FMA probes (common.Floors):

- decode: Llama-3-8B heads, B=8 of 512-2048 keys: the packed call with query_starts = arange(B + 1)
  against the same call without it (target: within 5%), the ratio the median of 41 back-to-back
  pairs of runs (``paired_ratio``).
- chunk: one request's prefill chunk (512 rows over 2,048 keys, 256 over 1,024), Llama-3-8B heads:
  share of the arithmetic floor counting only causal (row, key) pairs, and the speedup over
  mx.fast.scaled_dot_product_attention(mask="causal") on the same chunk (required: 10x; MLX's Linux
  wheel multiplies through reference BLAS).
- mixed: 8 decodes over 512-2,048 keys and a 256-row chunk over 1,024 keys in one packed call,
  against the decode call plus the chunk call made apart (target: at most 1.1x).
- mla: DeepSeek-V3 attention in latent space, B=8 of 1-4k keys, 128 query heads on one KV head of
  576 (latent 512 + rope 64), values a view of the latent: share of the memory floor (the latent
  read once) and of the FMA floor, and speedup over mlx-lm's absorbed attention on the same cache
  (matmuls and an additive mask; targets: 70% of the memory floor and 10x). The peer runs request
  by request: on MLX's Linux wheel the batched product [8, 128, 1, 576] x [8, 1, 576, 4096] gives
  wrong rows for the last request and sometimes crashes in the wheel's BLAS (measured).

Every timed output is checked: against its peer, the float64 numpy loops (mla) or the op without
query_starts (decode). K/V of the decode and mla rows are cycled through enough buffers to exceed
3x the last-level cache.

    python benchmarks/bench_varlen.py           # all four tables (several minutes: the peers are slow)
    python benchmarks/bench_varlen.py --quick   # float16 only, 256-row chunk, no mla peer
"""

import argparse
import math
import time

import mlx.core as mx
import numpy as np
from common import Floors, describe_machine, machine, print_table, rotation_sets, save

import mlx_batched_decode as mbd

H_Q, H_KV, D = 32, 8, 128  # Llama-3-8B
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 1e-4}


def max_err(a, b):
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def causal_pairs(rows, keys):
    """(row, key) pairs a bottom-right causal chunk of `rows` rows over `keys` keys attends."""
    return sum(keys - rows + i + 1 for i in range(rows))


def kv_sets(B, H_kv, T, Dk, dtype, valid_bytes, Dv=None):
    """Enough [B, H_kv, T, Dk] key buffers (values: the first Dv columns when Dv is given, else
    buffers of their own) that their valid bytes exceed 3x the last-level cache."""
    n = rotation_sets(valid_bytes)
    sets = []
    for _ in range(n):
        k = mx.random.normal((B, H_kv, T, Dk)).astype(dtype)
        v = k[..., :Dv] if Dv else mx.random.normal((B, H_kv, T, Dk)).astype(dtype)
        sets.append((k, v))
    mx.eval(sets)
    return sets


def paired_ratio(call, peer, pairs=41):
    """Median over ``pairs`` back-to-back runs (alternating which goes first) of call time /
    peer time: on a shared, memory-bound machine the runs' own spread (about 8%) swamps a
    ratio of medians taken apart; pairs see the same conditions."""
    ratios = []
    for i in range(pairs):
        seconds = {}
        for f in ((call, peer) if i % 2 == 0 else (peer, call)):
            start = time.perf_counter()
            f()
            seconds[f] = time.perf_counter() - start
        ratios.append(seconds[call] / seconds[peer])
    return float(np.median(ratios))


def decode_rows(floors, dtypes):
    rows = []
    lens_np = np.linspace(512, 2048, 8).astype(np.int32)
    lens = mx.array(lens_np)
    for name in dtypes:
        dtype = DTYPES[name]
        itemsize = mx.zeros((), dtype).itemsize
        valid = int(lens_np.sum()) * H_KV * D * 2 * itemsize
        sets = kv_sets(8, H_KV, 2048, D, dtype, valid)
        q = mx.random.normal((8, H_Q, 1, D)).astype(dtype)
        packed, starts = q[:, :, 0], mx.arange(9)
        mx.eval(q, packed)

        def plain():
            mx.eval([mbd.batched_decode_attention(q, k, v, lens) for k, v in sets])

        def with_starts():
            mx.eval([mbd.batched_decode_attention(packed, k, v, lens, query_starts=starts) for k, v in sets])

        t_plain, t_packed = (t / len(sets) for t in floors.timed([plain, with_starts]))
        ratio = paired_ratio(with_starts, plain)
        k, v = sets[0]
        err = max_err(mbd.batched_decode_attention(packed, k, v, lens, query_starts=starts),
                      mbd.batched_decode_attention(q, k, v, lens)[:, :, 0])
        row = {"table": "decode", "dtype": name, "ms": t_packed * 1e3, "peer_ms": t_plain * 1e3,
               "ratio": ratio, "max_err": err, "valid_bytes": valid}
        row.update(floors.columns(t_packed, valid, 2 * int(lens_np.sum()) * H_Q * D))
        rows.append(row)
        print(f"decode {name}: packed {t_packed * 1e3:.3f} ms, plain {t_plain * 1e3:.3f} ms, "
              f"{ratio:.3f}x (median of paired runs)", flush=True)
    return rows


def chunk_rows(floors, dtypes, shapes, peer=True):
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        for n_rows, n_keys in shapes:
            q = mx.random.normal((n_rows, H_Q, D)).astype(dtype)
            k = mx.random.normal((1, H_KV, n_keys, D)).astype(dtype)
            v = mx.random.normal((1, H_KV, n_keys, D)).astype(dtype)
            lens, starts = mx.array([n_keys]), mx.array([0, n_rows])
            q4 = q.transpose(1, 0, 2)[None]
            mx.eval(q, k, v, q4)

            def ours():
                mx.eval(mbd.batched_decode_attention(q, k, v, lens, query_starts=starts))

            def sdpa():
                mx.eval(mx.fast.scaled_dot_product_attention(q4, k, v, scale=D**-0.5, mask="causal"))

            (t,) = floors.timed([ours], warmup=1, repeats=5)
            pairs = causal_pairs(n_rows, n_keys)
            row = {"table": "chunk", "dtype": name, "rows": n_rows, "keys": n_keys, "ms": t * 1e3,
                   "causal_pairs": pairs}
            row.update(floors.columns(t, 2 * n_keys * H_KV * D * q.itemsize, 2 * pairs * H_Q * D))
            out = mbd.batched_decode_attention(q, k, v, lens, query_starts=starts)
            if peer:
                t_sdpa = floors.timed([sdpa], warmup=0, repeats=1)[0]
                want = mx.fast.scaled_dot_product_attention(q4, k, v, scale=D**-0.5, mask="causal")[0].transpose(1, 0, 2)
                row.update(peer_ms=t_sdpa * 1e3, speedup=t_sdpa / t, max_err=max_err(out, want))
            else:
                want = mbd.reference_attention(q, k, v, lens, query_starts=starts)
                row["max_err"] = max_err(out, want)
            assert row["max_err"] < TOL[name] * 4, row
            rows.append(row)
            print(f"chunk {name} {n_rows}x{n_keys}: {t * 1e3:.2f} ms, {row['frac_arith']:.0%} of the fma floor"
                  + (f", {row['speedup']:.1f}x sdpa" if peer else ""), flush=True)
    return rows


def mixed_rows(floors, dtypes):
    rows = []
    dec_lens = np.linspace(512, 2048, 8).astype(np.int32)
    for name in dtypes:
        dtype = DTYPES[name]
        lens = mx.array(np.concatenate([dec_lens, [1024]]).astype(np.int32))
        k = mx.random.normal((9, H_KV, 2048, D)).astype(dtype)
        v = mx.random.normal((9, H_KV, 2048, D)).astype(dtype)
        q = mx.random.normal((8 + 256, H_Q, D)).astype(dtype)
        starts = mx.array(list(range(9)) + [8 + 256])
        dec_q = q[:8, :, None]
        chunk_q, chunk_k, chunk_v = q[8:], k[8:], v[8:]
        mx.eval(k, v, q, dec_q, chunk_q, chunk_k, chunk_v)

        def mixed():
            mx.eval(mbd.batched_decode_attention(q, k, v, lens, query_starts=starts))

        def apart():
            mx.eval(mbd.batched_decode_attention(dec_q, k[:8], v[:8], lens[:8]),
                    mbd.batched_decode_attention(chunk_q, chunk_k, chunk_v, lens[8:], query_starts=mx.array([0, 256])))

        t_mixed, t_apart = floors.timed([mixed, apart], warmup=1, repeats=7)
        out = mbd.batched_decode_attention(q, k, v, lens, query_starts=starts)
        err = max(max_err(out[:8], mbd.batched_decode_attention(dec_q, k[:8], v[:8], lens[:8])[:, :, 0]),
                  max_err(out[8:], mbd.reference_attention(chunk_q, chunk_k, chunk_v, lens[8:],
                                                           query_starts=mx.array([0, 256]))))
        assert err < TOL[name] * 4, err
        rows.append({"table": "mixed", "dtype": name, "ms": t_mixed * 1e3, "peer_ms": t_apart * 1e3,
                     "ratio": t_mixed / t_apart, "max_err": err})
        print(f"mixed {name}: {t_mixed * 1e3:.2f} ms, apart {t_apart * 1e3:.2f} ms, {t_mixed / t_apart:.3f}x",
              flush=True)
    return rows


def absorbed_attention(q, latent, lens, scale):
    """mlx-lm's absorbed MLA decode on a [B, 1, T, 576] cache: scores by a matmul, an additive
    mask of each request's length, a softmax and a matmul with the latent (the first 512)."""
    T = latent.shape[2]
    mask = mx.where(mx.arange(T)[None, None, None, :] < lens[:, None, None, None], 0.0, -math.inf).astype(q.dtype)
    scores = (q * scale) @ latent.swapaxes(-1, -2) + mask
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype) @ latent[..., :512]


def float64_mla(q, latent, lens, scale, b):
    """float64 [128, 512]: request b's latent attention in numpy."""
    k = np.array(latent[b, 0, : int(lens[b])].astype(mx.float32)).astype(np.float64)
    s = np.array(q[b, :, 0].astype(mx.float32)).astype(np.float64) @ k.T * scale
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)) @ k[:, :512]


def mla_rows(floors, dtypes, peer=True):
    rows = []
    lens_np = np.linspace(1024, 4096, 8).astype(np.int32)
    lens = mx.array(lens_np)
    scale = 192**-0.5  # DeepSeek-V3's (qk_nope 128 + rope 64)^-0.5, before mscale
    for name in dtypes:
        dtype = DTYPES[name]
        itemsize = mx.zeros((), dtype).itemsize
        valid = int(lens_np.sum()) * 576 * itemsize
        sets = kv_sets(8, 1, 4096, 576, dtype, valid, Dv=512)
        q = mx.random.normal((8, 128, 1, 576)).astype(dtype)
        mx.eval(q)

        def ours():
            mx.eval([mbd.batched_decode_attention(q, k, v, lens, scale=scale) for k, v in sets])

        def peer_call():
            k = sets[0][0]
            mx.eval([absorbed_attention(q[b : b + 1], k[b : b + 1], lens[b : b + 1], scale) for b in range(8)])

        (t,) = (s / len(sets) for s in floors.timed([ours], warmup=1, repeats=5))
        k, v = sets[0]
        out = mbd.batched_decode_attention(q, k, v, lens, scale=scale)
        err = max(float(np.abs(np.array(out[b, :, 0].astype(mx.float32)) - float64_mla(q, k, lens_np, scale, b)).max())
                  for b in (0, 7))
        assert err < TOL[name], err
        row = {"table": "mla", "dtype": name, "ms": t * 1e3, "valid_bytes": valid, "max_err": err}
        row.update(floors.columns(t, valid, int(lens_np.sum()) * 128 * (576 + 512)))
        row["frac_mem"] = row["mem_floor_ms"] / row["ms"]
        if peer:
            t_peer = floors.timed([peer_call], warmup=0, repeats=1)[0]
            row.update(peer_ms=t_peer * 1e3, speedup=t_peer / t)
        rows.append(row)
        print(f"mla {name}: {t * 1e3:.2f} ms, {row['frac_mem']:.0%} of the memory floor, "
              f"{row['frac_arith']:.0%} of the fma floor" + (f", {row['speedup']:.1f}x absorbed" if peer else ""),
              flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="float16 only, the 256-row chunk, no mla peer")
    parser.add_argument("--output", default="varlen", help="results/<name>.json")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    floors = Floors()
    info = machine() | floors.describe
    print(describe_machine(info))
    print(floors.header(), flush=True)
    dtypes = ["float16"] if args.quick else ["float16", "bfloat16", "float32"]
    half = ["float16"] if args.quick else ["float16", "bfloat16"]
    shapes = [(256, 1024)] if args.quick else [(512, 2048), (256, 1024)]
    rows = decode_rows(floors, dtypes)
    rows += chunk_rows(floors, half, shapes)
    rows += mixed_rows(floors, half)
    rows += mla_rows(floors, half, peer=not args.quick)
    print()
    print(describe_machine(info))
    columns = [
        ("table", "table", "{}"), ("dtype", "dtype", "{}"), ("rows", "rows", "{}"), ("keys", "keys", "{}"),
        ("ms", "ms", "{:.3f}"), ("peer_ms", "peer ms", "{:.2f}"), ("ratio", "/ peer", "{:.3f}"),
        ("speedup", "x peer", "{:.1f}"), *Floors.COLUMNS, ("frac_arith", "of fma", "{:.0%}"),
        ("frac_mem", "of mem", "{:.0%}"), ("max_err", "max err", "{:.1e}"),
    ]
    print_table(rows, columns)
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
