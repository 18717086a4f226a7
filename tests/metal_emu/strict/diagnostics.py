"""clang's diagnostics, grouped, and the one kind the strict compile tolerates.

MSL declares a class's implicit copy and move constructors in every address
space, and its implicit assignments in every writable one: a struct is copied
out of a ``device`` or ``constant`` buffer, or assigned into a ``device`` or
``threadgroup`` one, as in any vertex shader. Clang declares them in the
default address space only and no shim can add the others (it takes no
address space on a member function), so it rejects such copies; those errors,
and only those, are tolerated: every candidate clang names is an implicit
member refused for its address space. Any user-declared member, a write into
``constant`` or a pointer or reference of the wrong address space stays an error.

MSL's vector types are built in, so they too are declared and assigned in
``threadgroup`` and ``device`` memory; the shim's ``vec`` is a class, whose
default constructor and assignment clang takes in the default address space
only. Those two errors are tolerated for the shim's ``vec`` alone: a
``threadgroup`` declaration of vectors, and an assignment into ``device`` or
``threadgroup`` vectors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HEAD = re.compile(r"^(?P<where>[^\s:][^:]*:\d+:\d+): (?P<kind>error|warning|fatal error): (?P<message>.*)$")
_CANDIDATE = re.compile(r": note: candidate ")
_IMPLICIT_COPY = re.compile(
    r"candidate constructor \(the implicit (?:copy|move|default) constructor\) not viable: "
    r"(?:cannot bind reference in address space '\d+' to object in generic address space|requires 0 arguments)"
)
_IMPLICIT_ASSIGNMENT = re.compile(
    r"candidate function \(the implicit (?:copy|move) assignment operator\) not viable: "
    r"'this' object is in address space '(?:1|3)'"
)
_SHIM_NOTE = r"msl_strict\.h:\d+:\d+: note: "
_VEC_DECLARATION = re.compile(
    r"^no matching constructor for initialization of 'threadgroup \w+(?:\[\d+\])*' "
    r"\(aka '__attribute__\(\(address_space\(3\)\)\) vec<\w+, \d>(?:\[\d+\])*'\)$"
)
_VEC_DEFAULT_CONSTRUCTOR = re.compile(
    _SHIM_NOTE + r"candidate constructor ignored: cannot be used to construct an object in address space "
    r"'__attribute__\(\(address_space\(3\)\)\)'"
)
_VEC_ASSIGNMENT = re.compile(
    _SHIM_NOTE + r"candidate function not viable: 'this' object is in address space '(?:1|3)', "
    r"but method expects object in generic address space"
)
_COPY_MESSAGES = re.compile(r"^(?:no matching constructor for initialization of '.*'|no viable overloaded '=')$")


@dataclass
class Diagnostic:
    """One error or warning with its notes (candidates, instantiation context)."""

    where: str
    kind: str
    message: str
    notes: list[str]

    def text(self) -> str:
        return "\n".join([f"{self.where}: {self.kind}: {self.message}", *self.notes])

    def is_implicit_copy_across_address_spaces(self) -> bool:
        """Whether this is an error MSL would not raise: an implicit copy or
        assignment of a class refused only for its object's address space."""
        candidates = [n for n in self.notes if _CANDIDATE.search(n)]
        copies = [n for n in candidates if _IMPLICIT_COPY.search(n) or _IMPLICIT_ASSIGNMENT.search(n)]
        return (self.kind == "error" and bool(_COPY_MESSAGES.match(self.message)) and bool(candidates)
                and len(copies) == len(candidates) and any("address space" in n for n in candidates))


    def is_vector_in_address_space(self) -> bool:
        """Whether this is an error MSL would not raise for its built-in vectors: a
        ``threadgroup`` declaration of the shim's ``vec``, or an assignment into a
        ``device`` or ``threadgroup`` one (its only candidate the shim's own)."""
        candidates = [n for n in self.notes if _CANDIDATE.search(n)]
        if self.kind != "error" or not candidates:
            return False
        if _VEC_DECLARATION.match(self.message):
            return any(_VEC_DEFAULT_CONSTRUCTOR.search(n) for n in candidates)
        return self.message == "no viable overloaded '='" and all(_VEC_ASSIGNMENT.search(n) for n in candidates)


def parse(output: str) -> list[Diagnostic]:
    """clang's output (-fno-caret-diagnostics) as diagnostics; notes join the one before them."""
    diagnostics: list[Diagnostic] = []
    for line in output.splitlines():
        head = _HEAD.match(line)
        if head:
            diagnostics.append(Diagnostic(head["where"], head["kind"], head["message"], []))
        elif diagnostics and ": note: " in line:
            diagnostics[-1].notes.append(line)
    return diagnostics
