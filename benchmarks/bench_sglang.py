"""SGLang's MLX decode step with and without the plug-in: tokens/s on the same caches.

SGLang's MLX backend (``sglang==0.5.23``; on Linux ``pip install --no-deps``, its backend files
loaded as the tests load them, ``tests/support/sglang_backend.py``) is driven as its model
runner drives it (``tests/support/sglang_runner.py``): per request and layer a
``ContiguousAttentionKVCache``, one ``BatchedDecodeContext`` per step, ``AttentionOffsetCache``
shims, the model's wrapped attention layers. Two paths decode the same requests from two copies
of the same caches:

- ``sglang``: SGLang's own ``MLXAttentionWrapper._batched_decode`` (per layer: slice each cache,
  pad to the longest, concatenate, a mask, masked ``mx.fast.scaled_dot_product_attention``);
- ``plugin``: the same with ``mlx_batched_decode.sglang`` enabled (one
  ``ragged_decode_attention`` call per layer on the requests' own buffers).

Models (random weights): ``attention``, ``bench_decode.CONFIG`` (a Llama with Llama-3-8B
attention heads, H_q 32, H_kv 8, head dim 128, 4 small layers, float32: attention is most of a
step), and ``qwen3-0.6b``, Qwen3-0.6B's shapes (28 layers, hidden 1024, H_q 16, H_kv 8, head dim
128, q/k norms, vocabulary 151936; ``--qwen-dtype``, default float32). Contexts are loaded, not
prefilled (as ``bench_decode.py`` does; prefill is not what the plug-in changes): each request's
caches are filled with seeded random keys/values of its context length, the buffers starting at
``--capacity`` positions and doubling as SGLang's do. Length sets: ``uniform``, lengths drawn in
``--contexts`` (default 512-2048) for each B; ``skewed``, one request of the longest length and
the others of ``--short`` (default 64) tokens (B > 1 only).

The paths run one after the other, each from its own copy of the caches (two sets of
Qwen3-shaped float32 caches at B=32 would not fit in memory together); after ``--warmup``
steps, the median of ``--steps`` timed steps gives ``tok/s`` = B / step time. A step is the
whole decode step: the model's forward, the greedy tokens, the evaluation of the caches. Every
step's tokens of the two paths must be identical.

Why a ratio is what it is: ``op ms`` is the plug-in's attention alone (one
``ragged_decode_attention`` per layer on the plug-in's caches after the run, median of repeats),
``rest ms`` = plug-in step - ``op ms`` (everything but attention, the same in both paths), so
``ceiling`` = sglang step / ``rest ms`` is the most any attention could give; ``KV MB`` is the
keys/values a step must read (sum of lengths x H_kv x D x 2 x dtype size x layers) and
``floor ms`` that over the machine's read bandwidth (``common.ReadBandwidth``, measured once).

    python benchmarks/bench_sglang.py            # both models, B in {1, 8, 32}, both length sets
    python benchmarks/bench_sglang.py --quick    # B in {1, 8}, contexts 256-1024, 2 timed steps
    python benchmarks/bench_sglang.py --models attention --batch-sizes 8
"""

import argparse
import gc
import pathlib
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root, for tests.*
import mlx_batched_decode  # noqa: E402
import mlx_batched_decode.sglang as plugin  # noqa: E402
from mlx_batched_decode.tools.random_model import random_model  # noqa: E402
from tests.support.sglang_backend import load_backend, skip_reason  # noqa: E402
from tests.support.sglang_runner import SGLangRunner  # noqa: E402

from bench_decode import CONFIG as ATTENTION_CONFIG  # noqa: E402
from common import ReadBandwidth, describe_machine, machine, median_seconds, print_table, save  # noqa: E402

QWEN3_0_6B = dict(
    model_type="qwen3",
    hidden_size=1024,
    num_hidden_layers=28,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1e6,
    tie_word_embeddings=True,
)
# name -> (config, the B=8 speed-up the plug-in is meant to reach on it)
MODELS = {"attention": (ATTENTION_CONFIG, 5.0), "qwen3-0.6b": (QWEN3_0_6B, 1.5)}
PATHS = ("sglang", "plugin")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def load_caches(runner, config, lengths, dtype, seed):
    """The requests' caches, each request's layers holding seeded random keys/values of its
    context length: the same for the same seed."""
    shape = (config["num_key_value_heads"], config["head_dim"])
    caches = [runner.new_cache() for _ in lengths]
    for b, n in enumerate(lengths):
        for layer in range(config["num_hidden_layers"]):
            key = mx.random.key(seed * 1_000_003 + b * 1000 + layer)
            keys, values = mx.random.normal((2, 1, shape[0], n, shape[1]), key=key).astype(dtype)
            caches[b][layer].update_and_fetch(keys, values)
        mx.eval([c.state for c in caches[b]])
    return caches


def op_seconds(caches, config, dtype, repeats):
    """Median seconds of the plug-in's attention alone: one ``ragged_decode_attention`` per layer
    over the caches as they are (queries random, lengths = their offsets)."""
    batch = len(caches)
    queries = mx.random.normal((batch, config["num_attention_heads"], 1, config["head_dim"])).astype(dtype)
    valid_lens = mx.array([c[0].offset for c in caches], dtype=mx.int32)
    mx.eval(queries, valid_lens)

    def attend():
        mx.eval([
            mlx_batched_decode.ragged_decode_attention(
                queries, [c[layer].keys for c in caches], [c[layer].values for c in caches], valid_lens
            )
            for layer in range(config["num_hidden_layers"])
        ])

    return median_seconds(attend, warmup=1, repeats=repeats)


def bench_case(runner, config, lengths, dtype, warmup, steps, seed):
    """Step times and tokens of both paths decoding the same requests from the same caches, and
    the op's time alone."""
    rng = np.random.default_rng(seed)
    first = [int(t) for t in rng.integers(0, config["vocab_size"], len(lengths))]
    req_ids = [str(b) for b in range(len(lengths))]
    times, tokens = {}, {}
    for path in PATHS:
        # One path at a time: two sets of Qwen3-shaped float32 caches at B=32 do not fit in
        # memory together.
        caches = load_caches(runner, config, lengths, dtype, seed)
        tokens[path], times[path] = [first], []
        if path == "plugin":
            plugin.enable()
        try:
            for step in range(warmup + steps):
                start = time.perf_counter()
                tokens[path].append(runner.step(caches, tokens[path][-1], req_ids))
                if step >= warmup:
                    times[path].append(time.perf_counter() - start)
        finally:
            plugin.disable()
        if path == "plugin":
            op_s = op_seconds(caches, config, dtype, repeats=max(3, steps))
        del caches
        gc.collect()
        mx.clear_cache()
    return times, tokens, op_s


def length_sets(batch, contexts, short, rng):
    """``{name: lengths}``: ``uniform`` in ``contexts``, and for B > 1 ``skewed``."""
    low, high = contexts
    sets = {"uniform": [int(n) for n in rng.integers(low, high + 1, batch)]}
    if batch > 1:
        sets["skewed"] = [high] + [short] * (batch - 1)
    return sets


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B in {1, 8}, contexts 256-1024, 2 timed steps")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="default both")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default 1 8 32 (quick 1 8)")
    parser.add_argument(
        "--contexts", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="uniform context lengths (default 512 2048, quick 256 1024); skewed: one of HIGH",
    )
    parser.add_argument("--short", type=int, default=64, help="the short requests' contexts when skewed (default 64)")
    parser.add_argument("--steps", type=int, help="timed decode steps per path (default 5, quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per path first (default 1)")
    parser.add_argument("--capacity", type=int, default=256, help="first capacity of each cache buffer (default 256)")
    parser.add_argument("--qwen-dtype", choices=list(DTYPES), default="float32", help="default float32")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, contexts and caches")
    parser.add_argument("--output", help="results/<name>.json (default bench_sglang, quick bench_sglang_quick)")
    args = parser.parse_args()

    reason = skip_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    backend = load_backend()
    mx.set_default_device(mx.cpu)
    batches = args.batch_sizes or ((1, 8) if args.quick else (1, 8, 32))
    contexts = args.contexts or ((256, 1024) if args.quick else (512, 2048))
    steps = args.steps or (2 if args.quick else 5)
    info = machine()
    print(describe_machine(info))
    bandwidth = ReadBandwidth()
    read_gbs = bandwidth.gbs(median_seconds(bandwidth.probe, warmup=2, repeats=9))
    print(f"read bandwidth {read_gbs:.1f} GB/s; sglang {plugin.SGLANG_VERSION}, {steps} timed steps per path")

    rows, mismatched = [], []
    for name in args.models:
        config, target = MODELS[name]
        dtype_name = args.qwen_dtype if name == "qwen3-0.6b" else "float32"
        dtype = DTYPES[dtype_name]
        print(f"model {name}: {config}, {dtype_name}, random weights (seed {args.seed})", flush=True)
        model = random_model(config, seed=args.seed, dtype=dtype)
        runner = SGLangRunner(model, backend, max_seq_len=args.capacity)
        rng = np.random.default_rng(args.seed)
        kv_row_bytes = config["num_key_value_heads"] * config["head_dim"] * 2 * dtype.size * config["num_hidden_layers"]
        for batch in batches:
            for lengths_name, lengths in length_sets(batch, contexts, args.short, rng).items():
                times, tokens, op_s = bench_case(runner, config, lengths, dtype, args.warmup, steps, args.seed)
                same = tokens["sglang"] == tokens["plugin"]
                if not same:
                    mismatched.append((name, batch, lengths_name))
                step = {path: float(np.median(times[path])) for path in PATHS}
                kv_bytes = sum(lengths) * kv_row_bytes
                rest = step["plugin"] - op_s
                row = {
                    "model": name, "dtype": dtype_name, "B": batch, "lengths": lengths_name,
                    "contexts": f"{min(lengths)}-{max(lengths)}", "context_tokens": sum(lengths),
                    "sglang_ms": step["sglang"] * 1e3, "plugin_ms": step["plugin"] * 1e3,
                    "sglang_tok_s": batch / step["sglang"], "plugin_tok_s": batch / step["plugin"],
                    "speedup": step["sglang"] / step["plugin"], "op_ms": op_s * 1e3, "rest_ms": rest * 1e3,
                    "ceiling": step["sglang"] / rest if rest > 0 else None,
                    "kv_mb": kv_bytes / 1e6, "floor_ms": kv_bytes / (read_gbs * 1e9) * 1e3,
                    "target": target if batch == 8 else None, "same_tokens": same,
                    "step_seconds": times,
                }
                rows.append(row)
                print(
                    f"  B={batch} {lengths_name}: sglang {row['sglang_tok_s']:.1f} tok/s, plugin "
                    f"{row['plugin_tok_s']:.1f} tok/s, {row['speedup']:.2f}x, tokens "
                    f"{'identical' if same else 'DIFFER'}",
                    flush=True,
                )
        del model, runner

    print("\nDecode steps on the same caches (median step; tok/s = B / step):")
    print_table(
        rows,
        [
            ("model", "model", "{}"), ("B", "B", "{}"), ("lengths", "lengths", "{}"),
            ("contexts", "contexts", "{}"), ("sglang_ms", "sglang ms", "{:.1f}"),
            ("plugin_ms", "plugin ms", "{:.1f}"), ("sglang_tok_s", "sglang tok/s", "{:.1f}"),
            ("plugin_tok_s", "plugin tok/s", "{:.1f}"), ("speedup", "speed-up", "{:.2f}x"),
            ("target", "target", "{:.1f}x"), ("op_ms", "op ms", "{:.1f}"), ("rest_ms", "rest ms", "{:.1f}"),
            ("ceiling", "ceiling", "{:.2f}x"), ("kv_mb", "KV MB", "{:.0f}"), ("floor_ms", "floor ms", "{:.1f}"),
            ("same_tokens", "= tokens", "{}"),
        ],
    )
    path = save(
        args.output or ("bench_sglang_quick" if args.quick else "bench_sglang"),
        {
            "machine": info, "read_gbs": read_gbs, "sglang": plugin.SGLANG_VERSION,
            "models": {name: MODELS[name][0] for name in args.models}, "qwen_dtype": args.qwen_dtype,
            "capacity": args.capacity, "contexts": list(contexts), "short": args.short,
            "warmup": args.warmup, "steps": steps, "rows": rows, "mismatched": mismatched,
        },
    )
    print(f"\nsaved {path}")
    missed = [
        f"{r['model']} {r['lengths']} {r['speedup']:.2f}x < {r['target']:.1f}x"
        for r in rows if r["target"] is not None and r["speedup"] < r["target"]
    ]
    if missed:
        print(f"below target at B=8: {'; '.join(missed)} (see ceiling: the most attention can give)")
    if mismatched:
        print(f"FAILED: greedy tokens differ between SGLang's path and the plug-in's for {mismatched}", file=sys.stderr)
        return 1
    print("OK: every step's greedy tokens are identical on both paths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
