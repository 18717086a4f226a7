"""Property-based tests of the emulated Metal kernel: random small shapes, dtypes,
head dims (fast and generic), L query rows, lengths and starts (negative, zero,
past T), windows (narrow, wider than T), sinks and thread limits against the
float64 reference.

Dimensions: B requests, H_kv KV heads, G = H_q / H_kv, L query rows per
request, T positions, D head dim.
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.metal_emu.build import build_library
from tests.metal_emu.cases import make_case
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.reference import TOLERANCE, to_float64


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


@st.composite
def emulated_calls(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(0, 90))
    positions = st.lists(st.one_of(st.integers(-3, T + 3), st.sampled_from([0, 1, T])), min_size=B, max_size=B)
    return dict(
        dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])),
        d=draw(st.sampled_from([1, 3, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 200, 256, 300, 512])),
        h_kv=draw(st.integers(1, 2)),
        g=draw(st.sampled_from([1, 2, 3, 4, 8, 9])),
        t=T,
        lens=draw(positions),
        extra_capacity=draw(st.integers(1, 6)),
        rows=draw(st.sampled_from([1, 2, 3, 5, 8, 9])),
        starts=draw(st.none() | positions),
        window=draw(st.none() | st.integers(1, 8) | st.integers(1, T + 5)),
        sinks=draw(st.booleans()),
        max_threads=draw(st.sampled_from([32, 64, 256, 1024])),
        seed=draw(st.integers(0, 2**16)),
    )


# The emulator runs every lane of every threadgroup on the CPU: keep it small.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(emulated_calls())
def test_emulated_kernel_matches_float64_reference(lib, call):
    max_threads, seed = call.pop("max_threads"), call.pop("seed")
    case = make_case(np.random.default_rng(seed), **call)
    got = to_float64(case.run(lib, max_threads=max_threads), case.dtype)
    # Every position no row attends holds NaN or inf: none may reach the output.
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, case.reference(), atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])
