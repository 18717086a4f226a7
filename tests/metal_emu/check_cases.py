"""Runs a fixed set of small cases through a harness library and checks them.

A separate process, so that a sanitizer build can be loaded under LD_PRELOAD:
``python -m metal_emu.check_cases LIBRARY [--cases SET] [--no-nan-tail] [--backend threads]
[--max-threads N]``.
Prints one line per case; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .cases import make_case
from .driver import EmulatedLibrary
from .reference import TOLERANCE, to_float64

# (dtype, D, H_kv, G, T, lengths): both paths, every dtype, clamped lengths.
CASE_SETS = {
    "small": [
        ("float16", 64, 2, 4, 24, [24, 0, 1, 3, 30, -2]),
        ("bfloat16", 80, 1, 8, 140, [140, 5, 0, 200]),
        ("float32", 256, 1, 1, 130, [129, 64, 1]),
        ("float32", 96, 1, 12, 20, [20, 2]),
    ],
    # Lengths far past T; 2 splits of 66 keys end past T = 131, so an unclamped
    # kernel reads past the K/V allocations.
    "overlong": [("float32", 64, 1, 1, 131, [131, 10_000])],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("library", type=Path)
    parser.add_argument("--cases", choices=sorted(CASE_SETS), default="small")
    parser.add_argument("--no-nan-tail", action="store_true")
    parser.add_argument("--backend", choices=["fibers", "threads"], default="fibers")
    parser.add_argument("--max-threads", type=int, default=1024, help="the pipeline's thread limit")
    args = parser.parse_args()
    lib = EmulatedLibrary(args.library)
    rng = np.random.default_rng(5)
    for dtype, d, h_kv, g, t, lens in CASE_SETS[args.cases]:
        case = make_case(rng, dtype, d, h_kv, g, t, lens, extra_capacity=0)
        out = lib.attention(case.queries, case.keys, case.values, case.valid_lens, dtype, case.scale,
                            max_threads=args.max_threads, backend=args.backend, nan_tail=not args.no_nan_tail)
        np.testing.assert_allclose(to_float64(out, dtype), case.reference(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        print(f"ok {dtype} D={d} H_kv={h_kv} G={g} T={t} lens={lens}")


if __name__ == "__main__":
    main()
