"""Source pre-pass of the emulation harness: what no C++ macro can do.

Takes a flattened Metal source (cmake/metal_source.py: includes resolved,
``#line`` directives naming the original files) and rewrites four MSL
constructs into the harness's C++, keeping every line where it was, so that
compiler errors and harness reports name ``.metal`` and header lines:

- built-in parameters (``uint lid [[thread_index_in_simdgroup]]``) get the
  calling lane's value as default argument;
- ``threadgroup`` variables declared in a kernel body become ``static``
  (threadgroups run one after another) and are registered for NaN poisoning;
- ``constant T x [[function_constant(i)]]`` reads the value the launch sets;
- ``template [[host_name("n")]] [[kernel]] decltype(f<..>) f<..>;`` also
  registers ``f<..>`` under the host name, with the buffer indices of ``f``.
"""

from __future__ import annotations

import re

BUILTINS = (
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "thread_position_in_threadgroup",
    "thread_position_in_grid",
    "thread_index_in_threadgroup",
    "simdgroup_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroups_per_threadgroup",
    "threads_per_simdgroup",
)

_BUILTIN = re.compile(r"\[\[\s*(" + "|".join(BUILTINS) + r")\s*\]\]")
_TG_VAR = re.compile(r"^(\s*)threadgroup\s+([A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)((?:\s*\[[^\]]+\])*)\s*;\s*$")
_FUNCTION_CONSTANT = re.compile(
    r"^(\s*)constant\s+([\w:]+)\s+(\w+)\s*\[\[\s*function_constant\(([^)]+)\)\s*\]\]\s*;\s*$"
)
# `[[kernel]]`, `[[kernel, max_total_threads_per_threadgroup(n)]]` or `kernel`.
_KERNEL_DEF = re.compile(r"(?:\[\[\s*kernel\b[^\]]*\]\]|\bkernel\b)\s*void\s+([A-Za-z_]\w*)\s*\(")
# `[[buffer(i)]]`, or `[[buffer(i), function_constant(c)]]` for a buffer bound only when c is set.
_BUFFER = re.compile(r"\[\[\s*buffer\(\s*(\d+)\s*\)\s*(?:,[^\]]*)?\]\]")
_THREADGROUP_ATTRIBUTE = re.compile(r"\[\[\s*threadgroup\(\s*\d+\s*\)\s*\]\]")
_WS = r"[\s\\]*"
_INSTANTIATION = re.compile(
    r"template" + _WS + r"\[\[\s*host_name\((.*?)\)\s*\]\]" + _WS + r"\[\[\s*kernel\s*\]\]" + _WS
    + r"decltype\((.*?)\)" + _WS + r"([^;]*?)" + _WS + ";",
    re.S,
)


class PrepassError(Exception):
    """The source uses something the harness does not emulate."""


def _closing_paren(text: str, open_index: int) -> int:
    depth = 0
    for i in range(open_index, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise PrepassError("unbalanced parentheses in a kernel signature")


def kernel_buffer_indices(text: str) -> dict[str, list[int]]:
    """Buffer indices of each kernel, in parameter order."""
    kernels = {}
    for match in _KERNEL_DEF.finditer(text):
        signature = text[match.end() - 1 : _closing_paren(text, match.end() - 1) + 1]
        kernels[match.group(1)] = [int(i) for i in _BUFFER.findall(signature)]
    return kernels


def _declaration(line: str) -> str:
    """Rewrites a threadgroup variable or a function constant declared on ``line``."""
    match = _TG_VAR.match(line)
    if match:
        indent, type_, name, dims = match.groups()
        return (
            f"{indent}static {type_} {name}{dims}; "
            f"static ::emu::ThreadgroupMemory EMU_UNIQUE{{{name}, sizeof({name})}};"
        )
    match = _FUNCTION_CONSTANT.match(line)
    if match:
        indent, type_, name, index = match.groups()
        return f"{indent}static const ::emu::FunctionConstant<{type_}> {name}{{{index}}};"
    return line


def _builtin_parameter(text: str, match: re.Match) -> str:
    """The calling lane's value as default argument of a built-in parameter; where a later parameter
    of the list has no attribute (so cannot take a default), nothing: the caller passes the value."""
    depth, start, later = 0, match.end(), []
    for i in range(match.end(), len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth < 0 or (depth == 0 and text[i] == ","):
            later.append(text[start:i])
            start = i + 1
        if depth < 0:
            break
    if any("[[" not in parameter for parameter in later[1:]):
        return ""
    return f"[[maybe_unused]] = ::emu::builtins::{match.group(1)}()"


def _registration(kernels: dict[str, list[int]], match: re.Match) -> str:
    host_name, function, declarator = match.group(1), match.group(2).strip(), match.group(3).strip()
    base = re.match(r"[A-Za-z_]\w*", function)
    if base is None or base.group(0) not in kernels:
        raise PrepassError(f"instantiation of an unknown kernel: {function}")
    indices = ", ".join(str(i) for i in kernels[base.group(0)])
    code = (
        f"template decltype({function}) {declarator}; "
        f"static const ::emu::KernelRegistration EMU_UNIQUE{{{host_name}, "
        f"[](void* const* b) {{ ::emu::Call<{indices}>::run([](auto... a) {{ {function}(a...); }}, b); }}, "
        f"::emu::Call<{indices}>::indices, ::emu::Call<{indices}>::count}};"
    )
    # Same number of lines as the original, so later #line numbers stay right.
    return code + " \\\n" * match.group(0).count("\n")


def prepass(source: str) -> str:
    """The C++ translation of the flattened Metal ``source``, ready for g++ with the harness headers."""
    text = "\n".join(_declaration(line) for line in source.splitlines()) + "\n"
    for match in _KERNEL_DEF.finditer(text):
        if _THREADGROUP_ATTRIBUTE.search(text[match.end() - 1 : _closing_paren(text, match.end() - 1) + 1]):
            raise PrepassError("[[threadgroup(n)]] kernel parameters are not emulated")
    # On a helper function's parameter (MLX's steel GEMM) it only names memory the caller passes.
    text = _THREADGROUP_ATTRIBUTE.sub("", text)
    text = _BUILTIN.sub(lambda m: _builtin_parameter(text, m), text)
    kernels = kernel_buffer_indices(text)
    for name, indices in kernels.items():
        if indices != sorted(set(indices)):
            raise PrepassError(f"kernel {name}: [[buffer(i)]] indices must be distinct and increasing")
    return _INSTANTIATION.sub(lambda m: _registration(kernels, m), text)
