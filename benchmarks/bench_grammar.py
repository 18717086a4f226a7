"""Grammar-constrained decoding's costs (structured output, llguidance), on a 130k-token
byte-level BPE vocabulary built offline (the 256 bytes, every byte pair, then 64k byte
triples of printable ASCII: no download):

1. mask cost per constrained token, for a JSON schema and a regex: the host's fill of the
   step's bitmasks (16 matchers at once, llguidance's executor, at states reached by random
   allowed tokens), consuming the sampled token, and the masks' application in
   ``sample_rows`` (16 constrained rows of 32, against the same call without masks);
   a matcher made from the cached template (``deep_copy``) against one made anew;
2. a decode step of 16 constrained + 16 plain requests against 32 plain ones on a small
   random model with that vocabulary (the plain requests' tokens compared too);
3. time to first token of a request with a new schema (its compile included: the server's
   ``check`` before queueing) beside one with a cached schema.

    PYTHONPATH=python python benchmarks/bench_grammar.py            # saves results/grammar.json
    PYTHONPATH=python python benchmarks/bench_grammar.py --steps 8 --output grammar_quick
"""

import argparse
import itertools
import json
import random
import time

import mlx.core as mx
import numpy as np

from common import describe_machine, interleaved_medians, machine, print_table, save

from mlx_batched_decode.decoding.decoder import BatchedDecoder
from mlx_batched_decode.decoding.grammar import GrammarCompiler, GrammarSpec, MaskRequest, fill_bitmasks
from mlx_batched_decode.decoding.sampling import Sampler, sample_rows
from mlx_batched_decode.tools.model_folder import byte_char
from mlx_batched_decode.tools.random_model import random_model

TRIPLES = 64_000
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags", "address"],
}
SPECS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
    "regex": GrammarSpec("regex", r"([A-Za-z]+ ){1,40}[0-9]{1,6}(, [a-z]+@[a-z]+\.com){0,4}\."),
}
MODEL = dict(
    model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def big_tokenizer(seed=0):
    """A Hugging Face fast tokenizer: byte-level BPE over 256 + 65,536 + ``TRIPLES`` tokens
    and an end-of-sequence token (ids: bytes, pairs, triples, ``<|end|>``)."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [byte_char(b) for b in range(256)]
    vocab = {c: i for i, c in enumerate(chars)}
    merges = []
    for a, b in itertools.product(chars, chars):
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    printable = [byte_char(b) for b in range(33, 127)]
    triples = [(a + b, c) for a, b, c in itertools.product(printable, printable, printable)]
    for pair, c in random.Random(seed).sample(triples, TRIPLES):
        vocab[pair + c] = len(vocab)
        merges.append((pair, c))
    model = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, fuse_unk=False))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens(["<|end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|end|>")


def mask_costs(compiler, spec, steps, rows=16, seed=0):
    """µs per constrained token of the fill and of consuming, over ``steps`` steps of ``rows``
    matchers each taking a random allowed token (a stopped one starts over)."""
    rng = np.random.default_rng(seed)
    matchers = [compiler.matcher(spec) for _ in range(rows)]
    width = (compiler.vocab_size + 31) // 32
    bits = np.arange(32, dtype=np.int64)
    fill = consume = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        mask = fill_bitmasks(compiler.executor, [MaskRequest(m, i) for i, m in enumerate(matchers)], rows, width)
        fill += time.perf_counter() - start
        allowed = ((mask[:, :, None].astype(np.int64) >> bits) & 1).reshape(rows, -1)
        for i, m in enumerate(matchers):
            token = int(rng.choice(np.flatnonzero(allowed[i, : compiler.vocab_size])))
            start = time.perf_counter()
            m.consume_token(token)
            consume += time.perf_counter() - start
            if m.is_stopped():
                matchers[i] = compiler.matcher(spec)
    return fill / (steps * rows) * 1e6, consume / (steps * rows) * 1e6


def apply_cost(vocab, rows=32, constrained=16, repeats=15):
    """µs per constrained row that the masks add to ``sample_rows`` (temperature 1, seeded)."""
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((rows, vocab), dtype=np.float32) * 3)
    width = (vocab + 31) // 32
    bitmask = mx.array(rng.integers(-(2**31), 2**31 - 1, (constrained, width), dtype=np.int64).astype(np.int32))
    which = mx.array(np.arange(0, rows, rows // constrained, dtype=np.int32))
    samplers = [Sampler(1.0, seed=r) for r in range(rows)]
    mx.eval(logits, bitmask, which)

    def call(masks):
        return lambda: mx.eval(sample_rows(samplers, logits, None, masks).tokens)

    plain, masked = interleaved_medians([call(None), call((which, bitmask))], warmup=3, repeats=repeats)
    return (masked - plain) / constrained * 1e6, plain * 1e3, masked * 1e3


def matcher_costs(compiler, spec, count=200):
    """µs of a matcher from the cached template (deep_copy) and of one made anew."""
    import llguidance

    template = compiler.matcher(spec)
    grammar = spec.llguidance_grammar()
    start = time.perf_counter()
    for _ in range(count):
        template.deep_copy()
    copy = (time.perf_counter() - start) / count
    start = time.perf_counter()
    for _ in range(count // 10):
        llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
    anew = (time.perf_counter() - start) / (count // 10)
    return copy * 1e6, anew * 1e6


def decode_steps(model, compiler, kind, constrained, steps, prompt_len=32, batch=32):
    """Median ms of ``steps`` decode steps of ``batch`` requests (the first ``constrained`` with
    grammar ``kind``, max_tokens past the steps and no stop token), and the plain requests'
    tokens."""
    rng = np.random.default_rng(1)
    dec = BatchedDecoder(model, kv_step=64, max_step_tokens=batch * prompt_len, grammar_compiler=compiler)
    uids = []
    for r in range(batch):
        prompt = rng.integers(0, compiler.vocab_size - 1, prompt_len).tolist()
        grammar = SPECS[kind] if r < constrained else None
        uids.append(dec.add_request(prompt, steps + 8, sampler=Sampler(1.0, seed=r), grammar=grammar))
    tokens = {u: [] for u in uids}
    times = []
    while len(times) < steps + 1:
        start = time.perf_counter()
        result = dec.step()
        times.append(time.perf_counter() - start)
        for uid, new in result.tokens.items():
            tokens[uid] += new
    # The first step feeds the prompts.
    running = dec.core.snapshot().running
    return float(np.median(times[1:])) * 1e3, [tokens[u] for u in uids[constrained:]], running


def first_token_ms(model, compiler, spec, prompt_len=32):
    """ms from a request's grammar check (compile, or cache hit) to its first token, alone."""
    dec = BatchedDecoder(model, kv_step=64, grammar_compiler=compiler)
    prompt = np.random.default_rng(2).integers(0, compiler.vocab_size - 1, prompt_len).tolist()
    start = time.perf_counter()
    compiler.check(spec)
    checked = time.perf_counter()
    dec.add_request(prompt, 4, sampler=Sampler(1.0, seed=0), grammar=spec)
    while not dec.step().tokens:
        pass
    end = time.perf_counter()
    return (end - start) * 1e3, (checked - start) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    parser.add_argument("--mask-steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3, help="runs of each batch in turns, median of medians")
    parser.add_argument("--output", default="grammar", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    start = time.perf_counter()
    tokenizer = big_tokenizer()
    vocab = len(tokenizer)
    built = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab)
    llg_seconds = time.perf_counter() - built
    info = machine() | {"vocab": vocab, "model": MODEL, "steps": args.steps, "runs": args.runs}
    print(describe_machine(info), flush=True)
    print(f"tokenizer of {vocab} tokens built in {built - start:.1f} s, llguidance's view in {llg_seconds:.1f} s", flush=True)

    mask_rows = []
    apply_us, plain_ms, masked_ms = apply_cost(vocab)
    for kind, spec in SPECS.items():
        compiler.check(spec)
        fill_us, consume_us = mask_costs(compiler, spec, args.mask_steps)
        copy_us, anew_us = matcher_costs(compiler, spec)
        mask_rows.append({
            "grammar": kind, "vocab": vocab, "fill_us": fill_us, "consume_us": consume_us,
            "apply_us": apply_us, "total_us": fill_us + consume_us + apply_us,
            "deep_copy_us": copy_us, "new_matcher_us": anew_us,
        })
        print(mask_rows[-1], flush=True)

    model = random_model(dict(MODEL, vocab_size=vocab), seed=0)
    step_rows = []
    for kind in SPECS:
        plain_runs, mixed_runs = [], []
        for _ in range(args.runs):
            ms, plain_tokens, _ = decode_steps(model, compiler, kind, 0, args.steps)
            plain_runs.append(ms)
            ms, mixed_tokens, running = decode_steps(model, compiler, kind, 16, args.steps)
            mixed_runs.append(ms)
        same = mixed_tokens == plain_tokens[16:]
        plain, mixed = float(np.median(plain_runs)), float(np.median(mixed_runs))
        step_rows.append({"grammar": kind, "plain_ms": plain, "mixed_ms": mixed, "ratio": mixed / plain,
                          "plain_tokens_identical": same, "running_at_end": running})
        print(step_rows[-1], flush=True)

    ttft = []
    for trial in range(3):
        fresh = dict(SCHEMA, properties=dict(SCHEMA["properties"], **{f"field_{trial}_{time.time_ns()}": {"type": "number"}}))
        new_ms, new_check = first_token_ms(model, compiler, GrammarSpec("json_schema", json.dumps(fresh)))
        cached_ms, cached_check = first_token_ms(model, compiler, SPECS["json_schema"])
        ttft.append({"trial": trial, "new_ms": new_ms, "new_compile_ms": new_check,
                     "cached_ms": cached_ms, "cached_check_ms": cached_check})
        print(ttft[-1], flush=True)

    print()
    print(describe_machine(info))
    print(f"vocabulary {vocab}; sample_rows over 32 rows at temperature 1: {plain_ms:.2f} ms, "
          f"with 16 rows masked {masked_ms:.2f} ms")
    print_table(mask_rows, [
        ("grammar", "grammar", "{}"), ("fill_us", "fill µs/tok", "{:.1f}"),
        ("consume_us", "consume µs/tok", "{:.1f}"), ("apply_us", "apply µs/tok", "{:.1f}"),
        ("total_us", "total µs/tok", "{:.1f}"), ("deep_copy_us", "deep_copy µs", "{:.2f}"),
        ("new_matcher_us", "new matcher µs", "{:.0f}"),
    ])
    print()
    print_table(step_rows, [
        ("grammar", "grammar", "{}"), ("plain_ms", "32 plain ms/step", "{:.2f}"),
        ("mixed_ms", "16+16 ms/step", "{:.2f}"), ("ratio", "ratio", "{:.3f}x"),
        ("plain_tokens_identical", "plain tokens same", "{}"), ("running_at_end", "running at end", "{}"),
    ])
    print()
    print_table(ttft, [
        ("trial", "trial", "{}"), ("new_ms", "TTFT new schema ms", "{:.1f}"),
        ("new_compile_ms", "of it compile ms", "{:.1f}"), ("cached_ms", "TTFT cached ms", "{:.1f}"),
        ("cached_check_ms", "of it check ms", "{:.3f}"),
    ])
    path = save(args.output, {"machine": info, "masks": mask_rows, "steps": step_rows, "ttft": ttft,
                              "sample_rows_ms": {"plain": plain_ms, "masked_16_of_32": masked_ms},
                              "llguidance_tokenizer_s": llg_seconds})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
