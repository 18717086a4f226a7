"""The address-space-strict compile: clang -fsyntax-only of a flattened Metal source.

The source (for the kernel directory, the text ``_ext`` embeds) goes through
``prepass.py`` and is compiled against ``msl_strict.h`` for aarch64 (which has
``_Float16`` and ``__bf16``) as C++14, the language MSL 3.1, the oldest MLX
compiles with, is based on; without exceptions or RTTI (MSL has neither);
including nothing else. Every instantiation the source has is checked, since
clang checks a template's body only where it is instantiated. Errors fail it,
but for the implicit copies across address spaces that MSL allows
(``diagnostics.py``); so do warnings, since no kernel warning is expected.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .diagnostics import Diagnostic, parse
from .prepass import prepass

SHIM = Path(__file__).resolve().parent / "msl_strict.h"
# Debian's `clang` package installs clang++ (clang++-14 on Debian 12).
CLANG_NAMES = ("clang++", "clang++-14")
FLAGS = [
    "-x", "c++", "-std=c++14", "--target=aarch64-unknown-linux-gnu", "-march=armv8.6-a+bf16",
    "-fsyntax-only", "-nostdinc", "-nostdinc++", "-ffreestanding", "-fno-exceptions", "-fno-rtti",
    "-fno-color-diagnostics", "-fno-caret-diagnostics", "-ferror-limit=0", "-Wall", "-Wextra", "-Werror",
    # `const constant T&` is MSL's spelling, and constant is const here already.
    "-Wno-duplicate-decl-specifier",
]


class StrictCompileError(Exception):
    """clang rejected the source; the message holds the diagnostics MSL would raise too."""


def find_clang() -> str | None:
    """The clang++ of this machine, or None."""
    return next((path for path in map(shutil.which, CLANG_NAMES) if path), None)


def strict_compile(source: str, clang: str | None = None) -> list[Diagnostic]:
    """Compiles the flattened Metal ``source``; returns the tolerated diagnostics
    (implicit copies across address spaces, the shim's vectors in threadgroup and device
    memory: diagnostics.py), raises StrictCompileError on any other."""
    clang = clang or find_clang()
    if clang is None:
        raise FileNotFoundError("no clang++: install Debian's `clang` package")
    result = subprocess.run(["nice", clang, *FLAGS, "-include", str(SHIM), "-"], input=prepass(source),
                            capture_output=True, text=True)
    diagnostics = parse(result.stderr)
    tolerated = [
        d for d in diagnostics if d.is_implicit_copy_across_address_spaces() or d.is_vector_in_address_space()
    ]
    rejected = [d for d in diagnostics if d not in tolerated]
    # A failure clang reports without a source location (a driver error) fails too.
    if rejected or (result.returncode != 0 and not tolerated):
        raise StrictCompileError("\n".join(d.text() for d in rejected) or result.stderr)
    return tolerated
