"""The tiled path of the kernel core (packed queries of many rows: simdgroup-matrix products of
32-row tiles, csrc/kernels/batched_decode_attention.h, bda_attend_tiles), compiled with g++ by the
emulation harness, against float64 attention: dense, paged and ragged rows, three dtypes, head
dims 64 and 128 (vector widths 2 and 4), GQA groups 1 and 4, requests of 0, 1, 5, 37 and 70 rows,
windows, sinks, kv_starts and a softcap. Every position no query row of a request attends holds
NaN (keys) or inf (values). K/V bytes stay within ceil(G x q_b / 32) reads of each request's
keys; mutants of the tiled path must fail.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, q_b rows of request b, N rows
in all, T positions, D head dim of queries, keys and values.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.kernels.metal.test_metal_varlen_emulated import assert_close, fails, plan_of, run_paged
from tests.metal_emu.build import build_library
from tests.metal_emu.cases import attended, make_case
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.mutants import TILED_ONLY, mutant_source
from tests.metal_emu.ragged_cases import make_ragged_case
from tests.metal_emu.sources import subset_source
from tests.metal_emu.strict.compile import find_clang, strict_compile
from tests.support.repo import REPO

DTYPES = ["float16", "bfloat16", "float32"]
HEAD_DIMS = [64, 128]
# Rows of a threadgroup's tile (MBD_TILE_ROWS).
TILE_ROWS = 32
# Requests of 0, 1, 5, 37 and 70 rows: lengths shorter than their rows (rows before the first key
# get zeros), a start past some rows' windows, a negative start.
REQUESTS = dict(t=96, lens=[9, 1, 30, 60, 96], query_rows=[0, 1, 5, 37, 70], starts=[3, 0, 28, 10, -2])
WINDOW = 24
SOFTCAP = 5.0


def tiled_case(seed, dtype: str, d: int, g: int, options: bool, starts: bool = True):
    """Packed queries of REQUESTS over 2 KV heads, GQA group g; with ``options`` kv_starts (unless
    not ``starts``), a window, sinks and a softcap (scores scaled past the cap)."""
    return make_case(np.random.default_rng(seed), dtype, d, 2, g, REQUESTS["t"], REQUESTS["lens"],
                     query_rows=REQUESTS["query_rows"], starts=REQUESTS["starts"] if options and starts else None,
                     window=WINDOW if options else None, sinks=options, softcap=SOFTCAP if options else None,
                     scale=(4.0 if options else 1.0) / np.sqrt(d))


def tiled_kernels() -> list[str]:
    return [f"batched_decode_attention_{dtype}_{d}" for dtype in DTYPES for d in HEAD_DIMS]


@functools.cache
def library() -> EmulatedLibrary:
    return EmulatedLibrary(build_library(subset_source(tiled_kernels())))


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return library()


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense(lib, dtype, d, g, options):
    case = tiled_case([d, g, len(options)], dtype, d, g, options == "all")
    p = plan_of(lib, case)
    assert p["tiled"] and p["num_splits"] == 1 and p["group"][0] == 128
    assert p["rows_per_group"] * p["group_chunks"] == TILE_ROWS
    assert_close(case.run(lib), case.reference(), dtype)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged(lib, dtype, d):
    """Pools read through shuffled block tables, a few pages unused (the paged layout takes no kv_starts)."""
    case = tiled_case([d, 7], dtype, d, 4, True, starts=False)
    assert_close(run_paged(lib, case, d), case.reference(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged(dtype):
    """Requests in buffers of their own, every layout: the tiled path reads them through the same row source."""
    lengths = [int(np.clip(n, 0, REQUESTS["t"])) for n in REQUESTS["lens"]]
    case = make_ragged_case(np.random.default_rng(9), dtype, 64, 2, 4, lengths, valid_lens=REQUESTS["lens"],
                            layouts=("slice", "token_major", "3d", "shared", "exact"), starts=REQUESTS["starts"],
                            window=WINDOW, sinks=True, query_rows=REQUESTS["query_rows"])
    case.softcap = SOFTCAP
    lib = EmulatedLibrary(build_library(subset_source([f"ragged_decode_attention_{dtype}_64"])))
    assert_close(case.run(lib), case.reference(), dtype)


@pytest.mark.parametrize("n,b,g,d,tiled", [
    (6, 6, 4, 128, False), (45, 5, 4, 64, True), (20, 5, 4, 64, True), (19, 5, 4, 64, False),
    (80, 5, 1, 128, True), (79, 5, 1, 128, False), (512, 2, 1, 256, False), (64, 2, 4, 100, False)])
def test_plan_takes_tiles_for_many_rows(lib, n, b, g, d, tiled):
    """Tiled when G x N >= 16 x B (half a tile per request and KV head on average), D a fast head
    dim, a multiple of 8 and at most 128; decode calls keep the vector path."""
    p = lib.plan(b, 2 * g, 2, 4096, d, "float16", rows=n, packed=True)
    assert p["tiled"] == tiled
    if tiled:
        assert p["row_groups"] == g * n // TILE_ROWS + b and p["grid"] == (1, 2 * p["row_groups"], 1)
    assert not lib.plan(b, 2 * g, 2, 4096, d, "float16", rows=n)["tiled"]


def test_kv_traffic_within_the_tiles_bound():
    """Each tile reads the keys of its rows' joint interval once: K/V bytes are at least those the
    rows attend and at most ceil(G x q_b / 32) times each request's."""
    case = tiled_case(3, "float16", 64, 4, True)
    lib = library()
    assert plan_of(lib, case)["tiled"]
    counting = EmulatedLibrary(build_library(subset_source(["batched_decode_attention_float16_64"]), sanitize="loads"))
    assert_close(case.run(counting), case.reference(), case.dtype)
    loads = counting.loads()["main"]
    per_row = case.keys.shape[1] * (case.keys.shape[3] + case.values.shape[3]) * case.keys.itemsize
    read = attended(case.valid_lens, case.kv_starts, case.rows(), case.keys.shape[2], case.window).sum(1)
    floor = int(read.sum()) * per_row
    bound = sum(-(-4 * q // TILE_ROWS) * int(r) for q, r in zip(case.rows(), read)) * per_row
    assert floor <= loads["keys"] + loads["values"] <= bound


@pytest.mark.parametrize("name", sorted(TILED_ONLY))
def test_mutant_fails(name):
    cases = [tiled_case([64, g, 1], "float32", 64, g, True) for g in (1, 4)]
    mutant = EmulatedLibrary(build_library(mutant_source(name, ["batched_decode_attention_float32_64"])))
    assert all(fails(mutant, c) for c in cases), name


@pytest.mark.skipif(find_clang() is None, reason="no clang++: the strict compile needs Debian's `clang` package")
def test_strict_compile_of_the_tiled_kernels():
    """The repository's source (which the installed extension embeds once rebuilt) with only the
    kernels of the tiled path: every address space kept, as test_metal_strict_compile checks the
    embedded whole; tolerated are only the diagnostics it tolerates, none in the tiled path."""
    tolerated = strict_compile(subset_source(tiled_kernels()))
    assert all(d.where.startswith("batched_decode_attention.h") for d in tolerated)
    lines = (REPO / "csrc" / "kernels" / "batched_decode_attention.h").read_text().splitlines()
    first = lines.index("inline void bda_attend_tiles(")
    last = lines.index("}", first)
    assert not any(first < int(d.where.split(":")[1]) <= last + 1 for d in tolerated)
