"""The quantized Metal kernel (csrc/kernels: BdaQuantizedRows in the one kernel core), compiled
with g++ by the emulation harness, against float64 attention over the dequantized keys and
values: dtypes x head dims (fast, fast pairs of values narrower than keys, generic) x bits x
group sizes x scale dtypes, GQA groups, L query rows, kv_starts, windows and sinks, both launch
paths (single pass and split-K with the dense reduce). Every position no query row of a request
attends holds all-ones words and NaN scales and biases: it must change nothing. Mutations of
the quantized row source must fail.

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows, T positions,
D head dim of queries and keys, Dv of values.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

from tests.metal_emu.build import build_library, kernel_text
from tests.metal_emu.cases import attended
from tests.metal_emu.driver import EmulatedLibrary
from tests.metal_emu.reference import TOLERANCE, reference_attention, to_dtype, to_float64
from tests.metal_emu.sources import kernel_sources
from tests.metal_emu.build import CACHE

MSL = {"float16": "half", "bfloat16": "bfloat", "float32": "float"}
# (D, Dv, group_size): fast kernels of V = 2 and V = 4, generic ones (upto256 and, of narrower
# values, upto128; V = 1), and the fast pairs of DeepSeek-V2 (192, 128) and MLA's latent (576, 512).
DIMS = [(64, 64, 32), (128, 128, 64), (128, 128, 128), (224, 224, 32), (96, 64, 32), (192, 128, 64),
        (576, 512, 64)]
FAST = (32, 64, 96, 128, 160, 192, 256, 512)
FAST_PAIRS = ((192, 128), (576, 512))
GENERIC = (32, 64, 128, 256, 512, 576)
PATHS = {
    "single_pass": dict(t=40, h_kv=2, lens=[0, 1, 40, 23, 47, 9], starts=[0, 3, 10, 40, 5, 2], window=7),
    "split_k": dict(t=140, h_kv=1, lens=[140, 1, 97, 300], starts=[0, 0, 60, -5], window=130),
}


def kernel_kind(d: int, dv: int) -> tuple[str, str]:
    """The instantiation macro's kind and head dims of (D, Dv), as the .metal file spells them."""
    if d == dv and d in FAST:
        return "fast", str(d)
    if (d, dv) in FAST_PAIRS:
        return "fast_pair", f"{d}, {dv}"
    return "generic", str(next(n for n in GENERIC if max(d, dv) <= n))


def instantiations(dims) -> str:
    """MBD_KERNELS of the dense reduce (and main) of every (dtype, D, Dv) and the quantized mains of both bits."""
    lines = []
    for dtype, msl in MSL.items():
        for kind, dims_text in sorted({kernel_kind(d, dv) for d, dv, _ in dims}):
            lines.append(f"instantiate_{kind}({dtype}, {msl}, {dims_text})")
            lines += [f"instantiate_quantized_{kind}({dtype}, {msl}, {dims_text}, {bits})" for bits in (4, 8)]
    return "#define MBD_KERNELS " + " ".join(lines) + "\n"


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library(instantiations(DIMS) + kernel_text()))


def scale_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    return to_dtype(x.astype(np.float32), dtype)


def quantized_case(seed, dtype, scales_dtype, d, group_size, bits, g, rows, path, starts, window, sinks,
                   softcap=None, scale=None, dv=None):
    """The call's arguments (``run``'s case) and its float64 output; scale None: 1 / sqrt(D); dv None: D."""
    spec = PATHS[path]
    scale = d ** -0.5 if scale is None else scale
    rng = np.random.default_rng(seed)
    t, h_kv, lens = spec["t"], spec["h_kv"], spec["lens"]
    b = len(lens)
    starts = spec["starts"] if starts else None
    window = spec["window"] if window else None
    capacity = t + 5  # views of a larger cache
    triples, dequantized = [], []
    unread = np.ones((b, capacity), dtype=bool)
    unread[:, :t] = ~attended(lens, starts, rows, t, window)
    for width in (d, d if dv is None else dv):
        x = mx.array(rng.standard_normal((b, h_kv, capacity, width)).astype(np.float32))
        packed, scales, biases = (np.array(a) for a in mx.quantize(x, group_size=group_size, bits=bits))
        scales, biases = scale_storage(scales, scales_dtype), scale_storage(biases, scales_dtype)
        s64, b64 = to_float64(scales, scales_dtype), to_float64(biases, scales_dtype)
        shifts = np.arange(32 // bits, dtype=np.uint64) * bits
        ints = (packed.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)
        ints = ints.reshape(b, h_kv, capacity, width)
        dequantized.append(np.repeat(s64, group_size, -1) * ints + np.repeat(b64, group_size, -1))
        # Positions no row attends: every word all ones, every scale and bias NaN.
        packed.transpose(0, 2, 1, 3)[unread] = 0xFFFFFFFF
        nan = scale_storage(np.array(np.nan), scales_dtype)
        scales.transpose(0, 2, 1, 3)[unread] = nan
        biases.transpose(0, 2, 1, 3)[unread] = nan
        triples.append(tuple(a[:, :, :t] for a in (packed, scales, biases)))
    queries = to_dtype(rng.standard_normal((b, h_kv * g, rows, d)), dtype)
    sink_values = (1.5 * rng.standard_normal(h_kv * g)).astype(np.float32) if sinks else None
    lens_np = np.array(lens, dtype=np.int32)
    starts_np = None if starts is None else np.array(starts, dtype=np.int32)
    want = reference_attention(to_float64(queries, dtype), dequantized[0][:, :, :t], dequantized[1][:, :, :t],
                               lens_np, scale, starts_np, window,
                               None if sink_values is None else sink_values.astype(np.float64), softcap)
    return dict(queries=queries, keys=triples[0], values=triples[1], valid_lens=lens_np, kv_starts=starts_np,
                window=window, sinks=sink_values, scale=scale, softcap=softcap), want


def run(lib, case, dtype, scales_dtype, group_size, bits):
    return lib.quantized_attention(case["queries"], case["keys"], case["values"], case["valid_lens"], dtype,
                                   case["scale"], bits, group_size, scales_dtype, kv_starts=case["kv_starts"],
                                   window=case["window"], sinks=case["sinks"], softcap=case["softcap"])


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("d,dv,group_size", DIMS)
@pytest.mark.parametrize("dtype", sorted(MSL))
def test_matches_float64(lib, dtype, d, dv, group_size, bits, path):
    # Options, GQA groups, rows and scale dtypes vary with the case so that each value meets each path.
    n = DIMS.index((d, dv, group_size)) + 4 * bits + 7 * sorted(MSL).index(dtype)
    scales_dtype = sorted(MSL)[n % 3]
    # (4, 3): 12 rows, two row chunks sharing staged tiles.
    g, rows = [(1, 1), (4, 1), (2, 3), (3, 2), (4, 3)][n % 5]
    case, want = quantized_case(n, dtype, scales_dtype, d, group_size, bits, g, rows, path,
                                starts=n % 2 == 0, window=n % 3 != 1, sinks=n % 5 < 3, dv=dv)
    out = to_float64(run(lib, case, dtype, scales_dtype, group_size, bits), dtype)
    assert out.shape[-1] == dv and not np.isnan(out).any()
    np.testing.assert_allclose(out, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# Bugs in the quantized row source: a wrong group's scale, a wrong element's bits, a missing bias.
MUTATIONS = {
    "scale_of_the_next_group": ("const int group = e0 / q->group_size;", "const int group = (e0 + V) / q->group_size;"),
    "element_of_the_next_word_slot": ("(((e0 + u) % (32 / BITS)) * BITS)", "(((e0 + u + 1) % (32 / BITS)) * BITS)"),
    "bias_left_out": ("x[u] = scale * float(w) + bias;", "x[u] = scale * float(w) + 0.0f * bias;"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutations_are_caught(name):
    text = kernel_sources(CACHE / "mutants" / f"quantized_{name}", None, MUTATIONS[name])
    mutant = EmulatedLibrary(build_library(instantiations([(128, 128, 64)]) + text))
    case, want = quantized_case(1, "float32", "float32", 128, 64, 8, 2, 1, "single_pass", True, False, False)
    out = to_float64(run(mutant, case, "float32", "float32", 64, 8), "float32")
    assert not np.allclose(out, want, atol=TOLERANCE["float32"], rtol=TOLERANCE["float32"])
