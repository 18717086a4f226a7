"""Kernel sources for builds that need less than all of the kernels.

A build may instantiate only some kernels (the sanitizer and mutant builds
compile in seconds what the whole source takes up to a minute for), through
the source's ``MBD_KERNELS`` switch, as eval_gpu's run-time libraries do
(csrc/metal/kernel_library.h); and may carry one text edit of the kernel
header (a mutant). The library of the main float64 comparison is built from
the real, unedited source, all of it.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from .build import KERNEL_DIR, kernel_text

HEADER = "batched_decode_attention.h"
MSL_TYPES = {"float16": "half", "bfloat16": "bfloat", "float32": "float"}
_KERNEL = re.compile(r"(ragged_decode_attention|quantized_batched_decode_attention|batched_decode_attention)_"
                     r"(float16|bfloat16|float32)_(upto)?(\d+)(?:_v(\d+))?(?:_(\d)bit)?")


def instantiations(kernel: str) -> list[str]:
    """The .metal instantiations of main kernel ``kernel`` (a plan's host name) and its reduce (with
    the dense main kernel for a ragged or quantized one, as ``ragged_kernel_instantiation`` and
    ``quantized_kernel_instantiation`` in kernel_library.h)."""
    match = _KERNEL.fullmatch(kernel)
    if match is None or (match.group(1) == "quantized_batched_decode_attention") != (match.group(6) is not None):
        raise ValueError(f"not a main kernel's host name: {kernel}")
    family, dtype, generic, dim, value_dim, bits = match.groups()
    # A fast pair of head dims (D, Dv): instantiate_fast_pair(..., D, Dv).
    kind = "generic" if generic else "fast_pair" if value_dim else "fast"
    dims = f"{dim}, {value_dim}" if value_dim else dim
    dense = f"instantiate_{kind}({dtype}, {MSL_TYPES[dtype]}, {dims})"
    if family == "ragged_decode_attention":
        return [dense, f"instantiate_ragged_{kind}({dtype}, {MSL_TYPES[dtype]}, {dims})"]
    if family == "quantized_batched_decode_attention":
        return [dense, f"instantiate_quantized_{kind}({dtype}, {MSL_TYPES[dtype]}, {dims}, {bits})"]
    return [dense]


def library_source(text: str, kernels: Iterable[str]) -> str:
    """``text`` (a flattened source) compiling only the main kernels ``kernels`` and their reduces:
    for one kernel, what ``library_source`` in csrc/metal/kernel_library.h makes."""
    lines = dict.fromkeys(line for k in sorted(set(kernels)) for line in instantiations(k))
    return "#define MBD_KERNELS " + " ".join(lines) + "\n" + text


def _replace_once(path: Path, original: str, replacement: str) -> None:
    text = path.read_text()
    assert text.count(original) == 1, f"{original!r} no longer matches {path.name} exactly once"
    path.write_text(text.replace(original, replacement))


def kernel_sources(directory: Path, kernels: Iterable[str] | None = None,
                   edit: tuple[str, str] | None = None) -> str:
    """The flattened source of a copy of the kernel sources in ``directory``
    (replaced if there) with the header edit ``(original, replacement)``
    applied exactly once, compiling only the main kernels ``kernels`` (None: all)."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(KERNEL_DIR, directory)
    if edit is not None:
        _replace_once(directory / HEADER, *edit)
    text = kernel_text(directory)
    return text if kernels is None else library_source(text, kernels)


def subset_source(kernels: Iterable[str]) -> str:
    """The real source compiling only the main kernels ``kernels`` and their reduces."""
    return library_source(kernel_text(), kernels)
