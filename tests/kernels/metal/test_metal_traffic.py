"""What the Metal kernel loads from each device buffer, counted by the emulation
harness (a "loads" build: the kernel compiled at -O0 with every load calling a
counting hook, see metal_emu/build.py).

The floor is ``sum over requests of rows in range x H_kv x D x 2 x itemsize``:
every K/V row some query row of a request attends, read once for all G heads
and all L query rows, no other row read. The kernel meets it whenever a
request's G x L query rows fit one threadgroup (8 rows; 4 above D = 256).
Beyond that, each threadgroup row chunk reads the keys of its own rows again:
the ratio is the predicted one, above 1.

The ragged row source (one buffer per request, bound in groups of slots) reads what the dense
one reads for the same shapes, to the byte.

Run as a script (``python -m tests.kernels.metal.test_metal_traffic`` from the repository root)
it prints the ratio of every variant, the table the README shows.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request, T positions, D head dim.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.metal_emu.build import build_library
from tests.metal_emu.cases import attended, make_case
from tests.metal_emu.driver import RAGGED_SLOTS, EmulatedLibrary
from tests.metal_emu.ragged_cases import RaggedCase
from tests.metal_emu.reference import TOLERANCE, row_range, to_float64
from tests.metal_emu.sources import subset_source

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
# make_case arguments (plus ``shift``: Q/K/V start that many elements off a
# 16-byte boundary). G x L fits one threadgroup in all of these.
ONE_CHUNK = {
    "dense": dict(dtype="float16", d=128, h_kv=2, g=4, t=60, lens=[60, 17, 0, 33]),
    "dense, split-K": dict(dtype="bfloat16", d=64, h_kv=1, g=8, t=300, lens=[300, 120, 71]),
    "dense, L = 2": dict(dtype="float32", d=80, h_kv=2, g=4, t=50, lens=[50, 9, 1], rows=2),
    "kv_starts, L = 3": dict(dtype="float16", d=96, h_kv=2, g=2, t=50, lens=[50, 30, 4], rows=3,
                             starts=[10, 29, 0]),
    "window 16, L = 3": dict(dtype="float16", d=128, h_kv=2, g=2, t=80, lens=[80, 40, 12], rows=3, window=16),
    "window 300, split-K": dict(dtype="float32", d=64, h_kv=1, g=4, t=400, lens=[400, 350], rows=2, window=300,
                                sinks=True),
    "scalar loads (odd row stride)": dict(dtype="float16", d=64, h_kv=2, g=4, t=40, lens=[40, 5], rows=2,
                                          row_pad=1),
    "scalar loads (odd offset)": dict(dtype="float32", d=128, h_kv=2, g=2, t=40, lens=[40, 5], shift=1),
    "generic head dim (D = 100)": dict(dtype="bfloat16", d=100, h_kv=2, g=4, t=40, lens=[40, 11]),
    "D = 512, G = 4": dict(dtype="float16", d=512, h_kv=1, g=4, t=30, lens=[30, 7]),
}
# G x L over one threadgroup: every row chunk reads its rows' keys.
SEVERAL_CHUNKS = {
    "G = 16": dict(dtype="float16", d=128, h_kv=1, g=16, t=40, lens=[40, 13]),
    "G = 4, L = 4": dict(dtype="float16", d=128, h_kv=2, g=4, t=40, lens=[40, 13], rows=4),
    "G = 4, L = 4, window 8": dict(dtype="float16", d=128, h_kv=2, g=4, t=40, lens=[40, 13], rows=4, window=8),
    "G = 8, L = 2, split-K": dict(dtype="bfloat16", d=64, h_kv=1, g=8, t=300, lens=[300, 200], rows=2),
    "D = 512, G = 8": dict(dtype="float16", d=512, h_kv=1, g=8, t=30, lens=[30, 7]),
}
VARIANTS = {**ONE_CHUNK, **SEVERAL_CHUNKS}
# Variants run again through the ragged row source.
RAGGED = ["dense", "dense, split-K", "kv_starts, L = 3", "window 300, split-K", "scalar loads (odd row stride)",
          "generic head dim (D = 100)", "G = 4, L = 4, window 8"]


@functools.cache
def plan_lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def plan(spec: dict) -> dict:
    return plan_lib().plan(len(spec["lens"]), spec["h_kv"] * spec["g"], spec["h_kv"], spec["t"], spec["d"],
                           spec["dtype"], rows=spec.get("rows", 1), window=spec.get("window"))


@functools.cache
def counting_lib() -> EmulatedLibrary:
    dense = [plan(s)["kernel"] for s in VARIANTS.values()]
    ragged = [plan(VARIANTS[name])["kernel"].replace("batched_", "ragged_") for name in RAGGED]
    return EmulatedLibrary(build_library(subset_source(dense + ragged), sanitize="loads"))


def run(name: str):
    """The variant's case, its output and the bytes each pass loaded per buffer."""
    spec = dict(VARIANTS[name])
    shift = spec.pop("shift", 0)
    case = make_case(np.random.default_rng(len(name)), **spec)
    lib = counting_lib()
    out = case.run(lib, shift=shift)
    return case, out, lib.loads()


def minimum_kv_bytes(case) -> int:
    """K and V bytes of the rows some query row of a request attends, each read once."""
    b, _, rows, d = case.queries.shape
    h_kv, t = case.keys.shape[1], case.keys.shape[2]
    rows_read = attended(case.valid_lens, case.kv_starts, rows, t, case.window).sum()
    return int(rows_read) * h_kv * d * 2 * ITEMSIZE[case.dtype]


def chunked_kv_bytes(case, p: dict) -> int:
    """K and V bytes when each row chunk (rows ordered by i, then g) reads the keys
    from its rows' first to their last, once."""
    b, h_q, rows, d = case.queries.shape
    h_kv, t = case.keys.shape[1], case.keys.shape[2]
    g, per_chunk = h_q // h_kv, p["rows_per_group"]
    keys = 0
    for n, length in enumerate(case.valid_lens):
        length = int(np.clip(length, 0, t))
        start = 0 if case.kv_starts is None else int(np.clip(case.kv_starts[n], 0, t))
        for first in range(0, g * rows, per_chunk):
            ranges = [row_range(length, start, rows, i, case.window)
                      for i in range(first // g, (min(first + per_chunk, g * rows) - 1) // g + 1)]
            ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
            keys += max(hi for _, hi in ranges) - min(lo for lo, _ in ranges) if ranges else 0
    return keys * h_kv * d * 2 * ITEMSIZE[case.dtype]


def ratio(name: str) -> float:
    case, _, loads = run(name)
    return (loads["main"]["keys"] + loads["main"]["values"]) / minimum_kv_bytes(case)


def ragged_ratio(name: str) -> float:
    """As ``ratio``, through the ragged row source with buffers of the requests' own."""
    case, _, _ = run(name)
    ragged_of(case, own=True).run(counting_lib())
    loads = counting_lib().loads()["main"]
    return sum(loads[f"slot{i}"] for i in range(RAGGED_SLOTS)) / minimum_kv_bytes(case)


@pytest.mark.parametrize("name", list(ONE_CHUNK))
def test_kv_bytes_are_the_minimum(name):
    case, out, loads = run(name)
    p = plan(VARIANTS[name])
    assert p["row_chunks"] == 1
    assert (p["num_splits"] > 1) == ("split-K" in name)
    assert counting_lib().vector_loads() == ("scalar" not in name)
    np.testing.assert_allclose(to_float64(out, case.dtype), case.reference(), atol=TOLERANCE[case.dtype],
                               rtol=TOLERANCE[case.dtype])
    # K and V alike: each row in range once, in the main pass; the reduction reads neither.
    assert loads["main"]["keys"] == loads["main"]["values"] == minimum_kv_bytes(case) // 2
    assert loads["reduce"]["keys"] == loads["reduce"]["values"] == 0


@pytest.mark.parametrize("name", list(SEVERAL_CHUNKS))
def test_row_chunks_read_their_keys_again(name):
    case, _, loads = run(name)
    p = plan(VARIANTS[name])
    assert p["row_chunks"] > 1
    kv = loads["main"]["keys"] + loads["main"]["values"]
    assert kv == chunked_kv_bytes(case, p) > minimum_kv_bytes(case)


def ragged_of(case, own: bool) -> RaggedCase:
    """The dense case as a ragged call: request b's keys and values are views [b] of the dense
    ones (one buffer each: two slots), or copies of their first len_b positions (T_b = len_b)."""
    t = case.keys.shape[2]
    lengths = np.clip(case.valid_lens, 0, t)
    pick = (lambda a, b: a[b, :, :lengths[b]].copy()) if own else (lambda a, b: a[b])
    return RaggedCase(case.dtype, case.queries, [pick(case.keys, b) for b in range(len(lengths))],
                      [pick(case.values, b) for b in range(len(lengths))], case.valid_lens, case.scale,
                      case.kv_starts, case.window, case.sinks)


@pytest.mark.parametrize("own", [False, True], ids=["views", "own buffers"])
@pytest.mark.parametrize("name", RAGGED)
def test_ragged_rows_read_what_dense_rows_read(name, own):
    """Every K/V byte the dense kernel loads, and no other, whether the requests share the dense
    buffers or hold buffers of their own; the same output."""
    case, out, loads = run(name)
    ragged = ragged_of(case, own)
    got = ragged.run(counting_lib())
    counted = counting_lib().loads()
    slots = [f"slot{i}" for i in range(RAGGED_SLOTS)]
    assert sum(counted["main"][s] for s in slots) == loads["main"]["keys"] + loads["main"]["values"]
    assert sum(counted["reduce"][s] for s in slots) == 0
    assert counted["main"]["queries"] == loads["main"]["queries"]
    np.testing.assert_allclose(to_float64(got, case.dtype), to_float64(out, case.dtype), atol=TOLERANCE[case.dtype],
                               rtol=TOLERANCE[case.dtype])
    if not own:
        np.testing.assert_array_equal(got, out)


def test_counts_see_every_load():
    """The counts bite: queries, lengths and parameters are loaded too, stores
    and unbound options are not, and longer requests load exactly their keys."""
    case, _, loads = run("dense")
    assert loads["main"]["queries"] > 0 and loads["main"]["valid_lens"] > 0 and loads["main"]["params"] > 0
    assert loads["main"]["kv_starts"] == loads["main"]["sinks"] == loads["main"]["out"] == 0
    case.valid_lens = np.minimum(2 * case.valid_lens, case.keys.shape[2]).astype(np.int32)
    case.run(counting_lib())
    assert counting_lib().loads()["main"]["keys"] == minimum_kv_bytes(case) // 2


if __name__ == "__main__":
    print("| variant | K/V bytes loaded / minimum | ragged |\n|---|---|---|")
    for variant in VARIANTS:
        ragged = f"{ragged_ratio(variant):.2f}" if variant in RAGGED else ""
        print(f"| {variant} | {ratio(variant):.2f} | {ragged} |")
