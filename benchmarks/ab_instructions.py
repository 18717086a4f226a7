"""A/B of two builds of the package by the instructions the engine's steps execute (callgrind).

Wall-clock A/Bs of the engine on the 2-core VM spread by 20-50% from run to run (``ab_compare.py``
against itself, ``results/ab_*_trial.json``), far more than the 3% a refactor must stay within.
Instructions do not depend on what else the machine runs. For each side (``--base DIR``,
``--head DIR``: folders holding ``mlx_batched_decode``) and each KV layout, this script runs a
worker under ``valgrind --tool=callgrind`` twice: once up to the warm-up (model built, every code
path traced once), once with ``--tokens`` more tokens for each of 8 requests of uneven prompts
(chunked prefill beside decode tokens, then decode steps alone); the difference is the
instructions of that work, the Python engine and the MLX kernels together. The fused kernel's
thread pool does not spin (``MBD_CPU_SPIN_US=0``) and Python's hashes are fixed; the counts still
move by a few percent from run to run (threads), so take ``--repeats`` and compare medians. The model is tiny on purpose, so that the engine's own work
per step is a large share of the count.

    python benchmarks/ab_instructions.py --base ../base/python --head python   # about 25 minutes

Prints instructions per generated token for each side and layout and head / base; saves
``results/<--output>.json`` (default ``ab_instructions``). Needs valgrind (Debian's package).
"""

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    vocab_size=256, tie_word_embeddings=False,
)
REQUESTS = 8
LAYOUTS = {"slot": {}, "seed": {"attention": "seed"}, "paged": {"kv_layout": "paged"}}


def worker(layout, tokens):
    """The measured work, in this process: a warm-up, then ``tokens`` per request (if any)."""
    # Under valgrind, mlx-lm's raise of the open-file limit is refused: keep the limit.
    setrlimit = resource.setrlimit

    def lenient(*args):
        try:
            setrlimit(*args)
        except ValueError:
            pass

    resource.setrlimit = lenient
    from mlx_batched_decode import BatchedDecoder
    from mlx_batched_decode.tools.random_model import random_model

    model = random_model(CONFIG, seed=1)
    prompts = [[(7 * i + j) % 256 for j in range(24 + 9 * i)] for i in range(REQUESTS)]
    decoder = BatchedDecoder(model, max_step_tokens=64, **LAYOUTS[layout])
    decoder.generate(prompts[:2], 2)
    if tokens:
        out = decoder.generate(prompts, tokens)
        assert sum(map(len, out)) == REQUESTS * tokens


def count(tree, layout, tokens):
    """Instructions of one worker run on ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree), MBD_CPU_SPIN_US="0", PYTHONHASHSEED="0")
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         __file__, "--worker", layout, str(tokens)],
        env=env, capture_output=True, text=True,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"the worker failed on {tree} ({layout}):\n{done.stderr[-3000:]}")
    return int(found.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, help="the base build's folder")
    parser.add_argument("--head", type=Path, help="the head build's folder")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request (16)")
    parser.add_argument("--repeats", type=int, default=1, help="measurements per side (1)")
    parser.add_argument("--output", default="ab_instructions", help="results/<name>.json")
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is needed: apt-get install valgrind")
    sys.path.insert(0, str(HERE))
    from common import machine, print_table, save

    trees = {"base": args.base.resolve(), "head": args.head.resolve()}
    rows = []
    for layout in args.layouts:
        per_token = {side: [] for side in trees}
        for _ in range(args.repeats):
            for side, tree in trees.items():
                work = count(tree, layout, args.tokens) - count(tree, layout, 0)
                per_token[side].append(work / (REQUESTS * args.tokens))
                print(f"  {layout} {side}: {per_token[side][-1]:,.0f} instructions a token",
                      file=sys.stderr, flush=True)
        base, head = (statistics.median(per_token[s]) for s in trees)
        spread = max(
            (max(v) - min(v)) / statistics.median(v) for v in per_token.values()
        )
        rows.append(dict(layout=layout, base=round(base), head=round(head),
                         ratio=round(head / base, 4), spread=round(spread, 4),
                         base_runs=per_token["base"], head_runs=per_token["head"]))
    print_table(rows, [
        ("layout", "layout", "{}"), ("base", "base instr/token", "{:,}"),
        ("head", "head instr/token", "{:,}"), ("ratio", "head/base", "{:.3f}"),
        ("spread", "spread", "{:.2%}"),
    ])
    path = save(args.output, {"machine": machine(), "trees": {k: str(v) for k, v in trees.items()},
                                    "tokens": args.tokens, "requests": REQUESTS, "config": CONFIG,
                                    "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
