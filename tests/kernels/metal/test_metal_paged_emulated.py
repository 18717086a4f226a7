"""The Metal kernel's paged row source, run by the emulation harness against float64.

The cases of the CPU tests (paged_cases.py): tables that share and repeat blocks, pad with
garbage past each length and hold out-of-pool entries inside it; every pool row no query row
attends holds NaN keys and inf values. The Metal kernel reads a shared block once per
request (the CPU kernel reads it once per call).

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, D head dim,
NB blocks, BS rows per block, MB table entries per request.
"""

from __future__ import annotations


import numpy as np
import pytest

from tests.metal_emu.build import build_library
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.reference import TOLERANCE, paged_reference_attention, to_dtype, to_float64
from tests.support.paged_cases import LENGTHS, paged_tables, read_rows  # noqa: E402

H_KV = 2


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def paged_case(dtype, d, g, rows, block_size, window, seed, lengths=LENGTHS, tables=None, nb=None, sinks=None,
               softcap=None, scale=None):
    """Storage arrays: queries, NaN-poisoned pools (views into wider buffers), tables, and
    the float64 reference of the clean pools (with sinks float32 [H_q] and softcap, when given;
    scale None: 1 / sqrt(D))."""
    rng = np.random.default_rng(seed)
    if tables is None:
        tables, nb = paged_tables(block_size, seed)
    q = to_dtype(rng.standard_normal((len(lengths), H_KV * g, rows, d)), dtype)
    # Pools are [:, :, :, :d] views of rows 8 elements wider: strided pages and rows.
    k = to_dtype(rng.standard_normal((nb, block_size, H_KV, d + 8)), dtype)[..., :d]
    v = to_dtype(rng.standard_normal((nb, block_size, H_KV, d + 8)), dtype)[..., :d]
    expected = paged_reference_attention(
        to_float64(q, dtype), to_float64(k, dtype), to_float64(v, dtype), tables, np.asarray(lengths),
        1 / np.sqrt(d) if scale is None else scale, window, None if sinks is None else sinks.astype(np.float64),
        softcap)
    unread = ~read_rows(tables, lengths, nb, block_size, rows, window)
    k, v = k.copy(), v.copy()
    k[unread] = to_dtype(np.full(d, np.nan), dtype)
    v[unread] = to_dtype(np.full(d, np.inf), dtype)
    return q, k, v, np.ascontiguousarray(tables, dtype=np.int32), np.asarray(lengths, np.int32), expected


def run(lib, dtype, q, k, v, tables, lens, window=None, sinks=None, softcap=None, scale=None):
    return lib.paged_attention(q, k, v, tables, lens, dtype, 1 / np.sqrt(q.shape[-1]) if scale is None else scale,
                               window=window, sinks=sinks, softcap=softcap)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("d, g, rows", [(64, 1, 1), (128, 4, 3), (24, 2, 2)])
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
@pytest.mark.parametrize("window", [None, 6])
def test_matches_float64(lib, dtype, d, g, rows, block_size, window):
    q, k, v, tables, lens, expected = paged_case(dtype, d, g, rows, block_size, window, seed=d + block_size)
    out = to_float64(run(lib, dtype, q, k, v, tables, lens, window), dtype)
    assert np.max(np.abs(out - expected)) < TOLERANCE[dtype]
    assert not np.isnan(out).any()
    assert (out[4] == 0).all() and (out[6] == 0).all()


@pytest.mark.parametrize("window", [None, 300])
def test_split_k_over_a_shared_prefix(lib, window):
    # One long request pair (few threadgroups): the plan splits the keys; the reduce pass
    # merges them and must give zeros to a row whose blocks all lie outside the pool.
    bs, nb = 16, 80
    rng = np.random.default_rng(5)
    lengths = [700, 700, 650]
    tables = np.full((3, 45), -1, np.int32)
    tables[0, :44] = rng.permutation(nb)[:44]
    tables[1] = tables[0]
    tables[2, :41] = nb + 7
    q, k, v, tables, lens, expected = paged_case("float32", 64, 2, 2, bs, window, seed=9, lengths=lengths,
                                                 tables=tables, nb=nb)
    assert lib.plan(3, 4, 2, 45 * bs, 64, "float32", rows=2, window=window)["num_splits"] > 1
    out = run(lib, "float32", q, k, v, tables, lens, window)
    assert np.max(np.abs(out - expected)) < TOLERANCE["float32"]
    assert (out[2] == 0).all()
