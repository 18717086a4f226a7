"""What the Metal kernel loads from each device buffer, counted by the emulation
harness (a "loads" build: the kernel compiled at -O0 with every load calling a
counting hook, see metal_emu/build.py).

The floor is ``sum over requests of rows in range x H_kv x D x 2 x itemsize``:
every K/V row some query row of a request attends, read once for all G heads
and all L query rows, no other row read. The kernel meets it in every shape
counted here, whatever the row source (dense, paged, quantized, ragged): a
request's G x L query rows are split into row chunks (8 rows a simdgroup; 4
above D = 256), and one threadgroup holds every chunk (up to 8), its
simdgroups sharing each K/V tile through threadgroup memory. Only a pipeline
whose thread limit is below one simdgroup per chunk spreads the chunks over
row groups, threadgroups that each read their rows' keys: the ratio is then
the predicted one, above 1.

The ragged row source (one buffer per request, bound in groups of slots) and
the paged one (pools read through block tables) read what the dense one reads
for the same shapes, to the byte; the quantized one the packed words of the
same rows, once.

Run as a script (``python -m tests.kernels.metal.test_metal_traffic`` from the repository root)
it prints the ratio of every variant, the table docs/metal.md shows.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows
per request, T positions, D head dim, BS rows per page.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from tests.metal_emu.build import build_library
from tests.metal_emu.cases import attended, make_case
from tests.metal_emu.driver import BUFFERS, RAGGED_SLOTS, EmulatedLibrary
from tests.metal_emu.ragged_cases import RaggedCase
from tests.metal_emu.reference import TOLERANCE, reference_attention, row_range, to_dtype, to_float64
from tests.metal_emu.sources import subset_source

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
# make_case arguments (plus ``shift``: Q/K/V start that many elements off a 16-byte boundary).
VARIANTS = {
    "dense": dict(dtype="float16", d=128, h_kv=2, g=4, t=60, lens=[60, 17, 0, 33]),
    "dense, split-K": dict(dtype="bfloat16", d=64, h_kv=1, g=8, t=300, lens=[300, 120, 71]),
    "dense, L = 2": dict(dtype="float32", d=80, h_kv=2, g=4, t=50, lens=[50, 9, 1], rows=2),
    "kv_starts, L = 3": dict(dtype="float16", d=96, h_kv=2, g=2, t=50, lens=[50, 30, 4], rows=3,
                             starts=[10, 29, 0]),
    "window 16, L = 3": dict(dtype="float16", d=128, h_kv=2, g=2, t=80, lens=[80, 40, 12], rows=3, window=16),
    "window 300, split-K, sinks": dict(dtype="float32", d=64, h_kv=1, g=4, t=400, lens=[400, 350], rows=2,
                                       window=300, sinks=True),
    "scalar loads (odd row stride)": dict(dtype="float16", d=64, h_kv=2, g=4, t=40, lens=[40, 5], rows=2,
                                          row_pad=1),
    "scalar loads (odd offset)": dict(dtype="float32", d=128, h_kv=2, g=2, t=40, lens=[40, 5], shift=1),
    "generic head dim (D = 100)": dict(dtype="bfloat16", d=100, h_kv=2, g=4, t=40, lens=[40, 11]),
    "D = 512, G = 4": dict(dtype="float16", d=512, h_kv=1, g=4, t=30, lens=[30, 7]),
    "G = 16": dict(dtype="float16", d=128, h_kv=1, g=16, t=40, lens=[40, 13]),
    "G = 4, L = 4": dict(dtype="float16", d=128, h_kv=2, g=4, t=40, lens=[40, 13], rows=4),
    "G = 4, L = 4, window 8": dict(dtype="float16", d=128, h_kv=2, g=4, t=40, lens=[40, 13], rows=4, window=8),
    "G = 8, L = 2, split-K": dict(dtype="bfloat16", d=64, h_kv=1, g=8, t=300, lens=[300, 200], rows=2),
    "D = 512, G = 8": dict(dtype="float16", d=512, h_kv=1, g=8, t=30, lens=[30, 7]),
    "G = 12, L = 3, kv_starts, window 9": dict(dtype="float32", d=64, h_kv=2, g=12, t=50, lens=[50, 20, 0],
                                               rows=3, starts=[4, 0, 0], window=9, sinks=True),
}
# More chunks than a threadgroup's 8 simdgroups: two row groups, which read their keys each.
ROW_GROUPS = {"G = 33, L = 2 (9 chunks)": dict(dtype="float32", d=64, h_kv=1, g=33, t=40, lens=[40, 13], rows=2)}
# Shapes of several row chunks (G x L above 8 rows; 4 above D = 256), all in one threadgroup.
SEVERAL_CHUNKS = ["G = 16", "G = 4, L = 4", "G = 4, L = 4, window 8", "G = 8, L = 2, split-K", "D = 512, G = 8",
                  "G = 12, L = 3, kv_starts, window 9"]
# The variants run again through the paged row source (which takes no kv_starts) and the
# quantized one (head dims that are multiples of its group size, 32), on the same keys and values.
PAGED = [n for n, s in VARIANTS.items() if "starts" not in s and "shift" not in s and "row_pad" not in s]
QUANTIZED = [n for n, s in VARIANTS.items() if s["d"] % 32 == 0 and "shift" not in s and "row_pad" not in s]
RAGGED = [n for n, s in VARIANTS.items() if "shift" not in s]
BLOCK_SIZE = 16
BITS, GROUP_SIZE = 8, 32
# The quantized kernel's scales and biases, at MBD_QUANT_KEY_SCALES (11) .. MBD_QUANT_VALUE_BIASES (14).
QUANT_SCALES = BUFFERS[11:15]


@functools.cache
def plan_lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def plan(spec: dict, max_threads: int = 1024) -> dict:
    return plan_lib().plan(len(spec["lens"]), spec["h_kv"] * spec["g"], spec["h_kv"], spec["t"], spec["d"],
                           spec["dtype"], max_threads, rows=spec.get("rows", 1), window=spec.get("window"))


def quantized_kernel(spec: dict) -> str:
    return plan(spec)["kernel"].replace("batched_", "quantized_batched_") + f"_{BITS}bit"


@functools.cache
def counting_lib() -> EmulatedLibrary:
    dense = [plan(s)["kernel"] for s in VARIANTS.values()]
    ragged = [plan(VARIANTS[name])["kernel"].replace("batched_", "ragged_") for name in RAGGED]
    quantized = [quantized_kernel(VARIANTS[name]) for name in QUANTIZED]
    return EmulatedLibrary(build_library(subset_source(dense + ragged + quantized), sanitize="loads"))


def make(name: str):
    spec = dict({**VARIANTS, **ROW_GROUPS}[name])
    shift = spec.pop("shift", 0)
    return make_case(np.random.default_rng(len(name)), **spec), shift


def run(name: str, max_threads: int = 1024):
    """The variant's case, its output and the bytes each pass loaded per buffer."""
    case, shift = make(name)
    lib = counting_lib()
    out = case.run(lib, shift=shift, max_threads=max_threads)
    return case, out, lib.loads()


def rows_read(case) -> int:
    """The (request, position) pairs some query row of the request attends."""
    return int(attended(case.valid_lens, case.kv_starts, case.queries.shape[2], case.keys.shape[2],
                        case.window).sum())


def minimum_kv_bytes(case) -> int:
    """K and V bytes of the rows some query row of a request attends, each read once."""
    h_kv, d = case.keys.shape[1], case.keys.shape[3]
    return rows_read(case) * h_kv * d * 2 * ITEMSIZE[case.dtype]


def row_group_kv_bytes(case, p: dict) -> int:
    """K and V bytes when each row group (rows ordered by i, then g) reads the keys
    from its rows' first to their last, once."""
    b, h_q, rows, d = case.queries.shape
    h_kv, t = case.keys.shape[1], case.keys.shape[2]
    g, per_group = h_q // h_kv, p["rows_per_group"] * p["group_chunks"]
    keys = 0
    for n, length in enumerate(case.valid_lens):
        length = int(np.clip(length, 0, t))
        start = 0 if case.kv_starts is None else int(np.clip(case.kv_starts[n], 0, t))
        for first in range(0, g * rows, per_group):
            ranges = [row_range(length, start, rows, i, case.window)
                      for i in range(first // g, (min(first + per_group, g * rows) - 1) // g + 1)]
            ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
            keys += max(hi for _, hi in ranges) - min(lo for lo, _ in ranges) if ranges else 0
    return keys * h_kv * d * 2 * ITEMSIZE[case.dtype]


def assert_close(out, want, dtype):
    np.testing.assert_allclose(to_float64(out, dtype), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def ratio(name: str, max_threads: int = 1024) -> float:
    case, _, loads = run(name, max_threads)
    return (loads["main"]["keys"] + loads["main"]["values"]) / minimum_kv_bytes(case)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_kv_bytes_are_the_minimum(name):
    case, out, loads = run(name)
    p = plan(VARIANTS[name])
    assert (p["row_chunks"] > 1) == (name in SEVERAL_CHUNKS)
    assert p["row_groups"] == 1 and p["group_chunks"] == p["row_chunks"]
    assert (p["num_splits"] > 1) == ("split-K" in name)
    assert counting_lib().vector_loads() == ("scalar" not in name)
    assert_close(out, case.reference(), case.dtype)
    # K and V alike: each row in range once, in the main pass; the reduction reads neither.
    assert loads["main"]["keys"] == loads["main"]["values"] == minimum_kv_bytes(case) // 2
    assert loads["reduce"]["keys"] == loads["reduce"]["values"] == 0


@pytest.mark.parametrize("name,max_threads", [*((name, 32) for name in SEVERAL_CHUNKS),
                                              ("G = 12, L = 3, kv_starts, window 9", 64),
                                              ("G = 12, L = 3, kv_starts, window 9", 96),
                                              ("G = 33, L = 2 (9 chunks)", 1024)])
def test_a_small_thread_limit_takes_row_groups_that_read_again(name, max_threads):
    """Fewer simdgroups than row chunks: each row group is a threadgroup reading its rows' keys,
    exactly what the plan predicts, and still the reference's output. At a limit of one
    simdgroup, every row chunk is a row group: what the kernel read before chunks shared tiles."""
    case, out, loads = run(name, max_threads)
    p = plan({**VARIANTS, **ROW_GROUPS}[name], max_threads)
    assert p["row_groups"] > 1 and p["group"][0] <= max_threads
    assert_close(out, case.reference(), case.dtype)
    assert loads["main"]["keys"] + loads["main"]["values"] == row_group_kv_bytes(case, p) > minimum_kv_bytes(case)


def paged_of(case):
    """The dense case as pools [B * MB, BS, H_kv, D] of request b's pages b * MB .. b * MB + MB - 1
    (the positions past T hold NaN and are never attended), and the block tables."""
    b, h_kv, t, d = case.keys.shape
    mb = -(-t // BLOCK_SIZE)

    def pool(x):
        out = to_dtype(np.full((b, mb * BLOCK_SIZE, h_kv, d), np.nan), case.dtype)
        out[:, :t] = x.transpose(0, 2, 1, 3)
        return out.reshape(b * mb, BLOCK_SIZE, h_kv, d)

    tables = np.arange(b * mb, dtype=np.int32).reshape(b, mb)
    return pool(case.keys), pool(case.values), tables


def paged_loads(name: str):
    case, _ = make(name)
    k, v, tables = paged_of(case)
    lib = counting_lib()
    out = lib.paged_attention(case.queries, k, v, tables, case.valid_lens, case.dtype, case.scale,
                              window=case.window, sinks=case.sinks)
    return case, out, lib.loads()


@pytest.mark.parametrize("name", PAGED)
def test_paged_rows_read_what_dense_rows_read(name):
    """A pool read through block tables: every attended row once, the dense kernel's bytes."""
    case, out, loads = paged_loads(name)
    assert_close(out, case.reference(), case.dtype)
    assert loads["main"]["keys"] == loads["main"]["values"] == minimum_kv_bytes(case) // 2
    assert loads["reduce"]["keys"] == loads["reduce"]["values"] == 0


def quantized_of(case):
    """mx.quantize triples of the case's keys and values (float32 scales), and their dequantized float64."""
    triples, dequantized = [], []
    for x in (case.keys, case.values):
        packed, scales, biases = (np.array(a) for a in mx.quantize(
            mx.array(to_float64(x, case.dtype).astype(np.float32)), group_size=GROUP_SIZE, bits=BITS))
        shifts = np.arange(32 // BITS, dtype=np.uint64) * BITS
        ints = ((packed.astype(np.uint64)[..., None] >> shifts) & ((1 << BITS) - 1)).reshape(x.shape)
        dequantized.append(np.repeat(scales.astype(np.float64), GROUP_SIZE, -1) * ints +
                           np.repeat(biases.astype(np.float64), GROUP_SIZE, -1))
        triples.append((packed, scales, biases))
    return triples, dequantized


def quantized_loads(name: str):
    case, _ = make(name)
    (keys, values), (k64, v64) = quantized_of(case)
    lib = counting_lib()
    out = lib.quantized_attention(case.queries, keys, values, case.valid_lens, case.dtype, case.scale, BITS,
                                  GROUP_SIZE, "float32", kv_starts=case.kv_starts, window=case.window,
                                  sinks=case.sinks)
    want = reference_attention(to_float64(case.queries, case.dtype), k64, v64, case.valid_lens, case.scale,
                               case.kv_starts, case.window, None if case.sinks is None else
                               case.sinks.astype(np.float64))
    return case, out, want, lib.loads()


def paged_ratio(name: str) -> float:
    case, _, loads = paged_loads(name)
    return (loads["main"]["keys"] + loads["main"]["values"]) / minimum_kv_bytes(case)


def word_loads(case, name: str) -> int:
    """Bytes of packed words one side loads when every attended row is read once: a lane
    loads the word holding its V elements, which 32 / BITS / V lanes of its simdgroup share."""
    h_kv, d = case.keys.shape[1], case.keys.shape[3]
    lanes_per_word = max(1, 32 // BITS // plan(VARIANTS[name])["vector_width"])
    return rows_read(case) * h_kv * d * BITS // 32 * 4 * lanes_per_word


def quantized_ratio(name: str) -> float:
    case, _, _, loads = quantized_loads(name)
    return (loads["main"]["keys"] + loads["main"]["values"]) / (2 * word_loads(case, name))


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_rows_read_their_words_once(name):
    """Packed words of every attended row once, each by the lanes whose elements it holds; each
    lane loads the scale and bias of its own elements (one of each per load, shared by
    GROUP_SIZE / V lanes of a simdgroup)."""
    case, out, want, loads = quantized_loads(name)
    assert_close(out, want, case.dtype)
    h_kv, d = case.keys.shape[1], case.keys.shape[3]
    assert loads["main"]["keys"] == loads["main"]["values"] == word_loads(case, name)
    lane_loads = rows_read(case) * h_kv * d // plan(VARIANTS[name])["vector_width"] * 4
    assert [loads["main"][n] for n in QUANT_SCALES] == [lane_loads] * 4
    assert loads["reduce"]["keys"] == loads["reduce"]["values"] == 0


def ragged_of(case, own: bool) -> RaggedCase:
    """The dense case as a ragged call: request b's keys and values are views [b] of the dense
    ones (one buffer each: two slots), or copies of their first len_b positions (T_b = len_b)."""
    t = case.keys.shape[2]
    lengths = np.clip(case.valid_lens, 0, t)
    pick = (lambda a, b: a[b, :, :lengths[b]].copy()) if own else (lambda a, b: a[b])
    return RaggedCase(case.dtype, case.queries, [pick(case.keys, b) for b in range(len(lengths))],
                      [pick(case.values, b) for b in range(len(lengths))], case.valid_lens, case.scale,
                      case.kv_starts, case.window, case.sinks)


def ragged_ratio(name: str) -> float:
    """As ``ratio``, through the ragged row source with buffers of the requests' own."""
    case, _, _ = run(name)
    ragged_of(case, own=True).run(counting_lib())
    loads = counting_lib().loads()["main"]
    return sum(loads[f"slot{i}"] for i in range(RAGGED_SLOTS)) / minimum_kv_bytes(case)


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


def threadgroup_bytes(spec: dict) -> int:
    """The main kernel's threadgroup memory: the tile / merge rows (8 x D floats, D the kernel's),
    the simdgroups' max and sum (2 x 8 x 8 floats) and the tile's 4 validity flags (ints)."""
    kernel = plan(spec)["kernel"]
    d = int(kernel.rsplit("_", 1)[1].removeprefix("upto"))
    return 8 * d * 4 + 2 * 8 * 8 * 4 + 4 * 4


if __name__ == "__main__":
    print("| variant | row chunks | dense | paged | quantized (lane words) | ragged | threadgroup memory "
          "| dense, limit of 32 threads |\n|---|---|---|---|---|---|---|---|")
    for variant, spec in VARIANTS.items():
        cells = [f"{ratio(variant):.2f}", f"{paged_ratio(variant):.2f}" if variant in PAGED else "",
                 f"{quantized_ratio(variant):.2f}" if variant in QUANTIZED else "",
                 f"{ragged_ratio(variant):.2f}" if variant in RAGGED else ""]
        small = f"{ratio(variant, 32):.2f}" if variant in SEVERAL_CHUNKS else ""
        print(f"| {variant} | {plan(spec)['row_chunks']} | " + " | ".join(cells) +
              f" | {threadgroup_bytes(spec)} B | {small} |")
