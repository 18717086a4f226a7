"""Copies of the kernel sources for builds that need less than all of them.

A copy may instantiate only some kernels (the sanitizer and mutant builds
compile in seconds what the whole ``.metal`` file takes up to a minute for)
and may carry one text edit of the kernel header (a mutant). The library of
the main float64 comparison is built from the real, unedited ``.metal`` file.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from .build import CACHE, KERNEL_SOURCE

HEADER = "batched_decode_attention.h"
# The instantiations of every dtype x head dim at the end of the .metal file.
ALL_INSTANTIATIONS = (
    "instantiate_batched_decode_attention_dims(float16, half)\n"
    "instantiate_batched_decode_attention_dims(bfloat16, bfloat)\n"
    "instantiate_batched_decode_attention_dims(float32, float)\n"
)
MSL_TYPES = {"float16": "half", "bfloat16": "bfloat", "float32": "float"}
_KERNEL = re.compile(r"batched_decode_attention_(float16|bfloat16|float32)_(upto)?(\d+)")


def instantiation(kernel: str) -> str:
    """The .metal line instantiating main kernel ``kernel`` (a plan's host name) and its reduce."""
    match = _KERNEL.fullmatch(kernel)
    if match is None:
        raise ValueError(f"not a main kernel's host name: {kernel}")
    dtype, generic, dim = match.groups()
    return f"instantiate_{'generic' if generic else 'fast'}({dtype}, {MSL_TYPES[dtype]}, {dim})\n"


def _replace_once(path: Path, original: str, replacement: str) -> None:
    text = path.read_text()
    assert text.count(original) == 1, f"{original!r} no longer matches {path.name} exactly once"
    path.write_text(text.replace(original, replacement))


def kernel_sources(directory: Path, kernels: Iterable[str] | None = None,
                   edit: tuple[str, str] | None = None) -> Path:
    """The .metal file of a copy of the kernel sources in ``directory`` (replaced if
    there) that instantiates only the main kernels named in ``kernels`` (None:
    all) and has the header edit ``(original, replacement)`` applied exactly once."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(KERNEL_SOURCE.parent, directory)
    if edit is not None:
        _replace_once(directory / HEADER, *edit)
    if kernels is not None:
        lines = "".join(instantiation(k) for k in sorted(set(kernels)))
        _replace_once(directory / KERNEL_SOURCE.name, ALL_INSTANTIATIONS, lines)
    return directory / KERNEL_SOURCE.name


def subset_source(kernels: Iterable[str]) -> Path:
    """The .metal file of an unedited copy of the kernel sources instantiating only ``kernels``."""
    names = sorted(set(kernels))
    return kernel_sources(CACHE / "subsets" / hashlib.sha256(" ".join(names).encode()).hexdigest()[:16], names)
