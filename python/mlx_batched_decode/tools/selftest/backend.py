"""Which kernels serve the default device, and what their first call costs."""

from __future__ import annotations

import time

import mlx.core as mx

from ... import _ext, ops
from .cases import Case
from .layouts import prepare

# The first call times this case: the decode shape of most models (float16, D = 128, G = 4).
FIRST_CALL_CASE = Case("dense", mx.float16, 128, 4, (300, 17), kv_heads=8)


def backend_name(device: mx.Device) -> str:
    """``"metallib"`` or ``"source"`` (where the GPU's kernels come from), or ``"cpu"``."""
    if device.type == mx.DeviceType.gpu:
        return ops.metal_backend() or "none"
    return "cpu"


def backend_line(device: mx.Device) -> str:
    """The backend in words, for the report."""
    name = backend_name(device)
    if name == "metallib":
        return "metallib (Metal kernels from the prebuilt mlx_batched_decode.metallib)"
    if name == "source":
        return "source (Metal kernels compiled from the embedded source, each dtype and D at its first call)"
    if name == "cpu":
        return f"cpu (CPU kernel, {_ext.cpu_isa()} variant on {_ext.cpu_threads()} threads)"
    return f"{name} (the GPU is the default device but this build has no Metal kernels)"


def first_call_note(name: str) -> str:
    """What the first call's extra time is, for backend ``name``."""
    if name == "source":
        return "the difference: compiling this dtype and D's kernels from source, and their pipelines"
    if name == "metallib":
        return "the difference: loading the metallib and building this dtype and D's pipelines"
    return "the CPU kernel compiles nothing at run time"


def first_call_seconds() -> tuple[float, float]:
    """(first, warm): the seconds of the process's first call of the dense op on
    FIRST_CALL_CASE, evaluated, and the best of three calls after it. On the GPU their
    difference is building the kernels' pipelines (and, for ``"source"``, compiling them)."""
    prepared = prepare(FIRST_CALL_CASE)
    start = time.perf_counter()
    mx.eval(prepared.run())
    first = time.perf_counter() - start
    warm = []
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(prepared.run())
        warm.append(time.perf_counter() - start)
    return first, min(warm)
