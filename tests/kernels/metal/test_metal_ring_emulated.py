"""The Metal kernel's ring (the dense layout with ring offsets), run by the emulation harness:
logical position j of request b lives in slot (j + ring_offset[b]) mod T of its [T] positions.

Offsets reach the kernel raw (0, mid, T - 1, negative, near +-2^31, past T), without the op's
modulo, so the kernel's own modulo is what keeps every read in [0, T). Every slot no query row
reads holds NaN (keys) or inf (values), the capacity past T too: a slot read wrongly shows.
Against float64 on both launch paths; the traffic of a ring is that of the same call without
one; AddressSanitizer + UBSan on buffers of exactly the views' size; and mutants of the
modulo and of the wrap must fail.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows per request,
T positions, D head dim.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from tests.kernels.metal.test_metal_sanitizers import REPORTS, run_sanitized
from tests.metal_emu.build import KERNEL_DIR, build_library, kernel_text
from tests.metal_emu.cases import make_case, make_ring_case
from tests.metal_emu.check_cases import RING_CASE_SETS
from tests.metal_emu.driver import RING_OFFSETS, EmulatedLibrary, HarnessError
from tests.metal_emu.mutants import RING_ONLY, mutant_source
from tests.metal_emu.prepass import kernel_buffer_indices
from tests.metal_emu.reference import TOLERANCE, row_range, to_float64
from tests.metal_emu.sources import subset_source

DTYPES = ["float16", "bfloat16", "float32"]
# The generic kernel (up to 32) and two fast ones, scalar and vector-of-4 loads.
DIMS = [1, 64, 128]
BIG = 2**31 - 1
# Per launch path: T <= 64 keeps one pass; T = 140 with few items takes split-K. One ring
# offset per request: 0, mid ones, T - 1, negative, the int32 ends, a multiple of T plus some.
PATHS = {
    "single_pass": dict(t=40, h_kv=2, lens=[40, 33, 5, 40, 1, 47, 12, 0], starts=[0, -2, 3, 10, 0, 5, 2, 0],
                        window=7, ring=[0, 10, 39, -3, BIG, -BIG - 1, 3 * 40 + 5, 20]),
    "split_k": dict(t=140, h_kv=1, lens=[140, 97, 300, 64, 1, 140], starts=[0, 60, -50, 64, 0, 7], window=130,
                    ring=[0, 70, 139, -1, BIG, -BIG - 1]),
}


def kernel(dtype: str, d: int) -> str:
    return f"batched_decode_attention_{dtype}_{d if d >= 32 else 'upto32'}"


@functools.cache
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library(subset_source({kernel(t, d) for t in DTYPES for d in DIMS})))


def ring_case(path: str, dtype: str, d: int, g: int, rows: int, starts: bool, window: bool, seed: int,
              sinks: bool = False):
    spec = PATHS[path]
    return make_ring_case(np.random.default_rng(seed), dtype, d, spec["h_kv"], g, spec["t"], spec["lens"],
                          spec["ring"], rows=rows, starts=spec["starts"] if starts else None,
                          window=spec["window"] if window else None, sinks=sinks)


def wraps(case) -> bool:
    """Whether some request's rows read keys on both sides of the wrap."""
    t, rows = case.keys.shape[2], case.queries.shape[2]
    for b, (n, r) in enumerate(zip(case.valid_lens, case.ring_offset)):
        start = 0 if case.kv_starts is None else int(np.clip(case.kv_starts[b], 0, t))
        for i in range(rows):
            lo, hi = row_range(int(np.clip(n, 0, t)), start, rows, i, case.window)
            if lo < hi and lo < t - int(r) % t < hi:
                return True
    return False


def run_and_compare(case) -> float:
    """The largest error against float64, asserted within the dtype's tolerance."""
    got = to_float64(case.run(lib()), case.dtype)
    expected = case.reference()
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])
    assert np.isfinite(got).all()
    return float(np.abs(got - expected).max())


def assert_path(case, path: str):
    b, h_q, rows, d = case.queries.shape
    plan = lib().plan(b, h_q, case.keys.shape[1], case.keys.shape[2], d, case.dtype, rows=rows, window=case.window)
    assert plan["kernel"] == kernel(case.dtype, d)
    assert (plan["num_splits"] > 1) == (path == "split_k")


def test_dense_kernel_binds_the_ring_at_its_index():
    """The dense kernel's [[buffer(i)]] end with MBD_RING_OFFSETS, which the launchers bind, then
    MBD_QUERY_STARTS."""
    params = (KERNEL_DIR / "batched_decode_attention_params.h").read_text()
    index, query_starts = (int(re.search(rf"#define {name} (\d+)", params).group(1))
                           for name in ("MBD_RING_OFFSETS", "MBD_QUERY_STARTS"))
    assert kernel_buffer_indices(kernel_text())["batched_decode_attention"] == [*range(11), index, query_starts]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_head_dims(dtype, d, path):
    """Every dtype x head dim on both paths; L, kv_starts, window and G turn along."""
    turn = DTYPES.index(dtype) + DIMS.index(d)
    case = ring_case(path, dtype, d, g=[1, 2, 4][turn % 3], rows=[1, 4][turn % 2], starts=turn % 2 == 0,
                     window=turn % 3 != 1, seed=turn + 10 * len(path), sinks=turn % 2 == 1)
    assert_path(case, path)
    assert wraps(case)
    run_and_compare(case)


@pytest.mark.parametrize("window", [False, True], ids=["", "window"])
@pytest.mark.parametrize("starts", [False, True], ids=["", "starts"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_options(path, rows, starts, window):
    """L x kv_starts x window on both paths (float32, D = 64, G = 3: rows split over chunks)."""
    case = ring_case(path, "float32", 64, g=3, rows=rows, starts=starts, window=window,
                     seed=rows + 2 * starts + 4 * window)
    assert_path(case, path)
    assert wraps(case)
    run_and_compare(case)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_zero_ring_is_no_ring(path):
    """Offsets 0 (and multiples of T) give bit for bit the output of the same call without a ring."""
    t = PATHS[path]["t"]
    case = ring_case(path, "float16", 64, g=2, rows=4, starts=True, window=True, seed=3)
    case.ring_offset = np.array([0, t, -t, 5 * t, 0, -7 * t, 0, t][:len(case.valid_lens)], dtype=np.int32)
    with_ring = case.run(lib())
    case.ring_offset = None
    np.testing.assert_array_equal(with_ring, case.run(lib()))


def test_strided_and_broadcast_offsets():
    """Offsets of any stride, 0 included (the op's broadcast of an int)."""
    case = ring_case("single_pass", "float32", 64, g=2, rows=4, starts=True, window=False, seed=5)
    buffer = np.full(2 * len(case.valid_lens), -1, dtype=np.int32)
    buffer[::2] = case.ring_offset
    case.ring_offset = buffer[::2]
    run_and_compare(case)
    one = ring_case("split_k", "bfloat16", 128, g=4, rows=1, starts=False, window=True, seed=6)
    one.ring_offset = np.lib.stride_tricks.as_strided(np.array([-17], dtype=np.int32), (6,), (0,))
    # make_ring_case rotated each request by its own offset: rotate them all by -17 instead.
    for n, r in enumerate(PATHS["split_k"]["ring"]):
        one.keys[n] = np.roll(one.keys[n], -17 - r, axis=1)
        one.values[n] = np.roll(one.values[n], -17 - r, axis=1)
    run_and_compare(one)


# The traffic counter: a loads build of the kernels these cases run.
TRAFFIC = {
    "single_pass": dict(dtype="float16", d=128, g=4, rows=1, starts=False, window=False),
    "split_k": dict(dtype="bfloat16", d=64, g=2, rows=4, starts=True, window=True),
}


@functools.cache
def counting_lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library(subset_source(kernel(s["dtype"], s["d"]) for s in TRAFFIC.values()),
                                         sanitize="loads"))


@pytest.mark.parametrize("path", sorted(TRAFFIC))
def test_ring_reads_the_bytes_of_no_ring(path):
    """A ring reads from device memory what the same call without one reads, buffer by buffer,
    plus its own offset once per lane; the K/V rows only move."""
    spec, shape = TRAFFIC[path], PATHS[path]
    kwargs = dict(rows=spec["rows"], starts=shape["starts"] if spec["starts"] else None,
                  window=shape["window"] if spec["window"] else None)
    plain = make_case(np.random.default_rng(1), spec["dtype"], spec["d"], shape["h_kv"], spec["g"], shape["t"],
                      shape["lens"], **kwargs)
    ring = make_ring_case(np.random.default_rng(1), spec["dtype"], spec["d"], shape["h_kv"], spec["g"], shape["t"],
                          shape["lens"], shape["ring"], **kwargs)
    lib_ = counting_lib()
    plain_out = plain.run(lib_)
    plain_loads = lib_.loads()
    ring_out = ring.run(lib_)
    ring_loads = lib_.loads()
    np.testing.assert_array_equal(ring_out, plain_out)
    b, h_q, rows, d = plain.queries.shape
    plan = lib_.plan(b, h_q, shape["h_kv"], shape["t"], d, spec["dtype"], rows=rows, window=plain.window)
    assert (plan["num_splits"] > 1) == (path == "split_k")
    lanes = int(np.prod(plan["grid"])) * plan["group"][0]
    assert ring_loads["main"].pop(RING_OFFSETS) == 4 * lanes and plain_loads["main"].pop(RING_OFFSETS) == 0
    # The params are the constant buffer (the wrap reads T there per key), not device memory.
    for loads in (ring_loads, plain_loads):
        for counts in loads.values():
            counts.pop("params")
    assert ring_loads == plain_loads
    assert ring_loads["main"]["keys"] > 0


@functools.cache
def sanitized_library(mutant: str | None = None):
    cases = RING_CASE_SETS["ring_adversarial"]
    kernels = [kernel(c["dtype"], c["d"]) for c in cases]
    source = subset_source(kernels) if mutant is None else mutant_source(mutant, kernels)
    return build_library(source, sanitize="address")


def test_adversarial_offsets_stay_in_bounds():
    """Offsets near +-2^31 and past T, lengths and starts outside [0, T], on allocations ending at
    the views with every slot no row reads poisoned: AddressSanitizer + UBSan report nothing."""
    result = run_sanitized("address", sanitized_library(), "--cases", "ring_adversarial", "--no-nan-margins",
                           "--poison-unread")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not [r for r in REPORTS if r in result.stderr], result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(RING_CASE_SETS["ring_adversarial"])


@pytest.mark.parametrize("name", ["ring_modulo_dropped", "ring_wrap_off_by_one"])
def test_sanitizer_reports_a_read_out_of_the_ring(name):
    result = run_sanitized("address", sanitized_library(name), "--cases", "ring_adversarial", "--no-nan-margins",
                           "--poison-unread")
    assert result.returncode != 0 and "ERROR: AddressSanitizer" in result.stderr, result.stderr[-3000:]


# Offsets whose wrong reads stay inside the NaN margins and capacity of the harness's
# buffers (the mutants run in this process): T + 2 and -(T + 1) unreduced read 2 slots past
# the range and the one before it; the others wrap at 1, T / 2 and T - 1.
MUTANT_RING = {"single_pass": [42, -41, 1, 20, 39, 42, -41, 39], "split_k": [142, -141, 1, 70, 139, 142]}


def mutant_cases():
    out = {}
    for path, ring in MUTANT_RING.items():
        spec = PATHS[path]
        out[path] = make_ring_case(np.random.default_rng(8), "float32", 64, spec["h_kv"], 2, spec["t"], spec["lens"],
                                   ring, rows=4, window=spec["window"])
        assert wraps(out[path])
    return out


def verdict(lib_: EmulatedLibrary, case) -> str | None:
    """None when the harness accepts the run, else how it failed."""
    try:
        out = case.run(lib_)
    except HarnessError as error:
        return f"harness error: {error}"
    tolerance = TOLERANCE[case.dtype]
    if not np.allclose(to_float64(out, case.dtype), case.reference(), atol=tolerance, rtol=tolerance):
        return "result differs from the reference"
    return None


def test_unmutated_kernel_passes_the_mutant_cases():
    assert {path: verdict(lib(), case) for path, case in mutant_cases().items()} == dict.fromkeys(MUTANT_RING)


@pytest.mark.parametrize("name", sorted(RING_ONLY))
def test_mutant_fails_the_harness(name):
    mutant = EmulatedLibrary(build_library(mutant_source(name, [kernel("float32", 64)])))
    verdicts = {path: verdict(mutant, case) for path, case in mutant_cases().items()}
    assert all(verdicts.values()), f"mutant {name} passed: {verdicts}"

