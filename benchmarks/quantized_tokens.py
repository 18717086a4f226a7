"""Greedy tokens of ``BatchedDecoder(kv_bits=...)`` against mlx-lm's own quantized decode.

For each dtype x kv_bits x group size, on the random-weight models of the decoder tests (Llama,
Qwen2, Qwen3, Mistral, Ministral 3; a group size is skipped for a model whose head dim it does
not divide), every prompt is decoded greedily by ``BatchedDecoder(kv_bits=b, kv_group_size=g)``
(a few requests at once, joining as others finish) and by mlx-lm's single-request
``generate_step(kv_bits=b, kv_group_size=g, quantized_kv_start=0)``. Reported: the share of
tokens equal to mlx-lm's (per request, the tokens before the first difference: after it, the two
decode different histories) and of requests equal throughout; and, as a yardstick of how far
quantization moves these models, the same share between mlx-lm's quantized and unquantized
decodes. Prompts have two tokens or more; ``--one-token`` uses one-token prompts instead, where
mlx-lm attends the first token before its cache is quantized and this project attends it
quantized.

    python benchmarks/quantized_tokens.py            # float32, float16, bfloat16; 8 prompts x 32 tokens
    python benchmarks/quantized_tokens.py --quick    # float32 only, group size 64, 4 prompts x 8 tokens
    python benchmarks/quantized_tokens.py --one-token
"""

import argparse
import pathlib
import sys

import mlx.core as mx

from mlx_batched_decode import BatchedDecoder
from mlx_batched_decode.tools.random_model import random_model

from common import describe_machine, machine, print_table, save

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root, for tests.*
from tests.decoding.test_decoder import FAMILIES  # noqa: E402
from tests.support.mlx_lm_models import mlx_lm_greedy, random_prompts  # noqa: E402

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def leading_equal(tokens, reference):
    """Tokens of each request before its first difference from ``reference``, summed."""
    same = 0
    for got, want in zip(tokens, reference):
        for a, b in zip(got, want):
            if a != b:
                break
            same += 1
    return same


def compare(dtype, bits, group_size, prompts, max_tokens, seed):
    row = dict(dtype=dtype, bits=bits, group_size=group_size, tokens=0, same=0, requests=0,
               same_requests=0, quantized_vs_dense=0, families=[])
    for family, config in FAMILIES.items():
        head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
        if head_dim % group_size:
            continue
        model = random_model(config, seed=seed, dtype=DTYPES[dtype])
        decoder = BatchedDecoder(model, kv_bits=bits, kv_group_size=group_size)
        ours = decoder.generate(prompts, max_tokens, max_batch_size=4)
        options = dict(kv_bits=bits, kv_group_size=group_size, quantized_kv_start=0)
        theirs = [mlx_lm_greedy(model, p, max_tokens, **options) for p in prompts]
        dense = [mlx_lm_greedy(model, p, max_tokens) for p in prompts]
        row["families"].append(family)
        row["tokens"] += len(prompts) * max_tokens
        row["same"] += leading_equal(ours, theirs)
        row["requests"] += len(prompts)
        row["same_requests"] += sum(a == b for a, b in zip(ours, theirs))
        row["quantized_vs_dense"] += leading_equal(theirs, dense)
    row["share"] = row["same"] / row["tokens"]
    row["requests_equal"] = f"{row['same_requests']}/{row['requests']}"
    row["tokens_equal"] = f"{row['same']}/{row['tokens']}"
    row["mlx_lm_q_vs_dense"] = f"{row['quantized_vs_dense']}/{row['tokens']}"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="float32, group size 64, 4 prompts x 8 tokens")
    parser.add_argument("--one-token", action="store_true", help="one-token prompts (nothing to prefill)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default all three (quick: float32)")
    parser.add_argument("--seed", type=int, default=3, help="seed of the weights")
    parser.add_argument("--output", help="results/<name>.json (default quantized_tokens[_one_token][_quick])")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    dtypes = args.dtypes or (["float32"] if args.quick else list(DTYPES))
    group_sizes = (64,) if args.quick else (32, 64, 128)
    lens = [2, 17, 64, 150] if args.quick else [2, 3, 5, 17, 40, 64, 100, 150]
    if args.one_token:
        lens = [1] * len(lens)
    max_tokens = 8 if args.quick else 32
    prompts = random_prompts(lens, seed=11 if not args.one_token else 13)
    print(describe_machine(machine()))
    print(f"families {list(FAMILIES)}, prompt lengths {lens}, {max_tokens} tokens each")

    rows = []
    for dtype in dtypes:
        for bits in (8, 4):
            for group_size in group_sizes:
                rows.append(compare(dtype, bits, group_size, prompts, max_tokens, args.seed))
                r = rows[-1]
                print(f"{dtype} {bits}-bit g{group_size}: {r['tokens_equal']} tokens equal", flush=True)
    print("\nGreedy tokens of BatchedDecoder(kv_bits) equal to mlx-lm's generate_step(kv_bits, quantized_kv_start=0):")
    print_table(
        rows,
        [
            ("dtype", "dtype", "{}"), ("bits", "bits", "{}"), ("group_size", "group", "{}"),
            ("tokens_equal", "tokens equal", "{}"), ("share", "share", "{:.1%}"),
            ("requests_equal", "requests equal", "{}"),
            ("mlx_lm_q_vs_dense", "mlx-lm quantized = unquantized", "{}"),
        ],
    )
    name = args.output or "quantized_tokens" + ("_one_token" if args.one_token else "") + (
        "_quick" if args.quick else ""
    )
    path = save(name, {"machine": machine(), "prompt_lens": lens, "max_tokens": max_tokens, "rows": rows})
    print(f"\nsaved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
