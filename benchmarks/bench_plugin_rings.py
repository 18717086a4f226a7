"""mlx-lm plug-in on wrapped rings: decode tokens/s of a gpt-oss-shaped model through ``batch_generate``.

Three paths decode the same requests from the same state, greedy, with mlx-lm's own
``batch_generate`` (all B requests prefilled and decoding together):

- ``mlx-lm``: the plug-in off;
- ``plug-in, rings on mlx-lm``: ``enabled(wrapped_rings=False)``, the plug-in before it read
  rings: the full-attention layers on the op, the sliding-window layers on the op only until
  their ring wraps, then on mlx-lm's masked SDPA;
- ``plug-in``: ``enabled()``: every decode call on the op, wrapped rings through ``ring_offset``.

The model (``CONFIG``): gpt-oss's attention (H_q 64, H_kv 8, head dim 64, sinks, sliding
window 128 on every other layer, RoPE theta 150000) in 4 layers, with a small hidden size (128),
4 experts of 256 and a vocabulary of 1024, float32 and random weights (random sinks, as trained
ones are not zero): MLX's float32 CPU matmuls run at a few GFLOPS here, so attention is a large
part of a step. Contexts are loaded, not prefilled (as in ``bench_decode.py``: prefilling 8
prompts of 1-2k tokens with 64 query heads takes many minutes on this machine): each request's
mlx-lm caches (``KVCache`` for full layers, ``RotatingKVCache(128)`` for sliding ones, from the
model's ``make_cache``) are filled with seeded random keys/values of its context length and
passed to ``batch_generate(prompt_caches=...)`` with the request's last token as its prompt. A
sliding layer's ring is then full, so it wraps at the first decode step.

``decode tok/s`` is mlx-lm's own count: generated tokens / the time of its decode steps
(``BatchStats.decode_time``); ``x mlx-lm`` is the ratio to the mlx-lm row. ``sliding on op`` is
the share of the sliding layers' decode calls the op served (``stats().batch_rotating`` over it
plus ``rotating_wrapped``). The paths alternate over ``--rounds`` and the table shows each
path's median; every path's tokens must equal mlx-lm's, token for token, or the script exits
with status 1 after saving.

    python benchmarks/bench_plugin_rings.py            # B 8, contexts 1024-2048, 256 tokens, 3 rounds
    python benchmarks/bench_plugin_rings.py --quick    # B 4, contexts 256-512, 32 tokens, 1 round
"""

import argparse
import statistics
import sys

import mlx.core as mx
import numpy as np

import mlx_batched_decode.mlx_lm as plugin
from mlx_batched_decode import _ext
from mlx_batched_decode.tools.random_model import random_model

from common import machine, print_table, save

CONFIG = dict(
    model_type="gpt_oss",
    hidden_size=128,
    num_hidden_layers=4,
    intermediate_size=256,
    head_dim=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=128,
    rope_theta=150000,
    vocab_size=1024,
    rms_norm_eps=1e-5,
)
PATHS = {
    "mlx-lm": None,
    "plug-in, rings on mlx-lm": dict(wrapped_rings=False),
    "plug-in": dict(wrapped_rings=True),
}


class Tokenizer:
    """What ``batch_generate`` uses of a tokenizer: no end tokens, so every request runs its
    budget."""

    eos_token_ids = set()

    def decode(self, tokens):
        return ""


def build_model(seed):
    model = random_model(CONFIG, seed=seed)
    for layer in model.layers:
        layer.self_attn.sinks = 2.0 * mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(model.parameters())
    return model


def prompt_caches(model, lengths, seed):
    """Per request, the model's own mlx-lm caches holding seeded random keys/values
    ``[1, H_kv, context, D]`` in every layer. ``batch_generate`` merges them into its batch
    caches without changing them, so every path starts from the same ones."""
    shape = (2, 1, CONFIG["num_key_value_heads"], None, CONFIG["head_dim"])
    caches = []
    for i, n in enumerate(lengths):
        layers = model.make_cache()
        for layer, cache in enumerate(layers):
            key = mx.random.key((seed * 1000 + i) * 100 + layer)
            keys, values = mx.random.normal(shape[:3] + (n,) + shape[4:], key=key)
            cache.update_and_fetch(keys, values)
        mx.eval([(c.keys, c.values) for c in layers])
        caches.append(layers)
    return caches


def run(model, caches, last_tokens, max_tokens, options):
    """(tokens per request, mlx-lm's BatchStats, the plug-in's stats or None) of one
    ``batch_generate`` over every request at once, with the plug-in as ``options`` says."""
    from mlx_lm.generate import batch_generate, generation_stream

    batch = len(last_tokens)

    def generate():
        response = batch_generate(
            model, Tokenizer(), [[t] for t in last_tokens], prompt_caches=caches,
            max_tokens=max_tokens, return_token_ids=True,
            completion_batch_size=batch, prefill_batch_size=batch,
        )
        mx.synchronize(generation_stream)
        return response

    if options is None:
        response = generate()
        return response.token_ids, response.stats, None
    with plugin.enabled(**options):
        response = generate()
        return response.token_ids, response.stats, plugin.stats()


def row(path, runs, expected, lengths):
    """The table row of one path: medians over its runs."""
    tokens, stats, plugin_stats = runs[-1]
    decode_s = statistics.median(s.decode_time for _, s, _ in runs)
    generated = stats.generation_tokens
    out = {
        "path": path, "B": len(lengths), "contexts": f"{min(lengths)}-{max(lengths)}",
        "generated": generated, "decode_s": decode_s, "decode_tok_s": generated / decode_s,
        "decode_tok_s_runs": [s.generation_tokens / s.decode_time for _, s, _ in runs],
        "same_as_mlx_lm": sum(t == e for t, e in zip(tokens, expected)),
    }
    if plugin_stats is not None:
        sliding = plugin_stats.batch_rotating + plugin_stats.rotating_wrapped
        out |= {
            "sliding_on_op": plugin_stats.batch_rotating / sliding,
            "batch_kv": plugin_stats.batch_kv, "batch_rotating": plugin_stats.batch_rotating,
            "batch_rotating_wrapped": plugin_stats.batch_rotating_wrapped,
            "rotating_wrapped": plugin_stats.rotating_wrapped, "prefill": plugin_stats.prefill,
        }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B 4, contexts 256-512, 32 tokens, 1 round")
    parser.add_argument("--batch", type=int, help="requests (default 8, quick 4)")
    parser.add_argument(
        "--contexts", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="context length range (default 1024 2048, quick 256 512)",
    )
    parser.add_argument("--max-tokens", type=int, help="new tokens per request (default 256, quick 32)")
    parser.add_argument("--rounds", type=int, help="runs of each path, alternated (default 3, quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, contexts and caches")
    parser.add_argument("--output", help="results/<name>.json (default plugin_rings, quick plugin_rings_quick)")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    batch = args.batch or (4 if args.quick else 8)
    low, high = args.contexts or ((256, 512) if args.quick else (1024, 2048))
    max_tokens = args.max_tokens or (32 if args.quick else 256)
    rounds = args.rounds or (1 if args.quick else 3)
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, kernel {info['cpu_isa']} on {info['threads']} threads")
    print(f"model: {CONFIG}, float32, random weights and sinks (seed {args.seed})")
    print(f"B={batch}, contexts {low}-{high} tokens (loaded), {max_tokens} new tokens each, greedy")

    model = build_model(args.seed)
    rng = np.random.default_rng(args.seed)
    lengths = [int(n) for n in rng.integers(low, high + 1, size=batch)]
    last_tokens = [int(t) for t in rng.integers(0, CONFIG["vocab_size"], size=batch)]
    caches = prompt_caches(model, lengths, args.seed)
    # Warm-up: the first call of each path pays one-time costs kept out of the table.
    warm = prompt_caches(model, [300, 200], args.seed + 1)
    for options in PATHS.values():
        run(model, warm, [1, 2], 4, options)

    runs = {path: [] for path in PATHS}
    for round_ in range(rounds):
        order = list(PATHS) if round_ % 2 == 0 else list(PATHS)[::-1]
        for path in order:
            runs[path].append(run(model, caches, last_tokens, max_tokens, PATHS[path]))
            _, stats, _ = runs[path][-1]
            print(f"round {round_ + 1}: {path} {stats.generation_tokens / stats.decode_time:.1f} tok/s", flush=True)

    expected = runs["mlx-lm"][0][0]
    rows = [row(path, path_runs, expected, lengths) for path, path_runs in runs.items()]
    for r in rows:
        r["vs_mlx_lm"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
    print("\nDecode only (contexts loaded); medians over rounds:")
    print_table(
        rows,
        [
            ("path", "path", "{}"), ("B", "B", "{}"), ("contexts", "contexts", "{}"),
            ("generated", "tokens", "{}"), ("decode_s", "decode s", "{:.2f}"),
            ("decode_tok_s", "decode tok/s", "{:.1f}"), ("vs_mlx_lm", "x mlx-lm", "{:.2f}"),
            ("sliding_on_op", "sliding on op", "{:.0%}"), ("rotating_wrapped", "rings on mlx-lm", "{}"),
            ("same_as_mlx_lm", "= mlx-lm", "{}"),
        ],
    )
    mismatched = [r["path"] for r in rows if r["same_as_mlx_lm"] != batch]
    path = save(
        args.output or ("plugin_rings_quick" if args.quick else "plugin_rings"),
        {
            "machine": info, "config": CONFIG, "dtype": "float32", "max_tokens": max_tokens,
            "context_range": [low, high], "lengths": lengths, "rounds": rounds, "rows": rows,
            "mismatched": mismatched, "kernel_calls": _ext.cpu_kernel_calls(),
        },
    )
    print(f"\nsaved {path}")
    if mismatched:
        print(f"FAILED: greedy tokens differ from mlx-lm's for {mismatched}", file=sys.stderr)
        return 1
    print("OK: every request's greedy tokens are identical on the three paths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
