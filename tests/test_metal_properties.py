"""Property-based tests of the emulated Metal kernel: random small shapes, dtypes,
lengths (negative, zero, past T) and thread limits against the float64 reference.

Dimensions: B requests, H_kv KV heads, G = H_q / H_kv, T positions, D head dim.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness package lives next to the tests

from metal_emu.build import build_library  # noqa: E402
from metal_emu.cases import make_case  # noqa: E402
from metal_emu.driver import EmulatedLibrary  # noqa: E402
from metal_emu.reference import TOLERANCE, to_float64  # noqa: E402


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


@st.composite
def emulated_calls(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(0, 90))
    lens = draw(
        st.lists(st.one_of(st.integers(-3, T + 3), st.sampled_from([0, 1, T])), min_size=B, max_size=B)
    )
    return dict(
        dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])),
        d=draw(st.sampled_from([64, 80, 96, 128, 256])),
        h_kv=draw(st.integers(1, 2)),
        g=draw(st.sampled_from([1, 2, 3, 4, 8, 9])),
        t=T,
        lens=lens,
        extra=draw(st.integers(1, 6)),
        max_threads=draw(st.sampled_from([32, 64, 256, 1024])),
        seed=draw(st.integers(0, 2**16)),
    )


# The emulator runs every lane of every threadgroup on the CPU: keep it small.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(emulated_calls())
def test_emulated_kernel_matches_float64_reference(lib, call):
    rng = np.random.default_rng(call["seed"])
    case = make_case(
        rng, call["dtype"], call["d"], call["h_kv"], call["g"], call["t"], call["lens"], call["extra"]
    )
    out = lib.attention(
        case.queries, case.keys, case.values, case.valid_lens, case.dtype, case.scale,
        max_threads=call["max_threads"],
    )
    got = to_float64(out, case.dtype)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, case.reference(), atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])
