"""The functions a Metal source defines, their bodies and whom they call, by name.

Works on code text (``source_text.code_only``): a definition is a name, a
parenthesised parameter list, optional qualifiers and a brace-enclosed body
that lies in no other body (member functions included, lambdas and local
classes not). Overloads and templates of one name are one node of the call
graph: a cycle through a name may be a false alarm, never a missed recursion
between functions the source defines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NOT_FUNCTIONS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "decltype",
                  "static_assert", "alignas", "noexcept", "defined", "__attribute__"}
_QUALIFIERS = re.compile(r"(?:\s*\b(?:const|noexcept|override|final|volatile)\b)*\s*$")
_IDENTIFIER_BEFORE = re.compile(r"([A-Za-z_]\w*|operator\s*\S+)\s*$")
_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*(?:<[^;{}()<>]*(?:<[^;{}()<>]*>[^;{}()<>]*)*>\s*)?\(")


@dataclass(frozen=True)
class Function:
    """A definition: its name, where its body's braces are (offsets of ``{`` and ``}``)."""

    name: str
    open: int
    close: int


def _matching(code: str, index: int, opening: str, closing: str, step: int) -> int:
    depth = 0
    while 0 <= index < len(code):
        depth += (code[index] == opening) - (code[index] == closing)
        if depth == 0:
            return index
        index += step
    return -1


def definitions(code: str) -> list[Function]:
    """Every function definition of ``code``, in order."""
    found: list[Function] = []
    index = code.find("{")
    while index >= 0:
        # Qualifiers are short: a window keeps the search linear.
        start = max(0, index - 200)
        qualifiers = _QUALIFIERS.search(code, start, index)
        before = code[: qualifiers.start()]
        close = _matching(code, index, "{", "}", 1)
        if before.endswith(")") and close > 0:
            open_paren = _matching(code, len(before) - 1, ")", "(", -1)
            name = _IDENTIFIER_BEFORE.search(code[:open_paren]) if open_paren > 0 else None
            if name and name.group(1) not in _NOT_FUNCTIONS:
                found.append(Function(name.group(1), index, close))
                index = code.find("{", close)
                continue
        index = code.find("{", index + 1)
    return found


def call_graph(code: str, functions: list[Function]) -> dict[str, set[str]]:
    """Name -> the names of the source's functions its bodies call."""
    names = {f.name for f in functions}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for f in functions:
        body = code[f.open + 1 : f.close]
        graph[f.name] |= {m.group(1) for m in _CALL.finditer(body) if m.group(1) in names}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One call cycle (a path that ends where it starts) through each function on one."""
    found, reported = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for callee in sorted(graph[node]):
                if callee == start:
                    if start not in reported:
                        found.append(path + [start])
                        reported.update(path)
                elif callee not in seen:
                    seen.add(callee)
                    stack.append((callee, path + [callee]))
    return found
