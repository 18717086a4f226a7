"""The Metal kernel's ragged row source (one buffer per request), run by the emulation harness
against float64, bound and dispatched as eval_gpu of RaggedDecodeAttention does: in groups of
requests whose buffers fit the kernel's 16 slots (csrc/metal/ragged_launch_plan.h).

Every dtype x head dim (fast and generic), G, L, kv_starts, windows and sinks, both launch
paths; requests in every layout of ragged_cases (slices of larger caches, token-major views
transposed, 3-d arrays, views of one shared buffer, arrays of their own), T_b = 0, lengths above
T_b and negative (clamped to [0, T_b]); every position no row attends is NaN (keys) or inf
(values), and so is everything in a buffer outside the views.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows per request,
T_b request b's positions, T the longest, D head dim.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.metal_emu.build import KERNEL_DIR, build_library, kernel_text
from tests.metal_emu.cases import make_case
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.prepass import kernel_buffer_indices
from tests.metal_emu.ragged_cases import LAYOUTS, make_ragged_case
from tests.metal_emu.reference import TOLERANCE, row_range, to_float64

DTYPES = ["float16", "bfloat16", "float32"]
DIMS = [1, 32, 64, 80, 128, 256]
GROUPS = [1, 4, 8]
# T_b, valid_lens, starts and a window per launch path: T <= 64 keeps one pass; a long T with
# few (request, KV head) items takes split-K. Lengths: empty, one key, above T_b (clamped to it),
# negative, huge; T_b = 0 with a positive length.
PATHS = {
    "single_pass": dict(h_kv=2, lengths=[0, 1, 5, 40, 33, 12, 7, 40, 20, 0],
                        lens=[3, 1, 5, 40, 50, -3, 2**31 - 1, 12, 20, 0], starts=[0, -2, 3, 10, 40, 0, 5, 100, 2, 0],
                        window=7),
    "split_k": dict(h_kv=1, lengths=[140, 1, 0, 97, 130, 64], lens=[140, 1, 9, 97, 300, 64],
                    starts=[0, 0, 7, 60, -50, 64], window=130),
}


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


def path_case(rng, path, dtype, d, g, rows, starts, window, sinks, layouts=LAYOUTS):
    spec = PATHS[path]
    return make_ragged_case(rng, dtype, d, spec["h_kv"], g, spec["lengths"], spec["lens"], layouts=layouts,
                            rows=rows, starts=spec["starts"] if starts else None,
                            window=spec["window"] if window else None, sinks=sinks)


def empty_rows(case) -> np.ndarray:
    """bool [B, L]: the query rows with no key."""
    rows = case.queries.shape[2]
    out = np.zeros((len(case.keys), rows), dtype=bool)
    for b, k in enumerate(case.keys):
        t = (k[0] if k.ndim == 4 else k).shape[1]
        start = 0 if case.kv_starts is None else int(np.clip(case.kv_starts[b], 0, t))
        for i in range(rows):
            lo, hi = row_range(int(np.clip(case.valid_lens[b], 0, t)), start, rows, i, case.window)
            out[b, i] = hi <= lo
    return out


def run_and_compare(lib, case, **kwargs):
    got = to_float64(case.run(lib, **kwargs), case.dtype)
    np.testing.assert_allclose(got, case.reference(), atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])
    # NaN/inf outside every row's range is never read; a row with no key is exactly zero.
    assert np.isfinite(got).all()
    assert not got.transpose(0, 2, 1, 3)[empty_rows(case)].any()
    return got


def plan_of(lib, case) -> dict:
    b, h_q, rows, d = case.queries.shape
    h_kv, t = case.keys[0].shape[-3], max(k.shape[-2] for k in case.keys)
    return lib.plan(b, h_q, h_kv, t, d, case.dtype, rows=rows, window=case.window)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(lib, dtype, d, path):
    """Every dtype and head dim of the list on both paths, one plain (L = 1, no option), the
    other with every option on (L = 4), in turns."""
    turn = DIMS.index(d) + DTYPES.index(dtype)
    on = (turn + sorted(PATHS).index(path)) % 2 == 0
    case = path_case(np.random.default_rng([d, turn, len(path)]), path, dtype, d, GROUPS[turn % 3], 4 if on else 1,
                     on, on, on)
    assert (plan_of(lib, case)["num_splits"] > 1) == (path == "split_k")
    run_and_compare(lib, case)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("window", [False, True], ids=["", "window"])
@pytest.mark.parametrize("starts", [False, True], ids=["", "starts"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_options(lib, path, starts, window, sinks):
    """Every combination of the options on both paths; L (1 or 4) and G vary."""
    rows = 4 if (starts + window + sinks) % 2 else 1
    g = [1, 3, 8][(rows + 2 * starts + window + sinks) % 3]
    case = path_case(np.random.default_rng([rows, starts, window, sinks]), path, "float32", 64, g, rows, starts,
                     window, sinks)
    run_and_compare(lib, case)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_requests_read_in_place_as_the_dense_kernel_reads(lib, path):
    """Views [b] of one dense cache (one buffer: one slot) give the dense kernel's output bit for bit."""
    spec = {"single_pass": dict(t=40, h_kv=2, lens=[40, 3, 0, 17]), "split_k": dict(t=140, h_kv=1, lens=[140, 9])}
    dense = make_case(np.random.default_rng(2), "bfloat16", 80, g=4, rows=2, window=100, sinks=True, **spec[path])
    ragged = make_ragged_case(np.random.default_rng(2), "bfloat16", 80, 1, 4, [1])
    ragged.queries, ragged.valid_lens, ragged.window, ragged.sinks = (
        dense.queries, dense.valid_lens, dense.window, dense.sinks)
    ragged.keys = [dense.keys[b] for b in range(len(dense.valid_lens))]
    ragged.values = [dense.values[b] for b in range(len(dense.valid_lens))]
    np.testing.assert_array_equal(ragged.run(lib), dense.run(lib))
    assert lib.dispatches() == 1


@pytest.mark.parametrize("h_kv,lengths,splits", [(4, [5, 60, 0, 33, 17], False), (1, [130, 7, 0, 150, 64], True)])
def test_groups_of_requests(lib, h_kv, lengths, splits):
    """B = 40 requests of their own buffers, 32 with positions: 8 fit 16 slots, 4 dispatches (one reduce
    over all B when split)."""
    lengths = lengths * 8
    case = make_ragged_case(np.random.default_rng(h_kv), "float16", 64, h_kv, 2, lengths,
                            [n + 3 if b % 3 else n for b, n in enumerate(lengths)], layouts=("slice", "exact"),
                            rows=2, window=140, sinks=True)
    assert (plan_of(lib, case)["num_splits"] > 1) == splits
    run_and_compare(lib, case)
    # Zero-length requests (8 of the 40) bind nothing.
    assert lib.dispatches() == 4


def test_shared_buffers_and_mixed_layouts(lib):
    """Requests sharing one buffer take one slot in each group: 20 requests of 5 layouts (25 buffers;
    the token-major requests have no position) in 2 groups."""
    lengths = [9, 0, 30, 1, 17] * 4
    case = make_ragged_case(np.random.default_rng(5), "float32", 128, 2, 4, lengths,
                            [n + b % 3 - 1 for b, n in enumerate(lengths)], layouts=LAYOUTS, rows=3, window=6,
                            row_pad=2)
    run_and_compare(lib, case)
    assert lib.dispatches() == 2


@pytest.mark.parametrize("shared", [False, True])
def test_a_thousand_short_requests(lib, shared):
    """B = 1024 requests of 0 to 4 positions: 8 per group of their own buffers, one dispatch when all
    share one cache."""
    rng = np.random.default_rng(1024)
    lengths = [int(n) for n in rng.integers(0, 5, 1024)]
    case = make_ragged_case(rng, "float16", 32, 1, 2, lengths, layouts=("shared",) if shared else ("exact",))
    run_and_compare(lib, case, max_threads=32)
    assert lib.dispatches() == (1 if shared else -(-sum(n > 0 for n in lengths) // 8))


def test_no_positions_at_all(lib):
    """T_b = 0 for every request (T = 0), whatever valid_lens says: zeros, nothing bound."""
    case = make_ragged_case(np.random.default_rng(0), "float16", 64, 2, 2, [0, 0, 0], [0, 5, -1], rows=2, sinks=True)
    got = run_and_compare(lib, case)
    assert not got.any()


@pytest.mark.parametrize("row_pad,vectors", [(0, True), (1, False)])
def test_loads_follow_every_request(lib, row_pad, vectors):
    """Vector loads when every request's rows sit on the vector width; one request with an odd row
    stride makes the call scalar, with the same values."""
    lengths = [20, 7, 0, 13]
    case = make_ragged_case(np.random.default_rng(3), "float16", 128, 2, 2, lengths, layouts=("slice", "3d"), rows=2)
    odd = make_ragged_case(np.random.default_rng(3), "float16", 128, 2, 2, lengths[:1], row_pad=row_pad, rows=2)
    case.keys[0], case.values[0] = odd.keys[0], odd.values[0]
    run_and_compare(lib, case)
    assert lib.vector_loads() == vectors


def test_kernel_binds_the_plans_indices():
    """The kernel's [[buffer(i)]] are the launch plan's: the dense inputs but keys and values,
    the table, the group, the slots, then query_starts (as the reduce's last)."""
    defines = dict(re.findall(r"#define (MBD_RAGGED_\w+) (\d+)",
                              (KERNEL_DIR / "ragged_decode_attention_params.h").read_text()))
    query_starts = int(re.search(r"#define MBD_QUERY_STARTS (\d+)",
                                 (KERNEL_DIR / "batched_decode_attention_params.h").read_text()).group(1))
    slot0, slots = int(defines["MBD_RAGGED_SLOT0"]), int(defines["MBD_RAGGED_SLOTS"])
    indices = kernel_buffer_indices(kernel_text())
    assert indices["ragged_decode_attention"] == [0, *range(3, 11), int(defines["MBD_RAGGED_REQUESTS"]),
                                                  int(defines["MBD_RAGGED_GROUP"]), *range(slot0, slot0 + slots),
                                                  query_starts]
    assert slot0 + slots <= query_starts < 31
    assert indices["batched_decode_attention_reduce"][-2:] == [11, query_starts]
