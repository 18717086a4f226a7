"""End-to-end paged decode benchmark: 16 prompts sharing a long prefix, prefill and decode.

Runs ``BatchedDecoder`` on the same random-weight model (``bench_decode.CONFIG``: a Llama with
Llama-3-8B attention heads, H_q 32, H_kv 8, head dim 128, 4 small layers, float32) and the same
requests in three ways:

- ``slot``: ``kv_layout="slot"`` (the default): every prompt prefilled in full, one cache row
  per request, ``batched_decode_attention``;
- ``paged``: ``kv_layout="paged"``, block size 16, prefix sharing: the shared prefix is
  prefilled once, the other requests take its blocks and prefill only their own tokens, and
  ``paged_decode_attention`` reads the shared blocks through the block tables;
- ``paged, no sharing``: ``kv_layout="paged", prefix_sharing=False``: the layout alone, its
  pools token-major (the default: vLLM's and SGLang's ``[N, block_size, H_kv, D]``);
- ``paged, no sharing, head-major``: the same with ``pool_layout="head-major"``, to compare the
  two pool layouts.

All prompts are ``--prefix`` shared tokens followed by ``--own`` tokens of their own. The B
requests are added at once and decoded for ``--max-tokens`` greedy tokens each: ``prefill s`` is
the time of the steps that fed prompt chunks (beside the decode tokens of requests whose prompts
were in), ``tok/s`` the tokens / time of the steps of decode tokens alone (``DecodeStats``); with
the paged layout a request waits for the prefix blocks an earlier prompt is writing.
``shared items``: work items in which the CPU kernel read blocks shared by several requests once
for all of them (its cells are 512 keys, so only a prefix of 512 tokens or more is read once).
The runs alternate in order over ``--repeats`` rounds (default 1: on this machine one slot
prefill of 16 x 1056 tokens takes minutes) and the table shows each path's median.
Every path's greedy tokens must equal the slot path's, token for token.

    python benchmarks/bench_paged_decode.py           # prefix 1024, own 32, B 16, 32 tokens
    python benchmarks/bench_paged_decode.py --quick   # prefix 64, own 16, B 16, 8 tokens, no
                                                      # "no sharing" rows
"""

import argparse
import random
import sys

import mlx.core as mx
import numpy as np

from mlx_batched_decode import BatchedDecoder, _ext
from mlx_batched_decode.tools.random_model import random_model

from bench_decode import CONFIG
from common import machine, print_table, save

PATHS = {
    "slot": dict(kv_layout="slot"),
    "paged": dict(kv_layout="paged", block_size=16, prefix_sharing=True),
    "paged, no sharing": dict(kv_layout="paged", block_size=16, prefix_sharing=False),
    "paged, no sharing, head-major": dict(
        kv_layout="paged", block_size=16, prefix_sharing=False, pool_layout="head-major"
    ),
}


def run(model, prompts, max_tokens, options):
    """(tokens per request, DecodeStats, peak blocks, cache bytes, shared-block work items of
    the CPU kernel during decode)."""
    decoder = BatchedDecoder(model, **options)
    uids = [decoder.add_request(p, max_tokens) for p in prompts]
    tokens = {uid: [] for uid in uids}
    peak_blocks, cache_bytes = decoder.stats.blocks_in_use, 0
    shared_items = _ext.cpu_shared_items()
    while decoder.num_active:
        result = decoder.step()
        for uid, emitted in result.tokens.items():
            tokens[uid] += emitted
        peak_blocks = max(peak_blocks, decoder.stats.blocks_in_use)
        if decoder.paged_cache is not None:
            cache_bytes = decoder.paged_cache.nbytes
        else:
            cache_bytes = sum(c.nbytes for c in decoder.slot_caches)
    stats = decoder.stats
    assert stats.generated_tokens == len(prompts) * max_tokens
    shared_items = _ext.cpu_shared_items() - shared_items
    return [tokens[u] for u in uids], stats, peak_blocks, cache_bytes, shared_items


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="prefix 64, own 16, 8 tokens, slot and paged only")
    parser.add_argument("--prefix", type=int, help="shared prompt tokens (default 1024, quick 64)")
    parser.add_argument("--own", type=int, help="tokens of each prompt after the prefix (default 32, quick 16)")
    parser.add_argument("--batch", type=int, default=16, help="requests (default 16)")
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default 32, quick 8)")
    parser.add_argument("--repeats", type=int, help="rounds over the paths (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    parser.add_argument("--output", help="results/<name>.json (default paged_decode, quick paged_decode_quick)")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    prefix_len = args.prefix or (64 if args.quick else 1024)
    own_len = args.own or (16 if args.quick else 32)
    max_tokens = args.max_tokens or (8 if args.quick else 32)
    repeats = args.repeats or 1
    paths = {n: o for n, o in PATHS.items() if not (args.quick and "no sharing" in n)}
    info = machine() | {"cpu_isa": _ext.cpu_isa(), "threads": _ext.cpu_threads()}
    print(f"{info['cpu']}, {info['cores']} cores, kernel {info['cpu_isa']}")
    print(f"model: {CONFIG}, float32, random weights (seed {args.seed})")
    print(
        f"{args.batch} prompts = {prefix_len} shared + {own_len} own tokens, "
        f"{max_tokens} new tokens each, greedy, {repeats} round(s)"
    )

    rng = random.Random(args.seed)
    vocab = CONFIG["vocab_size"]
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(own_len)] for _ in range(args.batch)]
    model = random_model(CONFIG, seed=args.seed)
    # Warm-up: the first call of each path pays one-time costs kept out of the table.
    for options in paths.values():
        run(model, [prompts[0][:40], prompts[1][:40]], 2, options)

    samples = {name: [] for name in paths}
    tokens = {}
    for round_ in range(repeats):
        order = list(paths) if round_ % 2 == 0 else list(paths)[::-1]
        for name in order:
            out, stats, peak, nbytes, shared = run(model, prompts, max_tokens, paths[name])
            tokens[name] = out
            samples[name].append((stats, peak, nbytes, shared))
            print(
                f"round {round_ + 1} {name}: prefill {stats.prefill_seconds:.2f} s, "
                f"{stats.decode_tokens_per_second:.1f} tok/s",
                flush=True,
            )

    rows = []
    for name, runs in samples.items():
        stats, peak, nbytes, shared = runs[-1]
        rows.append(
            {
                "path": name,
                "prefill_s": float(np.median([s.prefill_seconds for s, *_ in runs])),
                "prefilled": stats.prompt_tokens - stats.prefix_hit_tokens,
                "prefix_hits": stats.prefix_hit_tokens,
                "decode_s": float(np.median([s.decode_seconds for s, *_ in runs])),
                "tok_s": float(np.median([s.decode_tokens_per_second for s, *_ in runs])),
                "peak_blocks": peak if name != "slot" else None,
                "cache_mib": nbytes / 2**20,
                "shared_items": shared,
                "same_as_slot": tokens[name] == tokens["slot"],
            }
        )
    slot = rows[0]
    for row in rows:
        row["prefill_speedup"] = slot["prefill_s"] / row["prefill_s"]
        row["decode_speedup"] = row["tok_s"] / slot["tok_s"]
    print("\nSteps that fed prompts, then steps of decode tokens alone (medians):")
    print_table(
        rows,
        [
            ("path", "path", "{}"), ("prefilled", "prefilled tok", "{}"),
            ("prefix_hits", "prefix hits", "{}"), ("prefill_s", "prefill s", "{:.2f}"),
            ("prefill_speedup", "prefill x", "{:.2f}"), ("tok_s", "tok/s", "{:.1f}"),
            ("decode_speedup", "decode x", "{:.2f}"), ("peak_blocks", "blocks", "{}"),
            ("cache_mib", "cache MiB", "{:.1f}"), ("shared_items", "shared items", "{}"),
            ("same_as_slot", "= slot", "{}"),
        ],
    )
    path = save(
        args.output or ("paged_decode_quick" if args.quick else "paged_decode"),
        {
            "machine": info, "config": CONFIG, "dtype": "float32", "batch": args.batch,
            "prefix": prefix_len, "own": own_len, "max_tokens": max_tokens, "repeats": repeats,
            "rows": rows,
        },
    )
    print(f"\nsaved {path}")
    if not all(r["same_as_slot"] for r in rows):
        print("FAILED: greedy tokens differ from the slot path", file=sys.stderr)
        return 1
    print("OK: every request's greedy tokens are identical across the paths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
