"""Runs a fixed set of small cases through a harness library and checks them.

A separate process, so that a sanitizer build can be loaded under LD_PRELOAD:
``python -m metal_emu.check_cases LIBRARY [--cases SET] [--no-nan-margins] [--poison-unread]
[--backend threads] [--max-threads N]``.
Prints one line per case; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .cases import attended, make_case, make_ring_case, ring_unread
from .driver import EmulatedLibrary
from .ragged_cases import make_ragged_case
from .reference import TOLERANCE, to_float64

# make_case arguments. Both launch paths, every dtype, fast and generic head
# dims, L > 1, kv_starts, windows, sinks, rows with no key, clamped positions.
CASE_SETS = {
    "small": [
        dict(dtype="float16", d=64, h_kv=2, g=4, t=24, lens=[24, 0, 1, 3, 30, -2]),
        dict(dtype="bfloat16", d=80, h_kv=1, g=3, t=140, lens=[140, 5, 0, 200], rows=3, window=130, sinks=True),
        dict(dtype="float32", d=256, h_kv=1, g=1, t=130, lens=[129, 64, 1], rows=5, starts=[3, -4, 0], sinks=True),
        dict(dtype="float32", d=96, h_kv=1, g=12, t=20, lens=[20, 2], rows=2, starts=[25, 1], window=4),
        dict(dtype="float16", d=24, h_kv=1, g=2, t=70, lens=[70, 9], rows=8, starts=[2, 3], window=7, sinks=True),
    ],
    # Positions far outside [0, T], a window wider than T, more rows than keys.
    # Splits of 66 keys end past T = 131, so an unclamped length reads past the
    # K/V allocations, an unclamped negative start before them.
    "adversarial": [
        dict(dtype="float32", d=64, h_kv=1, g=1, t=131, lens=[131, 10_000]),
        dict(dtype="float32", d=64, h_kv=1, g=2, t=131, lens=[131, 2**31 - 1, -(2**31), 5, 131], rows=3,
             starts=[-(2**31), -7, 2**31 - 1, 200, 130], window=10**6),
        dict(dtype="float16", d=48, h_kv=2, g=1, t=131, lens=[131, 3], rows=9, starts=[-5, -1], window=2, sinks=True),
    ],
    # Views whose rows are off the vector width (row strides of D + 1 or D + 2
    # elements, first elements shifted off a 16-byte boundary), which the fast
    # kernels read with scalar loads; UBSan reports any misaligned vector load.
    "unaligned": [
        dict(dtype="float16", d=64, h_kv=2, g=4, t=24, lens=[24, 0, 7], rows=2, row_pad=1, sinks=True),
        dict(dtype="float32", d=256, h_kv=1, g=2, t=20, lens=[20, 9], rows=3, window=5, shift=2),
        dict(dtype="bfloat16", d=80, h_kv=1, g=3, t=140, lens=[140, 77], starts=[3, 0], row_pad=1, shift=1),
    ],
}


# make_ragged_case arguments, run with buffers of exactly the views' size (no capacity, no row
# padding): lengths far above T_b, negative or at 2^31 - 1, T_b = 0, starts far outside [0, T],
# several dispatch groups. Split-K takes 66 keys per split of T = 131: a length clamped to T
# instead of T_b reads past request 1's 5 positions.
RAGGED_CASE_SETS = {
    "ragged_adversarial": [
        dict(dtype="float32", d=64, h_kv=1, g=2, lengths=[131, 5, 0, 64, 1],
             valid_lens=[10_000, 2**31 - 1, 7, -(2**31), 131], rows=3, starts=[-(2**31), 0, 3, 2**31 - 1, -7],
             window=10**6, layouts=("exact",)),
        dict(dtype="float16", d=48, h_kv=2, g=1, lengths=[9, 0, 30, 3] * 5, valid_lens=[40, 3, 31, 2**31 - 1] * 5,
             rows=2, window=2, sinks=True, layouts=("exact", "3d", "token_major")),
        dict(dtype="bfloat16", d=64, h_kv=1, g=4, lengths=[40, 40, 40, 7], valid_lens=[41, 1000, 39, 8],
             layouts=("shared", "shared", "shared", "exact")),
    ],
    # Rows of D + 1 elements: the launch plan must choose scalar loads for the whole call.
    "ragged_unaligned": [
        dict(dtype="float16", d=64, h_kv=2, g=2, lengths=[20, 7, 13], rows=2, row_pad=1,
             layouts=("slice", "3d", "token_major")),
    ],
}


# make_ring_case arguments, run with buffers of exactly the views' size: ring offsets far outside
# [0, T] and at its ends, given to the kernel raw (its own modulo keeps every slot in [0, T)),
# with lengths and starts outside [0, T] too; split-K (the first), single pass, a generic head dim.
RING_CASE_SETS = {
    "ring_adversarial": [
        dict(dtype="float32", d=64, h_kv=1, g=2, t=131, lens=[131, 10_000, 5, 131, -3, 70], rows=3,
             starts=[0, -7, 2, 130, 0, 2**31 - 1], window=10**6,
             ring=[2**31 - 1, -(2**31), -1, 130, 131 * 7 + 3, 131]),
        dict(dtype="float16", d=1, h_kv=2, g=1, t=40, lens=[40, 3, 39], rows=4, window=5, sinks=True,
             ring=[-5, 2**31 - 2, 39]),
        dict(dtype="bfloat16", d=128, h_kv=1, g=4, t=20, lens=[20, 20, 11], starts=[3, 0, 0],
             ring=[-(2**31) + 1, 19, 2**30]),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("library", type=Path)
    parser.add_argument("--cases", choices=sorted(CASE_SETS) + sorted(RAGGED_CASE_SETS) + sorted(RING_CASE_SETS),
                        default="small")
    parser.add_argument("--no-nan-margins", action="store_true")
    parser.add_argument("--poison-unread", action="store_true",
                        help="AddressSanitizer reports a read of any K/V position no query row attends")
    parser.add_argument("--backend", choices=["fibers", "threads"], default="fibers")
    parser.add_argument("--max-threads", type=int, default=1024, help="the pipeline's thread limit")
    args = parser.parse_args()
    lib = EmulatedLibrary(args.library)
    rng = np.random.default_rng(5)
    for spec in RAGGED_CASE_SETS.get(args.cases, []):
        case = make_ragged_case(rng, extra_capacity=0, **spec)
        out = case.run(lib, max_threads=args.max_threads, backend=args.backend, nan_margins=not args.no_nan_margins,
                       unreadable=case.unread() if args.poison_unread else None)
        np.testing.assert_allclose(to_float64(out, case.dtype), case.reference(), atol=TOLERANCE[case.dtype],
                                   rtol=TOLERANCE[case.dtype])
        print("ok", " ".join(f"{k}={v}" for k, v in spec.items()))
    for spec in RING_CASE_SETS.get(args.cases, []):
        case = make_ring_case(rng, extra_capacity=0, **spec)
        out = case.run(lib, max_threads=args.max_threads, backend=args.backend, nan_margins=not args.no_nan_margins,
                       unreadable=ring_unread(case) if args.poison_unread else None)
        np.testing.assert_allclose(to_float64(out, case.dtype), case.reference(), atol=TOLERANCE[case.dtype],
                                   rtol=TOLERANCE[case.dtype])
        print("ok", " ".join(f"{k}={v}" for k, v in spec.items()))
    for spec in CASE_SETS.get(args.cases, []):
        shift = spec.get("shift", 0)
        case = make_case(rng, extra_capacity=0, **{k: v for k, v in spec.items() if k != "shift"})
        unread = None
        if args.poison_unread:
            unread = ~attended(case.valid_lens, case.kv_starts, case.queries.shape[2], case.keys.shape[2], case.window)
        out = case.run(lib, max_threads=args.max_threads, backend=args.backend,
                       nan_margins=not args.no_nan_margins, unreadable=unread, shift=shift)
        np.testing.assert_allclose(to_float64(out, case.dtype), case.reference(), atol=TOLERANCE[case.dtype],
                                   rtol=TOLERANCE[case.dtype])
        print("ok", " ".join(f"{k}={v}" for k, v in spec.items()))


if __name__ == "__main__":
    main()
