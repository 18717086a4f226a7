"""The Metal source embedded in _ext (``mlx_batched_decode.metal_source()``, on
every platform): ASCII, self-contained, instantiating every kernel the launch
plan can ask for, the very text the emulation harness compiles and runs, and,
per dtype and head dim, the run-time library source eval_gpu compiles where
there is no metallib (csrc/metal/kernel_library.h).

Dimensions: B requests, H_q/H_kv query/KV heads, L query rows, T positions,
D head dim.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.metal_emu.build import CXX, build_library, kernel_text, metal_source
from tests.metal_emu.cases import make_case
from tests.metal_emu.driver import EmulatedLibrary, HarnessError
from tests.metal_emu.reference import TOLERANCE, to_float64
from tests.metal_emu.sources import library_source

mbd = pytest.importorskip("mlx_batched_decode")

DTYPES = ["float16", "bfloat16", "float32"]
_HOST_NAME = re.compile(r'host_name\(((?:\s*"[^"]*")+)\s*\)')


@pytest.fixture(scope="module")
def lib() -> EmulatedLibrary:
    return EmulatedLibrary(build_library())


@pytest.fixture(scope="module")
def planned(lib) -> dict[tuple[str, int], tuple[str, str]]:
    """(dtype, D) -> the main and reduce kernels the launch plan picks, for every D in 1..512."""
    out = {}
    for dtype, d in itertools.product(DTYPES, range(1, 513)):
        plan = lib.plan(1, 1, 1, 4096, d, dtype)
        out[dtype, d] = (plan["kernel"], plan["reduce_kernel"])
    return out


# (D, Dv) of values narrower than keys: the fast pairs, and the generic kernel of keys past 512.
HEAD_DIM_PAIRS = [(192, 128), (576, 512), (520, 64), (576, 100)]


@pytest.fixture(scope="module")
def planned_pairs(lib) -> dict[tuple[str, int, int], tuple[str, str]]:
    """(dtype, D, Dv) -> the main and reduce kernels the launch plan picks for HEAD_DIM_PAIRS."""
    out = {}
    for dtype, (d, dv) in itertools.product(DTYPES, HEAD_DIM_PAIRS):
        plan = lib.plan(1, 1, 1, 4096, d, dtype, dv=dv)
        out[dtype, d, dv] = (plan["kernel"], plan["reduce_kernel"])
    return out


def host_names(source: str, tmp_path: Path) -> set[str]:
    """The ``[[host_name]]``s of a Metal source once preprocessed (g++ -E, with an
    empty <metal_stdlib> as the only header there is)."""
    (tmp_path / "include").mkdir(exist_ok=True)
    (tmp_path / "include" / "metal_stdlib").write_text("")
    path = tmp_path / "source.metal"
    path.write_text(source)
    result = subprocess.run([CXX, "-E", "-P", "-x", "c++", f"-I{tmp_path / 'include'}", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return {"".join(re.findall(r'"([^"]*)"', m.group(1))) for m in _HOST_NAME.finditer(result.stdout)}


def test_source_is_ascii_and_self_contained():
    text = mbd.metal_source()
    assert text.isascii()
    includes = re.findall(r"^[ \t]*#[ \t]*include.*$", text, re.M)
    assert includes == ["#include <metal_stdlib>"]
    assert "mlx/backend/metal" not in text


def test_source_instantiates_every_planned_kernel(lib, planned, planned_pairs, tmp_path):
    names = host_names(mbd.metal_source(), tmp_path)
    quantized = {n for n in names if n.startswith("quantized_")}
    ragged = {n for n in names if n.startswith("ragged_")}
    plans = [*planned.values(), *planned_pairs.values()]
    assert names - quantized - ragged == {name for pair in plans for name in pair}
    # 15 kernels of D = Dv, 2 fast pairs and the generic kernel of keys up to 576.
    assert len(names - quantized - ragged) == 2 * 3 * 18
    assert {main.removeprefix("batched_decode_attention_float16_") for main, _ in planned_pairs.values()} >= {
        "192_v128", "576_v512", "upto576"}
    # The ragged main kernel of every dense one (csrc/metal/ragged_launch_plan.h's ragged_kernel_name).
    assert ragged == {main.replace("batched_decode_attention_", "ragged_decode_attention_") for main, _ in plans}
    # The quantized main kernels of every (D, Dv) a group size divides (multiples of 32), named as
    # csrc/metal/quantized_launch_plan.h's quantized_kernel_name; their reduce is the dense one.
    suffixes = {lib.plan(1, 1, 1, 4096, d, dtype, dv=dv)["kernel"].removeprefix("batched_decode_attention_")
                for dtype in DTYPES for d in range(32, 577, 32) for dv in range(32, 513, 32)}
    assert quantized == {f"quantized_batched_decode_attention_{suffix}_{bits}bit"
                         for suffix in suffixes for bits in (4, 8)}
    assert {"float16_576_v512", "bfloat16_192_v128", "float32_upto576", "float16_upto128"} <= suffixes


def test_harness_compiles_and_runs_this_text(lib):
    """The extension's string is the generator's output for the sources on disk
    (a stale build fails here), and the harness library was compiled from it."""
    assert mbd.metal_source() == kernel_text()
    assert (build_library().parent / "source.metal").read_text() == mbd.metal_source()
    case = make_case(np.random.default_rng(0), "bfloat16", 80, 2, 3, 30, [30, 4, 0], rows=2, window=9, sinks=True)
    np.testing.assert_allclose(to_float64(case.run(lib), "bfloat16"), case.reference(),
                               atol=TOLERANCE["bfloat16"], rtol=TOLERANCE["bfloat16"])


def test_run_time_libraries_hold_the_planned_pair(lib, planned, tmp_path):
    """Per dtype and head dim, eval_gpu's source (C++ library_source) instantiates
    exactly that pair of kernels, as the harness's subset builds do, under a
    name that carries the source's hash."""
    text = mbd.metal_source()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    names = set()
    for (dtype, d), (kernel, reduce) in planned.items():
        if d > 1 and planned[dtype, d - 1] == (kernel, reduce):
            continue  # one library per generic bucket
        source = lib.library_source(text, dtype, d)
        assert source == library_source(text, [kernel])
        assert host_names(source, tmp_path) == {kernel, reduce}
        name = lib.library_name(digest, dtype, d)
        assert name == f"mlx_batched_decode_{digest}_{kernel.removeprefix('batched_decode_attention_')}"
        names.add(name)
    assert len(names) == 3 * 15


def test_run_time_libraries_of_head_dim_pairs(lib, planned_pairs, tmp_path):
    """The run-time library of (dtype, D, Dv), dense and ragged, holds the planned kernels."""
    text = mbd.metal_source()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    for (dtype, d, dv), (kernel, reduce) in planned_pairs.items():
        source = lib.library_source(text, dtype, d, dv=dv)
        assert source == library_source(text, [kernel])
        assert host_names(source, tmp_path) == {kernel, reduce}
        ragged = kernel.replace("batched_decode_attention_", "ragged_decode_attention_")
        assert host_names(lib.library_source(text, dtype, d, ragged=True, dv=dv), tmp_path) == {ragged, kernel, reduce}
        suffix = kernel.removeprefix("batched_decode_attention_")
        assert lib.library_name(digest, dtype, d, dv=dv) == f"mlx_batched_decode_{digest}_{suffix}"


def test_ragged_run_time_libraries(lib, planned, tmp_path):
    """The ragged library of a dtype and head dim (C++ ragged_library_source): its main kernel,
    the dense pair (for the reduce), under a name of its own."""
    text = mbd.metal_source()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    for dtype, d in (("float16", 128), ("bfloat16", 100), ("float32", 1)):
        kernel, reduce = planned[dtype, d]
        ragged = kernel.replace("batched_decode_attention_", "ragged_decode_attention_")
        source = lib.library_source(text, dtype, d, ragged=True)
        assert source == library_source(text, [ragged])
        assert host_names(source, tmp_path) == {ragged, kernel, reduce}
        suffix = kernel.removeprefix("batched_decode_attention_")
        assert lib.library_name(digest, dtype, d, ragged=True) == f"mlx_batched_decode_{digest}_ragged_{suffix}"


def test_quantized_run_time_libraries(lib, tmp_path):
    """The quantized library of a dtype, head dims and bits (C++ quantized_library_source): its
    main kernel, the dense pair (for the reduce), under a name of its own; values narrower than
    keys included (DeepSeek-V2's 192 / 128, MLA's latent 576 / 512, MiniCPM3's 96 / 64)."""
    text = mbd.metal_source()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    for dtype, d, dv, bits in (("float16", 128, 128, 8), ("bfloat16", 576, 512, 4), ("float32", 192, 128, 8),
                               ("float16", 96, 64, 4), ("bfloat16", 224, 224, 8)):
        plan = lib.plan(1, 1, 1, 4096, d, dtype, dv=dv)
        kernel, reduce = plan["kernel"], plan["reduce_kernel"]
        suffix = kernel.removeprefix("batched_decode_attention_")
        quantized = f"quantized_batched_decode_attention_{suffix}_{bits}bit"
        source = lib.library_source(text, dtype, d, dv=dv, bits=bits)
        assert source == library_source(text, [quantized])
        assert host_names(source, tmp_path) == {quantized, kernel, reduce}
        assert lib.library_name(digest, dtype, d, dv=dv, bits=bits) == \
            f"mlx_batched_decode_{digest}_quantized_{suffix}_{bits}bit"


def test_run_time_library_runs(lib):
    """The C++ library_source of one dtype and head dim, compiled by the harness: its two kernels, right."""
    text = lib.library_source(mbd.metal_source(), "bfloat16", 100)
    one = EmulatedLibrary(build_library(text))
    case = make_case(np.random.default_rng(1), "bfloat16", 100, 1, 4, 150, [150, 3], rows=2, starts=[5, 0])
    assert lib.plan(2, 4, 1, 150, 100, "bfloat16", rows=2)["num_splits"] > 1
    np.testing.assert_allclose(to_float64(case.run(one), "bfloat16"), case.reference(),
                               atol=TOLERANCE["bfloat16"], rtol=TOLERANCE["bfloat16"])
    with pytest.raises(HarnessError, match="no kernel named batched_decode_attention_bfloat16_96"):
        one.dispatch("batched_decode_attention_bfloat16_96", [], (1, 1, 1), (32, 1, 1))


def test_embedded_text_and_hash():
    """The C++ file the build compiles holds the text in a raw literal and its hash."""
    text = kernel_text()
    cpp = metal_source.render_cpp(text)
    assert f'R"mbd_metal({text})mbd_metal"' in cpp
    assert f'return "{hashlib.sha256(text.encode()).hexdigest()[:16]}";' in cpp


@pytest.mark.parametrize(
    "include,message",
    [('"missing.h"', 'cannot find include "missing.h"'),
     ("<metal_simdgroup>", "<metal_simdgroup> is not available"),
     ('"../kernels/batched_decode_attention.h"', None)])
def test_generator_resolves_only_what_a_run_time_compile_has(tmp_path, include, message):
    """Quoted includes are inlined (relative to the including file); any other
    system header is refused, as a run-time compile has only <metal_stdlib>."""
    entry = tmp_path / "kernels" / "entry.metal"
    entry.parent.mkdir()
    (tmp_path / "kernels" / "batched_decode_attention.h").write_text("// a header\n")
    entry.write_text(f"#include {include}\nkernel void f() {{}}\n")
    if message is None:
        assert "// a header" in metal_source.flatten([entry])
        return
    with pytest.raises(metal_source.SourceError, match=re.escape(message)):
        metal_source.flatten([entry])


def test_generator_refuses_non_ascii(tmp_path):
    entry = tmp_path / "entry.metal"
    entry.write_text("// d\u00e9j\u00e0 vu\n", encoding="utf-8")
    with pytest.raises(metal_source.SourceError, match="ASCII"):
        metal_source.flatten([entry])
