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
their own cache-loading code (``BatchedDecoder.add_request``, with the prefill function swapped
for one that returns these arrays; mlx-lm's ``KVCache`` objects handed to ``BatchGenerator``).
Decode speed depends on the context lengths, not on the cached values, and every path decodes
from the same state, so their greedy tokens must agree token for token.

Only decode steps are timed, each call on its own: ``tok/s`` = generated tokens / time of all
steps; ``steady tok/s`` leaves out the first step (where mlx-lm merges the requests' caches into
its batch cache). Every request's tokens are compared across the three paths. mlx-lm runs as
``batch_generate(..., prompt_caches=..., completion_batch_size=B, prefill_batch_size=B)`` does,
so all B requests decode together as in the other paths.

    python benchmarks/bench_decode.py            # B in {1, 8, 32}, contexts 256-4096 (minutes)
    python benchmarks/bench_decode.py --quick    # B in {1, 8}, contexts 256-1024, 4 tokens
    python benchmarks/bench_decode.py --batch-sizes 8 --contexts 512 2048   # one chosen case
"""

import argparse
import contextlib
import gc
import io
import sys
import time

import mlx.core as mx
import numpy as np

import mlx_batched_decode.served_model as served_model_module
from mlx_batched_decode import BatchedDecoder, _ext
from mlx_batched_decode.progress import ProgressBar
from mlx_batched_decode.random_model import random_model

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

    @contextlib.contextmanager
    def loaded_by_decoder(self):
        """While active, ``BatchedDecoder.add_request`` loads these caches instead of prefilling
        (it prefills ``prompt[:-1]``, the context)."""
        original = served_model_module.prefill
        served_model_module.prefill = lambda model, tokens, step_size: self.kv(self._index[tuple(tokens)])
        try:
            yield
        finally:
            served_model_module.prefill = original


def run_ours(model, requests, batch, max_tokens, path, stream=sys.stderr):
    """(tokens per request, seconds of each step) of ``BatchedDecoder`` on the first ``batch``."""
    decoder = BatchedDecoder(model, attention=path)
    with requests.loaded_by_decoder():
        uids = [decoder.add_request(p, max_tokens) for p in requests.prompts[:batch]]
    bar = ProgressBar(batch * max_tokens, f"tokens, B={batch} {path}", stream=stream)
    tokens = {uid: [] for uid in uids}
    times = []
    while decoder.num_active:
        start = time.perf_counter()
        result = decoder.step()
        times.append(time.perf_counter() - start)
        for uid, token in result.tokens.items():
            tokens[uid].append(token)
        bar.update(len(result.tokens))
    bar.close()
    assert decoder.stats.generated_tokens == batch * max_tokens
    return [tokens[uid] for uid in uids], times


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
    times = []
    while True:
        start = time.perf_counter()
        responses = gen.next_generated()
        if not responses:
            break
        times.append(time.perf_counter() - start)
        for r in responses:
            tokens[r.uid].append(r.token)
        bar.update(len(responses))
    gen.close()
    bar.close()
    return [tokens[uid] for uid in uids], times


def bench_batch(model, requests, batch, max_tokens):
    lengths = [len(p) - 1 for p in requests.prompts[:batch]]
    runs = {}
    for path in ("slot", "seed", "mlx-lm"):
        if path == "mlx-lm":
            runs[path] = run_mlx_lm(model, requests, batch, max_tokens)
        else:
            runs[path] = run_ours(model, requests, batch, max_tokens, path)
        gc.collect()
        mx.clear_cache()
    expected = runs["slot"][0]
    rows = []
    for path, (tokens, times) in runs.items():
        generated = sum(len(t) for t in tokens)
        steady = sum(times[1:])
        rows.append(
            {
                "B": batch, "path": path, "contexts": f"{min(lengths)}-{max(lengths)}",
                "context_tokens": sum(lengths), "generated": generated, "steps": len(times),
                "decode_s": sum(times), "first_step_s": times[0],
                "tok_s": generated / sum(times),
                "steady_tok_s": (generated - batch) / steady if steady > 0 else None,
                "same_as_slot": sum(t == e for t, e in zip(tokens, expected)),
            }
        )
    for row in rows:
        row["slot_speedup"] = rows[0]["steady_tok_s"] / row["steady_tok_s"] if row["steady_tok_s"] else None
    return rows, {path: tokens for path, (tokens, _) in runs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B in {1, 8}, contexts 256-1024, 4 tokens")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default 1 8 32 (quick 1 8)")
    parser.add_argument(
        "--contexts", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="context length range (default 256 4096, quick 256 1024)",
    )
    parser.add_argument("--max-tokens", type=int, help="tokens per request (default 8, quick 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, contexts and caches")
    parser.add_argument("--output", default="decode", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    batches = args.batch_sizes or ((1, 8) if args.quick else (1, 8, 32))
    low, high = args.contexts or ((256, 1024) if args.quick else (256, 4096))
    max_tokens = args.max_tokens or (4 if args.quick else 8)
    info = machine() | {"cpu_isa": _ext.cpu_isa(), "threads": _ext.cpu_threads()}
    print(f"{info['cpu']}, {info['cores']} cores, kernel {info['cpu_isa']}")
    print(f"model: {CONFIG}, float32, random weights (seed {args.seed})")

    model = random_model(CONFIG, seed=args.seed)
    # The B=b batch is the first b requests, so all batches share one set of contexts.
    lengths = np.random.default_rng(args.seed).integers(low, high + 1, size=max(batches))
    requests = Requests([int(n) for n in lengths], seed=args.seed)
    print(f"contexts {low}-{high} tokens, {max_tokens} new tokens per request, greedy")

    # Warm-up: the first call of each path pays one-time costs kept out of the table.
    warm = Requests([300, 17], seed=args.seed + 1)
    for path in ("slot", "seed"):
        run_ours(model, warm, 2, 2, path, stream=io.StringIO())
    run_mlx_lm(model, warm, 2, 2, stream=io.StringIO())

    rows, tokens = [], {}
    for batch in batches:
        batch_rows, tokens[batch] = bench_batch(model, requests, batch, max_tokens)
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
        args.output,
        {
            "machine": info, "config": CONFIG, "dtype": "float32", "max_tokens": max_tokens,
            "context_range": [low, high], "rows": rows, "mismatched": mismatched,
        },
    )
    print(f"\nsaved {path}")
    if mismatched:
        print(f"FAILED: greedy tokens differ from the slot path for {mismatched}", file=sys.stderr)
        return 1
    print("OK: every request's greedy tokens are identical across the three paths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
