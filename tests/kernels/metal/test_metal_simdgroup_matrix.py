"""The harness's simdgroup matrices (tests/metal_emu/emu_simdgroup_matrix.h) against MLX's own use of them.

MLX's steel attention kernel (the wheel's steel/attn headers, unmodified; see
tests/metal_emu/mlx_kernels.py for the three generic headers replaced) runs
through the harness and must match ``mx.fast.scaled_dot_product_attention`` on
the CPU: it multiplies 8x8 tiles it fills lane by lane through
``thread_elements()`` at ``BaseMMAFrag::get_coord``, so it proves the
multiply-accumulate and the element layout. It never calls simdgroup_load or
simdgroup_store; a probe kernel (tests/metal_emu/simdgroup_matrix_probe.metal)
checks those against MSL's documented addressing and numpy. Mutants of the
model must fail the check that covers them.

Shapes: queries [B, H, qL, D], keys and values [B, H_kv, kL, D], D in 64, 128;
float32 and float16.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.metal_emu.build import HARNESS, build_library, kernel_text, mutant_harness
from tests.metal_emu.driver import EmulatedLibrary, HarnessError
from tests.metal_emu.mlx_kernels import flatten_mlx
from tests.metal_emu.strict.compile import StrictCompileError, find_clang, strict_compile

STEEL = HARNESS / "steel_attention.metal"
PROBE = HARNESS / "simdgroup_matrix_probe.metal"
MODEL = "emu_simdgroup_matrix.h"
# (dtype, BQ, BK, BD, WM, WN) as steel_attention.metal instantiates them; BD is the head dim D.
# WN = 2 splits D over two simdgroups and multiplies float16 tiles (WN = 1: float32 ones).
KERNELS = [("float32", 32, 16, 64, 4, 1), ("float16", 32, 32, 64, 4, 1), ("float16", 32, 32, 128, 4, 2)]
TOLERANCE = {"float32": 2e-5, "float16": 2e-3}

PARAMS = np.dtype([(name, np.int32) for name in ("B", "H", "D", "qL", "kL", "gqa_factor")]
                  + [("scale", np.float32)]
                  + [(name, np.int32) for name in ("NQ", "NK", "NQ_aligned", "NK_aligned", "qL_rem", "kL_rem",
                                                   "qL_off")]
                  + [(name, np.int64, 3) for name in ("Q_strides", "K_strides", "V_strides", "O_strides")],
                  align=True)

# Each mutant of the model and the check that must catch it.
MUTANTS = {
    "swapped element pair": ("column = (quad & 2) * 2 + (lane % 2) * 2 + j;",
                             "column = (quad & 2) * 2 + (lane % 2) * 2 + (1 - j);", "steel"),
    "B transposed in multiply-accumulate": ("acc = std::fma(ma[row][k], mb[k][column], acc);",
                                            "acc = std::fma(ma[row][k], mb[column][k], acc);", "steel"),
    "transposed load": ("out[j] = a.memory[emu::simdgroup_matrix_offset(row, column, a.elements_per_row, a.origin,\n"
                        "                                                                       a.transpose)];",
                        "out[j] = a.memory[emu::simdgroup_matrix_offset(row, column, a.elements_per_row, a.origin,\n"
                        "                                                                       !a.transpose)];",
                        "probe"),
    "store to the wrong origin": ("a.origin,\n" + " " * 62 + "a.transpose)] = static_cast",
                                  "metal::ulong2(a.origin.y, a.origin.x),\n" + " " * 62 + "a.transpose)] = static_cast",
                                  "probe"),
}


def steel_source() -> str:
    return flatten_mlx(STEEL.name, STEEL.read_text())


def steel_attention(lib: EmulatedLibrary, kernel: tuple, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    causal: bool) -> np.ndarray:
    """The steel kernel's output [B, H, qL, D] for queries, keys and values of ``kernel``'s dtype,
    launched as MLX's sdpa_full_self_attention_metal does."""
    dtype, bq, bk, d, wm, wn = kernel
    b, h, q_len, _ = q.shape
    k_len = k.shape[2]
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    params = np.zeros(1, PARAMS)
    nq, nk = -(-q_len // bq), -(-k_len // bk)
    values = dict(B=b, H=h, D=d, qL=q_len, kL=k_len, gqa_factor=h // k.shape[1], scale=d ** -0.5, NQ=nq, NK=nk,
                  NQ_aligned=q_len // bq, NK_aligned=k_len // bk, qL_rem=q_len % bq, kL_rem=k_len % bk,
                  qL_off=k_len - q_len)
    for name, value in values.items():
        params[name] = value
    for name, array in (("Q", q), ("K", k), ("V", v), ("O", out)):
        params[f"{name}_strides"] = [s // array.itemsize for s in array.strides[:3]]
    unused = np.zeros(16, dtype=np.float32)  # mask, mask params, sinks, lse: off by function constant
    lib.dispatch(f"steel_attention_{dtype}_bq{bq}_bk{bk}_bd{d}_wm{wm}_wn{wn}",
                 [q, k, v, out, params, unused, unused, unused, unused], (nq, h, b), (32 * wm * wn, 1, 1),
                 constants={200: q_len % bq == 0, 201: k_len % bk == 0, 300: False, 301: causal, 302: False,
                            303: False})
    return out


def inputs(dtype: str, b: int, h: int, h_kv: int, q_len: int, k_len: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, heads, n, d)).astype(dtype)
            for heads, n in ((h, q_len), (h_kv, k_len), (h_kv, k_len))]


def mlx_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """mx.fast.scaled_dot_product_attention on the CPU, in float32."""
    with mx.stream(mx.cpu):
        out = mx.fast.scaled_dot_product_attention(*(mx.array(x.astype(np.float32)) for x in (q, k, v)),
                                                   scale=q.shape[-1] ** -0.5, mask="causal" if causal else None)
        return np.array(out)


# (B, H, H_kv, qL, kL, causal): uneven lengths (a partial last query and key block), GQA, bottom-right causal.
SHAPES = [(1, 2, 1, 40, 50, False), (2, 2, 2, 33, 47, True)]


def check_steel(lib: EmulatedLibrary, kernel: tuple, shape: tuple) -> float:
    """Max abs error of the steel kernel against MLX's CPU attention."""
    b, h, h_kv, q_len, k_len, causal = shape
    q, k, v = inputs(kernel[0], b, h, h_kv, q_len, k_len, kernel[3])
    return float(np.abs(steel_attention(lib, kernel, q, k, v, causal) - mlx_reference(q, k, v, causal)).max())


@pytest.fixture(scope="module")
def steel() -> EmulatedLibrary:
    return EmulatedLibrary(build_library(steel_source()))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}_H{s[1]}_Hkv{s[2]}_q{s[3]}_k{s[4]}"
                         + ("_causal" if s[5] else ""))
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: f"{k[0]}_bk{k[2]}_d{k[3]}_wn{k[5]}")
def test_mlx_steel_attention_matches_mlx(steel, kernel, shape):
    assert check_steel(steel, kernel, shape) < TOLERANCE[kernel[0]]


def probe(lib: EmulatedLibrary, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The probe's two outputs (sentinel 7 outside the stored tiles) and a, b."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((16, 16)).astype(dtype) for _ in range(2))
    ld = 19
    product, first = (np.full((18, ld), 7.0, dtype=np.float32) for _ in range(2))
    lib.dispatch(f"simdgroup_matrix_probe_{'float' if dtype == 'float32' else 'half'}",
                 [a, b, product, first, np.array([ld], dtype=np.int32)], (1, 1, 1), (128, 1, 1))
    return product, first, a.astype(np.float64), b.astype(np.float64)


def probe_error(lib: EmulatedLibrary, dtype: str) -> float:
    product, first, a, b = probe(lib, dtype)
    expected = np.full((2, 18, 19), 7.0)
    expected[0, 2:, 1:17] = a @ b
    expected[1, 2:, 1:17] = a[:, :8] @ b[:8, :]
    return float(np.abs(np.stack([product, first]) - expected).max())


@pytest.fixture(scope="module")
def probe_lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library(PROBE))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_load_store_and_multiply_follow_msl_addressing(probe_lib, dtype):
    assert probe_error(probe_lib, dtype) < 1e-4


def test_matrix_op_from_some_lanes_is_reported():
    """A simdgroup matrix op reached by half the simdgroup is a divergent collective, reported at its line."""
    source = kernel_text(PROBE).replace("simdgroup_multiply(head, ta, tb);",
                                        "if (tid % 32 < 16) { simdgroup_multiply(head, ta, tb); }")
    lib = EmulatedLibrary(build_library(source))
    line = PROBE.read_text().splitlines().index("      simdgroup_multiply(head, ta, tb);") + 1
    with pytest.raises(HarnessError, match=rf"mismatched collectives: thread 0 reached simdgroup_multiply_accumulate "
                                           rf"at simdgroup_matrix_probe.metal:{line} while threads [0-9, -]+ wait at simdgroup_load"):
        probe(lib, "float32")


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_model_mutant_fails_its_check(tmp_path, mutant):
    original, replacement, check = MUTANTS[mutant]
    harness = mutant_harness(tmp_path / "harness", MODEL, original, replacement)
    if check == "steel":
        lib = EmulatedLibrary(build_library(steel_source(), harness=harness))
        assert check_steel(lib, KERNELS[0], SHAPES[0]) > 1e-2
    else:
        lib = EmulatedLibrary(build_library(kernel_text(PROBE), harness=harness))
        assert probe_error(lib, "float32") > 1e-2


@pytest.mark.skipif(find_clang() is None, reason="no clang++: the strict compile needs Debian's `clang` package")
def test_strict_compile_takes_matrices_from_device_and_threadgroup_memory_only():
    """The address-space-strict compile accepts the probe; a load from thread memory, which MSL
    has no overload for, is rejected."""
    assert strict_compile(kernel_text(PROBE)) == []
    with pytest.raises(StrictCompileError, match="no matching function for call to 'simdgroup_load'"):
        strict_compile(kernel_text(PROBE).replace("simdgroup_load(ta, a, 16", "simdgroup_load(ta, local, 16")
                       .replace("  const ulong row =", "  T local[64] = {};\n  const ulong row =", 1))
