"""Pre-pass of the strict compile: MSL's attributes and declarations clang cannot take.

Rewrites a flattened Metal source (cmake/metal_source.py) for clang with the
shim ``msl_strict.h``, line for line, so that every diagnostic names the
``.metal`` and header lines:

- ``#include <metal_stdlib>`` goes (the driver includes the shim first);
- MSL's own attributes go: ``[[kernel]]``, ``[[host_name(...)]]`` (clang
  refuses any attribute on an explicit instantiation), ``[[buffer(n)]]``,
  ``[[threadgroup(n)]]``, ``[[function_constant(n)]]`` and the built-in
  parameter attributes. Any other attribute stays, so a misspelt built-in is
  an unknown attribute, which the driver makes an error;
- a function constant (``constant T x [[function_constant(i)]];``) becomes an
  ``extern`` declaration: its value is the pipeline's, known to no compile;
- a ``threadgroup`` variable declared in a function becomes ``static`` (clang
  allows no automatic variable in a named address space).
"""

from __future__ import annotations

import re

from ..prepass import BUILTINS

# Built-in parameter attributes of compute kernels beyond those the emulation runs.
MORE_BUILTINS = (
    "threads_per_grid",
    "thread_execution_width",
    "quadgroup_index_in_threadgroup",
    "thread_index_in_quadgroup",
    "quadgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup",
)
_ARGUMENT = r"(?:\s*\((?:[^()]|\([^()]*\))*\))?"
_MSL_ATTRIBUTE = re.compile(
    r"\[\[\s*(?:kernel|host_name|buffer|threadgroup|function_constant|max_total_threads_per_threadgroup|"
    + "|".join(BUILTINS + MORE_BUILTINS) + r")\b" + _ARGUMENT + r"\s*\]\]"
)
_STDLIB = re.compile(r"^\s*#\s*include\s*<metal_stdlib>\s*$", re.M)
_FUNCTION_CONSTANT = re.compile(
    r"^(\s*)constant\s+(.+?)\s*\[\[\s*function_constant\([^)]*\)\s*\]\]\s*;", re.M
)
_TG_LOCAL = re.compile(r"^(\s+)threadgroup\b", re.M)


def prepass(source: str) -> str:
    """The flattened Metal ``source`` as C++ for clang with ``msl_strict.h``, lines kept."""
    text = _STDLIB.sub("", source)
    text = _FUNCTION_CONSTANT.sub(r"\1extern constant \2;", text)
    text = _TG_LOCAL.sub(r"\1static threadgroup", text)
    return _MSL_ATTRIBUTE.sub("", text)
