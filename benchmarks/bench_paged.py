"""Paged kernel benchmark: paged_decode_attention against its peers on the same lengths.

(a) No sharing: B = 8 requests of 512-2048 tokens (as bench_kernel's uniform batch) and B = 1 of
    8,192 tokens, Llama-3-8B heads (H_q 32, H_kv 8, D 128), float16. The dense op on
    [B, H_kv, T, D] caches against the paged op on the same rows in a pool of block size 16 or 1
    whose blocks are handed out in a shuffled order (as an allocator after some churn). Targets:
    paged >= 0.95x the dense GB/s at block 16, >= 0.9x at block 1. Two pools: a contiguous
    [NB, BS, H_kv, D] array (token-major: one head's rows of a block lie H_kv * D elements apart,
    as vLLM's and SGLang's pools), and a view of a head-major [NB, H_kv, BS, D] buffer (the same
    shape, read in place, one head's rows of a block together; at block 1 the two are one layout).
    Two more rows hand out the blocks of B = 8 in order: what the shuffling itself costs.
(b) Shared prefix: 16 requests with a common 4,096-token prefix and 128 tokens of their own.
    The paged op with the prefix's blocks shared (the CPU kernel reads them once per step)
    against the same batch with a private copy of the prefix per request. Target: >= 6x.

GB/s counts the K/V bytes of every request's valid positions (sum_b len_b * H_kv * D * 2 *
itemsize), whether or not the kernel reads a shared block once, so (b)'s shared figure can pass
the machine's bandwidth. Every timed call reads a different set of buffers (rotation_sets: the
sets together are >= 3x the last-level cache, 1/3 with --quick), K/V on transparent huge pages;
calls are timed in turns with the peer and the floors' probes (common.Floors: the extension's
native read-bandwidth and float32 FMA probes). The paged call's two floors: the bytes it must read
(each shared block once) over the read rate, and its 2 x H_q x D multiply-adds per key over the FMA
peak (sharing saves reads, not arithmetic); "of roofline" is the larger over its time, "peer
roofline" the same for the peer. Each output is checked against reference_paged_attention.

    python benchmarks/bench_paged.py            # both cases, 25 rounds
    python benchmarks/bench_paged.py --quick    # fewer buffers and rounds (well under a minute)
    python benchmarks/bench_paged.py --rows 2   # L = 2 query rows per request (G x L = 8 a KV head)
"""

import argparse
import itertools

import mlx.core as mx
import numpy as np

import mlx_batched_decode as mbd

from common import Floors, decode_multiply_adds, describe_machine, machine, print_table, rotation_sets, save

H_Q, H_KV, D = 32, 8, 128
DTYPE = mx.float16
ITEMSIZE = 2


def on_huge_pages(arrays):
    mx.eval(*arrays)
    for a in arrays:
        mbd.advise_huge_pages(a)
    return arrays


def kv_bytes(lens):
    return int(np.sum(lens)) * H_KV * D * 2 * ITEMSIZE


def pool_sets(blocks, block_size, n_sets, seed, head_major=False):
    """n_sets (key_pages, value_pages) pools [blocks, block_size, H_kv, D], each its own memory:
    contiguous, or (head_major) views of [blocks, H_kv, block_size, D] buffers, whose rows of
    one head and block lie together."""
    key = mx.random.key(seed)
    shape = (blocks, H_KV, block_size, D) if head_major else (blocks, block_size, H_KV, D)
    base = mx.random.normal(shape, key=key).astype(DTYPE)
    sets = [on_huge_pages([base * (1 + 0.01 * i), base * (1 - 0.01 * i)]) for i in range(n_sets)]
    return [[mx.swapaxes(p, 1, 2) for p in kv] for kv in sets] if head_major else sets


def cycling(fn, sets):
    """fn(set) on the next set at each call, blocking until done."""
    turn = itertools.cycle(sets)
    return lambda: mx.eval(fn(next(turn)))


def max_error(out, expected):
    return float(mx.max(mx.abs(out.astype(mx.float32) - expected.astype(mx.float32))).item())


def block_tables(lens, bs, seed, shuffled=True):
    """Block tables [B, max_pages] handing out the pool's blocks in a shuffled order (or in
    order), -1 past a request's pages, and the number of blocks."""
    pages = [-(-int(n) // bs) for n in lens]
    ids = np.random.default_rng(seed).permutation(sum(pages)) if shuffled else np.arange(sum(pages))
    tables = np.full((len(lens), max(pages)), -1, np.int32)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = ids[start:start + n]
        start += n
    return tables, sum(pages)


def with_floors(row, floors, t_peer, t_paged, peer_bytes, paged_bytes, lens, L):
    """row with the paged call's floor columns and the peer's share of its own roofline."""
    multiply_adds = decode_multiply_adds(int(lens.sum()), H_Q, D, L)
    peer = floors.columns(t_peer, peer_bytes, multiply_adds)
    return row | floors.columns(t_paged, paged_bytes, multiply_adds) | {"peer_roofline": peer["roofline"]}


def no_sharing(args, floors, lens, bs, head_major, shuffled=True):
    B = len(lens)
    tables, blocks = block_tables(lens, bs, seed=1, shuffled=shuffled)
    T = tables.shape[1] * bs
    n_sets = rotation_sets(kv_bytes(lens), args.factor)
    q = mx.random.normal((B, H_Q, args.rows, D), key=mx.random.key(2)).astype(DTYPE)
    valid = mx.array(lens.astype(np.int32))
    t = mx.array(tables)
    pools = pool_sets(blocks, bs, n_sets, seed=3, head_major=head_major)
    # The dense caches hold the same rows as the pools: [B, H_kv, T, D] gathered from the tables,
    # made contiguous (head-major), as a dense cache is.
    gather = lambda p: mx.contiguous(mx.transpose(  # noqa: E731
        mx.reshape(mx.take(p, mx.maximum(t, 0).flatten(), 0), (B, T, H_KV, D)), (0, 2, 1, 3)))
    dense = [on_huge_pages([gather(k), gather(v)]) for k, v in pools]
    paged_fn = lambda kv: mbd.paged_decode_attention(q, kv[0], kv[1], t, valid)  # noqa: E731
    dense_fn = lambda kv: mbd.batched_decode_attention(q, kv[0], kv[1], valid)  # noqa: E731
    expected = mbd.reference_paged_attention(q, *pools[0], t, valid)
    errors = {"paged": max_error(paged_fn(pools[0]), expected), "dense": max_error(dense_fn(dense[0]), expected)}
    t_dense, t_paged = floors.timed([cycling(dense_fn, dense), cycling(paged_fn, pools)], repeats=args.rounds)
    nbytes = kv_bytes(lens)
    pool = ("head-major pool view" if head_major else "contiguous pool") + ("" if shuffled else ", ids in order")
    row = {
        "case": f"no sharing, B={B}, block {bs}, {pool}", "B": B, "block_size": bs, "lens": lens.tolist(),
        "shuffled": shuffled, "sets": n_sets,
        "dense_ms": t_dense * 1e3, "paged_ms": t_paged * 1e3,
        "dense_gbs": nbytes / t_dense / 1e9, "paged_gbs": nbytes / t_paged / 1e9,
        "ratio": t_dense / t_paged, "target": 0.95 if bs > 1 else 0.9, "max_error": max(errors.values()),
    }
    return with_floors(row, floors, t_dense, t_paged, nbytes, nbytes, lens, args.rows)


def shared_prefix(args, floors, head_major):
    B, bs, prefix, own = 16, 16, 4096, 128
    lens = np.full(B, prefix + own)
    p_pages, o_pages = prefix // bs, own // bs
    q = mx.random.normal((B, H_Q, args.rows, D), key=mx.random.key(4)).astype(DTYPE)
    valid = mx.array(lens.astype(np.int32))
    # Shared: blocks 0 .. p_pages - 1 hold the prefix, then each request's own blocks.
    shared_tables = np.concatenate(
        [np.tile(np.arange(p_pages), (B, 1)), p_pages + np.arange(B * o_pages).reshape(B, o_pages)], 1)
    # Private: request b's copy of the prefix, then its own blocks, b * (p_pages + o_pages) on.
    private_tables = np.arange(B * (p_pages + o_pages)).reshape(B, -1)
    blocks_shared, blocks_private = p_pages + B * o_pages, B * (p_pages + o_pages)
    n_private = rotation_sets(blocks_private * bs * H_KV * D * 2 * ITEMSIZE, args.factor)
    n_shared = rotation_sets(blocks_shared * bs * H_KV * D * 2 * ITEMSIZE, args.factor)
    shared = pool_sets(blocks_shared, bs, n_shared, seed=5, head_major=head_major)
    # The private pools hold the same rows as the shared ones, the prefix copied per request.
    copy = mx.concatenate([mx.array(np.tile(np.arange(p_pages), (B, 1))),
                           mx.array(shared_tables[:, p_pages:])], 1).flatten()
    # A head-major pool is copied as its buffer ([NB, H_kv, BS, D]) and viewed as the shared one.
    axes = (lambda p: mx.swapaxes(p, 1, 2)) if head_major else (lambda p: p)
    private = [[axes(p) for p in on_huge_pages([mx.take(axes(k), copy, 0), mx.take(axes(v), copy, 0)])]
               for k, v in shared[:n_private]]
    ts, tp = mx.array(shared_tables.astype(np.int32)), mx.array(private_tables.astype(np.int32))
    shared_fn = lambda kv: mbd.paged_decode_attention(q, kv[0], kv[1], ts, valid)  # noqa: E731
    private_fn = lambda kv: mbd.paged_decode_attention(q, kv[0], kv[1], tp, valid)  # noqa: E731
    expected = mbd.reference_paged_attention(q, *shared[0], ts, valid)
    before = mbd._ext.cpu_shared_items()
    errors = [max_error(shared_fn(shared[0]), expected), max_error(private_fn(private[0]), expected)]
    assert mbd._ext.cpu_shared_items() > before, "the shared prefix was not read once"
    t_private, t_shared = floors.timed(
        [cycling(private_fn, private), cycling(shared_fn, shared)], repeats=args.rounds)
    nbytes = kv_bytes(lens)
    row = {
        "case": "16 x (4096 shared + 128 own), " + ("head-major pool view" if head_major else "contiguous pool"),
        "B": B, "sets": [n_private, n_shared],
        "dense_ms": t_private * 1e3, "paged_ms": t_shared * 1e3,
        "dense_gbs": nbytes / t_private / 1e9, "paged_gbs": nbytes / t_shared / 1e9,
        "ratio": t_private / t_shared, "target": 6.0, "max_error": max(errors),
    }
    shared_bytes = blocks_shared * bs * H_KV * D * 2 * ITEMSIZE
    return with_floors(row, floors, t_private, t_shared, nbytes, shared_bytes, lens, args.rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a third of the LLC of buffers, 5 rounds")
    parser.add_argument("--rows", type=int, default=1, help="query rows per request (L, default 1)")
    parser.add_argument("--output", help="results/<name>.json (default bench_paged, or bench_paged_quick)")
    args = parser.parse_args()
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    args.factor, args.rounds = (1 / 3, 5) if args.quick else (3, 25)
    floors = Floors()
    info = machine() | floors.describe
    print(describe_machine(info))
    print(floors.header(), flush=True)
    batches = [np.random.default_rng(8).integers(512, 2049, size=8), np.array([8192])]
    # At block 1 a head-major pool is the contiguous one.
    layouts = [(16, False), (16, True), (1, False)]
    rows = [no_sharing(args, floors, lens, bs, head_major) for lens in batches for bs, head_major in layouts]
    # The same pool with its block ids in order: what the shuffling itself costs.
    rows += [no_sharing(args, floors, batches[0], bs, False, shuffled=False) for bs in (16, 1)]
    rows += [shared_prefix(args, floors, head_major) for head_major in (False, True)]
    print(describe_machine(info))
    print(f"L = {args.rows} query rows per request; (a) peer = dense op on [B, H_kv, T, D]; (b) peer = paged op"
          " with private prefix copies")
    print_table(rows, [
        ("case", "case", "{}"), ("dense_ms", "peer ms", "{:.3f}"), ("paged_ms", "paged ms", "{:.3f}"),
        ("dense_gbs", "peer GB/s", "{:.1f}"), ("paged_gbs", "paged GB/s", "{:.1f}"),
        ("bw_gbs", "probe GB/s", "{:.1f}"), ("ratio", "paged / peer", "{:.2f}x"), ("target", "target", "{:.2f}x"),
        *Floors.COLUMNS, ("peer_roofline", "peer roofline", "{:.0%}"), ("max_error", "max err", "{:.1e}"),
    ])
    path = save(args.output or "bench_paged" + ("_quick" if args.quick else ""), {"machine": info, "quick": args.quick,
                                                                   "L": args.rows, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
