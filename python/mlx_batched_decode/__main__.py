"""The main job: batched decode of an mlx-lm model, checked and timed against its peers.

``python -m mlx_batched_decode`` builds a small random-weight mlx-lm Llama in place (or loads
``--model DIR``), decodes a batch of prompts of mixed lengths with ``BatchedDecoder`` (progress
bar on stderr), checks every request's tokens against mlx-lm's own single-request greedy decode,
and prints generated tokens/s for this project, the seed-style path (per-request caches, pad,
concatenate, masked SDPA) and mlx-lm's ``batch_generate`` on the same model and prompts.
Exits with status 1 when a request of this project's path differs from its single-request decode.

With ``--kv-bits 8`` (or 4) a fourth path keeps the keys and values quantized
(``BatchedDecoder(kv_bits=...)``, mlx-lm's ``QuantizedKVCache`` format, read by
``quantized_batched_decode_attention``); its tokens are checked against mlx-lm's single-request
decode at the same settings, ``generate_step(kv_bits=..., kv_group_size=...,
quantized_kv_start=0)``, and so is the exit status. mlx-lm's ``batch_generate`` has no quantized
cache: its row stays unquantized.

With ``--tensor-parallel``, started under ``mlx.launch`` (e.g. ``mlx.launch -n 2 --backend ring
--python "$(which python)" -- -m mlx_batched_decode --tensor-parallel``), every rank shards the
model over ``mx.distributed.init()``'s group with mlx-lm's ``model.shard`` and runs the same
three paths on it; each rank checks its tokens against the single-request decode of the
unsharded model (which it also holds), rank 0 prints the table once, and the cost of one
step's all-reduces is measured and printed.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any, NamedTuple

import mlx.core as mx

# Tiny on purpose: the main job must finish in seconds on a CPU; head dim 64 and GQA group 4, with
# two KV heads so that --tensor-parallel can split them over 2 ranks.
DEMO_CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=4,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
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
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        help="also decode with the keys and values quantized to this many bits (mlx-lm's format)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        choices=(32, 64, 128),
        default=64,
        help="elements per quantization group with --kv-bits (default 64)",
    )
    parser.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="shard the model over mx.distributed.init()'s group (start under mlx.launch); "
        "rank 0 prints",
    )
    return parser.parse_args(argv)


class _Run(NamedTuple):
    name: str
    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int
    decode_steps: int


def _quiet(*args, **kwargs) -> None:
    """``print`` on the ranks that do not print."""


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        import mlx_lm
        from mlx_lm.generate import batch_generate, generate_step, generation_stream
    except ImportError:
        print(
            "The main job runs mlx-lm models: pip install 'mlx-batched-decode[mlx-lm]'",
            file=sys.stderr,
        )
        return 2
    from .decoding.decoder import BatchedDecoder
    from .integrations.tensor_parallel import all_reduce_seconds, shard
    from .tools.random_model import random_model

    group = mx.distributed.init() if args.tensor_parallel else None
    if group is not None and group.size() < 2:
        print(
            "--tensor-parallel needs several processes: start it under mlx.launch, e.g. "
            'mlx.launch -n 2 --backend ring --python "$(which python)" -- '
            "-m mlx_batched_decode --tensor-parallel",
            file=sys.stderr,
        )
        return 2
    is_root = group is None or group.rank() == 0
    say = print if is_root else _quiet

    def build():
        if args.model:
            return mlx_lm.load(args.model)
        return random_model(DEMO_CONFIG, seed=args.seed), _NoTokenizer()

    model, tokenizer = build()
    # The unsharded model: the reference every rank's tokens are checked against.
    reference_model = model
    if args.model:
        what = args.model
    else:
        what = (
            f"random-weight Llama: {DEMO_CONFIG['num_hidden_layers']} layers, "
            f"{DEMO_CONFIG['num_attention_heads']}/{DEMO_CONFIG['num_key_value_heads']} heads, "
            f"head dim {DEMO_CONFIG['head_dim']}, float32"
        )
    if group is not None:
        try:
            model = shard(build()[0], group)
        except ValueError as e:
            say(str(e), file=sys.stderr)
            return 2
        what += f", sharded over {group.size()} ranks"
    stop_tokens = sorted(tokenizer.eos_token_ids)
    vocab = reference_model.args.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in args.prompt_lens]
    say(f"model: {what}")
    say(
        f"requests: {len(prompts)}, prompt lengths {args.prompt_lens}, "
        f"{args.max_tokens} new tokens each, greedy"
    )

    quantization = dict(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)

    def single_request(prompt: list[int], quantized: bool = False) -> list[int]:
        options = dict(quantization, quantized_kv_start=0) if quantized else {}
        tokens = []
        for token, _ in generate_step(
            mx.array(prompt), reference_model, max_tokens=args.max_tokens, **options
        ):
            if token in stop_tokens:
                break
            tokens.append(token)
        return tokens

    def ours(name: str, path: str, progress: bool, quantized: bool = False) -> _Run:
        decoder = BatchedDecoder(model, attention=path, **(quantization if quantized else {}))
        tokens = decoder.generate(
            prompts, args.max_tokens, stop_tokens=stop_tokens, progress=progress and is_root
        )
        stats = decoder.stats
        return _Run(
            name,
            tokens,
            stats.prefill_seconds,
            stats.decode_seconds,
            stats.decode_step_tokens,
            stats.decode_steps,
        )

    def mlx_lm_batch(prompts: list[list[int]], max_tokens: int) -> Any:
        response = batch_generate(
            model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True
        )
        # mlx-lm returns with the forward pass of a step nobody reads still running on its
        # stream; a sharded model's next collectives must not interleave with its all-reduces.
        mx.synchronize(generation_stream)
        return response

    def mlx_lm_run(name: str) -> _Run:
        response = mlx_lm_batch(prompts, args.max_tokens)
        stats = response.stats
        return _Run(
            name,
            response.token_ids,
            stats.prompt_time,
            stats.generation_time,
            sum(len(t) for t in response.token_ids),
            stats.generation_steps,
        )

    # Warm-up: the first call of each path pays one-time costs we do not want in the table.
    BatchedDecoder(model).generate(prompts[:2], 2)
    BatchedDecoder(model, attention="seed").generate(prompts[:2], 2)
    if args.kv_bits is not None:
        BatchedDecoder(model, **quantization).generate(prompts[:2], 2)
    mlx_lm_batch(prompts[:2], 2)

    say("decoding with mlx-batched-decode:", file=sys.stderr)
    runs = [
        ours("mlx-batched-decode (slot cache + fused op)", "slot", True),
        ours("seed-style (pad + concat + masked SDPA)", "seed", False),
        mlx_lm_run("mlx-lm batch_generate"),
    ]
    expected = [single_request(p) for p in prompts]
    # Each run's tokens against the single-request decode at its own cache settings.
    references = [expected] * len(runs)
    if args.kv_bits is not None:
        bits = f"{args.kv_bits}-bit"
        runs.insert(1, ours(f"mlx-batched-decode, {bits} KV (quantized op)", "slot", False, True))
        references.insert(1, [single_request(p, quantized=True) for p in prompts])

    rows = [("path", "tokens", "prefill s", "decode s", "decode tokens/s", "= single-request")]
    for run, reference_tokens in zip(runs, references):
        generated = sum(len(t) for t in run.tokens)
        same = sum(t == e for t, e in zip(run.tokens, reference_tokens))
        rows.append(
            (
                run.name,
                str(generated),
                f"{run.prefill_seconds:.3f}",
                f"{run.decode_seconds:.3f}",
                f"{run.decode_tokens / run.decode_seconds:.1f}",
                f"{same}/{len(prompts)}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    say(
        "same model, same prompts, greedy; our prefill s = steps that fed prompt chunks (beside "
        "decode tokens), decode s = steps of decode tokens alone, decode tokens/s = their "
        "tokens / their time:"
    )
    if args.kv_bits is not None:
        say(
            f"(the {bits} row is checked against mlx-lm's single-request decode with kv_bits="
            f"{args.kv_bits}, kv_group_size={args.kv_group_size}, quantized_kv_start=0)"
        )
    for row in rows:
        say(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
    if group is not None:
        hidden = reference_model.args.hidden_size
        layers = len(reference_model.layers)
        # o_proj and down_proj each sum the ranks' partial outputs once per layer and step.
        reduce_s = all_reduce_seconds(group, (len(prompts), 1, hidden), 2 * layers)
        step_s = runs[0].decode_seconds / runs[0].decode_steps
        say(
            f"tensor parallel: {group.size()} ranks; per decode step {2 * layers} all-reduces of "
            f"[{len(prompts)}, 1, {hidden}] float32 take {1e3 * reduce_s:.2f} ms (measured "
            f"alone, chained), {100 * reduce_s / step_s:.0f}% of this project's "
            f"{1e3 * step_s:.2f} ms step"
        )

    reference = "the unsharded model's" if group is not None else "its"
    checked = [0, 1] if args.kv_bits is not None else [0]
    failed = False
    for index in checked:
        mismatched = [
            i for i, (t, e) in enumerate(zip(runs[index].tokens, references[index])) if t != e
        ]
        if mismatched:
            rank = f"rank {group.rank()}: " if group is not None else ""
            print(
                f"FAILED: {rank}{runs[index].name}: requests {mismatched} differ from "
                f"{reference} single-request decode",
                file=sys.stderr,
            )
            failed = True
    if failed:
        return 1
    say(f"OK: every request's tokens equal {reference} single-request decode")
    return 0


if __name__ == "__main__":
    sys.exit(main())
