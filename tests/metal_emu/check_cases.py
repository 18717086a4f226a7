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

# make_case arguments (plus ``shift``, and ``query_starts``: given to the kernel in place of those
# of ``query_rows``). Both launch paths, every dtype, fast and generic head dims, L > 1, packed
# queries, values of their own head dim, kv_starts, windows, sinks, a softcap, rows with no key,
# clamped positions.
CASE_SETS = {
    "small": [
        dict(dtype="float16", d=64, h_kv=2, g=4, t=24, lens=[24, 0, 1, 3, 30, -2]),
        dict(dtype="bfloat16", d=80, h_kv=1, g=3, t=140, lens=[140, 5, 0, 200], rows=3, window=130, sinks=True),
        dict(dtype="float32", d=256, h_kv=1, g=1, t=130, lens=[129, 64, 1], rows=5, starts=[3, -4, 0], sinks=True),
        dict(dtype="float32", d=96, h_kv=1, g=12, t=20, lens=[20, 2], rows=2, starts=[25, 1], window=4),
        dict(dtype="float16", d=24, h_kv=1, g=2, t=70, lens=[70, 9], rows=8, starts=[2, 3], window=7, sinks=True),
        dict(dtype="float32", d=64, h_kv=2, g=2, t=70, lens=[70, 12, 0], rows=2, window=20, sinks=True, scale=0.5,
             softcap=5.0),
        dict(dtype="float16", d=192, dv=128, h_kv=2, g=4, t=40, lens=[40, 3, 0, 17], query_rows=[5, 1, 0, 9],
             starts=[0, 0, 0, 3], window=12, sinks=True),
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
    # Packed queries with lengths and starts far outside [0, T], requests of more rows than keys, of
    # none, split-K (T = 131), MLA's latent (values a view of the keys); then malformed
    # query_starts (a decrease, a huge last, a short last, a negative first): zeros, no K/V read.
    "packed_adversarial": [
        dict(dtype="float32", d=64, h_kv=1, g=2, t=131, lens=[131, 2**31 - 1, -5, 10_000], query_rows=[3, 0, 2, 37],
             starts=[-(2**31), 0, 2**31 - 1, 7], window=10**6),
        dict(dtype="bfloat16", d=576, dv=512, latent=True, h_kv=1, g=16, t=20, lens=[20, 25, 3], query_rows=[2, 1, 5],
             sinks=True),
        dict(dtype="float32", d=64, h_kv=1, g=2, t=131, lens=[131, 5, 70, 9], query_rows=[3, 2, 0, 37],
             query_starts=[0, 3, 1, 5, 42]),
        dict(dtype="float16", d=100, dv=64, h_kv=2, g=2, t=30, lens=[30, 5], query_rows=[4, 3],
             query_starts=[0, 4, 2**31 - 1]),
        dict(dtype="float16", d=64, h_kv=2, g=4, t=30, lens=[30, 5], query_rows=[4, 3], query_starts=[0, 4, 6]),
        dict(dtype="float32", d=64, h_kv=1, g=1, t=131, lens=[131, 5], query_rows=[4, 3],
             query_starts=[-(2**31), 4, 7]),
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
        # Packed queries and values narrower than keys, over several dispatch groups.
        dict(dtype="float32", d=64, dv=32, h_kv=1, g=2, lengths=[131, 5, 0, 64] * 5,
             valid_lens=[10_000, 7, 3, 64] * 5, query_rows=[2, 3, 1, 0] * 5, window=10**6, layouts=("exact",)),
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
        case = make_case(rng, extra_capacity=0, **{k: v for k, v in spec.items() if k not in ("shift", "query_starts")})
        if "query_starts" in spec:
            case.query_starts = np.array(spec["query_starts"], dtype=np.int32)
        unread = None
        if args.poison_unread:
            unread = ~attended(case.valid_lens, case.kv_starts, case.rows(), case.keys.shape[2], case.window)
        out = case.run(lib, max_threads=args.max_threads, backend=args.backend,
                       nan_margins=not args.no_nan_margins, unreadable=unread, shift=shift)
        np.testing.assert_allclose(to_float64(out, case.dtype), case.reference(), atol=TOLERANCE[case.dtype],
                                   rtol=TOLERANCE[case.dtype])
        print("ok", " ".join(f"{k}={v}" for k, v in spec.items()))


if __name__ == "__main__":
    main()
