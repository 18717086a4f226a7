"""Soak run: a simulated server decoding with requests joining and leaving at random.

Checks every request's output against its isolated attention at sampled steps and at every
capacity boundary, and MLX active memory at every drain of the batch; prints the counts and
saves them as JSON (results/soak.json). Exits non-zero at the first failure.

    python benchmarks/soak.py --steps 10000
"""

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root, for tests.*

from common import machine, save  # noqa: E402
from tests.support.server_sim import Server, SoakConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10000, help="decode steps to simulate")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and of all K/V/Q")
    parser.add_argument("--output", default="soak", help="results/<name>.json")
    args = parser.parse_args()

    cfg = SoakConfig(steps=args.steps, seed=args.seed)
    report = Server(cfg).run()
    # Failures raise inside run(); the memory invariants are checked here.
    leaks = [x for x in report.excess_with_caches if x] + [
        m - report.baseline_memory for m in report.memory_after_drain if m != report.baseline_memory
    ]
    for name, value in dataclasses.asdict(report).items():
        if isinstance(value, list):
            value = f"{len(value)} values, min {min(value, default=0)}, max {max(value, default=0)}"
        print(f"{name:20s} {value}")
    payload = {"config": dataclasses.asdict(cfg), "report": dataclasses.asdict(report)}
    path = save(args.output, {"machine": machine(), **payload})
    print(f"saved {path}")
    if leaks:
        sys.exit(f"memory did not return to its baseline at a drain: {leaks}")


if __name__ == "__main__":
    main()
