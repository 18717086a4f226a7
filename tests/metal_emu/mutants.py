"""Copies of the real kernel source with one injected bug each (mutation tests)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .build import CACHE
from .sources import kernel_sources

# name: (original text, replacement)
MUTATIONS = {
    "removed_threadgroup_barrier": (
        "      threadgroup_barrier(mem_flags::mem_threadgroup);\n      // Output rows are",
        "      // Output rows are",
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
        "      sg_sum[sg][r] = l[r];\n",
        "      if (sg + 1 < num_sg) { sg_sum[sg][r] = l[r]; }\n",
    ),
    "simdgroup_returns_before_barrier": (
        "  threadgroup float sg_max[",
        "  if (sg == 1) { return; }\n  threadgroup float sg_max[",
    ),
    # A window of T keys is no window.
    "removed_window_bound": (
        "row_i[r], p.window);",
        "row_i[r], p.seq_len);",
    ),
    "removed_kv_starts_clamp": (
        "clamp(kv_starts[b * p.starts_stride], 0, p.seq_len)",
        "kv_starts[b * p.starts_stride]",
    ),
    "removed_sink_term": (
        "l * f + exp(sink - m_all)",
        "l * f",
    ),
    "key_past_causal_end": (
        "pos + 1};",
        "pos + 2};",
    ),
}


def mutant_source(name: str, kernels: Iterable[str] | None = None) -> Path:
    """A copy of the kernel sources with mutation ``name`` applied exactly once,
    instantiating only the main kernels ``kernels`` (None: all), see ``sources``."""
    # A stable path: the build cache keys on it.
    return kernel_sources(CACHE / "mutants" / name, kernels, MUTATIONS[name])
