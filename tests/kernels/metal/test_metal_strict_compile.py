"""The address-space-strict compile and the MSL lint of the Metal source
(``mlx_batched_decode.metal_source()``, the text a Mac compiles): the source
passes both, and mutants that Apple's compiler would reject fail them, each
for its own reason. The compile needs clang++ (Debian's `clang` package, which
.ci/run installs); without it those tests skip, the lint's still run.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.metal_emu.strict.compile import StrictCompileError, find_clang, strict_compile
from tests.metal_emu.strict.lint import lint
from tests.metal_emu.strict.mutants import MUTANTS, mutant_text
from tests.support.repo import REPO

mbd = pytest.importorskip("mlx_batched_decode")

needs_clang = pytest.mark.skipif(
    find_clang() is None,
    reason="no clang++: the address-space-strict compile needs Debian's `clang` package (apt-get install clang)")
COMPILE_MUTANTS = sorted(name for name, m in MUTANTS.items() if m.check == "compile")
LINT_MUTANTS = sorted(name for name, m in MUTANTS.items() if m.check == "lint")
KERNEL_HEADER = "batched_decode_attention.h"


@needs_clang
def test_source_passes_strict_compile():
    """Every instantiation of the source type-checks with distinct address spaces;
    what is tolerated is only MSL's implicit copy of a struct across address spaces."""
    start = time.perf_counter()
    tolerated = strict_compile(mbd.metal_source())
    print(f"strict compile of the whole source: {time.perf_counter() - start:.1f} s")
    assert all(d.where.startswith(KERNEL_HEADER) for d in tolerated), [d.text() for d in tolerated]


def test_source_passes_lint():
    assert lint(mbd.metal_source()) == []


@needs_clang
@pytest.mark.parametrize("name", COMPILE_MUTANTS)
def test_compile_mutant_fails(name):
    """Each compile mutant fails, and with its own error only."""
    with pytest.raises(StrictCompileError) as error:
        strict_compile(mutant_text(mbd.metal_source(), name))
    errors = [line for line in str(error.value).splitlines() if ": error: " in line]
    assert errors and all(re.search(MUTANTS[name].expected, e) for e in errors), errors[:5]


@pytest.mark.parametrize("name", LINT_MUTANTS)
def test_lint_mutant_fails(name):
    """Each lint mutant breaks its rule, in the kernel header, and no other rule."""
    findings = lint(mutant_text(mbd.metal_source(), name))
    assert {f.rule for f in findings} == {MUTANTS[name].expected}, [str(f) for f in findings]
    assert all(f.where.startswith(KERNEL_HEADER + ":") for f in findings)


def test_lint_names_the_header_line():
    """A finding points at the line of the kernel header the mutant edited."""
    original = MUTANTS["double_local"].edits[0][0]
    header = (REPO / "csrc" / "kernels" / KERNEL_HEADER).read_text()
    line = header[: header.index(original)].count("\n") + 1
    assert [f.where for f in lint(mutant_text(mbd.metal_source(), "double_local"))] == [f"{KERNEL_HEADER}:{line}"]


def test_lint_allows_deleted_functions_and_const_statics():
    source = ("struct S {\n  S(const S&) = delete;\n};\n"
              "inline int f(int x) {\n  static constexpr int k = 2;\n  static const int j = 1;\n"
              "  return x * k + j;\n}\n")
    assert lint(source) == []


# A struct copied out of a device buffer and into one: MSL takes both.
_COPIES = """
struct S { int a; };
[[kernel]] void k(const device S* in [[buffer(0)]], device S* out [[buffer(1)]],
                  uint i [[thread_position_in_grid]]) {
  const S s = in[i];
  out[i] = s;
}
"""


@needs_clang
def test_implicit_copies_across_address_spaces_are_tolerated():
    assert len(strict_compile(_COPIES)) == 2


@needs_clang
@pytest.mark.parametrize("edits,message", [
    # A user-declared member function, even const, must be qualified for a device object, as in MSL.
    ((("struct S { int a; };", "struct S { int a; int get() const { return a; } };"),
      ("  out[i] = s;", "  out[i].a = in[i].get();")),
     r"cannot initialize object parameter of type 'const S' with an expression of type 'device S const'"),
    # Constant memory is read-only.
    ((("const device S* in", "constant S* in"), ("  out[i] = s;", "  in[i] = s;")), r"no viable overloaded '='"),
    ((("  out[i] = s;", "  const S* local = in;\n  out[i] = *local;"),),
     r"cannot initialize a variable of type 'const S \*' with an lvalue of type 'device S const \*'"),
    ((("[[thread_position_in_grid]]", "[[thread_position_in_grids]]"),), r"unknown attribute"),
], ids=["member_function", "write_to_constant", "device_to_thread_pointer", "misspelt_builtin"])
def test_strict_compile_rejects(edits, message):
    """What stays an error around the tolerated copies."""
    source = _COPIES
    for original, replacement in edits:
        source = source.replace(original, replacement)
    with pytest.raises(StrictCompileError, match=message):
        strict_compile(source)


# Vectors declared in threadgroup memory, written there and into a device
# buffer, and read back into thread ones: MSL takes all of it.
_VECTORS = """
#include <metal_stdlib>
using namespace metal;
[[kernel]] void k(const device float2* in [[buffer(0)]], device float2* out [[buffer(1)]],
                  uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float2 tile[4][32];
  tile[0][lane] = in[lane];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float2 mine = float2(0.0f);
  mine = tile[0][lane ^ 1];
  out[lane] = mine;
}
"""


@needs_clang
def test_vectors_in_threadgroup_and_device_memory_are_tolerated():
    """Their declaration, and the two assignments into threadgroup and device vectors."""
    assert len(strict_compile(_VECTORS)) == 3


@needs_clang
def test_a_vector_written_into_constant_memory_stays_an_error():
    source = _VECTORS.replace("device float2* out", "constant float2* out")
    with pytest.raises(StrictCompileError, match=r"no viable overloaded '='"):
        strict_compile(source)


# MSL the shim must take: conversions of vectors out of device and constant
# memory, composite and brace constructors, component access, threadgroup
# scalars, metal_stdlib overloads, function constants and host names.
_MSL = """
#include <metal_stdlib>
using namespace metal;
constant float limit = numeric_limits<float>::infinity();
constant int rows [[function_constant(0)]];
template <typename T>
[[kernel]] void k(const device T* in [[buffer(0)]], const device vec<T, 4>* in4 [[buffer(1)]],
                  constant float4& c4 [[buffer(2)]], device float* out [[buffer(3)]],
                  uint3 tgid [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup half scratch[32];
  scratch[lane] = half(in[lane]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float4 a = float4(in4[lane]);
  const float4 b = float4(float2(float(scratch[0]), 1.0f), float2(c4.x, c4.w));
  float4 s = a * 2.0f + b - c4;
  s.x += float(rows);
  const float2 p = {s.y, s[2]};
  const float d = dot(a, b) + dot(p, p) + simd_sum(s.z) + simd_shuffle_xor(s.w, ushort(1));
  out[tgid.x * 32 + lane] = min(max(d, 0.0f), limit) + fast::exp(-d) + fma(d, d, 1.0f) + float(clamp(int(lane), 0, 4));
}
template [[host_name("k_half")]] [[kernel]] decltype(k<half>) k<half>;
template [[host_name("k_bfloat")]] [[kernel]] decltype(k<bfloat>) k<bfloat>;
template [[host_name("k_float")]] [[kernel]] decltype(k<float>) k<float>;
"""


@needs_clang
def test_shim_takes_msl():
    assert strict_compile(_MSL) == []


@needs_clang
@pytest.mark.parametrize("original,replacement,message", [
    # MSL converts vectors of another element type only explicitly.
    ("const float4 a = float4(in4[lane]);", "const float4 a = in4[lane];", r"no viable conversion"),
    ("float(clamp(int(lane), 0, 4))", "float(max(int(lane), lane))", r"call to 'max' is ambiguous"),
    ("  s.x += float(rows);\n", "  s.x += float(rows);\n  c4.x = 1.0f;\n", r"cannot assign to variable 'c4'"),
], ids=["implicit_vector_conversion", "ambiguous_overload", "write_to_constant_reference"])
def test_shim_rejects_what_msl_rejects(original, replacement, message):
    assert _MSL.count(original) == 1
    with pytest.raises(StrictCompileError, match=message):
        strict_compile(_MSL.replace(original, replacement))
