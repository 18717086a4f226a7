"""Copies of the real kernel source with one injected bug each (mutation tests)."""

from __future__ import annotations

import shutil
from pathlib import Path

from .build import CACHE, KERNEL_SOURCE

HEADER = "batched_decode_attention.h"

# name: (original text, replacement)
MUTATIONS = {
    "removed_threadgroup_barrier": (
        "      threadgroup_barrier(mem_flags::mem_threadgroup);\n      const int row = row0 + g;\n",
        "      const int row = row0 + g;\n",
    ),
    "removed_length_clamp": (
        "const int len = clamp(valid_lens[b * p.lens_stride], 0, p.seq_len);",
        "const int len = valid_lens[b * p.lens_stride];",
    ),
    "simd_sum_in_half_the_lanes": (
        "        s = simd_sum(s);\n",
        "        if (lane < 16) { s = simd_sum(s); }\n",
    ),
    "unwritten_threadgroup_slot": (
        "      sg_sum[sg][g] = l[g];\n",
        "      if (sg + 1 < num_sg) { sg_sum[sg][g] = l[g]; }\n",
    ),
    "simdgroup_returns_before_barrier": (
        "  threadgroup float sg_max[",
        "  if (sg == 1) { return; }\n  threadgroup float sg_max[",
    ),
}

def mutant_source(name: str) -> Path:
    """A copy of the kernel sources with mutation ``name`` applied exactly once."""
    original, replacement = MUTATIONS[name]
    directory = CACHE / "mutants" / name  # stable path: the build cache keys on it
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(KERNEL_SOURCE.parent, directory)
    header = directory / HEADER
    text = header.read_text()
    assert text.count(original) == 1, f"mutation {name} no longer matches the kernel source"
    header.write_text(text.replace(original, replacement))
    return directory / KERNEL_SOURCE.name
