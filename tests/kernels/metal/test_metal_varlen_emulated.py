"""Packed queries (query_starts) and values of a head dim of their own (Dv) in the Metal kernel,
compiled with g++ by the emulation harness, against float64 attention: the four row sources
(dense, paged, quantized, ragged), three dtypes, (D, Dv) of equal fast dims, a fast pair, MLA's
latent (576, 512, values a view of the keys) and a generic pair, GQA groups up to 128, requests
of 0 to 37 rows (and one of 512), windows, sinks, kv_starts and a softcap, both launch paths and,
for equal head dims up to 128, the tiled path (test_metal_tiled_emulated.py has its own cases).
Every position no query row of a request attends holds NaN (keys) or inf (values); the
driver poisons the output and the memory around it. Malformed query_starts give zeros,
decided in the kernel; the launch plan reads nothing but shapes; K/V bytes stay within
the row blocks' bound; mutants of the packed rows and of the values' head dim must fail.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, q_b rows of request b, N
rows in all, T positions, D head dim of queries and keys, Dv of values.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from tests.kernels.metal.test_metal_quantized import scale_storage
from tests.metal_emu.build import build_library
from tests.metal_emu.cases import attended, make_case
from tests.metal_emu.driver import EmulatedLibrary, HarnessError
from tests.metal_emu.mutants import mutant_source
from tests.metal_emu.ragged_cases import make_ragged_case
from tests.metal_emu.reference import (TOLERANCE, packed_reference, query_starts_valid, reference_attention,
                                       to_dtype, to_float64)
from tests.metal_emu.sources import subset_source

DTYPES = ["float16", "bfloat16", "float32"]
# (D, Dv, latent): fast dims of V = 2 and V = 4, a fast pair, MLA's latent (values keys[..., :512]).
HEAD_DIMS = [(64, 64, False), (80, 80, False), (128, 128, False), (192, 128, False), (576, 512, True)]
# Requests of 0, 1, 2, 5 and 37 rows; some shorter than their rows (rows before the first key get
# zeros), lengths and starts outside [0, T]. Single pass, and split-K (few row blocks, long keys).
PATHS = {
    "single_pass": dict(t=48, h_kv=2, lens=[9, 1, 48, 70, 40], query_rows=[0, 1, 2, 5, 37],
                        starts=[3, 0, 10, 44, -2], window=20),
    "split_k": dict(t=200, h_kv=1, lens=[200, 0, 2, 130, 199], query_rows=[5, 0, 1, 2, 37],
                    starts=[0, 0, 1, 30, 5], window=150),
}
SOFTCAP = 5.0
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def packed_case(seed, path: str, dtype: str, dims: tuple, g: int, options: bool, **overrides):
    """A dense case of the path's requests: packed queries, (D, Dv, latent) head dims, GQA group
    g, and with ``options`` its kv_starts, window, sinks and a softcap."""
    spec = dict(PATHS[path], **overrides)
    d, dv, latent = dims
    return make_case(np.random.default_rng(seed), dtype, d, spec["h_kv"], g, spec["t"], spec["lens"],
                     query_rows=spec["query_rows"], dv=dv, latent=latent,
                     starts=spec["starts"] if options else None, window=spec["window"] if options else None,
                     sinks=options, softcap=SOFTCAP if options else None, scale=2.0 / np.sqrt(d))


def plan_of(lib, case, **kwargs) -> dict:
    n, h_q, d = case.queries.shape
    return lib.plan(len(case.valid_lens), h_q, case.keys.shape[1], case.keys.shape[2], d, case.dtype,
                    rows=n, window=case.window, dv=case.values.shape[-1], packed=True, **kwargs)


def assert_close(out, want, dtype):
    out = to_float64(out, dtype)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense(lib, dtype, dims, path, options):
    case = packed_case([dims[0], len(path), len(options)], path, dtype, dims, 4, options == "all")
    p = plan_of(lib, case)
    # Equal head dims up to 128 take the tiled path (many rows: G x N >= 16 x B), which never splits.
    assert p["tiled"] == (dims[0] == dims[1] <= 128)
    assert (p["num_splits"] > 1) == (path == "split_k" and not p["tiled"]) and p["grid"][2] == 1
    assert_close(case.run(lib), case.reference(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_generic_head_dims(lib, dtype):
    """(D, Dv) of no fast kernel: the generic one of their wider, values wider than keys too."""
    for dims in ((100, 70, False), (48, 96, False), (560, 500, False)):
        case = packed_case(dims[0], "single_pass", dtype, dims, 2, True)
        assert "upto" in plan_of(lib, case)["kernel"]
        assert_close(case.run(lib), case.reference(), dtype)


@pytest.mark.parametrize("g,h_kv,dims,path", [
    (1, 2, (128, 128, False), "single_pass"), (1, 1, (64, 64, False), "split_k"),
    (16, 2, (64, 64, False), "single_pass"), (16, 1, (128, 128, False), "split_k"),
    (128, 1, (576, 512, True), "single_pass"), (128, 1, (576, 512, True), "split_k")])
def test_gqa_groups(lib, g, h_kv, dims, path):
    """GQA groups of 1, 16 and 128 query heads a KV head (MLA: 128 heads on one latent KV head)."""
    if g == 128:
        # Decode and a short draft over one latent head: 128 x 3 rows are all the emulator needs.
        overrides = dict(lens=[40, 300], query_rows=[1, 2], starts=[0, 3]) if path == "split_k" else \
            dict(lens=[30, 0, 29], query_rows=[1, 0, 2], starts=[0, 0, 5])
        overrides["t"] = 300 if path == "split_k" else 30
    else:
        overrides = {}
    case = packed_case([g, len(path)], path, "bfloat16", dims, g, True, h_kv=h_kv, **overrides)
    p = plan_of(lib, case)
    assert (p["num_splits"] > 1) == (path == "split_k" and not p["tiled"])
    assert_close(case.run(lib), case.reference(), "bfloat16")


def test_request_of_512_rows(lib):
    """One prefill chunk of 512 rows beside a decode row, over row blocks sized for their mean."""
    case = make_case(np.random.default_rng(512), "float16", 64, 1, 1, 560, [560, 300], query_rows=[512, 1],
                     window=24, sinks=True)
    p = plan_of(lib, case)
    assert p["row_groups"] == 513 // (p["group_chunks"] * p["rows_per_group"]) + 2
    assert_close(case.run(lib), case.reference(), "float16")


def test_no_option_is_the_unpacked_call(lib):
    """q_b = L for every request gives, row for row, the output of the unpacked call of L rows."""
    case = make_case(np.random.default_rng(7), "float32", 128, 2, 4, 40, [40, 17, 3], query_rows=[3, 3, 3],
                     window=9, sinks=True, dv=128)
    unpacked = replace(case, queries=case.queries.reshape(3, 3, 8, 128).transpose(0, 2, 1, 3), query_starts=None)
    np.testing.assert_array_equal(case.run(lib), unpacked.run(lib).transpose(0, 2, 1, 3).reshape(9, 8, 128))


def paged(case, seed: int):
    """The case's keys and values as pools of BLOCK_SIZE-row pages in shuffled order, a few pages
    of NaN keys and inf values unused: (key pages, value pages, block tables). Latent values are
    the key pool's first Dv columns."""
    b, h_kv, t, d = case.keys.shape
    dv = case.values.shape[-1]
    mb = t // BLOCK_SIZE
    nb = b * mb + 3
    tables = np.random.default_rng(seed).permutation(nb)[:b * mb].reshape(b, mb).astype(np.int32)
    key_pages = to_dtype(np.full((nb, BLOCK_SIZE, h_kv, d), np.nan), case.dtype)
    value_pages = to_dtype(np.full((nb, BLOCK_SIZE, h_kv, dv), np.inf), case.dtype)
    for n in range(b):
        for m in range(mb):
            rows = slice(m * BLOCK_SIZE, (m + 1) * BLOCK_SIZE)
            key_pages[tables[n, m]] = case.keys[n, :, rows].transpose(1, 0, 2)
            value_pages[tables[n, m]] = case.values[n, :, rows].transpose(1, 0, 2)
    if np.shares_memory(case.keys, case.values):
        value_pages = key_pages[..., :dv]
    return key_pages, value_pages, tables


def run_paged(lib, case, seed: int):
    key_pages, value_pages, tables = paged(case, seed)
    return lib.paged_attention(case.queries, key_pages, value_pages, tables, case.valid_lens, case.dtype, case.scale,
                               window=case.window, sinks=case.sinks, softcap=case.softcap,
                               query_starts=case.query_starts)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dims", [(64, 64, False), (128, 128, False), (192, 128, False), (576, 512, True)],
                         ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged(lib, dtype, dims, path):
    """Pools read through shuffled block tables (the paged layout takes no kv_starts)."""
    case = packed_case([dims[0], len(path)], path, dtype, dims, 4, True, starts=None)
    assert_close(run_paged(lib, case, dims[0]), case.reference(), dtype)


def quantized_case(seed, path: str, dtype: str, d: int, group_size: int, bits: int, g: int):
    """mx.quantize triples of the path's requests (packed queries, kv_starts, a window, sinks, a
    softcap; every position no row attends all-ones words and NaN scales and biases): the
    quantized_attention arguments and the float64 output."""
    spec = PATHS[path]
    rng = np.random.default_rng(seed)
    t, h_kv, lens, rows = spec["t"], spec["h_kv"], spec["lens"], spec["query_rows"]
    b = len(lens)
    unread = ~attended(lens, spec["starts"], rows, t, spec["window"])
    triples, dequantized = [], []
    for _ in range(2):
        x = mx.array(rng.standard_normal((b, h_kv, t, d)).astype(np.float32))
        packed, scales, biases = (np.array(a) for a in mx.quantize(x, group_size=group_size, bits=bits))
        scales, biases = scale_storage(scales, "float16"), scale_storage(biases, "float16")
        shifts = np.arange(32 // bits, dtype=np.uint64) * bits
        ints = ((packed.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)).reshape(b, h_kv, t, d)
        dequantized.append(np.repeat(to_float64(scales, "float16"), group_size, -1) * ints +
                           np.repeat(to_float64(biases, "float16"), group_size, -1))
        packed.transpose(0, 2, 1, 3)[unread] = 0xFFFFFFFF
        scales.transpose(0, 2, 1, 3)[unread] = scale_storage(np.array(np.nan), "float16")
        biases.transpose(0, 2, 1, 3)[unread] = scale_storage(np.array(np.nan), "float16")
        triples.append((packed, scales, biases))
    queries = to_dtype(rng.standard_normal((sum(rows), h_kv * g, d)), dtype)
    args = dict(queries=queries, keys=triples[0], values=triples[1], valid_lens=np.array(lens, dtype=np.int32),
                kv_starts=np.array(spec["starts"], dtype=np.int32), window=spec["window"],
                sinks=(1.5 * rng.standard_normal(h_kv * g)).astype(np.float32), softcap=SOFTCAP,
                query_starts=np.cumsum([0, *rows], dtype=np.int32), scale=2.0 / np.sqrt(d))
    want = packed_reference(
        lambda n, q: reference_attention(q, dequantized[0][n:n + 1], dequantized[1][n:n + 1],
                                         args["valid_lens"][n:n + 1], args["scale"], args["kv_starts"][n:n + 1],
                                         args["window"], args["sinks"].astype(np.float64), SOFTCAP),
        to_float64(queries, dtype), args["query_starts"], d)
    return args, want


def run_quantized(lib, args, dtype, group_size, bits):
    args = dict(args)
    return lib.quantized_attention(args.pop("queries"), args.pop("keys"), args.pop("values"),
                                   args.pop("valid_lens"), dtype, args.pop("scale"), bits, group_size, "float16",
                                   **args)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("d,group_size,bits", [(64, 32, 4), (128, 64, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized(lib, dtype, d, group_size, bits, path):
    args, want = quantized_case(d + bits, path, dtype, d, group_size, bits, 4)
    assert_close(run_quantized(lib, args, dtype, group_size, bits), want, dtype)


def ragged_case(seed, path: str, dtype: str, dims: tuple, g: int, **kwargs):
    """The path's requests in buffers of their own (every layout), T_b their lengths or less."""
    spec = PATHS[path]
    d, dv, _ = dims
    lengths = [int(np.clip(n, 0, spec["t"])) for n in spec["lens"]]
    case = make_ragged_case(np.random.default_rng(seed), dtype, d, spec["h_kv"], g, lengths,
                            valid_lens=spec["lens"], layouts=("slice", "token_major", "3d", "shared", "exact"),
                            starts=spec["starts"], window=spec["window"], sinks=True, dv=dv,
                            query_rows=spec["query_rows"], **kwargs)
    case.scale, case.softcap = 2.0 / np.sqrt(d), SOFTCAP
    return case


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dims", [(64, 64, False), (80, 80, False), (192, 128, False), (576, 512, False)],
                         ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged(lib, dtype, dims, path):
    case = ragged_case([dims[0], len(path)], path, dtype, dims, 4)
    assert_close(case.run(lib), case.reference(), dtype)


def test_ragged_groups_serve_their_own_blocks(lib):
    """Twenty requests in buffers of their own: several dispatch groups, each running every row
    block and leaving those of other groups' requests alone."""
    rows = [1, 0, 3, 2] * 5
    case = make_ragged_case(np.random.default_rng(3), "float16", 64, 1, 4, [9, 12, 30, 3] * 5,
                            layouts=("exact", "3d"), sinks=True, window=6, query_rows=rows)
    out = case.run(lib)
    assert lib.dispatches() > 1
    assert_close(out, case.reference(), "float16")


def malformed(query_starts: np.ndarray) -> dict[str, np.ndarray]:
    """Ways query_starts of N rows can be wrong, which the op only catches outside mx.compile."""
    n = int(query_starts[-1])
    out = {}
    for name, (i, value) in {"first_not_0": (0, 1), "negative": (1, -5), "decreasing": (2, int(query_starts[1]) - 1),
                             "last_short": (-1, n - 1), "last_long": (-1, n + 1), "huge": (2, 2**31 - 1),
                             "most_negative": (-1, -(2**31))}.items():
        starts = query_starts.copy()
        starts[i] = value
        assert not query_starts_valid(starts, n)
        out[name] = starts
    return out


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("layout", ["dense", "paged", "quantized", "ragged"])
def test_malformed_query_starts_give_zeros(lib, layout, path):
    """Every malformed query_starts: the whole output zeros (not NaN, nothing unwritten or past
    it), from the main pass or, split, the reduce."""
    dims = (64, 64, False)
    if layout == "quantized":
        args, _ = quantized_case(1, path, "float32", 64, 32, 8, 4)
        starts, run = args["query_starts"], lambda s: run_quantized(lib, dict(args, query_starts=s), "float32", 32, 8)
    elif layout == "ragged":
        case = ragged_case(1, path, "float32", dims, 4)
        starts, run = case.query_starts, lambda s: replace(case, query_starts=s).run(lib)
    else:
        case = packed_case(1, path, "float32", dims, 4, True, starts=None)
        starts = case.query_starts
        if layout == "paged":
            run = lambda s: run_paged(lib, replace(case, query_starts=s), 1)  # noqa: E731
        else:
            run = lambda s: replace(case, query_starts=s).run(lib)  # noqa: E731
    for name, bad in malformed(starts).items():
        out = run(bad)
        assert out.shape[::2] == (starts[-1], 64) and not out.view(np.uint8).any(), name


def test_query_starts_view_at_a_stride(lib):
    case = packed_case(5, "single_pass", "float32", (64, 64, False), 4, True)
    case.query_starts = np.stack([case.query_starts, -np.ones_like(case.query_starts)], 1)[:, 0]
    assert case.query_starts.strides[0] == 8
    assert_close(case.run(lib), case.reference(), "float32")


@pytest.mark.parametrize("dims", [(64, 64), (192, 128), (576, 512), (100, 70)], ids=lambda x: f"{x[0]}-{x[1]}")
@pytest.mark.parametrize("n,b,g", [(1, 1, 1), (45, 5, 4), (512, 2, 1), (3, 2, 128), (64, 64, 8)])
def test_plan_of_packed_rows(lib, dims, n, b, g):
    """Shapes only: row groups sized for the mean request, G * N / rows_per_block + B row blocks
    per KV head (any q_b summing to N fits), a grid of z = 1, reduce rows over the N, partials
    and the reduce's threads by Dv."""
    d, dv = dims
    p = lib.plan(b, 2 * g, 2, 4096, d, "float16", rows=n, dv=dv, packed=True)
    unpacked = lib.plan(b, 2 * g, 2, 4096, d, "float16", rows=-(-n // b), dv=dv)
    block = p["group_chunks"] * p["rows_per_group"]
    # The tiled path's blocks are its 32-row tiles (test_metal_tiled_emulated.py).
    assert (p["rows_per_group"], p["group_chunks"]) == ((8, 4) if p["tiled"] else (
        unpacked["rows_per_group"], unpacked["group_chunks"]))
    assert p["row_groups"] == g * n // block + b and p["grid"][1:] == (2 * p["row_groups"], 1)
    suffix = f"{d}_v{dv}" if (d, dv) in ((192, 128), (576, 512)) else str(d) if d == dv else \
        f"upto{128 if max(d, dv) <= 128 else 576}"
    assert p["kernel"] == f"batched_decode_attention_float16_{suffix}"
    if p["num_splits"] > 1:
        assert p["reduce_grid"] == (n, 2 * g, 1) and p["reduce_group"][0] == -(-dv // 32) * 32
        assert p["partial_acc_elems"] == p["partial_stats_elems"] * dv == n * 2 * g * p["num_splits"] * dv
    # Any q_b summing to N: the blocks the kernel's numbering needs stay inside the grid.
    rng = np.random.default_rng(n)
    for _ in range(20):
        starts = np.sort(np.concatenate([[0, n], rng.integers(0, n + 1, b - 1)]))
        needed = max(g * int(s) // block + k + -(-g * int(q) // block) for k, (s, q) in
                     enumerate(zip(starts[:-1], np.diff(starts))))
        assert needed <= p["row_groups"]


@pytest.mark.parametrize("args,message", [
    (dict(d=577), "head dim 577"), (dict(d=64, dv=513), "values' head dim 513"), (dict(d=576), "head dim 576")])
def test_head_dims_out_of_range_raise(lib, args, message):
    with pytest.raises(HarnessError, match=message):
        lib.plan(1, 8, 2, 64, args["d"], "float16", dv=args.get("dv"))


# Packed shapes whose K/V loads are counted (a "loads" build): decode rows (one row block per
# request: the floor exactly), mixed q_b (a request of G x q_b rows reads its keys once per
# block, at most), MLA's latent, split-K.
TRAFFIC = {
    "decode, q_b = 1": dict(dtype="float16", d=128, h_kv=2, g=4, t=40, lens=[40, 13, 0, 29, 7, 33],
                            query_rows=[1] * 6),
    "mixed q_b, window 9": dict(dtype="float16", d=64, h_kv=2, g=4, t=48, lens=[9, 1, 48, 30, 40],
                                query_rows=[0, 1, 2, 5, 37], window=9),
    "MLA latent, G = 16": dict(dtype="bfloat16", d=576, dv=512, latent=True, h_kv=1, g=16, t=30, lens=[30, 12, 25],
                               query_rows=[1, 3, 2]),
    "split-K, (192, 128)": dict(dtype="float32", d=192, dv=128, h_kv=1, g=2, t=300, lens=[300, 250],
                                query_rows=[2, 9]),
}


@functools.cache
def counting_lib() -> EmulatedLibrary:
    lib = EmulatedLibrary(build_library())
    kernels = {plan_of(lib, make_case(np.random.default_rng(0), **s))["kernel"] for s in TRAFFIC.values()}
    return EmulatedLibrary(build_library(subset_source(kernels), sanitize="loads"))


@pytest.mark.parametrize("name", sorted(TRAFFIC))
def test_kv_traffic_within_the_row_blocks_bound(lib, name):
    spec = TRAFFIC[name]
    case = make_case(np.random.default_rng(len(name)), **spec)
    counting = counting_lib()
    assert_close(case.run(counting), case.reference(), case.dtype)
    loads = counting.loads()["main"]
    p = plan_of(lib, case)
    block = p["group_chunks"] * p["rows_per_group"]
    per_row = case.keys.shape[1] * (case.keys.shape[3] + case.values.shape[3]) * case.keys.itemsize
    read = attended(case.valid_lens, case.kv_starts, case.rows(), case.keys.shape[2], case.window).sum(1)
    floor = int(read.sum()) * per_row
    bound = sum(-(-spec["g"] * q // block) * int(n) for q, n in zip(case.rows(), read)) * per_row
    assert floor <= loads["keys"] + loads["values"] <= bound
    if name.startswith("decode"):
        assert loads["keys"] + loads["values"] == floor


def mutant_lib(name: str, cases) -> EmulatedLibrary:
    lib = EmulatedLibrary(build_library())
    kernels = {plan_of(lib, c)["kernel"] for c in cases}
    return EmulatedLibrary(build_library(mutant_source(name, kernels)))


def fails(lib, case) -> bool:
    try:
        out = to_float64(case.run(lib), case.dtype)
    except HarnessError:
        return True
    tolerance = TOLERANCE[case.dtype]
    return not np.allclose(out, case.reference(), atol=tolerance, rtol=tolerance, equal_nan=True)


@pytest.mark.parametrize("name,dims,paths", [
    ("packed_rows_one_position_late", (64, 64, False), ("single_pass", "split_k")),
    ("value_stride_of_the_keys", (192, 128, False), ("single_pass", "split_k")),
    # Single pass only: the mutant's split-K partials would overflow the launcher's buffers.
    ("value_dim_of_the_keys", (192, 128, False), ("single_pass",)),
    ("value_dim_of_the_keys", (100, 70, False), ("single_pass",)),
])
def test_mutant_fails(name, dims, paths):
    cases = [packed_case(2, path, "float32", dims, 4, True) for path in paths]
    mutant = mutant_lib(name, cases)
    assert all(fails(mutant, c) for c in cases), name
