"""The batched sampler's cost per step: ``sample_rows`` over R = 32 rows of float32 logits for
vocabularies of 1,024, 32,000 and 151,936 tokens, with every row on the same knobs:

    greedy        temperature 0
    temp 1        temperature 1, unseeded (MLX's global random state)
    seeded        temperature 1, each row its own seed
    knobs         seeded + top_k 40 + min_p 0.05 + repetition, presence and frequency penalties
                  over 64-token contexts + an 8-entry logit_bias
    knobs+top_p   the same + top_p 0.9
    knobs+lp5     the same + logprobs 5 (the chosen token's and the top 5)

Per case: the median ms of a step (the call and its ``mx.eval``), all cases of one vocabulary
timed in turns after warm-up, and its ratio to the greedy step's.

    PYTHONPATH=python python benchmarks/bench_sampling.py           # saves results/sampling.json
    PYTHONPATH=python python benchmarks/bench_sampling.py --repeats 5 --output sampling_quick
"""

import argparse

import mlx.core as mx
import numpy as np

from common import describe_machine, interleaved_medians, machine, print_table, save

from mlx_batched_decode.decoding.sampling import Sampler, sample_rows

VOCABS = (1024, 32000, 151936)
ROWS = 32
CONTEXT = 64


def knobs(row, vocab, rng):
    """Every penalty over the 64-token context, min-p, top-k and 8 biased tokens."""
    bias = rng.choice(vocab, 8, replace=False)
    return dict(
        temperature=1.0, seed=row, top_k=40, min_p=0.05, repetition_penalty=1.1,
        repetition_context_size=CONTEXT, presence_penalty=0.5, presence_context_size=CONTEXT,
        frequency_penalty=0.3, frequency_context_size=CONTEXT,
        logit_bias={int(t): float(b) for t, b in zip(bias, rng.uniform(-5, 5, 8))},
    )


CASES = {
    "greedy": lambda r, v, rng: {},
    "temp 1": lambda r, v, rng: dict(temperature=1.0),
    "seeded": lambda r, v, rng: dict(temperature=1.0, seed=r),
    "knobs": knobs,
    "knobs+top_p": lambda r, v, rng: knobs(r, v, rng) | dict(top_p=0.9),
    "knobs+lp5": lambda r, v, rng: knobs(r, v, rng) | dict(logprobs=5),
}


def step(samplers, logits, contexts):
    """One timed call: the step's sampling, evaluated."""
    def run():
        sampled = sample_rows(samplers, logits, contexts)
        mx.eval(*[a for a in sampled if a is not None])
    return run


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15, help="timings in turns per case, median reported")
    parser.add_argument("--output", default="sampling", help="results/<name>.json")
    args = parser.parse_args()

    mx.set_default_device(mx.cpu)
    info = machine() | {"rows": ROWS, "context": CONTEXT, "warmup": args.warmup, "repeats": args.repeats}
    print(describe_machine(info), flush=True)
    rows = []
    for vocab in args.vocabs:
        rng = np.random.default_rng(vocab)
        # Logits spread like a model's: a few likely tokens, a long tail.
        logits = mx.array(rng.standard_normal((ROWS, vocab), dtype=np.float32) * 3)
        contexts = mx.array(rng.integers(0, vocab, (ROWS, CONTEXT)), dtype=mx.int32)
        mx.eval(logits, contexts)
        calls = [
            step([Sampler(**make(r, vocab, rng)) for r in range(ROWS)], logits, contexts)
            for make in CASES.values()
        ]
        seconds = interleaved_medians(calls, warmup=args.warmup, repeats=args.repeats)
        for case, s in zip(CASES, seconds):
            rows.append({"vocab": vocab, "rows": ROWS, "case": case, "ms": s * 1e3, "vs_greedy": s / seconds[0]})
            print(f"V={vocab} {case}: {s * 1e3:.2f} ms", flush=True)

    print()
    print(describe_machine(info))
    print_table(rows, [
        ("vocab", "V", "{}"), ("rows", "R", "{}"), ("case", "case", "{}"), ("ms", "ms/step", "{:.2f}"),
        ("vs_greedy", "x greedy", "{:.1f}"),
    ])
    path = save(args.output, {"machine": info, "rows": rows})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
