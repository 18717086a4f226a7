"""What MSL forbids and a C++ compile accepts, found in the source text.

Rules, on the code with comments and strings blanked (``source_text``):

- ``double``: MSL has no double type;
- ``recursion``: a cycle in the call graph of the functions the source defines
  (``functions.py``);
- ``function_pointer``: a pointer or reference to a function declared, called
  through, or taken (``&f`` of a function the source defines);
- ``virtual``, ``exceptions`` (try, catch, throw), ``new_delete`` (the
  operators; ``= delete`` is allowed), ``thread_local``, ``rtti`` (dynamic_cast,
  typeid): features MSL does not have;
- ``static_local``: a ``static`` variable in a function body that is not
  const, constexpr or constant (MSL has no writable static storage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import functions
from .source_text import Locations, code_only

_KEYWORDS = {
    "double": re.compile(r"\bdouble\b"),
    "virtual": re.compile(r"\bvirtual\b"),
    "exceptions": re.compile(r"\b(?:try|catch|throw)\b"),
    "new_delete": re.compile(r"\b(?:new|delete)\b"),
    "thread_local": re.compile(r"\bthread_local\b"),
    "rtti": re.compile(r"\b(?:dynamic_cast|typeid)\b"),
}
# (*f)(  (&f)(  (C::*f)(  (*)(
_FUNCTION_DECLARATOR = re.compile(r"\(\s*(?:[A-Za-z_]\w*\s*::\s*)*[*&]\s*(?:[A-Za-z_]\w*)?\s*\)\s*\(")
_STATIC = re.compile(r"\bstatic\b([^;{}()=]*)")
_CONST = re.compile(r"\b(?:const|constexpr|constant)\b")


@dataclass(frozen=True)
class Finding:
    """One rule broken at one place of the source."""

    rule: str
    where: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.rule}: {self.text}"


def _keyword_findings(code: str, where: Locations) -> list[Finding]:
    out = []
    for rule, pattern in _KEYWORDS.items():
        for m in pattern.finditer(code):
            # `= delete` (a deleted function) is no operator.
            if m.group(0) == "delete" and code[: m.start()].rstrip().endswith("="):
                continue
            out.append(Finding(rule, where(m.start()), m.group(0).strip()))
    return out


def _function_pointer_findings(code: str, defined: set[str], where: Locations) -> list[Finding]:
    out = [Finding("function_pointer", where(m.start()), m.group(0)) for m in _FUNCTION_DECLARATOR.finditer(code)]
    if defined:
        address = re.compile(r"(?<![\w)\]\s])\s*&\s*(?:[A-Za-z_]\w*\s*::\s*)*(" + "|".join(sorted(defined))
                             + r")\b(?!\s*[(\[.])")
        out += [Finding("function_pointer", where(m.start()), f"&{m.group(1)}") for m in address.finditer(code)]
    return out


def _static_local_findings(code: str, bodies: list[functions.Function], where: Locations) -> list[Finding]:
    out = []
    for body in bodies:
        for m in _STATIC.finditer(code, body.open, body.close):
            if not _CONST.search(m.group(1)):
                out.append(Finding("static_local", where(m.start()), ("static" + m.group(1)).strip()))
    return out


def lint(text: str) -> list[Finding]:
    """The rules ``text`` (a flattened Metal source) breaks, in source order per rule."""
    code = code_only(text)
    where = Locations(text)
    defined = functions.definitions(code)
    findings = _keyword_findings(code, where)
    findings += _function_pointer_findings(code, {f.name for f in defined}, where)
    for cycle in functions.cycles(functions.call_graph(code, defined)):
        first = next(f for f in defined if f.name == cycle[0])
        findings.append(Finding("recursion", where(first.open), " -> ".join(cycle)))
    findings += _static_local_findings(code, defined, where)
    return findings
