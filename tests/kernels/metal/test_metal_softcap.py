"""Logit softcapping (Gemma 2's ``softcap=c``) in the Metal kernel, run by the emulation harness
against float64: each score s = scale * q . k becomes c * tanh(s / c) before windows and the
softmax, in the one kernel core every row source shares (dense, ring, paged, quantized, ragged);
sink logits are not capped. Queries are scaled up (scale 4 / sqrt(D): scores of about N(0, 16))
so that most scores pass the cap of 5, and every test asserts that the uncapped reference lies
far outside the tolerance of the capped one: a kernel that ignores the cap fails each.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows per request,
T positions, D head dim.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.kernels.metal.test_metal_emulated import PATHS, run_and_compare
from tests.kernels.metal.test_metal_paged_emulated import H_KV as PAGED_H_KV
from tests.kernels.metal.test_metal_paged_emulated import paged_case
from tests.kernels.metal.test_metal_paged_emulated import run as run_paged
from tests.kernels.metal.test_metal_quantized import PATHS as QUANTIZED_PATHS
from tests.kernels.metal.test_metal_quantized import quantized_case
from tests.kernels.metal.test_metal_quantized import run as run_quantized
from tests.kernels.metal.test_metal_ragged_emulated import PATHS as RAGGED_PATHS
from tests.kernels.metal.test_metal_ragged_emulated import path_case as ragged_path_case
from tests.kernels.metal.test_metal_ragged_emulated import run_and_compare as ragged_run_and_compare
from tests.metal_emu.build import CACHE, build_library
from tests.metal_emu.cases import make_case, make_ring_case
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.mutants import MUTATIONS
from tests.metal_emu.reference import TOLERANCE, to_float64
from tests.metal_emu.sources import kernel_sources

DTYPES = ["float16", "bfloat16", "float32"]
SOFTCAP = 5.0


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def scale_of(d: int) -> float:
    """Scores of about N(0, 16) for standard normal queries and keys: most pass the cap."""
    return 4.0 / np.sqrt(d)


def assert_cap_shows(capped: np.ndarray, uncapped: np.ndarray, dtype: str) -> None:
    """The cap moves the output by far more than the tolerance."""
    assert np.nanmax(np.abs(capped - uncapped)) > 10 * TOLERANCE[dtype]


def dense_case(rng, path: str, dtype: str, d: int, g: int, rows: int, options: bool):
    spec = PATHS[path]
    return make_case(rng, dtype, d, spec["h_kv"], g, spec["t"], spec["lens"], rows=rows,
                     starts=spec["starts"] if options else None, window=spec["window"] if options else None,
                     sinks=options, scale=scale_of(d), softcap=SOFTCAP)


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("d", [64, 80, 100, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense(lib, dtype, d, path, options):
    """Fast (V = 4 and 2) and generic head dims, plain (G = 1, L = 1, no option) or with GQA, L = 3
    (two row chunks sharing staged tiles), kv_starts, a window and sinks."""
    on = options == "all"
    case = dense_case(np.random.default_rng([d, len(path), on]), path, dtype, d, 4 if on else 1, 3 if on else 1, on)
    run_and_compare(lib, case)
    assert_cap_shows(case.reference(), replace(case, softcap=None).reference(), dtype)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_ring(lib, path):
    """The dense layout's ring (offsets negative and past T) with GQA, L = 2, kv_starts, a window and sinks."""
    spec = PATHS[path]
    ring = [7 * b - 3 for b in range(len(spec["lens"]))]
    case = make_ring_case(np.random.default_rng(len(path)), "float16", 64, spec["h_kv"], 4, spec["t"], spec["lens"],
                          ring, rows=2, starts=spec["starts"], window=spec["window"], sinks=True, scale=scale_of(64),
                          softcap=SOFTCAP)
    run_and_compare(lib, case)
    assert_cap_shows(case.reference(), replace(case, softcap=None).reference(), "float16")


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("d, g, rows", [(64, 1, 1), (128, 4, 3), (24, 2, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged(lib, dtype, d, g, rows, window):
    """Pools of 7-row pages read through tables that share, repeat and leave the pool, with sinks."""
    sinks = (1.5 * np.random.default_rng(d).standard_normal(PAGED_H_KV * g)).astype(np.float32)
    q, k, v, tables, lens, capped = paged_case(dtype, d, g, rows, 7, window, seed=d, sinks=sinks, softcap=SOFTCAP,
                                               scale=scale_of(d))
    uncapped = paged_case(dtype, d, g, rows, 7, window, seed=d, sinks=sinks, scale=scale_of(d))[-1]
    out = to_float64(run_paged(lib, dtype, q, k, v, tables, lens, window, sinks, SOFTCAP, scale_of(d)), dtype)
    np.testing.assert_allclose(out, capped, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert_cap_shows(capped, uncapped, dtype)


@pytest.mark.parametrize("path", sorted(QUANTIZED_PATHS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("d,group_size", [(64, 32), (128, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized(lib, dtype, d, group_size, bits, path):
    """mx.quantize triples with GQA, L = 3, kv_starts, a window and sinks."""
    args = (d + bits, dtype, "float16", d, group_size, bits, 4, 3, path, True, True, True)
    case, capped = quantized_case(*args, softcap=SOFTCAP, scale=scale_of(d))
    uncapped = quantized_case(*args, scale=scale_of(d))[1]
    out = to_float64(run_quantized(lib, case, dtype, "float16", group_size, bits), dtype)
    np.testing.assert_allclose(out, capped, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert_cap_shows(capped, uncapped, dtype)


@pytest.mark.parametrize("path", sorted(RAGGED_PATHS))
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged(lib, dtype, d, path):
    """Requests of their own buffers in every layout, with GQA, L = 3, kv_starts, a window and sinks."""
    case = ragged_path_case(np.random.default_rng([d, len(path)]), path, dtype, d, 4, 3, True, True, True)
    case.scale, case.softcap = scale_of(d), SOFTCAP
    ragged_run_and_compare(lib, case)
    assert_cap_shows(case.reference(), replace(case, softcap=None).reference(), dtype)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_sinks_are_not_capped(lib, path):
    """A sink logit of 8 joins the denominator as 8, above every capped score (at most 5)."""
    case = dense_case(np.random.default_rng(3), path, "float32", 64, 2, 2, True)
    case.sinks = np.full(case.queries.shape[1], 8.0, dtype=np.float32)
    run_and_compare(lib, case)
    sinks_capped = replace(case, sinks=(SOFTCAP * np.tanh(case.sinks / SOFTCAP)).astype(np.float32))
    assert_cap_shows(case.reference(), sinks_capped.reference(), "float32")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_infinite_scores_are_capped(lib, path):
    """Positive queries: a key row of -inf scores -c and one of +inf scores c, so rows stay finite.
    One request's keys all score -inf (its rows: 0/0 = NaN without the cap, the mean of their
    values with it); another's first key scores +inf (NaN without the cap)."""
    case = dense_case(np.random.default_rng(4), path, "float32", 64, 2, 2, False)
    t = case.keys.shape[2]
    *_, plus, minus = [b for b, n in enumerate(case.valid_lens) if 0 < n <= t]
    case.queries = np.abs(case.queries)
    case.keys[minus, :, :case.valid_lens[minus]] = -np.inf
    case.keys[plus, :, 0] = np.inf
    run_and_compare(lib, case)
    assert np.isnan(replace(case, softcap=None).reference()[[minus, plus]]).all()


def test_no_softcap_is_the_kernel_without_the_cap(lib):
    """softcap None (0 in the params) computes, bit for bit, what the kernel without the cap computes."""
    kernel = "batched_decode_attention_float32_64"
    text = kernel_sources(CACHE / "mutants" / "softcap_removed", [kernel], MUTATIONS["softcap_dropped"])
    uncapped = EmulatedLibrary(build_library(text))
    for path in sorted(PATHS):
        case = replace(dense_case(np.random.default_rng(5), path, "float32", 64, 4, 3, True), softcap=None)
        np.testing.assert_array_equal(case.run(lib), case.run(uncapped))
