"""Unit tests of the launch plan (csrc/metal/launch_plan.h), the one function the
Metal launcher and the emulation harness both dispatch with. Called through the
harness library, which compiles that header unchanged.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request, T positions, D head dim."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.metal_emu.build import REPO, build_library
from tests.metal_emu.driver import EmulatedLibrary, HarnessError

DTYPES = ["float16", "bfloat16", "float32"]
FAST_DIMS = [32, 64, 80, 96, 112, 128, 160, 192, 256, 512]
# Head dim -> the generic kernel's bucket.
GENERIC_DIMS = {1: 32, 24: 32, 31: 32, 33: 64, 48: 64, 100: 128, 129: 256, 200: 256, 257: 512, 300: 512, 511: 512}


# A harness library to test instead of the real one: test_launch_plan_mutations.py runs this
# file on builds of mutated plans, each of which must fail it.
PLAN_LIBRARY = "MBD_EMU_PLAN_LIBRARY"


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(Path(os.environ[PLAN_LIBRARY]) if PLAN_LIBRARY in os.environ else build_library())


@pytest.mark.parametrize("d", FAST_DIMS + sorted(GENERIC_DIMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_names(lib, dtype, d):
    """Fast head dims have kernels of their own, every other D the generic kernel of its bucket."""
    suffix = str(d) if d in FAST_DIMS else f"upto{GENERIC_DIMS[d]}"
    single = lib.plan(64, 32, 8, 4096, d, dtype)
    assert single["kernel"] == f"batched_decode_attention_{dtype}_{suffix}"
    assert single["num_splits"] == 1 and single["reduce_kernel"] == ""
    split = lib.plan(1, 32, 8, 4096, d, dtype)
    assert split["reduce_kernel"] == f"batched_decode_attention_reduce_{dtype}_{suffix}"
    assert split["vector_width"] == (1 if d not in FAST_DIMS else 4 if d % 128 == 0 else 2)


@pytest.mark.parametrize("b,h_q,h_kv,t", [(1, 32, 8, 4096), (2, 8, 1, 230), (1, 1, 1, 128), (3, 64, 2, 100000)])
def test_split_k_covers_the_sequence(lib, b, h_q, h_kv, t):
    p = lib.plan(b, h_q, h_kv, t, 128, "float16")
    assert p["num_splits"] > 1 and p["keys_span"] == t
    # Every position falls in exactly one split and no split starts past T.
    assert p["num_splits"] * p["split_len"] >= t > (p["num_splits"] - 1) * p["split_len"]
    assert p["split_len"] >= 64 and p["num_splits"] <= 64
    assert p["grid"] == (p["num_splits"], h_kv * p["row_groups"], b)
    assert p["reduce_grid"] == (1, h_q, b) and p["reduce_group"] == (128, 1, 1)
    assert p["partial_stats_elems"] == b * h_q * p["num_splits"]
    assert p["partial_acc_elems"] == p["partial_stats_elems"] * 128


@pytest.mark.parametrize("t,window,rows,span", [(100000, 4096, 1, 4096), (100000, 4096, 8, 4103), (300, 4096, 2, 300),
                                                (5000, 1, 1, 1), (5000, 100, 5, 104)])
def test_split_k_covers_a_chunks_keys(lib, t, window, rows, span):
    """A row chunk reads at most window + L - 1 keys: the splits cover that, not T."""
    p = lib.plan(1, 8, 8, t, 64, "float32", rows=rows, window=window)
    assert p["keys_span"] == span
    assert p["num_splits"] * p["split_len"] >= span > (p["num_splits"] - 1) * p["split_len"]
    assert p["num_splits"] == max(1, min(16 // ((rows + 7) // 8), span // 64))
    if p["num_splits"] > 1:
        assert p["reduce_grid"] == (rows, 8, 1)
        assert p["partial_acc_elems"] == 8 * rows * p["num_splits"] * 64


@pytest.mark.parametrize("b,h_kv,t", [(16, 8, 4096), (128, 1, 100000), (4, 8, 127), (1, 1, 1), (2, 1, 0)])
def test_single_pass_when_the_grid_is_full_or_short(lib, b, h_kv, t):
    """Enough (request, KV head) items, or too few keys to split, keep one pass."""
    p = lib.plan(b, 4 * h_kv, h_kv, t, 64, "float32")
    assert p["num_splits"] == 1 and p["partial_acc_elems"] == 0 and p["partial_stats_elems"] == 0
    assert p["grid"] == (1, h_kv, b)


@pytest.mark.parametrize(
    "g,rows,d,per_group,chunks",
    [(1, 1, 96, 1, 1), (8, 1, 96, 8, 1), (9, 1, 96, 5, 2), (2, 4, 96, 8, 1), (3, 5, 96, 8, 2), (32, 1, 96, 8, 4),
     (16, 4, 128, 8, 8), (1, 8, 256, 8, 1), (4, 2, 512, 4, 2), (2, 2, 300, 4, 1), (1, 9, 200, 5, 2), (1, 3, 1, 3, 1)])
def test_row_chunks(lib, g, rows, d, per_group, chunks):
    """G * L query rows per (request, KV head) in chunks of equal rows (within one), at most 8 a
    simdgroup (4 when D > 256); up to 8 chunks share one threadgroup, and so each K/V row it reads."""
    p = lib.plan(64, 2 * g, 2, 16, d, "bfloat16", rows=rows)
    assert p["rows_per_group"] == per_group and p["row_chunks"] == chunks
    assert p["rows_per_group"] * (chunks - 1) < g * rows <= p["rows_per_group"] * chunks
    assert p["group_chunks"] == chunks and p["row_groups"] == 1
    assert p["grid"][1] == 2 and p["group"][0] % (32 * chunks) == 0


@pytest.mark.parametrize("max_threads,group", [(32, 32), (100, 96), (256, 256), (1024, 256)])
def test_threadgroup_follows_the_pipeline_limit(lib, max_threads, group):
    assert lib.plan(4, 8, 2, 16, 256, "float16", max_threads)["group"] == (group, 1, 1)
    split = lib.plan(1, 8, 2, 4096, 256, "float16", max_threads)
    assert split["reduce_group"] == (min(256, max_threads // 32 * 32), 1, 1)


@pytest.mark.parametrize(
    "max_threads,chunks_per_group,streams",
    [(1024, 2, 4), (256, 2, 4), (160, 2, 2), (96, 2, 1), (64, 2, 1), (63, 1, 1), (32, 1, 1)])
def test_row_chunks_share_a_threadgroup_within_the_limit(lib, max_threads, chunks_per_group, streams):
    """G = 16: two row chunks, one threadgroup of both (each on its own simdgroups) while the
    limit allows two simdgroups; below, a row group each (which read the keys again)."""
    p = lib.plan(4, 32, 2, 64, 128, "float16", max_threads)
    assert p["row_chunks"] == 2 and p["group_chunks"] == chunks_per_group
    assert p["row_groups"] == 2 // chunks_per_group and p["grid"][1] == 2 * p["row_groups"]
    assert p["group"] == (32 * chunks_per_group * streams, 1, 1) and p["group"][0] <= max_threads


@pytest.mark.parametrize("max_threads", [32, 64, 96, 100, 200, 256, 832, 1024])
@pytest.mark.parametrize("g,rows,d", [(1, 1, 64), (16, 1, 128), (4, 4, 128), (8, 2, 64), (8, 1, 512), (64, 2, 128),
                                      (7, 3, 300)])
def test_plan_never_asks_more_threads_than_the_limit(lib, max_threads, g, rows, d):
    """Every shape runs on a pipeline of one simdgroup or more: fewer rows share a threadgroup, never more
    threads than the limit; the row groups cover every chunk, one chunk per simdgroup set."""
    for b, t in ((4, 64), (1, 4096)):
        p = lib.plan(b, 2 * g, 2, t, d, "float32", max_threads, rows=rows)
        assert 32 <= p["group"][0] <= max_threads and p["group"][0] % (32 * p["group_chunks"]) == 0
        assert p["group_chunks"] <= min(8, max_threads // 32)
        assert p["group_chunks"] * (p["row_groups"] - 1) < p["row_chunks"] <= p["group_chunks"] * p["row_groups"]
        if p["num_splits"] > 1:
            assert 32 <= p["reduce_group"][0] <= max_threads


def test_more_chunks_than_simdgroups_take_row_groups(lib):
    """G x L = 128 rows at D = 128: 16 chunks of 8, over two threadgroups of 8 simdgroups."""
    p = lib.plan(2, 128, 2, 64, 128, "float16", rows=2)
    assert (p["row_chunks"], p["group_chunks"], p["row_groups"]) == (16, 8, 2)
    assert p["grid"][1] == 4 and p["group"] == (256, 1, 1)


@pytest.mark.parametrize("main,reduce", [(1024, 64), (64, 1024), (256, 32), (832, 832)])
def test_reduce_follows_its_own_pipeline_limit(lib, main, reduce):
    """The split-K reduce is a pipeline of its own, with its own maxTotalThreadsPerThreadgroup."""
    p = lib.plan(1, 8, 2, 4096, 256, "float16", main, reduce_threads=reduce)
    assert p["num_splits"] > 1
    assert p["reduce_group"] == (min(256, reduce // 32 * 32), 1, 1)
    assert p["group"] == (min(256, main // 32 * 32), 1, 1)


def test_split_count_grows_as_the_batch_shrinks(lib):
    """About 128 threadgroups in all: 8 KV heads x B requests x splits."""
    splits = [lib.plan(b, 8, 8, 8192, 128, "float16")["num_splits"] for b in (1, 2, 4, 16)]
    assert splits == [16, 8, 4, 1]


@pytest.mark.parametrize(
    "args,options,message",
    [
        ((1, 8, 3, 16, 128, "float16"), {}, "multiple of H_kv"),
        ((1, 8, 2, 16, 0, "float16"), {}, "head dim 0"),
        ((1, 8, 2, 16, 513, "float16"), {}, "head dim 513"),
        ((0, 8, 2, 16, 128, "float16"), {}, "positive"),
        ((1, 8, 2, 16, 128, "float16"), {"rows": 0}, "positive"),
        ((1, 8, 2, -1, 128, "float16"), {}, "T >= 0"),
        ((1, 8, 2, 16, 128, "float16"), {"effective": 0}, "window 0"),
        ((1, 8, 2, 16, 128, "float16"), {"effective": 17}, "window 17"),
        ((1, 8, 2, 16, 128, "float16"), {"rows": 2**30}, "query rows"),
    ],
)
def test_invalid_shapes_raise(lib, args, options, message):
    with pytest.raises(HarnessError, match=rf"\[batched_decode_attention\].*{message}"):
        lib.plan(*args, **options)


@pytest.mark.parametrize("limit", [0, 1, 16, 31])
def test_too_small_thread_limit_raises(lib, limit):
    """A pipeline that cannot run one simdgroup is an error naming the pipeline and its limit, never a launch."""
    with pytest.raises(HarnessError, match=rf"pipeline batched_decode_attention_float16_128 allows {limit} threads"):
        lib.plan(1, 8, 2, 16, 128, "float16", limit)


def test_too_small_reduce_limit_raises_when_split(lib):
    """The reduce pipeline's limit counts when the plan splits, and only then."""
    with pytest.raises(HarnessError, match="pipeline batched_decode_attention_reduce_float16_128 allows 16 threads"):
        lib.plan(1, 8, 2, 4096, 128, "float16", 1024, reduce_threads=16)
    assert lib.plan(64, 8, 2, 16, 128, "float16", 1024, reduce_threads=16)["num_splits"] == 1


def test_launcher_uses_the_plan():
    """The Metal host code dispatches with the same plan and buffer indices."""
    source = (REPO / "csrc" / "metal" / "decode_launch.cpp").read_text()
    ops = (REPO / "csrc" / "metal" / "eval_gpu.cpp").read_text()
    assert '#include "launch_plan.h"' in source
    assert "plan_for(shape, {MBD_SIMD_WIDTH, MBD_SIMD_WIDTH}, quantized, ragged)" in source
    # Each pipeline's own limit sizes its pass; MLX's check stands behind the plan.
    assert "plan_for(shape, {main_limit, main_limit}, quantized, ragged)" in source
    assert "plan_for(shape, {main_limit, int(reduce->maxTotalThreadsPerThreadgroup())}, quantized, ragged)" in source
    assert "const int main_limit = int(kernel->maxTotalThreadsPerThreadgroup());" in source
    assert "mx::check_kernel_threadgroup_size(kernel, to_mtl(plan.group), plan.kernel);" in source
    assert "mx::check_kernel_threadgroup_size(reduce, to_mtl(plan.reduce_group), plan.reduce_kernel);" in source
    assert "make_launch_plan(shape, limits)" in source
    assert "make_ragged_launch_plan(shape, limits)" in source and "ragged_group_grid(plan, " in source
    assert "ragged_vector_loads(shape, provisional, strides, offsets.q, ragged->layout)" in source
    assert "make_ragged_layout(keys, values, lengths, rows.H_kv," in ops
    # The softcap reaches the kernels' params from the op's attributes, in every layout.
    assert "make_params(shape, plan, strides, scale, softcap, paged)" in source
    assert "make_ragged_params(shape, plan, strides, scale, softcap)" in source
    assert "at.scale, at.softcap," in ops
    assert "{&rows, MTL::DataType::DataTypeInt, MBD_FC_ROWS}" in source
    assert "{&vectors, MTL::DataType::DataTypeBool, MBD_FC_VECTOR_LOADS}" in source
    assert "vector_loads(shape, provisional, strides, offsets, paged)" in source
    assert "effective_window(at.window, rows.T)" in ops
    for index in ("kQueries", "kKeys", "kValues", "kValidLens", "kKvStarts", "kSinks", "kOut", "kPartialAcc",
                  "kPartialMax", "kPartialSum", "kParams", "kRequests", "kRaggedGroup"):
        assert f", {index})" in source
    assert "kRaggedSlot0 + s" in source
