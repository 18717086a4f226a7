"""End-to-end decode benchmark: tokens/s of three batched greedy decoders on one model.

Paths, on the same random-weight model and the same requests:

- ``slot``: this project, ``BatchedDecoder`` (slot cache + ``batched_decode_attention``);
- ``seed``: ``BatchedDecoder(attention="seed")``: per-request caches, pad, concatenate, a mask
  rebuilt per layer, masked ``mx.fast.scaled_dot_product_attention``;
- ``mlx-lm``: mlx-lm's ``BatchGenerator``, the engine of ``batch_generate``.

The model (``CONFIG``): a Llama with Llama-3-8B attention heads (H_q 32, H_kv 8, head dim 128),
4 layers, hidden 128, MLP 256, vocab 1024, float32 (as the main job's demo model). The hidden
size and vocabulary are small because MLX's float32 CPU matmuls run at about 2 GFLOPS on this
machine: with them small, attention over long contexts is a large part of a step. Per token and
layer the cache holds 8 KiB of keys and values.

Contexts are not prefilled: on this machine, prefilling one 2048-token prompt took 133 s with
these heads (measured with hidden 512), so 32 prompts of up to 4096 tokens per path would take
hours. Each request instead starts from a cache of its context length
filled with seeded random keys/values, the same for every path: the decoders get it through
their own cache-loading code (``BatchedDecoder.add_prefilled_request``; mlx-lm's ``KVCache``
objects handed to ``BatchGenerator``). The first step of ours feeds each prompt's last token.
Decode speed depends on the context lengths, not on the cached values, and every path decodes
from the same state, so their greedy tokens must agree token for token.

Only decode steps are timed, each call on its own: ``tok/s`` = generated tokens / time of all
steps; ``steady tok/s`` leaves out the first step (where mlx-lm merges the requests' caches into
its batch cache). Every request's tokens are compared across the three paths. mlx-lm runs as
``batch_generate(..., prompt_caches=..., completion_batch_size=B, prefill_batch_size=B)`` does,
so all B requests decode together as in the other paths.

With ``--kv-bits 8 4`` it also runs ``BatchedDecoder(kv_bits=8)`` and ``(kv_bits=4)`` (a quantized
slot cache read by ``quantized_batched_decode_attention``, group size ``--kv-group-size``) from
the same contexts, quantized as mlx-lm's ``QuantizedKVCache`` stores them; their greedy tokens
are checked against mlx-lm's single-request ``generate_step`` from a ``QuantizedKVCache`` holding
the same quantized contexts (``kv_bits``, ``quantized_kv_start=0``), not against the unquantized
paths, whose tokens may differ (results/decode_quantized.json).

With ``--speculative`` it compares ``BatchedDecoder`` without and with a draft model instead
(``results/decode_speculative.json``): tokens/s and the draft's acceptance rate for each
``--num-draft-tokens`` k. The draft is the target's first ``--draft-layers`` layers, sharing its
embeddings, final norm and head. In a random-weight target every layer moves the argmax, so such
a draft would almost never agree with it (1-3% of drafts accepted); the target's later layers
therefore have their output projections (attention ``o_proj``, MLP ``down_proj``) scaled by
``--tail-scale``, which sets how often the draft agrees (1.0: the target as built). The acceptance
rate is thus a chosen property of this synthetic pair, not a prediction for real models; what the
run measures is the cost of a round (k + 1 draft steps and one target pass of k + 1 tokens per
request) against the tokens it yields.
Both runs in a mode decode the same (scaled) target from the same state, so their greedy tokens
must agree token for token.

With ``--arrivals`` it replays requests arriving over time through ``BatchedDecoder`` instead,
prompts prefilled (``arrivals.py``: a burst of long prompts beside decoding requests, a seeded
trace of 32 requests, and prefill alone against mlx-lm's ``batch_generate``), on a 2-layer Llama
of hidden 256 (``arrivals.CONFIG``; ``results/decode_arrivals.json``). ``--budget-sweep`` times,
on that model, a step of 4 requests' decode tokens and one that also feeds a prompt chunk filling
each ``max_step_tokens`` (``results/decode_budget_sweep.json``).

    python benchmarks/bench_decode.py            # B in {1, 8, 32}, contexts 256-4096 (minutes)
    python benchmarks/bench_decode.py --quick    # B in {1, 8}, contexts 256-1024, 4 tokens
    python benchmarks/bench_decode.py --batch-sizes 8 --contexts 512 2048   # one chosen case
    python benchmarks/bench_decode.py --batch-sizes 8 --contexts 512 2048 --kv-bits 8 4
    python benchmarks/bench_decode.py --speculative   # B in {1, 8}, contexts 256-1024, 16 tokens,
                                                      # k in {2, 4}, 1-layer draft, tail scale 0.05
    python benchmarks/bench_decode.py --arrivals      # burst, trace, prefill (several minutes)
    python benchmarks/bench_decode.py --budget-sweep 64 128 256 512 1024   # step times per budget
"""

import argparse
import gc
import io
import sys
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_batched_decode import BatchedDecoder, _ext
from mlx_batched_decode.tools.progress import ProgressBar
from mlx_batched_decode.tools.random_model import random_model

import arrivals
from common import machine, print_table, save

CONFIG = dict(
    model_type="llama",
    hidden_size=128,
    num_hidden_layers=4,
    intermediate_size=256,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    vocab_size=1024,
    tie_word_embeddings=False,
)


class Requests:
    """Prompts of the given context lengths and their seeded cache contents."""

    def __init__(self, lengths, seed=0):
        self.seed = seed
        rng = np.random.default_rng(seed)
        # A prompt is its context plus the token that enters decoding; only that last token is
        # read, the context's keys/values come from ``kv``.
        self.prompts = [[int(t) for t in rng.integers(0, CONFIG["vocab_size"], n + 1)] for n in lengths]
        self._index = {tuple(p[:-1]): i for i, p in enumerate(self.prompts)}

    def kv(self, index):
        """Per layer, the ``[1, H_kv, context, D]`` keys and values of request ``index``."""
        shape = (2, 1, CONFIG["num_key_value_heads"], len(self.prompts[index]) - 1, CONFIG["head_dim"])
        return [
            tuple(mx.random.normal(shape, key=mx.random.key((self.seed * 1000 + index) * 100 + layer)))
            for layer in range(CONFIG["num_hidden_layers"])
        ]


def quantize(x, bits, group_size):
    """``x`` as the ``(packed, scales, biases)`` mlx-lm's ``QuantizedKVCache`` stores."""
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def run_ours(
    model, requests, batch, max_tokens, path, stream=sys.stderr, draft=None, num_draft_tokens=2,
    kv_bits=None, kv_group_size=64,
):
    """(tokens per request, seconds of each step, tokens of each step, DecodeStats) of
    ``BatchedDecoder`` on the first ``batch`` requests, speculative with ``draft``, quantized with
    ``kv_bits``."""
    decoder = BatchedDecoder(
        model, attention=path, draft_model=draft, num_draft_tokens=num_draft_tokens,
        kv_bits=kv_bits, kv_group_size=kv_group_size,
    )
    # Each request's context loaded, not prefilled; a draft with fewer layers gets the first of
    # them (it shares the target's first layers).
    uids = [
        decoder.add_prefilled_request(
            p, max_tokens, requests.kv(i),
            draft_keys_values=None if draft is None else requests.kv(i)[: len(draft.layers)],
        )
        for i, p in enumerate(requests.prompts[:batch])
    ]
    name = path if draft is None else f"{path}, draft k={num_draft_tokens}"
    name = name if kv_bits is None else f"{name} {kv_bits}-bit"
    bar = ProgressBar(batch * max_tokens, f"tokens, B={batch} {name}", stream=stream)
    tokens = {uid: [] for uid in uids}
    times, counts = [], []
    while decoder.num_active:
        start = time.perf_counter()
        result = decoder.step()
        times.append(time.perf_counter() - start)
        for uid, emitted in result.tokens.items():
            tokens[uid] += emitted
        counts.append(sum(len(t) for t in result.tokens.values()))
        bar.update(counts[-1])
    bar.close()
    assert decoder.stats.generated_tokens == batch * max_tokens
    return [tokens[uid] for uid in uids], times, counts, decoder.stats


def run_mlx_lm(model, requests, batch, max_tokens, stream=sys.stderr):
    """The same for mlx-lm's ``BatchGenerator``, all requests in one batch, no stop tokens."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import KVCache

    caches = []
    for i in range(batch):
        layers = [KVCache() for _ in range(CONFIG["num_hidden_layers"])]
        for cache, (keys, values) in zip(layers, requests.kv(i)):
            cache.update_and_fetch(keys, values)
        caches.append(layers)
    mx.eval([c.state for layers in caches for c in layers])
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=batch, prefill_batch_size=batch)
    uids = gen.insert([p[-1:] for p in requests.prompts[:batch]], [max_tokens] * batch, caches=caches)
    del caches
    bar = ProgressBar(batch * max_tokens, f"tokens, B={batch} mlx-lm", stream=stream)
    tokens = {uid: [] for uid in uids}
    times, counts = [], []
    while True:
        start = time.perf_counter()
        responses = gen.next_generated()
        if not responses:
            break
        times.append(time.perf_counter() - start)
        for r in responses:
            tokens[r.uid].append(r.token)
        counts.append(len(responses))
        bar.update(len(responses))
    gen.close()
    bar.close()
    return [tokens[uid] for uid in uids], times, counts, None


def mlx_lm_quantized(model, requests, batch, max_tokens, bits, group_size):
    """mlx-lm's single-request greedy decode of each of the first ``batch`` requests from a
    ``QuantizedKVCache`` holding its quantized context: the reference of the quantized paths."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    out = []
    for i in range(batch):
        caches = []
        for keys, values in requests.kv(i):
            cache = QuantizedKVCache(group_size=group_size, bits=bits)
            cache.keys, cache.values = quantize(keys, bits, group_size), quantize(values, bits, group_size)
            cache.offset = keys.shape[2]
            caches.append(cache)
        steps = generate_step(
            mx.array(requests.prompts[i][-1:]), model, max_tokens=max_tokens, prompt_cache=caches,
            kv_bits=bits, kv_group_size=group_size, quantized_kv_start=0,
        )
        out.append([token for token, _ in steps])
    return out


def table_rows(runs, batch, lengths, references=None):
    """One row per run; ``runs``: path -> (tokens, step seconds, step token counts, stats);
    ``references``: path -> the tokens a quantized path is checked against, instead of the slot
    path's."""
    references = references or {}
    expected = runs["slot"][0]
    rows = []
    for path, (tokens, times, counts, stats) in runs.items():
        generated = sum(len(t) for t in tokens)
        steady = sum(times[1:])
        rows.append(
            {
                "B": batch, "path": path, "contexts": f"{min(lengths)}-{max(lengths)}",
                "context_tokens": sum(lengths), "generated": generated, "steps": len(times),
                "decode_s": sum(times), "first_step_s": times[0],
                "tok_s": generated / sum(times),
                "steady_tok_s": (generated - counts[0]) / steady if steady > 0 else None,
                "acceptance": stats.acceptance_rate if stats and stats.draft_tokens else None,
                "same_as_slot": sum(t == e for t, e in zip(tokens, references.get(path, expected))),
            }
        )
    return rows


def bench_batch(model, requests, batch, max_tokens, kv_bits=(), kv_group_size=64):
    lengths = [len(p) - 1 for p in requests.prompts[:batch]]
    runs, references = {}, {}
    for path in ("slot", "seed", "mlx-lm", *kv_bits):
        if path == "mlx-lm":
            runs[path] = run_mlx_lm(model, requests, batch, max_tokens)
        elif isinstance(path, int):
            name = f"slot {path}-bit"
            runs[name] = run_ours(model, requests, batch, max_tokens, "slot", kv_bits=path, kv_group_size=kv_group_size)
            references[name] = mlx_lm_quantized(model, requests, batch, max_tokens, path, kv_group_size)
        else:
            runs[path] = run_ours(model, requests, batch, max_tokens, path)
        gc.collect()
        mx.clear_cache()
    rows = table_rows(runs, batch, lengths, references)
    for row in rows:
        row["slot_speedup"] = rows[0]["steady_tok_s"] / row["steady_tok_s"] if row["steady_tok_s"] else None
    return rows, {path: run[0] for path, run in runs.items()}


def speculative_pair(seed, draft_layers, tail_scale):
    """The target (``CONFIG``, layers after the first ``draft_layers`` with their output
    projections scaled by ``tail_scale``) and a draft made of its first ``draft_layers`` layers."""
    target = random_model(CONFIG, seed=seed)
    for layer in target.layers[draft_layers:]:
        layer.self_attn.o_proj.weight *= tail_scale
        layer.mlp.down_proj.weight *= tail_scale
    mx.eval(target.parameters())
    draft = random_model(dict(CONFIG, num_hidden_layers=draft_layers), seed=seed)
    shared = dict(tree_flatten(target.parameters()))
    draft.load_weights([(name, shared[name]) for name, _ in tree_flatten(draft.parameters())])
    mx.eval(draft.parameters())
    return target, draft


def bench_speculative(target, draft, requests, batch, max_tokens, draft_counts):
    """``BatchedDecoder`` on the first ``batch`` requests without a draft, then with ``draft``
    proposing k tokens per round for each k in ``draft_counts``."""
    lengths = [len(p) - 1 for p in requests.prompts[:batch]]
    runs = {"slot": run_ours(target, requests, batch, max_tokens, "slot")}
    for k in draft_counts:
        gc.collect()
        mx.clear_cache()
        runs[f"draft k={k}"] = run_ours(
            target, requests, batch, max_tokens, "slot", draft=draft, num_draft_tokens=k
        )
    rows = table_rows(runs, batch, lengths)
    for row in rows:
        row["speedup"] = row["steady_tok_s"] / rows[0]["steady_tok_s"] if row["steady_tok_s"] else None
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B in {1, 8}, contexts 256-1024, 4 tokens")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default 1 8 32 (quick, speculative 1 8)")
    parser.add_argument(
        "--contexts", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="context length range (default 256 4096, quick and speculative 256 1024)",
    )
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default 8, quick 4, speculative 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, contexts and caches")
    parser.add_argument(
        "--output",
        help="results/<name>.json (default decode, with --kv-bits decode_quantized, speculative decode_speculative)",
    )
    parser.add_argument(
        "--kv-bits", type=int, nargs="+", choices=(4, 8), default=[],
        help="also decode with a quantized cache of these bits (BatchedDecoder(kv_bits=...))",
    )
    parser.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64, help="default 64")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", action="store_true", help="compare decoding without and with a draft model")
    spec.add_argument("--num-draft-tokens", type=int, nargs="+", default=[2, 4], help="k values (default 2 4)")
    spec.add_argument("--draft-layers", type=int, default=1, help="the draft's layers (default 1)")
    spec.add_argument(
        "--tail-scale", type=float, default=0.05,
        help="scale of the target's output projections after the draft's layers (default 0.05)",
    )
    arrivals_group = parser.add_argument_group("requests arriving over time")
    arrivals_group.add_argument("--arrivals", action="store_true", help="replay the arrival scenarios")
    arrivals_group.add_argument("--arrival-rate", type=float, default=0.5, help="the trace's requests/s (default 0.5)")
    arrivals_group.add_argument("--budget-sweep", type=int, nargs="+", metavar="TOKENS",
                                help="time steps of decode tokens and a prompt chunk per max_step_tokens instead")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    short = args.quick or args.speculative
    batches = args.batch_sizes or ((1, 8) if short else (1, 8, 32))
    low, high = args.contexts or ((256, 1024) if short else (256, 4096))
    max_tokens = args.max_tokens or (16 if args.speculative else 4 if args.quick else 8)
    info = machine() | {"cpu_isa": _ext.cpu_isa(), "threads": _ext.cpu_threads()}
    print(f"{info['cpu']}, {info['cores']} cores, kernel {info['cpu_isa']}")
    if args.budget_sweep:
        return main_budget_sweep(args, info)
    if args.arrivals:
        return main_arrivals(args, info)
    print(f"model: {CONFIG}, float32, random weights (seed {args.seed})")

    # The B=b batch is the first b requests, so all batches share one set of contexts.
    lengths = np.random.default_rng(args.seed).integers(low, high + 1, size=max(batches))
    requests = Requests([int(n) for n in lengths], seed=args.seed)
    print(f"contexts {low}-{high} tokens, {max_tokens} new tokens per request, greedy")
    warm = Requests([300, 17], seed=args.seed + 1)
    if args.speculative:
        return main_speculative(args, info, batches, (low, high), max_tokens, requests, warm)

    model = random_model(CONFIG, seed=args.seed)
    # Warm-up: the first call of each path pays one-time costs kept out of the table.
    for path in ("slot", "seed"):
        run_ours(model, warm, 2, 2, path, stream=io.StringIO())
    for bits in args.kv_bits:
        run_ours(model, warm, 2, 2, "slot", stream=io.StringIO(), kv_bits=bits, kv_group_size=args.kv_group_size)
    run_mlx_lm(model, warm, 2, 2, stream=io.StringIO())
    if args.kv_bits:
        print(
            f"quantized paths: kv_bits {args.kv_bits}, group size {args.kv_group_size}; "
            "'= slot' counts their requests equal to mlx-lm's single-request quantized decode"
        )

    rows, tokens = [], {}
    for batch in batches:
        batch_rows, tokens[batch] = bench_batch(model, requests, batch, max_tokens, args.kv_bits, args.kv_group_size)
        rows += batch_rows
        print(
            f"B={batch}: " + ", ".join(f"{r['path']} {r['steady_tok_s']:.1f} tok/s" for r in batch_rows),
            flush=True,
        )

    print("\nDecode only (contexts loaded, not prefilled); every step counts, steady = steps 2..:")
    print_table(
        rows,
        [
            ("B", "B", "{}"), ("path", "path", "{}"), ("contexts", "contexts", "{}"),
            ("generated", "tokens", "{}"), ("decode_s", "decode s", "{:.2f}"),
            ("first_step_s", "1st step s", "{:.3f}"), ("tok_s", "tok/s", "{:.1f}"),
            ("steady_tok_s", "steady tok/s", "{:.1f}"), ("slot_speedup", "slot x", "{:.2f}"),
            ("same_as_slot", "= slot", "{}"),
        ],
    )
    mismatched = [(r["B"], r["path"]) for r in rows if r["same_as_slot"] != r["B"]]
    path = save(
        args.output or ("decode_quantized" if args.kv_bits else "decode"),
        {
            "machine": info, "config": CONFIG, "dtype": "float32", "max_tokens": max_tokens,
            "context_range": [low, high], "kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size,
            "rows": rows, "mismatched": mismatched,
        },
    )
    print(f"\nsaved {path}")
    if mismatched:
        print(f"FAILED: greedy tokens differ from the slot path (quantized: mlx-lm's) for {mismatched}", file=sys.stderr)
        return 1
    print("OK: every request's greedy tokens are identical across the three paths")
    if args.kv_bits:
        print("OK: the quantized paths' tokens equal mlx-lm's single-request decode at the same settings")
    return 0


def main_arrivals(args, info):
    print(f"model: {arrivals.CONFIG}, float32, random weights (seed {args.seed})")
    model = random_model(arrivals.CONFIG, seed=args.seed)
    warm = arrivals.prefill_trace(arrivals.CONFIG["vocab_size"], args.seed + 1, count=2, prompts=(100, 200))
    arrivals.replay(BatchedDecoder(model), warm)
    arrivals.mlx_lm_prefill(model, warm)
    rows = arrivals.run_scenarios(lambda: BatchedDecoder(model), model, args.seed, args.arrival_rate)
    print()
    print_table(rows, [
        ("scenario", "scenario", "{}"), ("requests", "requests", "{}"), ("seconds", "seconds", "{:.1f}"),
        ("step_ms", "decode step ms", "{:.1f}"), ("full_step_ms", "full step ms", "{:.0f}"),
        ("largest_gap_s", "largest gap s", "{:.2f}"), ("gap_over_full_step", "gap / full step", "{:.2f}"),
        ("ttft_p50_s", "ttft p50 s", "{:.2f}"), ("ttft_p99_s", "ttft p99 s", "{:.2f}"),
        ("itl_p50_s", "itl p50 s", "{:.3f}"), ("itl_p99_s", "itl p99 s", "{:.3f}"),
        ("tok_s", "prompt tok/s", "{:.0f}"), ("peer_tok_s", "mlx-lm tok/s", "{:.0f}"),
    ])
    path = save(args.output or "decode_arrivals", {
        "machine": info, "config": arrivals.CONFIG, "dtype": "float32", "arrival_rate": args.arrival_rate,
        "rows": rows,
    })
    print(f"\nsaved {path}")
    return 0


def main_budget_sweep(args, info):
    print(f"model: {arrivals.CONFIG}, float32, random weights (seed {args.seed})")
    model = random_model(arrivals.CONFIG, seed=args.seed)
    BatchedDecoder(model).generate([[1, 2, 3]], 2)
    rows = arrivals.budget_sweep(lambda b: BatchedDecoder(model, max_step_tokens=b), args.budget_sweep, args.seed)
    print()
    print_table(rows, [
        ("budget", "max_step_tokens", "{}"), ("decode_ms", "decode step ms", "{:.1f}"),
        ("chunk", "chunk tokens", "{}"), ("mixed_ms", "step with chunk ms", "{:.0f}"),
        ("gap_over_decode", "x decode step", "{:.1f}"), ("prompt_tok_s", "prompt tok/s", "{:.0f}"),
    ])
    path = save(args.output or "decode_budget_sweep", {
        "machine": info, "config": arrivals.CONFIG, "dtype": "float32", "rows": rows,
    })
    print(f"\nsaved {path}")
    return 0


def main_speculative(args, info, batches, context_range, max_tokens, requests, warm):
    target, draft = speculative_pair(args.seed, args.draft_layers, args.tail_scale)
    print(
        f"speculative: draft = the target's first {args.draft_layers} layer(s); the target's later "
        f"layers' output projections scaled by {args.tail_scale}; k in {args.num_draft_tokens}"
    )
    # Warm-up: the first call of each path pays one-time costs kept out of the table.
    run_ours(target, warm, 2, 4, "slot", stream=io.StringIO())
    for k in args.num_draft_tokens:
        run_ours(target, warm, 2, 4, "slot", stream=io.StringIO(), draft=draft, num_draft_tokens=k)

    rows = []
    for batch in batches:
        batch_rows = bench_speculative(target, draft, requests, batch, max_tokens, args.num_draft_tokens)
        rows += batch_rows
        print(
            f"B={batch}: " + ", ".join(f"{r['path']} {r['steady_tok_s']:.1f} tok/s" for r in batch_rows),
            flush=True,
        )

    print("\nDecode only (contexts loaded, not prefilled); a step is a round with a draft; steady = steps 2..:")
    print_table(
        rows,
        [
            ("B", "B", "{}"), ("path", "path", "{}"), ("contexts", "contexts", "{}"),
            ("generated", "tokens", "{}"), ("steps", "steps", "{}"), ("decode_s", "decode s", "{:.2f}"),
            ("acceptance", "accepted", "{:.0%}"), ("tok_s", "tok/s", "{:.1f}"),
            ("steady_tok_s", "steady tok/s", "{:.1f}"), ("speedup", "vs no draft", "{:.2f}x"),
            ("same_as_slot", "= no draft", "{}"),
        ],
    )
    mismatched = [(r["B"], r["path"]) for r in rows if r["same_as_slot"] != r["B"]]
    path = save(
        args.output or "decode_speculative",
        {
            "machine": info, "config": CONFIG, "dtype": "float32", "max_tokens": max_tokens,
            "context_range": list(context_range), "draft_layers": args.draft_layers,
            "tail_scale": args.tail_scale, "num_draft_tokens": args.num_draft_tokens,
            "rows": rows, "mismatched": mismatched,
        },
    )
    print(f"\nsaved {path}")
    if mismatched:
        print(f"FAILED: greedy tokens differ from decoding without a draft for {mismatched}", file=sys.stderr)
        return 1
    print("OK: every request's greedy tokens are identical with and without the draft")
    return 0


if __name__ == "__main__":
    sys.exit(main())
