"""A ragged call's per-request arrays as eval_gpu of RaggedDecodeAttention sees them.

MLX gives every array the Metal buffer of its data, shared by the views of
one array: requests whose keys or values are views of one cache share it, and
the launch plan binds it once per group (csrc/metal/ragged_launch_plan.h).
Here the numpy array a view was taken from plays that buffer: each gets one
device copy, and every view of it points into that copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class BoundArrays:
    """The 2B arrays (keys, then values) of a call, in their device copies."""

    heads: int  # H_kv
    itemsize: int
    lengths: list[int]  # T_b of each array
    arrays: ctypes.Array  # void* [2B]: each array's first element
    buffers: ctypes.Array  # void* [2B]: the start of its buffer's copy
    buffer_bytes: ctypes.Array  # unsigned long long [2B]: that copy's bytes
    strides: ctypes.Array  # long long [4B]: each array's head and position strides in elements
    copies: list  # keeps the device copies alive


def root(view: np.ndarray) -> np.ndarray:
    """The array owning the memory of ``view``: the buffer a view of it shares."""
    while isinstance(view.base, np.ndarray):
        view = view.base
    if not view.flags.c_contiguous:
        raise ValueError("a ragged array must be a view of a C-contiguous numpy array")
    return view


def bind(views: list[np.ndarray], storage: type, nan_margins: bool, device_copy: Callable) -> BoundArrays:
    """Device copies of the buffers of ``views`` (request b's keys at b, its values at B + b,
    each [1, H_kv, T_b, D] or [H_kv, T_b, D], values of a width Dv of their own, last axis
    contiguous), one per buffer, made by
    ``device_copy(buffer, nan_margins)`` (driver._device_copy)."""
    arrays = [v[0] if v.ndim == 4 else v for v in views]
    half = len(arrays) // 2
    for i, a in enumerate(arrays):
        if a.ndim != 3 or a.dtype != storage or (a.size and a.strides[-1] != a.itemsize):
            raise ValueError(f"array {i}: expected [1, H_kv, T_b, D] or [H_kv, T_b, D] {storage.__name__} "
                             "with a contiguous last axis")
        if a.shape[:2] != arrays[i % half].shape[:2] or a.shape[0] != arrays[0].shape[0] or \
                a.shape[2] != arrays[i // half * half].shape[2]:
            raise ValueError(f"array {i}: keys and values of a request share H_kv and T_b, requests H_kv, all "
                             "keys one D and all values one Dv")
    itemsize = np.dtype(storage).itemsize
    copies: dict[int, tuple] = {}
    for a in arrays:
        owner = root(a)
        if id(owner) not in copies:
            copies[id(owner)] = (owner, device_copy(owner, nan_margins))
    first, starts, sizes = [], [], []
    for a in arrays:
        owner, (_, start, span) = copies[id(root(a))]
        first.append(start + (a.__array_interface__["data"][0] - owner.__array_interface__["data"][0]))
        starts.append(start)
        sizes.append(span)
    n = len(arrays)
    return BoundArrays(
        heads=arrays[0].shape[0] if arrays else 0,
        itemsize=itemsize,
        lengths=[a.shape[1] for a in arrays],
        arrays=(ctypes.c_void_p * n)(*first),
        buffers=(ctypes.c_void_p * n)(*starts),
        buffer_bytes=(ctypes.c_ulonglong * n)(*sizes),
        strides=(ctypes.c_longlong * (2 * n))(*(s // itemsize for a in arrays for s in a.strides[:2])),
        copies=list(copies.values()),
    )
