"""One layer's decode attention at real model shapes: batched_decode_attention against mlx-lm's own
attention for the same model, on the same rows, in one run.

Families (B = 8 requests, lengths spread over a quarter of the context to the whole of it, one
request at the full context, left padded to it as mlx-lm's BatchKVCache batches them):

- deepseek-v3 (MLA in latent space): 128 query heads over one KV head of 576 (the 512-wide latent
  and 64 rope dims), scale 192**-0.5 * mscale**2 (rope factor 40). Ours reads the one 576-wide
  buffer in place, values a view of its first 512 columns: batched_decode_attention(q [B, 128, 1,
  576], cache, cache[..., :512], T, kv_starts=padding). The peer is mlx-lm 0.32.2's absorbed
  decode (DeepseekV3Attention at L = 1) on the same rows held as its BatchKVCache holds them,
  latent [B, 1, T, 512] and rope keys [B, 1, T, 64]: pe_scores = (q_pe * scale) @ k_pe^T, masked
  to finfo.min with the cache's padding mask, then base.scaled_dot_product_attention(q_nope,
  latent, latent, mask=pe_scores).
- deepseek-v3 MLA 8-bit: the same rows quantized as BatchedDecoder(kv_bits=8, kv_group_size=64)
  keeps them (mx.quantize of the 576-wide rows, scales and biases in the dtype): ours is
  quantized_batched_decode_attention over the triple, values the views of its first 512 columns'
  words, scales and biases. mlx-lm's quantized cache cannot run MLA, so the peer is its absorbed
  decode above on the dequantized rows, and "x dense" compares ours with ours on those rows
  unquantized (timed in the same turns).
- gemma-2-9b (softcap): 16 query heads, 8 KV heads of 256, scale 256**-0.5, softcap 50. Ours
  reads mlx-lm's left-padded K/V themselves (kv_starts = padding); the peer is gemma2.py's
  Attention manual path (queries * scale reshaped per KV head, @ keys^T, tanh(s / 50) * 50, the
  padding mask, softmax(precise=True), @ values) with the mask shaped [B, 1, 1, 1, T] for its
  GQA reshape (the [B, 1, 1, T] mask mlx-lm passes broadcasts B against the KV heads).

Queries are scaled so that the scores reach the softcap's bend (gemma) and a peaked softmax.
Before timing, each case checks ours against the peer (max abs diff), and a small case per family
and dtype checks both against a float64 numpy reference (the peer rounds its scores to the dtype:
about 10x ours' error in 16 bits). Ours is timed over distinct buffers ("layers", >= 3x the
last-level cache, on huge pages) in turns with the floors' probes (common.Floors: other jobs on the
machine slow both alike), the median of 9 turns; then the peer on the first layer (rows that fit
stay in the cache), the median of --peer-repeats calls after one warm-up (as bench_kernel's peers:
a peer call takes seconds, and ours after it starts on sleeping workers).

Per row: ms ours and the peer's, "x peer" (target >= 10x), MB read (the valid rows: ours reads
sum(lens) x 576 x itemsize for MLA, at 8 bits sum(lens) x (576 + 2 x 9 x itemsize), sum(lens) x
H_kv x 256 x 2 x itemsize for gemma), GB/s; the
memory floor (those bytes over the read probe's rate) and the arithmetic floor (multiply-adds over
the float32 FMA peak of the kernel's vectors: sum(lens) x H_q x (D + Dv), 576 + 512 for MLA),
each as a share of ours ("of mem", "of fma"); "binds" names the larger floor.

    python benchmarks/bench_models.py            # contexts 1024, 2048, 4096; bfloat16, float32 (about 2 minutes)
    python benchmarks/bench_models.py --quick    # contexts 1024, 2048; bfloat16 (under a minute)
    python benchmarks/bench_models.py --dtypes float16   # the peer's float16 matmuls take 4-10 s a call
    python benchmarks/bench_models.py --families mla-8bit --output bench_models_quantized
"""

import argparse
import math

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention

import mlx_batched_decode as mbd

from common import Floors, describe_machine, machine, median_seconds, print_table, rotation_sets, save

B = 8
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
# Max abs error against float64, outputs of order 1: ours rounds only its output; the peer also rounds its
# scores to the dtype (bfloat16 at scores near 10: steps of 1/16), about 10x ours in 16 bits.
TOLERANCE = {"ours": {"bfloat16": 3e-2, "float16": 4e-3, "float32": 1e-4},
             "peer": {"bfloat16": 0.2, "float16": 3e-2, "float32": 1e-4}}
MLA_HEADS, LATENT, ROPE = 128, 512, 64
MLA_SCALE = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2  # DeepSeek-V3: qk head dim 192, yarn factor 40
GEMMA_HEADS, GEMMA_KV_HEADS, GEMMA_DIM, SOFTCAP = 16, 8, 256, 50.0
GEMMA_SCALE = 256**-0.5  # query_pre_attn_scalar 256


def lengths(T, batch=B):
    """Lengths from T/4 to T, one of them T."""
    lens = np.random.default_rng(T).integers(T // 4, T + 1, size=batch)
    lens[0] = T
    return lens


def padding_mask(lens, T):
    """The boolean mask mlx-lm's BatchKVCache gives a decode step: [B, 1, 1, T], padding False."""
    return create_causal_mask(1, offset=T - 1, left_padding=mx.array(T - lens))


class Mla:
    """DeepSeek-V3's MLA decode in latent space: one [B, 1, T, 576] buffer per layer for ours,
    the first layer split into mlx-lm's latent and rope-key arrays for the peer."""

    family = "deepseek-v3 MLA"

    def __init__(self, lens, T, dtype, rotate=True):
        self.lens_np = lens
        itemsize = mx.zeros((), dtype).itemsize
        self.bytes = int(lens.sum()) * (LATENT + ROPE) * itemsize
        self.multiply_adds = int(lens.sum()) * MLA_HEADS * (2 * LATENT + ROPE)
        layers = rotation_sets(self.bytes) if rotate else 1
        self.caches = [mx.random.normal((B, 1, T, LATENT + ROPE)).astype(dtype) for _ in range(layers)]
        self.q = mx.random.normal((B, MLA_HEADS, 1, LATENT + ROPE)).astype(dtype)
        self.T, self.starts = mx.array([T] * B, dtype=mx.int32), mx.array(T - lens, dtype=mx.int32)
        mx.eval(self.caches, self.q)
        self.huge = sum(mbd.advise_huge_pages(c) for c in self.caches) / sum(c.nbytes for c in self.caches)
        first = self.caches[0]
        self.latent, self.k_pe = mx.contiguous(first[..., :LATENT]), mx.contiguous(first[..., LATENT:])
        self.q_nope, self.q_pe = mx.contiguous(self.q[..., :LATENT]), mx.contiguous(self.q[..., LATENT:])
        self.mask = padding_mask(lens, T)
        # The values ours reads of the first layer (MlaQuantized: dequantized in float32).
        self.exact_rows = first
        mx.eval(self.latent, self.k_pe, self.q_nope, self.q_pe, self.mask)

    def ours(self, cache):
        return mbd.batched_decode_attention(
            self.q, cache, cache[..., :LATENT], self.T, scale=MLA_SCALE, kv_starts=self.starts)

    def peer(self):
        pe_scores = (self.q_pe * MLA_SCALE) @ self.k_pe.swapaxes(-1, -2)
        pe_scores = mx.where(self.mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        return scaled_dot_product_attention(
            self.q_nope, self.latent, self.latent, cache=None, scale=MLA_SCALE, mask=pe_scores)

    def reference(self):
        """float64 numpy attention over each request's valid rows of the first layer (exact_rows)."""
        q, cache = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (self.q, self.exact_rows))
        return [softmax_attention(q[b, :, 0], cache[b, 0, -n:], cache[b, 0, -n:, :LATENT], MLA_SCALE)
                for b, n in enumerate(self.lens_np)]


class MlaQuantized(Mla):
    """Mla over its rows quantized (8 bits, groups of 64): the quantized triples per layer for
    ours, the dense rows kept for "x dense", the peer's latent and rope keys dequantized."""

    family = "deepseek-v3 MLA 8-bit"
    BITS, GROUP_SIZE = 8, 64

    def __init__(self, lens, T, dtype, rotate=True):
        super().__init__(lens, T, dtype, rotate)
        self.dense_caches = self.caches
        self.caches = [tuple(mx.quantize(c, group_size=self.GROUP_SIZE, bits=self.BITS)) for c in self.caches]
        # Scales and biases widened first: mx.dequantize rounds its output to their dtype.
        words, scales, biases = self.caches[0]
        self.exact_rows = mx.dequantize(words, scales.astype(mx.float32), biases.astype(mx.float32),
                                        group_size=self.GROUP_SIZE, bits=self.BITS)
        first = self.exact_rows.astype(dtype)
        self.latent, self.k_pe = mx.contiguous(first[..., :LATENT]), mx.contiguous(first[..., LATENT:])
        mx.eval(self.caches, self.exact_rows, self.latent, self.k_pe)
        itemsize = mx.zeros((), dtype).itemsize
        groups = (LATENT + ROPE) // self.GROUP_SIZE
        self.bytes = int(lens.sum()) * ((LATENT + ROPE) * self.BITS // 8 + 2 * groups * itemsize)
        self.huge = sum(mbd.advise_huge_pages(a) for t in self.caches for a in t) / sum(
            a.nbytes for t in self.caches for a in t)

    def ours(self, rows):
        groups = LATENT // self.GROUP_SIZE
        values = (rows[0][..., :LATENT * self.BITS // 32], rows[1][..., :groups], rows[2][..., :groups])
        return mbd.quantized_batched_decode_attention(
            self.q, rows, values, self.T, group_size=self.GROUP_SIZE, bits=self.BITS, scale=MLA_SCALE,
            kv_starts=self.starts)

    def dense(self, cache):
        return Mla.ours(self, cache)


class Gemma2:
    """gemma-2-9b's attention with softcap over mlx-lm's left-padded K/V [B, 8, T, 256]."""

    family = "gemma-2-9b softcap"

    def __init__(self, lens, T, dtype, rotate=True):
        self.lens_np = lens
        itemsize = mx.zeros((), dtype).itemsize
        self.bytes = int(lens.sum()) * GEMMA_KV_HEADS * GEMMA_DIM * 2 * itemsize
        self.multiply_adds = int(lens.sum()) * GEMMA_HEADS * 2 * GEMMA_DIM
        layers = rotation_sets(self.bytes) if rotate else 1
        shape = (B, GEMMA_KV_HEADS, T, GEMMA_DIM)
        self.caches = [tuple(mx.random.normal(shape).astype(dtype) for _ in range(2)) for _ in range(layers)]
        self.q = (4 * mx.random.normal((B, GEMMA_HEADS, 1, GEMMA_DIM))).astype(dtype)
        self.T, self.starts = mx.array([T] * B, dtype=mx.int32), mx.array(T - lens, dtype=mx.int32)
        self.mask = mx.expand_dims(padding_mask(lens, T), 2)  # [B, 1, 1, 1, T] against [B, H_kv, G, 1, T]
        mx.eval(self.caches, self.q, self.mask)
        self.huge = sum(mbd.advise_huge_pages(a) for kv in self.caches for a in kv) / sum(
            a.nbytes for kv in self.caches for a in kv)

    def ours(self, kv):
        return mbd.batched_decode_attention(
            self.q, *kv, self.T, scale=GEMMA_SCALE, softcap=SOFTCAP, kv_starts=self.starts)

    def peer(self):
        keys, values = self.caches[0]
        repeats = GEMMA_HEADS // GEMMA_KV_HEADS
        queries = (self.q * GEMMA_SCALE).reshape(B, GEMMA_KV_HEADS, repeats, 1, GEMMA_DIM)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        scores = queries @ keys.swapaxes(-1, -2)
        scores = mx.tanh(scores / SOFTCAP)
        scores *= SOFTCAP
        scores = mx.where(self.mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        scores = mx.softmax(scores, precise=True, axis=-1)
        return (scores @ values).reshape(B, GEMMA_HEADS, 1, GEMMA_DIM)

    def reference(self):
        q, k, v = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (self.q, *self.caches[0]))
        repeats = GEMMA_HEADS // GEMMA_KV_HEADS
        return [
            np.concatenate([softmax_attention(q[b, h * repeats:(h + 1) * repeats, 0], k[b, h, -n:], v[b, h, -n:],
                                              GEMMA_SCALE, SOFTCAP) for h in range(GEMMA_KV_HEADS)])
            for b, n in enumerate(self.lens_np)
        ]


def softmax_attention(q, k, v, scale, softcap=None):
    """q [H, D], k [n, D], v [n, Dv] in float64: [H, Dv]."""
    s = scale * q @ k.T
    if softcap:
        s = softcap * np.tanh(s / softcap)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def max_diff(a, b):
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def reference_errors(family, dtype_name):
    """Max abs error of ours and of the peer against float64 numpy on a small case (T = 64)."""
    case = family(lengths(64), 64, DTYPES[dtype_name], rotate=False)
    ref = case.reference()
    errors = []
    for out in (case.ours(case.caches[0]), case.peer()):
        out = np.array(out.astype(mx.float32))
        errors.append(max(np.abs(out[b, :, 0] - r).max() for b, r in enumerate(ref)))
    for name, err in zip(("ours", "peer"), errors):
        assert err < TOLERANCE[name][dtype_name], f"{family.family} {dtype_name}: {name} off float64 by {err}"
    return errors


def measure(family, T, dtype_name, floors, peer_repeats):
    lens = lengths(T)
    case = family(lens, T, DTYPES[dtype_name])
    diff = max_diff(case.ours(case.caches[0]), case.peer())
    assert diff < TOLERANCE["peer"][dtype_name], f"{family.family} T={T} {dtype_name}: ours and peer differ by {diff}"
    timed = [lambda: mx.eval([case.ours(c) for c in case.caches])]
    dense = getattr(case, "dense", None)
    if dense is not None:
        timed.append(lambda: mx.eval([dense(c) for c in case.dense_caches]))
    seconds, *dense_seconds = floors.timed(timed, warmup=2, repeats=9)
    t = seconds / len(case.caches)
    t_peer = median_seconds(lambda: mx.eval(case.peer()), warmup=1, repeats=peer_repeats)
    row = dict(model=family.family, dtype=dtype_name, T=T, lens=f"{lens.min()}-{lens.max()}", ms=t * 1e3,
               peer_ms=t_peer * 1e3, vs_peer=t_peer / t, mb=case.bytes / 1e6, gbs=case.bytes / t / 1e9,
               multiply_adds=case.multiply_adds, diff_vs_peer=diff, layers=len(case.caches), kv_on_huge_pages=case.huge)
    if dense_seconds:
        row["vs_dense"] = dense_seconds[0] / len(case.dense_caches) / t
    row.update(floors.columns(t, case.bytes, case.multiply_adds))
    row["frac_mem"] = row["mem_floor_ms"] / row["ms"]
    row["binds"] = "fma" if row["arith_floor_ms"] > row["mem_floor_ms"] else "memory"
    return row


FAMILIES = {"mla": Mla, "mla-8bit": MlaQuantized, "gemma2": Gemma2}
COLUMNS = [
    ("model", "model", "{}"), ("dtype", "dtype", "{}"), ("T", "T", "{}"), ("lens", "lens", "{}"),
    ("ms", "ms ours", "{:.2f}"), ("peer_ms", "ms peer", "{:.1f}"), ("vs_peer", "x peer", "{:.1f}x"),
    ("vs_dense", "x dense", "{:.2f}x"),
    ("mb", "MB read", "{:.1f}"), ("gbs", "GB/s", "{:.2f}"), ("bw_gbs", "bw GB/s", "{:.1f}"),
    ("mem_floor_ms", "mem floor", "{:.2f}"), ("frac_mem", "of mem", "{:.0%}"), ("fma_gs", "fma G/s", "{:.0f}"),
    ("arith_floor_ms", "fma floor", "{:.2f}"), ("frac_arith", "of fma", "{:.0%}"), ("binds", "binds", "{}"),
    ("diff_vs_peer", "diff vs peer", "{:.1e}"), ("err_ours", "err ours", "{:.1e}"), ("err_peer", "err peer", "{:.1e}"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="contexts 1024 and 2048, bfloat16 only")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default bfloat16 float32 (--quick: bfloat16)")
    parser.add_argument("--peer-repeats", type=int, default=3, help="timed peer calls per case, median reported")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, help="default: all")
    parser.add_argument("--output", default="bench_models", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    floors = Floors()
    dtype_names = args.dtypes or (["bfloat16"] if args.quick else ["bfloat16", "float32"])
    info = machine() | floors.describe | {"quick": args.quick, "B": B, "peer_repeats": args.peer_repeats}
    print(describe_machine(info))
    print(floors.header(), flush=True)

    contexts = (1024, 2048) if args.quick else (1024, 2048, 4096)
    results = {}
    for family in (FAMILIES[name] for name in args.families or FAMILIES):
        rows = []
        for dtype_name in dtype_names:
            err_ours, err_peer = reference_errors(family, dtype_name)
            for T in contexts:
                row = measure(family, T, dtype_name, floors, args.peer_repeats)
                row.update(err_ours=err_ours, err_peer=err_peer)
                rows.append(row)
                print(f"{family.family} {dtype_name} T={T}: ours {row['ms']:.2f} ms, peer {row['peer_ms']:.1f} ms, "
                      f"{row['vs_peer']:.1f}x, {row['frac_mem']:.0%} of the memory floor, "
                      f"{row['frac_arith']:.0%} of the fma floor", flush=True)
        results[family.family] = rows
        print(f"\n{family.family} (B={B}; {describe_machine(info)})")
        print_table(rows, COLUMNS)
        print(flush=True)
    path = save(args.output, {"machine": info, "families": results})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
