"""Unit tests of the launch plan (csrc/metal/launch_plan.h), the one function the
Metal launcher and the emulation harness both dispatch with. Called through the
harness library, which compiles that header unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness package lives next to the tests

from metal_emu.build import REPO, build_library  # noqa: E402
from metal_emu.driver import EmulatedLibrary, HarnessError  # noqa: E402

DTYPES = ["float16", "bfloat16", "float32"]
HEAD_DIMS = [64, 80, 96, 128, 256]


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_names(lib, dtype, d):
    single = lib.plan(64, 32, 8, 4096, d, dtype)
    assert single["kernel"] == f"batched_decode_attention_{dtype}_{d}"
    assert single["num_splits"] == 1 and single["reduce_kernel"] == ""
    split = lib.plan(1, 32, 8, 4096, d, dtype)
    assert split["reduce_kernel"] == f"batched_decode_attention_reduce_{dtype}_{d}"
    assert split["vector_width"] == (4 if d % 128 == 0 else 2)


@pytest.mark.parametrize("b,h_q,h_kv,t", [(1, 32, 8, 4096), (2, 8, 1, 230), (1, 1, 1, 128), (3, 64, 2, 100000)])
def test_split_k_covers_the_sequence(lib, b, h_q, h_kv, t):
    p = lib.plan(b, h_q, h_kv, t, 128, "float16")
    assert p["num_splits"] > 1
    # Every position falls in exactly one split and no split starts past T.
    assert p["num_splits"] * p["split_len"] >= t > (p["num_splits"] - 1) * p["split_len"]
    assert p["split_len"] >= 64 and p["num_splits"] <= 64
    assert p["grid"] == (p["num_splits"], h_kv * p["head_chunks"], b)
    assert p["reduce_grid"] == (1, h_q, b) and p["reduce_group"] == (128, 1, 1)
    assert p["partial_stats_elems"] == b * h_q * p["num_splits"]
    assert p["partial_acc_elems"] == p["partial_stats_elems"] * 128


@pytest.mark.parametrize("b,h_kv,t", [(16, 8, 4096), (128, 1, 100000), (4, 8, 127), (1, 1, 1), (2, 1, 0)])
def test_single_pass_when_the_grid_is_full_or_short(lib, b, h_kv, t):
    """Enough (request, KV head) items, or too few keys to split, keep one pass."""
    p = lib.plan(b, 4 * h_kv, h_kv, t, 64, "float32")
    assert p["num_splits"] == 1 and p["partial_acc_elems"] == 0 and p["partial_stats_elems"] == 0
    assert p["grid"] == (1, h_kv, b)


@pytest.mark.parametrize("g,chunks", [(1, 1), (8, 1), (9, 2), (16, 2), (32, 4)])
def test_head_chunks(lib, g, chunks):
    p = lib.plan(64, 2 * g, 2, 16, 96, "bfloat16")
    assert p["head_chunks"] == chunks and p["grid"][1] == 2 * chunks
    assert p["heads_per_group"] == min(g, 8)


@pytest.mark.parametrize("max_threads,group", [(32, 32), (100, 96), (256, 256), (1024, 256)])
def test_threadgroup_follows_the_pipeline_limit(lib, max_threads, group):
    assert lib.plan(4, 8, 2, 16, 256, "float16", max_threads)["group"] == (group, 1, 1)
    split = lib.plan(1, 8, 2, 4096, 256, "float16", max_threads)
    assert split["reduce_group"] == (min(256, max_threads // 32 * 32), 1, 1)


def test_split_count_grows_as_the_batch_shrinks(lib):
    """About 128 threadgroups in all: 8 KV heads x B requests x splits."""
    splits = [lib.plan(b, 8, 8, 8192, 128, "float16")["num_splits"] for b in (1, 2, 4, 16)]
    assert splits == [16, 8, 4, 1]


@pytest.mark.parametrize(
    "args,message",
    [
        ((1, 8, 3, 16, 128, "float16"), "multiple of H_kv"),
        ((1, 8, 2, 16, 100, "float16"), "head dim 100"),
        ((0, 8, 2, 16, 128, "float16"), "positive"),
        ((1, 8, 2, -1, 128, "float16"), "T >= 0"),
    ],
)
def test_invalid_shapes_raise(lib, args, message):
    with pytest.raises(HarnessError, match=rf"\[batched_decode_attention\].*{message}"):
        lib.plan(*args)


def test_too_small_thread_limit_raises(lib):
    with pytest.raises(HarnessError, match="allows 16 threads"):
        lib.plan(1, 8, 2, 16, 128, "float16", 16)


def test_launcher_uses_the_plan():
    """The Metal host code dispatches with the same plan and buffer indices."""
    source = (REPO / "csrc" / "metal" / "batched_decode_attention_gpu.cpp").read_text()
    assert '#include "launch_plan.h"' in source
    assert source.count("make_launch_plan(shape)") == 2 and "make_params(" in source
    assert "{&heads, MTL::DataType::DataTypeInt, MBD_FC_HEADS}" in source
    for index in ("kQueries", "kKeys", "kValues", "kValidLens", "kOut", "kPartialAcc", "kPartialMax",
                  "kPartialSum", "kParams"):
        assert f", {index})" in source
