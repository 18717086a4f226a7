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
from typing import Any, Callable, NamedTuple

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


class _Job(NamedTuple):
    """What every path of the main job shares.

    ``model`` is the one decoded (sharded over ``group`` under ``--tensor-parallel``),
    ``reference_model`` the unsharded one that single-request decodes run on; ``prompts`` are
    token lists, ``description`` the header's model line.
    """

    args: argparse.Namespace
    group: Any
    model: Any
    reference_model: Any
    tokenizer: Any
    description: str
    prompts: list[list[int]]
    stop_tokens: list[int]

    @property
    def is_root(self) -> bool:
        """Whether this process prints: rank 0, or the only process."""
        return self.group is None or self.group.rank() == 0

    @property
    def say(self) -> Callable[..., None]:
        """``print`` on the rank that prints, nothing on the others."""
        return print if self.is_root else _quiet

    @property
    def quantization(self) -> dict[str, Any]:
        """``--kv-bits`` and ``--kv-group-size`` as ``BatchedDecoder`` and mlx-lm take them."""
        return dict(kv_bits=self.args.kv_bits, kv_group_size=self.args.kv_group_size)


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and tokenizer: ``--model``'s directory, or the demo Llama with random weights."""
    import mlx_lm

    from .tools.random_model import random_model

    if args.model:
        return mlx_lm.load(args.model)
    return random_model(DEMO_CONFIG, seed=args.seed), _NoTokenizer()


def _prepare(args: argparse.Namespace, group: Any) -> _Job | None:
    """Loads the model (and shards a second copy over ``group``) and draws the prompts.

    Returns None, after printing why on stderr, when the model cannot be sharded over ``group``.
    """
    from .integrations.tensor_parallel import shard

    model, tokenizer = _load(args)
    # The unsharded model: the reference every rank's tokens are checked against.
    reference_model = model
    if args.model:
        description = args.model
    else:
        description = (
            f"random-weight Llama: {DEMO_CONFIG['num_hidden_layers']} layers, "
            f"{DEMO_CONFIG['num_attention_heads']}/{DEMO_CONFIG['num_key_value_heads']} heads, "
            f"head dim {DEMO_CONFIG['head_dim']}, float32"
        )
    if group is not None:
        try:
            model = shard(_load(args)[0], group)
        except ValueError as e:
            if group.rank() == 0:
                print(str(e), file=sys.stderr)
            return None
        description += f", sharded over {group.size()} ranks"
    vocab = reference_model.args.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in args.prompt_lens]
    return _Job(
        args,
        group,
        model,
        reference_model,
        tokenizer,
        description,
        prompts,
        sorted(tokenizer.eos_token_ids),
    )


def _single_request(job: _Job, prompt: list[int], quantized: bool = False) -> list[int]:
    """mlx-lm's own greedy decode of one prompt on the unsharded model, up to an end token.

    ``quantized``: with the keys and values quantized from the first token, as ``--kv-bits``
    asks.
    """
    from mlx_lm.generate import generate_step

    options = dict(job.quantization, quantized_kv_start=0) if quantized else {}
    tokens = []
    for token, _ in generate_step(
        mx.array(prompt), job.reference_model, max_tokens=job.args.max_tokens, **options
    ):
        if token in job.stop_tokens:
            break
        tokens.append(token)
    return tokens


def _ours(job: _Job, name: str, path: str, progress: bool, quantized: bool = False) -> _Run:
    """This project's batched decode of every prompt, with ``BatchedDecoder(attention=path)``.

    ``progress`` draws the progress bar (on the printing rank); ``quantized`` keeps the keys and
    values at ``--kv-bits``.
    """
    from .decoding.decoder import BatchedDecoder

    decoder = BatchedDecoder(job.model, attention=path, **(job.quantization if quantized else {}))
    tokens = decoder.generate(
        job.prompts,
        job.args.max_tokens,
        stop_tokens=job.stop_tokens,
        progress=progress and job.is_root,
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


def _mlx_lm_batch(job: _Job, prompts: list[list[int]], max_tokens: int) -> Any:
    """mlx-lm's ``batch_generate`` of ``prompts`` on the decoded model; its response."""
    from mlx_lm.generate import batch_generate, generation_stream

    response = batch_generate(
        job.model, job.tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True
    )
    # mlx-lm returns with the forward pass of a step nobody reads still running on its
    # stream; a sharded model's next collectives must not interleave with its all-reduces.
    mx.synchronize(generation_stream)
    return response


def _mlx_lm_run(job: _Job, name: str) -> _Run:
    """mlx-lm's ``batch_generate`` of every prompt, as a row of the table."""
    response = _mlx_lm_batch(job, job.prompts, job.args.max_tokens)
    stats = response.stats
    return _Run(
        name,
        response.token_ids,
        stats.prompt_time,
        stats.generation_time,
        sum(len(t) for t in response.token_ids),
        stats.generation_steps,
    )


def _warm_up(job: _Job) -> None:
    """Runs each path once on two prompts: its first call pays one-time costs the table must
    not show."""
    from .decoding.decoder import BatchedDecoder

    BatchedDecoder(job.model).generate(job.prompts[:2], 2)
    BatchedDecoder(job.model, attention="seed").generate(job.prompts[:2], 2)
    if job.args.kv_bits is not None:
        BatchedDecoder(job.model, **job.quantization).generate(job.prompts[:2], 2)
    _mlx_lm_batch(job, job.prompts[:2], 2)


def _decode(job: _Job) -> tuple[list[_Run], list[list[list[int]]]]:
    """Every path's run, and beside each the single-request tokens it is checked against.

    The runs: this project's, the seed-style path, mlx-lm's ``batch_generate``, and with
    ``--kv-bits`` this project's quantized path second.
    """
    job.say("decoding with mlx-batched-decode:", file=sys.stderr)
    runs = [
        _ours(job, "mlx-batched-decode (slot cache + fused op)", "slot", True),
        _ours(job, "seed-style (pad + concat + masked SDPA)", "seed", False),
        _mlx_lm_run(job, "mlx-lm batch_generate"),
    ]
    expected = [_single_request(job, p) for p in job.prompts]
    # Each run's tokens against the single-request decode at its own cache settings.
    references = [expected] * len(runs)
    if job.args.kv_bits is not None:
        name = f"mlx-batched-decode, {job.args.kv_bits}-bit KV (quantized op)"
        runs.insert(1, _ours(job, name, "slot", False, True))
        references.insert(1, [_single_request(job, p, quantized=True) for p in job.prompts])
    return runs, references


def _print_table(job: _Job, runs: list[_Run], references: list[list[list[int]]]) -> None:
    """Prints one row per run: tokens, prefill and decode seconds, decode tokens/s, and how
    many requests equal their single-request decode."""
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
                f"{same}/{len(job.prompts)}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    job.say(
        "same model, same prompts, greedy; our prefill s = steps that fed prompt chunks (beside "
        "decode tokens), decode s = steps of decode tokens alone, decode tokens/s = their "
        "tokens / their time:"
    )
    if job.args.kv_bits is not None:
        job.say(
            f"(the {job.args.kv_bits}-bit row is checked against mlx-lm's single-request decode "
            f"with kv_bits={job.args.kv_bits}, kv_group_size={job.args.kv_group_size}, "
            "quantized_kv_start=0)"
        )
    for row in rows:
        job.say(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )


def _print_all_reduce_cost(job: _Job, ours: _Run) -> None:
    """Prints what one decode step's all-reduces cost over ``job.group``, measured alone, beside
    the step time of ``ours``."""
    from .integrations.tensor_parallel import all_reduce_seconds

    hidden = job.reference_model.args.hidden_size
    layers = len(job.reference_model.layers)
    # o_proj and down_proj each sum the ranks' partial outputs once per layer and step.
    reduce_s = all_reduce_seconds(job.group, (len(job.prompts), 1, hidden), 2 * layers)
    step_s = ours.decode_seconds / ours.decode_steps
    job.say(
        f"tensor parallel: {job.group.size()} ranks; per decode step {2 * layers} all-reduces of "
        f"[{len(job.prompts)}, 1, {hidden}] float32 take {1e3 * reduce_s:.2f} ms (measured "
        f"alone, chained), {100 * reduce_s / step_s:.0f}% of this project's "
        f"{1e3 * step_s:.2f} ms step"
    )


def _check(job: _Job, runs: list[_Run], references: list[list[list[int]]]) -> int:
    """The exit status: 1, each failure printed on stderr (by every rank), when a request of this
    project's paths differs from its single-request decode; else 0."""
    reference = "the unsharded model's" if job.group is not None else "its"
    checked = [0, 1] if job.args.kv_bits is not None else [0]
    failed = False
    for index in checked:
        mismatched = [
            i for i, (t, e) in enumerate(zip(runs[index].tokens, references[index])) if t != e
        ]
        if mismatched:
            rank = f"rank {job.group.rank()}: " if job.group is not None else ""
            print(
                f"FAILED: {rank}{runs[index].name}: requests {mismatched} differ from "
                f"{reference} single-request decode",
                file=sys.stderr,
            )
            failed = True
    if failed:
        return 1
    job.say(f"OK: every request's tokens equal {reference} single-request decode")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the main job with the command line ``argv`` (default ``sys.argv[1:]``).

    Returns the exit status: 0 when every request of this project's paths equals its
    single-request decode, 1 when one differs, 2 when the job cannot run (mlx-lm missing,
    ``--tensor-parallel`` on one process, a model that does not shard).
    """
    args = _parse_args(argv)
    try:
        import mlx_lm.generate  # noqa: F401
    except ImportError:
        print(
            "The main job runs mlx-lm models: pip install 'mlx-batched-decode[mlx-lm]'",
            file=sys.stderr,
        )
        return 2
    group = mx.distributed.init() if args.tensor_parallel else None
    if group is not None and group.size() < 2:
        print(
            "--tensor-parallel needs several processes: start it under mlx.launch, e.g. "
            'mlx.launch -n 2 --backend ring --python "$(which python)" -- '
            "-m mlx_batched_decode --tensor-parallel",
            file=sys.stderr,
        )
        return 2
    job = _prepare(args, group)
    if job is None:
        return 2
    job.say(f"model: {job.description}")
    job.say(
        f"requests: {len(job.prompts)}, prompt lengths {args.prompt_lens}, "
        f"{args.max_tokens} new tokens each, greedy"
    )
    _warm_up(job)
    runs, references = _decode(job)
    _print_table(job, runs, references)
    if group is not None:
        _print_all_reduce_cost(job, runs[0])
    return _check(job, runs, references)


if __name__ == "__main__":
    sys.exit(main())
