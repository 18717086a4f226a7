"""The unedited Metal kernel, compiled with g++ by the emulation harness, against
a float64 reference: every dtype x head dim x GQA group, both launch paths.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, T positions, D head dim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness package lives next to the tests

from metal_emu.build import build_library  # noqa: E402
from metal_emu.cases import make_case  # noqa: E402
from metal_emu.driver import EmulatedLibrary, HarnessError  # noqa: E402
from metal_emu.reference import TOLERANCE, to_float64  # noqa: E402

DTYPES = ["float16", "bfloat16", "float32"]
HEAD_DIMS = [64, 80, 96, 128, 256]
GROUPS = [1, 4, 8]

# (T, H_kv, lengths): T <= 64 keeps one pass; a long T with few (request, KV head)
# items takes split-K. Lengths: empty, one key, fewer keys than simdgroups, full,
# above T and negative (both clamped), and ends inside a split.
PATHS = {
    "single_pass": (40, 2, [0, 1, 5, 40, 33, 47, -3]),
    "split_k": (230, 1, [230, 1, 0, 137, 300, 64]),
}


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def run_and_compare(lib, case, **kwargs):
    out = lib.attention(case.queries, case.keys, case.values, case.valid_lens, case.dtype, case.scale, **kwargs)
    got = to_float64(out, case.dtype)
    np.testing.assert_allclose(got, case.reference(), atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])
    return got


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(lib, dtype, d, g, path):
    t, h_kv, lens = PATHS[path]
    rng = np.random.default_rng([d, g, DTYPES.index(dtype), len(path)])
    case = make_case(rng, dtype, d, h_kv, g, t, lens)
    plan = lib.plan(len(lens), h_kv * g, h_kv, t, d, dtype)
    assert (plan["num_splits"] > 1) == (path == "split_k")
    got = run_and_compare(lib, case)
    # NaN/inf padding is never read, an empty request is exactly zero.
    assert np.isfinite(got).all()
    assert not got[case.valid_lens <= 0].any()


@pytest.mark.parametrize("max_threads", [32, 64, 96, 1024])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_threadgroup_sizes(lib, max_threads, path):
    """A pipeline allowing fewer threads gets fewer simdgroups per threadgroup."""
    t, h_kv, lens = PATHS[path]
    case = make_case(np.random.default_rng(max_threads), "float32", 80, h_kv, 4, t, lens)
    assert lib.plan(len(lens), 4 * h_kv, h_kv, t, 80, "float32", max_threads)["group"][0] == min(256, max_threads)
    run_and_compare(lib, case, max_threads=max_threads)


@pytest.mark.parametrize("g", [12, 16])
def test_groups_wider_than_one_chunk(lib, g):
    """G above the heads one threadgroup serves splits the heads over chunks."""
    case = make_case(np.random.default_rng(g), "float16", 64, 2, g, 50, [50, 3, 0])
    assert lib.plan(3, 2 * g, 2, 50, 64, "float16")["head_chunks"] == 2
    run_and_compare(lib, case)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_lengths_are_clamped(lib, path):
    """Lengths above T read exactly T keys, negative ones none."""
    t, h_kv, _ = PATHS[path]
    rng = np.random.default_rng(7)
    case = make_case(rng, "float32", 128, h_kv, 4, t, [t + 1, 10 * t, -1, -(2**31)])
    out = lib.attention(case.queries, case.keys, case.values, case.valid_lens, "float32", case.scale)
    clamped = lib.attention(case.queries, case.keys, case.values, np.array([t, t, 0, 0], dtype=np.int32), "float32", case.scale)
    np.testing.assert_array_equal(out, clamped)
    assert not out[2:].any()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_thread_backend_matches_fibers(lib, path):
    """Lanes as OS threads compute bit for bit what the fiber schedule computes."""
    t, h_kv, lens = PATHS[path]
    case = make_case(np.random.default_rng(3), "bfloat16", 96, h_kv, 4, t, lens[:3])
    args = (case.queries, case.keys, case.values, case.valid_lens, "bfloat16", case.scale)
    np.testing.assert_array_equal(lib.attention(*args, backend="threads"), lib.attention(*args))


@pytest.mark.parametrize("layout", ["every_other", "broadcast"])
def test_strided_valid_lens(lib, layout):
    """valid_lens may be a view: every other element of a buffer, or one length broadcast."""
    t, h_kv, lens = PATHS["split_k"]
    case = make_case(np.random.default_rng(9), "float16", 128, h_kv, 4, t, lens if layout == "every_other" else [101] * 4)
    if layout == "every_other":
        buffer = np.full(2 * len(lens), 10**6, dtype=np.int32)
        buffer[::2] = case.valid_lens
        case.valid_lens = buffer[::2]
    else:
        case.valid_lens = np.broadcast_to(np.int32(101), (4,))
    run_and_compare(lib, case)


@pytest.mark.parametrize("b,t", [(0, 16), (3, 0)])
def test_empty_inputs(lib, b, t):
    """No request launches nothing; no positions (T = 0) gives zeros."""
    case = make_case(np.random.default_rng(1), "float16", 64, 2, 4, t, [5, 0, -1][:b])
    got = run_and_compare(lib, case)
    assert got.shape == (b, 8, 1, 64) and not got.any()


def test_misaligned_strides_are_rejected(lib):
    """Vector loads need row starts on the vector width: the plan refuses others."""
    case = make_case(np.random.default_rng(0), "float32", 128, 1, 1, 8, [8])
    buffer = np.zeros((1, 1, 8, 129), dtype=np.float32)
    buffer[..., :128] = case.keys
    with pytest.raises(HarnessError, match="multiples of 4"):
        lib.attention(case.queries, buffer[..., :128], case.values, case.valid_lens, "float32", case.scale)
