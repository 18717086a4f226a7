"""The grid of cases the self-test runs: every op x dtype x head dim x GQA group x variant.

Dimension legend: B requests, H_q query heads, H_kv key/value heads, G = H_q / H_kv,
L query rows per request, T padded length, D head dim.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import mlx.core as mx

OPS = ("dense", "paged", "quantized", "ragged")
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# Deliberately uneven: an empty request, one shorter than L, lengths off every block and
# vector width, and one long enough that the GPU splits its keys (split-K); the full grid
# cycles through longer ones too.
QUICK_LENS = (1, 17, 0, 300, 97)
FULL_LENS = (QUICK_LENS, (1500, 3, 61), (4099,))

QUICK_HEAD_DIMS = (64, 80, 128)
FULL_HEAD_DIMS = (1, 32, 64, 80, 96, 100, 128, 160, 192, 256, 512)
QUICK_GROUPS = (1, 4)
FULL_GROUPS = (1, 2, 4, 8)

# (bits, group_size) cycled over the quantized cases; a pair whose group size does not divide
# D is skipped for that D.
QUANTIZATIONS = ((8, 64), (4, 32), (8, 128), (4, 64), (8, 32), (4, 128))
BLOCK_SIZES = (16, 32, 8)


@dataclass(frozen=True)
class Variant:
    """What a case adds to plain one-row decode: L rows, a window, sinks, kv_starts, a ring, a
    softcap (scores c * tanh(s / c); 1.0 caps most scores of unit-normal inputs), packed rows
    (query_starts: request i brings its own count of up to ``rows + 1`` rows, 0 included) and
    narrow values (a head dim of their own, ``Case.value_dim``)."""

    rows: int = 1
    window: int | None = None
    sinks: bool = False
    starts: bool = False
    ring: bool = False
    softcap: float | None = None
    packed: bool = False
    narrow_values: bool = False


VARIANTS = (
    Variant(),
    Variant(rows=3, sinks=True, softcap=1.0),
    Variant(window=7, starts=True),
    Variant(rows=4, window=16, sinks=True, starts=True, softcap=1.0),
    Variant(rows=2, starts=True, ring=True, softcap=1.0),
    Variant(rows=5, window=9, sinks=True, packed=True, narrow_values=True),
    Variant(rows=3, starts=True, softcap=1.0, packed=True),
)


@dataclass(frozen=True)
class Case:
    """One call of one op, and what it is compared on."""

    op: str
    dtype: mx.Dtype
    head_dim: int
    group: int
    lens: tuple[int, ...]
    variant: Variant = Variant()
    kv_heads: int = 2
    block_size: int = 16
    bits: int = 8
    group_size: int = 64
    seed: int = 0

    @property
    def label(self) -> str:
        """The case in one short line: what a report needs to rerun it."""
        v = self.variant
        parts = [f"D={self.head_dim}", f"G={self.group}", f"H_kv={self.kv_heads}", f"L={v.rows}"]
        parts += [f"window={v.window}"] if v.window else []
        parts += ["sinks"] if v.sinks else []
        parts += ["starts"] if v.starts else []
        parts += ["ring"] if v.ring else []
        parts += [f"softcap={v.softcap:g}"] if v.softcap else []
        parts += ["packed"] if v.packed else []
        parts += [f"Dv={self.value_dim}"] if v.narrow_values else []
        parts += [f"block={self.block_size}"] if self.op == "paged" else []
        parts += [f"bits={self.bits} gs={self.group_size}"] if self.op == "quantized" else []
        return " ".join(parts + ["lens=" + ",".join(map(str, self.lens))])

    @property
    def value_dim(self) -> int:
        """The values' head dim: D, or with narrow values D // 2 + 8 (for the quantized op
        rounded down to a multiple of its group size, a group at least)."""
        if not self.variant.narrow_values:
            return self.head_dim
        dv = self.head_dim // 2 + 8
        if self.op == "quantized":
            return max(dv // self.group_size, 1) * self.group_size
        return dv


def row_counts(variant: Variant, requests: int) -> list[int]:
    """Rows of each request: L each, or for packed rows 0 to L + 1 by request (at least one in all)."""
    if not variant.packed:
        return [variant.rows] * requests
    counts = [(i * 5 + 2) % (variant.rows + 2) for i in range(requests)]
    return counts if sum(counts) else [1] + counts[1:]


def fit(op: str, variant: Variant) -> Variant:
    """The variant as ``op`` takes it: only the dense op has a ring, the paged op no kv_starts."""
    ring, starts = variant.ring and op == "dense", variant.starts and op != "paged"
    return replace(variant, ring=ring, starts=starts)


def grid(quick: bool, ops: tuple[str, ...] = OPS) -> list[Case]:
    """Every case of the quick or the full grid, for ``ops``.

    Quick: each op x dtype x D in (64, 80, 128) x G in (1, 4) x every variant, on one set of
    lengths (462 cases). Full: D from 1 to 512 (the specialised head dims and generic ones) x G
    up to 8 x every variant, the cases taking the three sets of lengths in turn (about 3,500).
    """
    head_dims = QUICK_HEAD_DIMS if quick else FULL_HEAD_DIMS
    groups = QUICK_GROUPS if quick else FULL_GROUPS
    lens_sets = (QUICK_LENS,) if quick else FULL_LENS
    cases = []
    for op in ops:
        combos = itertools.product(DTYPES, head_dims, groups, VARIANTS)
        for i, (dtype, d, g, variant) in enumerate(combos):
            lens = lens_sets[i % len(lens_sets)]
            quantizations = [(b, gs) for b, gs in QUANTIZATIONS if d % gs == 0]
            if op == "quantized" and not quantizations:
                continue
            bits, group_size = quantizations[i % len(quantizations)] if quantizations else (8, 64)
            cases.append(Case(
                op, dtype, d, g, lens, fit(op, variant),
                block_size=BLOCK_SIZES[i % len(BLOCK_SIZES)], bits=bits, group_size=group_size, seed=i,
            ))
    return cases
