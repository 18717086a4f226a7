"""The main job: batched decode of an mlx-lm model, checked and timed against its peers.

``python -m mlx_batched_decode`` builds a small random-weight mlx-lm Llama in place (or loads
``--model DIR``), decodes a batch of prompts of mixed lengths with ``BatchedDecoder`` (progress
bar on stderr), checks every request's tokens against mlx-lm's own single-request greedy decode,
and prints generated tokens/s for this project, the seed-style path (per-request caches, pad,
concatenate, masked SDPA) and mlx-lm's ``batch_generate`` on the same model and prompts.
Exits with status 1 when a request of this project's path differs from its single-request decode.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import NamedTuple

import mlx.core as mx

# Tiny on purpose: the main job must finish in seconds on a CPU; head dim 64 and GQA group 4.
DEMO_CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=4,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=1024,
    tie_word_embeddings=False,
)
DEMO_PROMPT_LENS = [3, 17, 40, 64, 97, 150, 220, 300]


class _NoTokenizer:
    """What ``batch_generate`` uses of a tokenizer, for a model built without one: no end tokens."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, tokens: list[int]) -> str:
        return ""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_batched_decode", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model",
        help="a local mlx-lm model directory (default: a random-weight Llama built in place)",
    )
    parser.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=DEMO_PROMPT_LENS,
        help="prompt lengths, one per request",
    )
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens to generate per request")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights and prompts"
    )
    return parser.parse_args(argv)


class _Run(NamedTuple):
    name: str
    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        import mlx_lm
        from mlx_lm.generate import batch_generate, generate_step
    except ImportError:
        print(
            "The main job runs mlx-lm models: pip install 'mlx-batched-decode[mlx-lm]'",
            file=sys.stderr,
        )
        return 2
    from .decoder import BatchedDecoder
    from .random_model import random_model

    if args.model:
        model, tokenizer = mlx_lm.load(args.model)
        what = args.model
    else:
        model, tokenizer = random_model(DEMO_CONFIG, seed=args.seed), _NoTokenizer()
        what = (
            f"random-weight Llama: {DEMO_CONFIG['num_hidden_layers']} layers, "
            f"{DEMO_CONFIG['num_attention_heads']}/{DEMO_CONFIG['num_key_value_heads']} heads, "
            f"head dim {DEMO_CONFIG['head_dim']}, float32"
        )
    stop_tokens = sorted(tokenizer.eos_token_ids)
    vocab = model.args.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in args.prompt_lens]
    print(f"model: {what}")
    print(
        f"requests: {len(prompts)}, prompt lengths {args.prompt_lens}, "
        f"{args.max_tokens} new tokens each, greedy"
    )

    def single_request(prompt: list[int]) -> list[int]:
        tokens = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=args.max_tokens):
            if token in stop_tokens:
                break
            tokens.append(token)
        return tokens

    def ours(name: str, path: str, progress: bool) -> _Run:
        decoder = BatchedDecoder(model, attention=path)
        tokens = decoder.generate(
            prompts, args.max_tokens, stop_tokens=stop_tokens, progress=progress
        )
        return _Run(name, tokens, decoder.stats.prefill_seconds, decoder.stats.decode_seconds)

    def mlx_lm_batch(name: str) -> _Run:
        response = batch_generate(
            model, tokenizer, prompts, max_tokens=args.max_tokens, return_token_ids=True
        )
        return _Run(
            name, response.token_ids, response.stats.prompt_time, response.stats.generation_time
        )

    # Warm-up: the first call of each path pays one-time costs we do not want in the table.
    BatchedDecoder(model).generate(prompts[:2], 2)
    BatchedDecoder(model, attention="seed").generate(prompts[:2], 2)
    batch_generate(model, tokenizer, prompts[:2], max_tokens=2)

    print("decoding with mlx-batched-decode:", file=sys.stderr)
    runs = [
        ours("mlx-batched-decode (slot cache + fused op)", "slot", True),
        ours("seed-style (pad + concat + masked SDPA)", "seed", False),
        mlx_lm_batch("mlx-lm batch_generate"),
    ]
    expected = [single_request(p) for p in prompts]

    rows = [("path", "tokens", "prefill s", "decode s", "decode tokens/s", "= single-request")]
    for run in runs:
        generated = sum(len(t) for t in run.tokens)
        same = sum(t == e for t, e in zip(run.tokens, expected))
        rows.append(
            (
                run.name,
                str(generated),
                f"{run.prefill_seconds:.3f}",
                f"{run.decode_seconds:.3f}",
                f"{generated / run.decode_seconds:.1f}",
                f"{same}/{len(prompts)}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("same model, same prompts, greedy; decode tokens/s = generated tokens / decode time:")
    for row in rows:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )

    mismatched = [i for i, (t, e) in enumerate(zip(runs[0].tokens, expected)) if t != e]
    if mismatched:
        print(
            f"FAILED: requests {mismatched} differ from their single-request decode",
            file=sys.stderr,
        )
        return 1
    print("OK: every request's tokens equal its single-request decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
