"""ctypes front end of the harness library: the launch plan and emulated calls.

Arrays follow the op's contract: queries [B, H_q, 1, D], keys/values
[B, H_kv, T, D] (any strides, last axis contiguous), valid_lens int32 [B].
float16 and float32 are numpy arrays of that dtype; bfloat16 travels as the
raw uint16 bits (numpy has no bfloat16), see ``reference.to_dtype``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2}
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
BACKENDS = {"fibers": 0, "threads": 1}


class HarnessError(RuntimeError):
    """The harness rejected a launch or caught the kernel misusing a collective."""


class Plan(ctypes.Structure):
    """Mirror of MbdPlan in launcher.cpp."""

    _fields_ = [
        ("kernel", ctypes.c_char * 96),
        ("reduce_kernel", ctypes.c_char * 96),
        ("grid", ctypes.c_ulonglong * 3),
        ("group", ctypes.c_ulonglong * 3),
        ("reduce_grid", ctypes.c_ulonglong * 3),
        ("reduce_group", ctypes.c_ulonglong * 3),
        ("num_splits", ctypes.c_int),
        ("split_len", ctypes.c_int),
        ("head_chunks", ctypes.c_int),
        ("heads_per_group", ctypes.c_int),
        ("vector_width", ctypes.c_int),
        ("partial_acc_elems", ctypes.c_ulonglong),
        ("partial_stats_elems", ctypes.c_ulonglong),
    ]


def _device_copy(view: np.ndarray, nan_tail: bool) -> np.ndarray:
    """Copy of the memory ``view`` spans (from its first element), optionally
    followed by NaN bytes as wide again.

    With the tail, reads past the view land in its own padding or in NaN, so an
    unclamped length shows up in the result; without it, the allocation ends
    with the view, for AddressSanitizer to report such reads.
    """
    if min(view.strides) < 0:
        raise ValueError("negative strides are not supported")
    span = int((np.array(view.shape) - 1) @ np.array(view.strides)) + view.itemsize if view.size else 0
    buffer = np.full(max(1, 2 * span if nan_tail else span), 0xFF, dtype=np.uint8)
    ctypes.memmove(buffer.ctypes.data, view.ctypes.data, span)
    return buffer


class EmulatedLibrary:
    """The kernels of one build of the harness library."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))
        self._lib.mbd_emu_plan.argtypes = [ctypes.POINTER(ctypes.c_int * 7), ctypes.POINTER(Plan),
                                           ctypes.c_char_p, ctypes.c_int]
        self._lib.mbd_emu_attention.argtypes = [
            ctypes.POINTER(ctypes.c_int * 7), ctypes.POINTER(ctypes.c_longlong * 9),
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_float, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]

    def dispatch(self, kernel: str, buffers: list[np.ndarray], grid: tuple, group: tuple,
                 constants: dict[int, int] | None = None, backend: str = "fibers") -> None:
        """Runs any kernel of the library with ``buffers[i]`` bound at index i and
        int function constants ``{index: value}``."""
        pointers = (ctypes.c_void_p * len(buffers))(*(b.ctypes.data for b in buffers))
        constants = constants or {}
        indices = (ctypes.c_int * len(constants))(*constants.keys())
        values = (ctypes.c_int * len(constants))(*constants.values())
        error = ctypes.create_string_buffer(4096)
        if self._lib.mbd_emu_dispatch(kernel.encode(), pointers, len(buffers), (ctypes.c_uint * 3)(*grid),
                                      (ctypes.c_uint * 3)(*group), BACKENDS[backend], indices, values,
                                      len(constants), error, 4096):
            raise HarnessError(error.value.decode())

    @staticmethod
    def _shape(b, h_q, h_kv, t, d, dtype, max_threads):
        return (ctypes.c_int * 7)(b, h_q, h_kv, t, d, DTYPES[dtype], max_threads)

    def plan(self, b: int, h_q: int, h_kv: int, t: int, d: int, dtype: str, max_threads: int = 1024) -> dict:
        """The shared launch plan (csrc/metal/launch_plan.h) as a dict."""
        out, error = Plan(), ctypes.create_string_buffer(1024)
        if self._lib.mbd_emu_plan(self._shape(b, h_q, h_kv, t, d, dtype, max_threads), out, error, 1024):
            raise HarnessError(error.value.decode())
        plan = {name: getattr(out, name) for name, _ in Plan._fields_}
        for name in ("kernel", "reduce_kernel"):
            plan[name] = plan[name].decode()
        for name in ("grid", "group", "reduce_grid", "reduce_group"):
            plan[name] = tuple(plan[name])
        return plan

    def attention(self, queries: np.ndarray, keys: np.ndarray, values: np.ndarray, valid_lens: np.ndarray,
                  dtype: str, scale: float, max_threads: int = 1024, backend: str = "fibers",
                  nan_tail: bool = True) -> np.ndarray:
        """Runs the emulated kernels; returns the [B, H_q, 1, D] output in the storage dtype.

        ``max_threads`` plays the pipeline's maxTotalThreadsPerThreadgroup;
        ``backend`` is "fibers" (deterministic) or "threads"; ``nan_tail``, see
        ``_device_copy``.
        """
        b, h_q, _, d = queries.shape
        h_kv, t = keys.shape[1], keys.shape[2]
        for name, array in (("queries", queries), ("keys", keys), ("values", values)):
            if array.dtype != STORAGE[dtype] or (array.size and array.strides[-1] != array.itemsize):
                raise ValueError(f"{name}: expected {STORAGE[dtype].__name__} with a contiguous last axis")
        itemsize = queries.itemsize
        strides = [queries.strides[0], queries.strides[1], *keys.strides[:3], *values.strides[:3]]
        if any(s % itemsize for s in strides):
            raise ValueError("strides must be whole elements")
        if valid_lens.dtype != np.int32:
            raise ValueError("valid_lens must be int32")
        copies = [_device_copy(a, nan_tail) for a in (queries, keys, values, valid_lens)]
        # Poisoned output: an element the kernel never writes stays NaN.
        out = np.full((b, h_q, 1, d), 0xFFFF if dtype == "bfloat16" else np.nan, dtype=STORAGE[dtype])
        error = ctypes.create_string_buffer(4096)
        status = self._lib.mbd_emu_attention(
            self._shape(b, h_q, h_kv, t, d, dtype, max_threads),
            (ctypes.c_longlong * 9)(*(s // itemsize for s in strides), valid_lens.strides[0] // 4),
            *(c.ctypes.data for c in copies), out.ctypes.data,
            scale, BACKENDS[backend], error, 4096)
        if status:
            raise HarnessError(error.value.decode())
        return out
