"""KV memory of ``BatchedDecoder`` on a Gemma-3-shaped model: rings for windowed layers vs before.

Two layouts decode the same requests from the same state, greedy:

- ``every position``: the layout before rings, every layer a ``SlotKVCache`` holding all of its
  requests' positions (built by swapping the ring classes for the slot ones while the decoder
  is made);
- ``rings``: ``BatchedDecoder`` as it is: the full-attention layer a ``SlotKVCache``, every
  sliding-window layer a ``RingSlotKVCache`` of ``window + chunk - 1`` positions per request
  (room for a prompt chunk of up to ``min(max_step_tokens, window)`` tokens behind its window),
  read through ``ring_offset``.

The model (``CONFIG``): Gemma 3's layer pattern (5 sliding-window layers of window 1024, then a
global one) and its 4B attention (H_q 8, H_kv 4, head dim 256, query scale 256 ** -0.5) in 6
layers with a small hidden size (128), MLP 256 and vocabulary 1024, random weights, float32: in
bfloat16 the tokens of the two layouts part after about 20 (the op sums a window that wraps in
another order, a float32 difference of about 3e-8 that now and then crosses a bfloat16 rounding
step; with the ring unrolled into time order first they are identical), and the check below is
for identical tokens. The bytes scale with the dtype; their ratio does not.
Contexts are loaded, not prefilled (as in ``bench_decode.py``): each request starts from seeded
random keys/values of its context length in every layer (``add_prefilled_request``), the same
for both layouts.

``KV MiB`` is the bytes of every layer's cache buffers after the run (``nbytes``), ``peak MiB``
MLX's peak memory over the decode steps (the caches, the weights and a step's arrays),
``tok/s`` generated tokens / time of the decode steps; ``steady tok/s`` leaves out the first
step, in which a cache of every position grows past the 8192 prompt positions (one copy of its
buffers) while a ring is already full size. Every request's tokens must be the same
in both layouts, or the script exits with status 1 after saving.

    python benchmarks/bench_ring_memory.py           # B 4, contexts 8192, 32 tokens
    python benchmarks/bench_ring_memory.py --quick   # B 2, contexts 8192, 4 tokens
"""

import argparse
import contextlib
import sys
import time

import mlx.core as mx
import numpy as np

import mlx_batched_decode.decoding.layouts.slot as slot_layout
from mlx_batched_decode import BatchedDecoder, SlotAttention, SlotKVCache
from mlx_batched_decode.tools.random_model import random_model

from common import machine, print_table, save

CONFIG = dict(
    model_type="gemma3_text",
    hidden_size=128,
    num_hidden_layers=6,
    intermediate_size=256,
    head_dim=256,
    num_attention_heads=8,
    num_key_value_heads=4,
    query_pre_attn_scalar=256,
    sliding_window=1024,
    sliding_window_pattern=6,
    vocab_size=1024,
    rms_norm_eps=1e-6,
)
DTYPE = mx.float32


@contextlib.contextmanager
def every_position():
    """While active, ``SlotLayout`` gives windowed layers the layout before rings: a
    ``SlotKVCache`` of every position, read by ``SlotAttention`` with the step's lengths."""
    saved = slot_layout.RingSlotKVCache, slot_layout.RingSlotAttention
    slot_layout.RingSlotKVCache = lambda size, step: SlotKVCache(step)
    slot_layout.RingSlotAttention = lambda size: SlotAttention()
    try:
        yield
    finally:
        slot_layout.RingSlotKVCache, slot_layout.RingSlotAttention = saved


def context(model, prompt, seed):
    """Seeded random keys/values ``[1, H_kv, P, D]`` for every layer, P the prompt's context
    (all but its last token)."""
    base = seed * 10**6 + (len(prompt) - 1) * 100 + prompt[0]
    shape = (2, 1, CONFIG["num_key_value_heads"], len(prompt) - 1, CONFIG["head_dim"])
    return [
        tuple(mx.random.normal(shape, key=mx.random.key(base + layer)).astype(DTYPE))
        for layer in range(len(model.layers))
    ]


def run(model, prompts, max_tokens, seed, layout):
    """(tokens per request, KV bytes, peak bytes over the decode steps, seconds of each step)."""
    with layout():
        decoder = BatchedDecoder(model)
    uids = [decoder.add_prefilled_request(p, max_tokens, context(model, p, seed)) for p in prompts]
    tokens = {uid: [] for uid in uids}
    mx.reset_peak_memory()
    times = []
    while decoder.num_active:
        start = time.perf_counter()
        for uid, emitted in decoder.step().tokens.items():
            tokens[uid] += emitted
        times.append(time.perf_counter() - start)
    peak = mx.get_peak_memory()
    kv_bytes = sum(c.nbytes for c in decoder.slot_caches)
    return [tokens[u] for u in uids], kv_bytes, peak, times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B 2, 4 tokens")
    parser.add_argument("--batch", type=int, help="requests (default 4, quick 2)")
    parser.add_argument("--context", type=int, default=8192, help="context tokens per request (default 8192)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per request (default 32, quick 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and contexts")
    parser.add_argument("--output", help="results/<name>.json (default ring_memory, quick ring_memory_quick)")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    batch = args.batch or (2 if args.quick else 4)
    max_tokens = args.max_tokens or (4 if args.quick else 32)
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, kernel {info['cpu_isa']} on {info['threads']} threads")
    print(f"model: {CONFIG}, float32, random weights (seed {args.seed})")
    print(f"B={batch}, contexts {args.context} tokens (loaded), {max_tokens} new tokens each, greedy")

    model = random_model(CONFIG, seed=args.seed, dtype=DTYPE)
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(0, CONFIG["vocab_size"], args.context + 1)] for _ in range(batch)]
    # Warm-up: the first call of each layout pays one-time costs kept out of the table.
    for layout in (every_position, contextlib.nullcontext):
        run(model, [p[:300] for p in prompts[:2]], 2, args.seed, layout)

    rows, outputs = [], {}
    for name, layout in (("every position", every_position), ("rings", contextlib.nullcontext)):
        mx.clear_cache()
        outputs[name], kv_bytes, peak, times = run(model, prompts, max_tokens, args.seed, layout)
        rows.append(
            {
                "layout": name, "B": batch, "context": args.context, "generated": batch * max_tokens,
                "kv_mib": kv_bytes / 2**20, "peak_mib": peak / 2**20, "decode_s": sum(times),
                "first_step_s": times[0], "tok_s": batch * max_tokens / sum(times),
                "steady_tok_s": batch * (max_tokens - 1) / sum(times[1:]) if max_tokens > 1 else None,
            }
        )
        print(f"{name}: KV {kv_bytes / 2**20:.0f} MiB, {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    for r in rows:
        r["kv_share"] = r["kv_mib"] / rows[0]["kv_mib"]
        r["same_tokens"] = sum(a == b for a, b in zip(outputs[r["layout"]], outputs["every position"]))
    print("\nKV memory and decode speed (contexts loaded):")
    print_table(
        rows,
        [
            ("layout", "layout", "{}"), ("B", "B", "{}"), ("context", "context", "{}"),
            ("kv_mib", "KV MiB", "{:.0f}"), ("kv_share", "KV share", "{:.1%}"), ("peak_mib", "peak MiB", "{:.0f}"),
            ("generated", "tokens", "{}"), ("first_step_s", "1st step s", "{:.2f}"), ("tok_s", "tok/s", "{:.1f}"),
            ("steady_tok_s", "steady tok/s", "{:.1f}"), ("same_tokens", "= before", "{}"),
        ],
    )
    mismatched = [r["layout"] for r in rows if r["same_tokens"] != batch]
    path = save(
        args.output or ("ring_memory_quick" if args.quick else "ring_memory"),
        {
            "machine": info, "config": CONFIG, "dtype": "float32", "max_tokens": max_tokens,
            "rows": rows, "mismatched": mismatched,
        },
    )
    print(f"\nsaved {path}")
    if mismatched:
        print(f"FAILED: greedy tokens differ between the layouts for {mismatched}", file=sys.stderr)
        return 1
    print("OK: every request's greedy tokens are identical in both layouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
