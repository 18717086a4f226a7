"""A/B of two builds of the package: one benchmark run alternately against each, medians compared.

``--base DIR`` and ``--head DIR`` are folders holding ``mlx_batched_decode`` (a checkout's
``python/``, with the built extension in it). The benchmark command after ``--`` (a script under
``benchmarks/`` and its flags) runs ``--repeats`` rounds in the order base, head, head, base,
base, head, ..., each run a fresh process with ``PYTHONPATH`` set to that side's folder alone (the
native server the server benchmark starts inherits it). Before the first run each side's import
is checked to resolve to its folder.

The benchmark scripts are the same for both sides: those of ``--scripts`` (default: the checkout
holding this file, normally the head's). The scripts use only the package's public API
(``BatchedDecoder``, its stats, ``tools.*``), so running one copy keeps the workload identical and
any difference is the package's; it also lets base run flags newer than its commit (such as
``bench_server.py --native-only``). ``--own-scripts`` runs each side's own checkout's scripts
instead (the parent of DIR), for a head that had to change a script.

Each run works in a fresh temporary copy of the scripts' folder, so the JSON it saves lands there
(``results/*.json``) and no checkout's results are touched. Read from it, per row, are:

- ``bench_decode.py``: ``tok_s`` and ``steady_tok_s`` of each (B, path) row (higher is better);
- ``bench_kernel.py``: ``ms`` (lower is better) and ``frac_bw`` (higher) of each row;
- ``bench_quantized.py``: ``ms``, ``hot_ms`` (lower), ``frac_bw`` and ``vs_float16`` (higher, the
  ratio to the float16 op timed in the same turns) of each row;
- ``bench_server.py``: ``largest_gap_s`` of the burst row, ``seconds``, ``ttft_p50_s`` and
  ``itl_p99_s`` of the trace row (lower is better);
- any other script: every numeric field ending in ``tok_s`` (higher is better) or ``_s`` / ``_ms``
  (lower is better).

The table shows each metric's median for base and head, each side's spread ((max - min) /
median over its runs), head / base, and flags a head more than ``--threshold`` (default 3%)
slower. Saved as ``results/<--output>.json`` (default ``ab_<script>``) with every run's values.
A run that exits non-zero (for example greedy tokens that differ) stops the A/B with its log.

    git worktree add ../base <commit before the change>   # then build or copy its _ext there
    python benchmarks/ab_compare.py --base ../base/python --head python --repeats 6 \\
        -- benchmarks/bench_decode.py --quick                  # 3-5 minutes on the 2-core VM
    python benchmarks/ab_compare.py --base ../base/python --head python --repeats 3 \\
        -- benchmarks/bench_server.py --arrivals --native-only  # 9-10 minutes there
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, print_table, save

HERE = Path(__file__).resolve().parent
# Per script: the fields naming a row, and the metrics that matter (+1: higher is better).
METRICS = {
    "bench_decode.py": (("B", "path"), {"tok_s": +1, "steady_tok_s": +1}),
    # The call's time, and its share of the read probe timed in the same turns (steadier on a
    # shared machine, whose memory speed drifts between runs).
    "bench_kernel.py": (("heads", "B", "lengths", "dtype"), {"ms": -1, "frac_bw": +1}),
    "bench_quantized.py": (("case", "kernel"), {"ms": -1, "hot_ms": -1, "frac_bw": +1, "vs_float16": +1}),
    "bench_server.py": (
        ("server", "scenario"),
        {"largest_gap_s": -1, "seconds": -1, "ttft_p50_s": -1, "itl_p99_s": -1},
    ),
}


def generic_metrics(row):
    """(metric, direction) of every numeric field named like a rate or a time."""
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key.endswith("tok_s"):
                yield key, +1
            elif key.endswith(("_s", "_ms")):
                yield key, -1


def metrics_of(script, payload):
    """{(row label, metric): (value, direction)} of one run's saved JSON."""
    out = {}
    for i, row in enumerate(payload.get("rows", [])):
        if script in METRICS:
            names, wanted = METRICS[script]
            label = " ".join(f"{n}={row[n]}" for n in names if n in row)
            pairs = [(k, d) for k, d in wanted.items() if row.get(k) is not None]
        else:
            label = " ".join(str(v) for v in row.values() if isinstance(v, str)) or f"row {i}"
            pairs = list(generic_metrics(row))
        for key, direction in pairs:
            out[(label, key)] = (float(row[key]), direction)
    return out


def describe_tree(tree):
    """The commit of the checkout holding ``tree`` (with -dirty for uncommitted changes)."""
    result = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"],
                            capture_output=True, text=True)
    return result.stdout.strip() or "not a git checkout"


def child_env(tree):
    return dict(os.environ, PYTHONPATH=str(tree))


def check_import(tree):
    """Fail unless ``import mlx_batched_decode`` with this PYTHONPATH resolves inside ``tree``."""
    found = subprocess.run(
        [sys.executable, "-c", "import mlx_batched_decode as m; print(m.__file__)"],
        env=child_env(tree), cwd=tempfile.gettempdir(), capture_output=True, text=True,
    ).stdout.strip()
    if not found or Path(tree).resolve() not in Path(found).resolve().parents:
        sys.exit(f"with PYTHONPATH={tree} the package imports from {found or 'nowhere'}")


def run_once(scripts_dir, tree, command):
    """Runs ``command`` (a script under benchmarks/ and its flags) in a fresh copy of
    ``scripts_dir`` against ``tree``; returns (seconds, the JSON it saved)."""
    with tempfile.TemporaryDirectory(prefix="ab_") as tmp:
        work = Path(tmp, "benchmarks")
        shutil.copytree(scripts_dir, work, ignore=shutil.ignore_patterns("results", "__pycache__", "*.png"))
        tests = scripts_dir.parent / "tests"  # a few scripts import tests.* from the repository root
        if tests.is_dir():
            Path(tmp, "tests").symlink_to(tests)
        script = work / Path(command[0]).name
        log = Path(tmp, "run.log")
        start = time.perf_counter()
        with open(log, "w") as out:
            rc = subprocess.run([sys.executable, str(script), *command[1:]], env=child_env(tree),
                                cwd=tmp, stdout=out, stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - start
        saved = sorted((work / "results").glob("*.json"))
        if rc != 0 or len(saved) != 1:
            print(log.read_text()[-4000:], file=sys.stderr)
            sys.exit(f"{script.name} against {tree}: exit status {rc}, {len(saved)} JSON files saved")
        return seconds, json.loads(saved[0].read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, type=Path, help="folder holding the base mlx_batched_decode")
    parser.add_argument("--head", required=True, type=Path, help="folder holding the head mlx_batched_decode")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of one base and one head run (default 3)")
    parser.add_argument("--scripts", type=Path, default=HERE.parent,
                        help="checkout whose benchmarks/ both sides run (default: the one holding this file)")
    parser.add_argument("--own-scripts", action="store_true",
                        help="each side runs its own checkout's benchmarks/ (the parent of --base / --head)")
    parser.add_argument("--threshold", type=float, default=0.03, help="flag a head slower by more (default 0.03)")
    parser.add_argument("--output", help="results/<name>.json (default ab_<script name>)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- benchmarks/SCRIPT.py [flags]")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark command after --")
    script = Path(command[0]).name

    trees = {"base": args.base.resolve(), "head": args.head.resolve()}
    scripts = {side: (tree.parent if args.own_scripts else args.scripts.resolve()) / "benchmarks"
               for side, tree in trees.items()}
    for side, tree in trees.items():
        check_import(tree)
        if not (scripts[side] / script).is_file():
            sys.exit(f"no {script} in {scripts[side]}")
        print(f"{side}: {tree} ({describe_tree(tree)}), scripts {scripts[side]}")
    print(f"command: {' '.join(command)}; {args.repeats} rounds, base and head alternated")

    values = {"base": {}, "head": {}}  # (label, metric) -> [value per run]
    directions, seconds = {}, {"base": [], "head": []}
    for round_ in range(args.repeats):
        for side in ("base", "head") if round_ % 2 == 0 else ("head", "base"):
            took, payload = run_once(scripts[side], trees[side], command)
            seconds[side].append(took)
            for key, (value, direction) in metrics_of(script, payload).items():
                values[side].setdefault(key, []).append(value)
                directions[key] = direction
            print(f"  round {round_ + 1}/{args.repeats} {side}: {took:.0f} s", file=sys.stderr, flush=True)

    rows = []
    for key, direction in directions.items():
        base, head = values["base"].get(key), values["head"].get(key)
        if not base or not head:
            continue
        row = {"row": key[0], "metric": key[1], "better": "higher" if direction > 0 else "lower",
               "base": statistics.median(base), "head": statistics.median(head),
               "base_runs": base, "head_runs": head}
        row["base_spread"] = (max(base) - min(base)) / row["base"] if row["base"] else None
        row["head_spread"] = (max(head) - min(head)) / row["head"] if row["head"] else None
        row["ratio"] = row["head"] / row["base"] if row["base"] else None
        # Slower: a rate below base, or a time above it, by more than the threshold.
        row["slower"] = row["ratio"] is not None and (
            row["ratio"] < 1 - args.threshold if direction > 0 else row["ratio"] > 1 + args.threshold
        )
        row["flag"] = "SLOWER" if row["slower"] else ""
        rows.append(row)

    print(f"\nmedians over {args.repeats} runs a side; spread = (max - min) / median")
    print_table(rows, [
        ("row", "row", "{}"), ("metric", "metric", "{}"), ("better", "better", "{}"),
        ("base", "base", "{:.4g}"), ("base_spread", "spread", "{:.1%}"),
        ("head", "head", "{:.4g}"), ("head_spread", "spread", "{:.1%}"),
        ("ratio", "head/base", "{:.3f}"), ("flag", f"> {args.threshold:.0%} slower", "{}"),
    ])
    slower = [f"{r['row']} {r['metric']}" for r in rows if r["slower"]]
    path = save(args.output or f"ab_{Path(script).stem}", {
        "machine": machine(), "command": command, "repeats": args.repeats, "threshold": args.threshold,
        "trees": {side: {"path": str(tree), "commit": describe_tree(tree), "scripts": str(scripts[side])}
                  for side, tree in trees.items()},
        "run_seconds": seconds, "rows": rows, "slower": slower,
    })
    print(f"\nsaved {path}")
    print(f"SLOWER by more than {args.threshold:.0%}: {', '.join(slower)}" if slower
          else f"OK: no metric more than {args.threshold:.0%} slower")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
