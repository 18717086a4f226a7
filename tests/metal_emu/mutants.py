"""Copies of the real kernel source with one injected bug each (mutation tests)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from .build import CACHE, HOST, HOST_HEADERS
from .sources import kernel_sources

# name: (original text, replacement)
MUTATIONS = {
    "removed_threadgroup_barrier": (
        "      threadgroup_barrier(mem_flags::mem_threadgroup);\n      const int64_t out_row = bda_out_row(",
        "      const int64_t out_row = bda_out_row(",
    ),
    # (bound kept used: warnings fail the build.)
    "removed_length_clamp": (
        "const int len = clamp(valid_lens[b * p.lens_stride], 0, bound);",
        "const int len = valid_lens[b * p.lens_stride] + 0 * bound;",
    ),
    "simd_sum_in_half_the_lanes": (
        "        s = simd_sum(s);\n",
        "        if (lane < 16) { s = simd_sum(s); }\n",
    ),
    "unwritten_threadgroup_slot": (
        "      sg_sum[sg][r] = l[r];\n",
        "      if (sg + 1 < num_sg) { sg_sum[sg][r] = l[r]; }\n",
    ),
    # Tiles of keys that several row chunks share (cases of L = 3: 12 rows, two chunks): read
    # before every simdgroup has staged its row, or the chunks' states merged together.
    "tile_read_before_it_is_staged": (
        "      // The tile is whole before any simdgroup reads it.\n      threadgroup_barrier(mem_flags::mem_threadgroup);\n",
        "",
    ),
    # A tile restaged while other simdgroups still read it: a race the fiber schedule never
    # shows, ThreadSanitizer's build does (tests/kernels/metal/test_metal_sanitizers.py).
    "tile_overwritten_while_read": (
        "    if (staged) {\n      // The next tile (or the merge) overwrites this one only once every simdgroup has read it.\n"
        "      threadgroup_barrier(mem_flags::mem_threadgroup);\n    }\n",
        "",
    ),
    "chunks_merged_across_simdgroup_sets": (
        "const uint set = uint(chunk * streams);",
        "const uint set = uint(0 * chunk * streams);",
    ),
    # The threadgroup's keys: those of its first i only.
    "group_keys_of_the_first_position": (
        "i <= (group_end - 1) / p.gqa_factor; ++i) {",
        "i <= (group_end - 1) / p.gqa_factor && i == group_first / p.gqa_factor; ++i) {",
    ),
    "simdgroup_returns_before_barrier": (
        "  threadgroup float sg_max[",
        "  if (sg == 1) { return; }\n  threadgroup float sg_max[",
    ),
    # No window: every row (and so the threadgroup's interval) takes the keys from the start.
    "removed_window_bound": (
        "max(start, pos - window + 1)",
        "start + 0 * window",
    ),
    "removed_kv_starts_clamp": (
        "clamp(kv_starts[b * p.starts_stride], 0, p.seq_len)",
        "kv_starts[b * p.starts_stride]",
    ),
    "removed_sink_term": (
        "l * f + exp(sink - m_all)",
        "l * f",
    ),
    # Scores never capped, whatever p.softcap says (softcap is never negative).
    "softcap_dropped": (
        "if (softcap > 0.0f) {\n            s = softcap * precise::tanh(s / softcap);",
        "if (softcap < 0.0f) {\n            s = softcap * precise::tanh(s / softcap);",
    ),
    "key_past_causal_end": (
        "pos + 1};",
        "pos + 2};",
    ),
    # The online softmax's exp(-inf - -inf): a key scoring -inf as a state's first turns it NaN.
    "unguarded_rescale": (
        "const float factor = bda_weight(m[r], m_new);",
        "const float factor = exp(m[r] - m_new);",
    ),
    "unguarded_probability": (
        "const float prob = bda_weight(s, m_new);",
        "const float prob = exp(s - m_new);",
    ),
    # The former answer for a row whose scores are all -inf: zeros instead of NaN.
    "all_minus_inf_row_gives_zeros": (
        "  const float m_all = max(m, sink);\n",
        "  if (m == -bda_inf) {\n    return 0.0f;\n  }\n  const float m_all = max(m, sink);\n",
    ),
    "row_without_keys_not_zeroed": (
        "const bool has_keys = row_lo[r] < row_hi[r] &&",
        "const bool has_keys = true ||",
    ),
    # Paged row source (tests/kernels/metal/test_metal_paged_mutations.py): a table entry outside the
    # pool, inside the length, is dereferenced.
    "paged_entry_above_pool_read": (
        "if (page < 0 || page >= p.num_blocks) {",
        "if (page < 0) {",
    ),
    "paged_out_of_pool_row_read": (
        "      if (!row.valid) {\n        continue;\n      }\n",
        "",
    ),
    # The same when several row chunks share a staged tile: the row is staged and scored.
    "paged_out_of_pool_row_staged": (
        "bda_tile_valid[key] = row.valid ? 1 : 0;\n        }\n        if (!row.valid) {\n          continue;\n        }\n",
        "bda_tile_valid[key] = 1;\n        }\n",
    ),
    # A row whose pages all lie outside the pool is 0/0 instead of zeros.
    "paged_row_without_keys_not_zeroed": (
        "(m_max != -bda_inf || bda_holds_key(kv_starts, p, b, row_lo[r], row_hi[r]));",
        "true;",
    ),
    # Ragged row source (tests/kernels/metal/test_metal_ragged_mutations.py): a length clamped to the
    # longest T_b (T), not the request's own, in both passes.
    "ragged_length_unclamped": (
        "const int bound = p.ragged ? requests[b].length : p.seq_len;",
        "const int bound = p.ragged ? max(requests[b].length, p.seq_len) : p.seq_len;",
    ),
    "ragged_values_in_the_keys_slot": (
        "values = slots.pick(r.v_slot) + r.v_offset",
        "values = slots.pick(r.k_slot) + r.v_offset",
    ),
    "ragged_wrong_slot": (
        "      case 1: return slot[1];\n",
        "      case 1: return slot[0];\n",
    ),
    # Every group serves requests 0 .. count - 1 (the parameter kept used: warnings fail the build).
    "ragged_group_offset_ignored": (
        "tgid, group.first_request, group.num_requests,",
        "tgid, 0 * group.first_request, group.num_requests,",
    ),
    "ragged_request_offset_ignored": (
        "keys = slots.pick(r.k_slot) + r.k_offset + h * r.k_head_stride;",
        "keys = slots.pick(r.k_slot) + h * r.k_head_stride;",
    ),
    # Ring row source (tests/kernels/metal/test_metal_ring_emulated.py): the offset used as given, so
    # one of T + 2 reads 2 slots past the range and one of -(T + 1) the slot before it.
    "ring_modulo_dropped": (
        "const int r = ring_offsets[b * p.ring_stride] % p.seq_len;",
        "const int r = ring_offsets[b * p.ring_stride] + 0 * p.seq_len;",
    ),
    # A shift of T is none, but every other offset outside [0, T] rotates the ring wrongly.
    "ring_modulo_of_t_plus_1": (
        "ring_offsets[b * p.ring_stride] % p.seq_len;",
        "ring_offsets[b * p.ring_stride] % (p.seq_len + 1);",
    ),
    # Position T - shift read from slot T, one past the range, instead of slot 0.
    "ring_wrap_off_by_one": (
        "t < p.seq_len - shift ? t + shift",
        "t <= p.seq_len - shift ? t + shift",
    ),
    # Packed queries and values of their own head dim (tests/kernels/metal/test_metal_varlen_emulated.py):
    # each request one row short, so its rows sit one position late (and its last is never written).
    "packed_rows_one_position_late": (
        "return BdaRows{first, query_starts[(b + 1) * p.query_starts_stride] - first};",
        "return BdaRows{first, query_starts[(b + 1) * p.query_starts_stride] - first - 1};",
    ),
    # Value rows stepped by the keys' stride, which MLA's latent shares and values of their own do not.
    "value_stride_of_the_keys": (
        "int64_t(b) * p.v_batch_stride + int64_t(slot) * p.v_seq_stride}",
        "int64_t(b) * p.v_batch_stride + int64_t(slot) * p.k_seq_stride}",
    ),
    # Values and output rows as wide as the keys (the driver reports writes past the output).
    "value_dim_of_the_keys": (
        "const int value_dim = GENERIC ? p.value_dim : DV;\n  const int nk",
        "const int value_dim = GENERIC ? p.head_dim : D;\n  const int nk",
    ),
    # The tiled path (tests/kernels/metal/test_metal_tiled_emulated.py): each row's range that of
    # the next position, its scores never capped, and P V with the value block transposed.
    "tiled_position_off_by_one": (
        "mine ? bda_row_keys(request.len, request.start, own.count, row_i, p.window)",
        "mine ? bda_row_keys(request.len, request.start, own.count, row_i + 1, p.window)",
    ),
    "tiled_softcap_dropped": (
        "if (softcap > 0.0f) {\n          scores[j] =",
        "if (softcap < 0.0f) {\n          scores[j] =",
    ),
    "tiled_values_transposed": (
        "simdgroup_load(v, bda_stage + KB * D, D, ulong2(8 * d, kb));",
        "simdgroup_load(v, bda_stage + KB * D, D, ulong2(8 * d, kb), true);",
    ),
    # The tiled path's P V on a block holding a NaN or inf value: the value never noticed (every block
    # multiplied, as the kernel once did), or each row adding every key, its range forgotten.
    "tiled_non_finite_values_unnoticed": (
        "(side == 1 && isnan(bda_dot(x, floatv(0.0f))))",
        "(side == 2 && isnan(bda_dot(x, floatv(0.0f))))",
    ),
    "tiled_guarded_rows_take_every_key": (
        "if (bda_tile_holds(key, n, tile + key, range, bda_stage_valid)) {",
        "if (key < n) {",
    ),
    # Vector loads whatever the views' alignment (UBSan reports them, see test_metal_sanitizers).
    "vector_loads_whatever_the_alignment": (
        "constant bool bda_vector_loads [[function_constant(MBD_FC_VECTOR_LOADS)]];",
        "constant bool bda_vector_loads = true;",
    ),
}


# Mutations of the paged row source, run on paged cases (tests/kernels/metal/test_metal_paged_mutations.py).
PAGED_ONLY = {"paged_entry_above_pool_read", "paged_out_of_pool_row_read", "paged_out_of_pool_row_staged",
              "paged_row_without_keys_not_zeroed"}

# Mutations of the ragged row source, run on ragged cases (tests/kernels/metal/test_metal_ragged_mutations.py).
RAGGED_ONLY = {"ragged_length_unclamped", "ragged_values_in_the_keys_slot", "ragged_wrong_slot",
               "ragged_group_offset_ignored", "ragged_request_offset_ignored"}

# Mutations of the ring (dense layout with ring offsets), run on ring cases
# (tests/kernels/metal/test_metal_ring_emulated.py).
RING_ONLY = {"ring_modulo_dropped", "ring_modulo_of_t_plus_1", "ring_wrap_off_by_one"}

# Mutations of packed queries and of values' head dim, run on such cases
# (tests/kernels/metal/test_metal_varlen_emulated.py); the value dim's only on single-pass
# ones, whose writes past the output land in the driver's margins, not in the split-K partials.
VARLEN_ONLY = {"packed_rows_one_position_late", "value_stride_of_the_keys", "value_dim_of_the_keys"}

# Mutations of the tiled path, run on its cases (tests/kernels/metal/test_metal_tiled_emulated.py).
TILED_ONLY = {"tiled_position_off_by_one", "tiled_softcap_dropped", "tiled_values_transposed"}
# Mutations of the tiled path's non-finite values, run on the cases of tests/kernels/metal/test_metal_non_finite.py.
TILED_NON_FINITE_ONLY = {"tiled_non_finite_values_unnoticed", "tiled_guarded_rows_take_every_key"}

# Caught by the sanitizer builds only (tests/kernels/metal/test_metal_sanitizers.py): on x86 a
# misaligned vector load reads the right bytes (UBSan), and a tile restaged early is a race
# (ThreadSanitizer).
SANITIZER_ONLY = {"vector_loads_whatever_the_alignment", "tile_overwritten_while_read"}


def mutant_source(name: str, kernels: Iterable[str] | None = None) -> str:
    """The flattened source of a copy of the kernel sources with mutation ``name``
    applied exactly once, compiling only the main kernels ``kernels`` (None: all), see ``sources``."""
    # A stable path: the build cache keys on it.
    return kernel_sources(CACHE / "mutants" / name, kernels, MUTATIONS[name])


# Mutations of the launch plan (csrc/metal/launch_plan.h), the host side of the thread limits:
# tests/kernels/metal/test_launch_plan_mutations.py requires test_launch_plan.py to fail on each.
PLAN_HEADER = "metal/launch_plan.h"
PLAN_MUTATIONS = {
    # Threadgroups of 8 simdgroups whatever the pipeline allows: on Metal, a launch that runs nothing.
    "thread_limit_ignored": (
        "const int simdgroups = std::min(MBD_MAX_SIMDGROUPS, limits.main / MBD_SIMD_WIDTH);",
        "const int simdgroups = MBD_MAX_SIMDGROUPS + 0 * limits.main;",
    ),
    # A pipeline of fewer threads than a simdgroup planned anyway.
    "thread_limit_check_dropped": (
        "  if (limit < MBD_SIMD_WIDTH) {",
        "  if (limit < 0) {",
    ),
    "reduce_sized_by_the_main_pipeline": (
        "limits.reduce / MBD_SIMD_WIDTH * MBD_SIMD_WIDTH);",
        "limits.main / MBD_SIMD_WIDTH * MBD_SIMD_WIDTH);",
    ),
    # Every row chunk in one threadgroup, however few simdgroups the limit allows.
    "row_groups_ignored": (
        "p.row_groups = ceil_div(p.row_chunks, simdgroups);",
        "p.row_groups = 1 + 0 * simdgroups;",
    ),
}


def plan_mutant_host(name: str) -> Path:
    """A copy of the host headers the harness compiles (csrc's HOST_HEADERS) with plan
    mutation ``name`` applied exactly once, for ``build_library(..., host=...)``."""
    directory = CACHE / "plan_mutants" / name
    shutil.rmtree(directory, ignore_errors=True)
    for header in HOST_HEADERS:
        (directory / header).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(HOST / header, directory / header)
    original, replacement = PLAN_MUTATIONS[name]
    path = directory / PLAN_HEADER
    text = path.read_text()
    assert text.count(original) == 1, f"{original!r} no longer matches {PLAN_HEADER} exactly once"
    path.write_text(text.replace(original, replacement))
    return directory
