"""ctypes front end of the harness library: the launch plan, the run-time
library names and sources, the backend choice, and emulated calls.

Arrays follow the op's contract: queries [B, H_q, L, D], or packed [N, H_q, D]
with query_starts int32 [B + 1], keys [B, H_kv, T, D] and values [B, H_kv, T, Dv]
(any strides, last axis contiguous; ragged: lists of B views, see
``ragged_buffers.py``), valid_lens and kv_starts int32 [B], sinks float32
[H_q] (any stride); the output is [B, H_q, L, Dv], or packed [N, H_q, Dv]. float16 and float32 are numpy
arrays of that dtype; bfloat16 travels as the raw uint16 bits (numpy has no
bfloat16), see ``reference.to_dtype``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from . import ragged_buffers

DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2}
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
BACKENDS = {"fibers": 0, "threads": 1}
# The kernels' buffer indices (csrc/metal/launch_plan.h, BufferIndex; from 11 on, the ragged
# kernel's of csrc/metal/ragged_launch_plan.h).
RAGGED_SLOTS = 16
BUFFERS = ("queries", "keys", "values", "valid_lens", "kv_starts", "sinks", "out", "partial_acc", "partial_max",
           "partial_sum", "params", "requests", "group", *(f"slot{i}" for i in range(RAGGED_SLOTS)), "query_starts")
# The dense kernel binds its ring offsets at the ragged kernel's "requests" index (MBD_RING_OFFSETS).
RING_OFFSETS = "requests"
# Device copies start on this boundary (Metal buffers start at least this aligned), plus any shift.
ALIGNMENT = 16
MAX_BUFFERS = 31
# The shape array of the harness's entry points (to_shape in launcher.cpp).
SHAPE_INTS = 14
# What closes every attention entry point: query_starts, their stride and bytes.
QUERY_STARTS_ARGS = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_ulonglong]


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
        ("keys_span", ctypes.c_int),
        ("rows_per_group", ctypes.c_int),
        ("row_chunks", ctypes.c_int),
        ("group_chunks", ctypes.c_int),
        ("row_groups", ctypes.c_int),
        ("vector_width", ctypes.c_int),
        ("partial_acc_elems", ctypes.c_ulonglong),
        ("partial_stats_elems", ctypes.c_ulonglong),
        ("tiled", ctypes.c_int),
    ]


class Launch(ctypes.Structure):
    """Mirror of MbdLaunch in launcher.cpp."""

    _fields_ = [("vector_loads", ctypes.c_int), ("dispatches", ctypes.c_int),
                ("loaded", (ctypes.c_ulonglong * MAX_BUFFERS) * 2)]


class RaggedRequest(ctypes.Structure):
    """Mirror of RaggedRequest in csrc/kernels/ragged_decode_attention_params.h."""

    _fields_ = [(name, ctypes.c_longlong) for name in ("k_offset", "v_offset", "k_head_stride", "k_seq_stride",
                                                        "v_head_stride", "v_seq_stride")] + [
        (name, ctypes.c_int) for name in ("k_slot", "v_slot", "length")]


def effective_window(window: int | None, t: int) -> int:
    """The window the kernels apply, as ``effective_window`` in csrc/batched_decode_attention.h:
    ``window`` when set and shorter than T, else T (1 when T == 0)."""
    return window if window is not None and 0 < window < t else max(t, 1)


def _device_copy(view: np.ndarray, nan_margins: bool, shift: int = 0) -> tuple[np.ndarray, int, int]:
    """A buffer holding the memory ``view`` spans (from its first element), the
    address of that first element in it, and the span in bytes.

    The first element sits ``shift`` bytes past a 16-byte boundary. With
    margins, NaN bytes (at least as wide as the span) lie before and after it,
    so a read before or past the view lands in its own padding or in NaN and
    shows up in the result; without them, the allocation ends exactly at the
    span, for AddressSanitizer to report such reads.
    """
    if min(view.strides, default=0) < 0:
        raise ValueError("negative strides are not supported")
    span = int((np.array(view.shape) - 1) @ np.array(view.strides)) + view.itemsize if view.size else 0
    margin = -(-span // ALIGNMENT) * ALIGNMENT if nan_margins else 0
    buffer = np.full(max(1, shift + span + 2 * margin), 0xFF, dtype=np.uint8)
    if buffer.ctypes.data % ALIGNMENT:
        raise HarnessError(f"numpy allocated a buffer off a {ALIGNMENT}-byte boundary")
    first = buffer.ctypes.data + margin + shift
    ctypes.memmove(first, view.ctypes.data, span)
    return buffer, first, span


def _query_view(queries: np.ndarray, query_starts: np.ndarray | None) -> tuple[tuple[int, int, int, int], list[int]]:
    """(B, H_q, L, D) and the byte strides (batch, head, row) of the [B, H_q, L, D] view the kernel
    reads: the queries', or, packed, [N, H_q, D] read as [B, H_q, N, D] of batch stride 0 (as
    request_queries hands the primitive)."""
    if query_starts is None:
        return queries.shape, list(queries.strides[:3])
    if query_starts.dtype != np.int32 or query_starts.ndim != 1 or query_starts.strides[0] % 4:
        raise ValueError("query_starts must be int32 [B + 1] with a stride of whole elements")
    n, h_q, d = queries.shape
    return (len(query_starts) - 1, h_q, n, d), [0, queries.strides[1], queries.strides[0]]


def _query_starts_args(query_starts: np.ndarray | None, nan_margins: bool):
    """The device copy of query_starts (kept alive by the caller) and the three closing arguments."""
    if query_starts is None:
        return None, [None, 0, 0]
    copy = _device_copy(query_starts, nan_margins)
    return copy, [copy[1], query_starts.strides[0] // 4, copy[2]]


def _output(shape: tuple, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A NaN-poisoned output (an element the kernel never writes stays NaN) inside a buffer of as
    many NaN elements before and after it, which ``_check_output`` requires untouched."""
    n = int(np.prod(shape))
    buffer = np.full(3 * n, 0xFFFF if dtype == "bfloat16" else np.nan, dtype=STORAGE[dtype])
    return buffer, buffer[n:2 * n].reshape(shape)


def _check_output(buffer: np.ndarray, out: np.ndarray) -> None:
    n = out.size
    poison = np.full(n, 0xFFFF if out.dtype == np.uint16 else np.nan, dtype=out.dtype).view(np.uint8)
    for margin in (buffer[:n], buffer[2 * n:]):
        if not np.array_equal(margin.view(np.uint8), poison):
            raise HarnessError("the kernel wrote outside the output")


class EmulatedLibrary:
    """The kernels of one build of the harness library."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))
        self._lib.mbd_emu_plan.argtypes = [ctypes.POINTER(ctypes.c_int * SHAPE_INTS), ctypes.POINTER(Plan),
                                           ctypes.c_char_p, ctypes.c_int]
        self._lib.mbd_emu_poison.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int]
        self._lib.mbd_emu_attention.argtypes = [
            ctypes.POINTER(ctypes.c_int * SHAPE_INTS), ctypes.POINTER(ctypes.c_longlong * 12), *[ctypes.c_void_p] * 6,
            ctypes.POINTER(ctypes.c_ulonglong * 6), ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int,
            ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_ulonglong,
            *QUERY_STARTS_ARGS]
        self._lib.mbd_emu_quantized_attention.argtypes = [
            ctypes.POINTER(ctypes.c_int * SHAPE_INTS), ctypes.POINTER(ctypes.c_longlong * 12),
            ctypes.POINTER(ctypes.c_longlong * 16), ctypes.POINTER(ctypes.c_int * 3), *[ctypes.c_void_p] * 6,
            ctypes.POINTER(ctypes.c_void_p * 4), ctypes.POINTER(ctypes.c_ulonglong * 10), ctypes.c_void_p,
            ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, *QUERY_STARTS_ARGS]
        self._lib.mbd_emu_ragged_attention.argtypes = [
            ctypes.POINTER(ctypes.c_int * SHAPE_INTS), ctypes.POINTER(ctypes.c_longlong * 12), *[ctypes.c_void_p] * 4,
            ctypes.POINTER(ctypes.c_ulonglong * 4), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int,
            ctypes.c_char_p, ctypes.c_int, *QUERY_STARTS_ARGS]
        self._lib.mbd_emu_ragged_layout.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        self._lib.mbd_emu_last_launch.argtypes = [ctypes.POINTER(Launch)]
        self._lib.mbd_emu_library_name.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                   ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
        self._lib.mbd_emu_library_source.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                     ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_longlong]
        self._lib.mbd_emu_library_source.restype = ctypes.c_longlong
        self._lib.mbd_emu_metal_backend.argtypes = [ctypes.c_int, ctypes.c_int]
        self._lib.mbd_emu_metal_backend.restype = ctypes.c_char_p
        # Only a "loads" build links the hooks of g++'s load instrumentation (load_counter.cpp).
        self.counts_loads = hasattr(self._lib, "__asan_loadN_noabort")

    def dispatch(self, kernel: str, buffers: list[np.ndarray], grid: tuple, group: tuple,
                 constants: dict[int, int | bool] | None = None, backend: str = "fibers") -> None:
        """Runs any kernel of the library with ``buffers[i]`` bound at index i and
        function constants ``{index: value}`` (int, or bool for a ``constant bool``)."""
        pointers = (ctypes.c_void_p * len(buffers))(*(b.ctypes.data for b in buffers))
        constants = constants or {}
        indices = (ctypes.c_int * len(constants))(*constants.keys())
        values = (ctypes.c_int * len(constants))(*(int(v) for v in constants.values()))
        is_bool = (ctypes.c_int * len(constants))(*(isinstance(v, bool) for v in constants.values()))
        error = ctypes.create_string_buffer(4096)
        if self._lib.mbd_emu_dispatch(kernel.encode(), pointers, len(buffers), (ctypes.c_uint * 3)(*grid),
                                      (ctypes.c_uint * 3)(*group), BACKENDS[backend], indices, values, is_bool,
                                      len(constants), error, 4096):
            raise HarnessError(error.value.decode())

    @staticmethod
    def _shape(b, h_q, h_kv, rows, t, d, window, dtype, max_threads, has_kv_starts, has_sinks, reduce_threads=None,
               dv=None, packed=False):
        """``max_threads``, ``reduce_threads`` (None: max_threads): the main and reduce pipelines' limits;
        ``dv``: the values' head dim (None: D); ``packed``: query_starts, ``rows`` being N."""
        reduce_threads = max_threads if reduce_threads is None else reduce_threads
        return (ctypes.c_int * SHAPE_INTS)(b, h_q, h_kv, rows, t, d, window, DTYPES[dtype], max_threads,
                                           reduce_threads, int(has_kv_starts), int(has_sinks), dv or d, int(packed))

    def plan(self, b: int, h_q: int, h_kv: int, t: int, d: int, dtype: str, max_threads: int = 1024, *,
             rows: int = 1, window: int | None = None, effective: int | None = None,
             reduce_threads: int | None = None, dv: int | None = None, packed: bool = False) -> dict:
        """The shared launch plan (csrc/metal/launch_plan.h) as a dict, for ``rows`` = L query
        rows (``packed``: N rows in all, with query_starts) and ``window`` (None: none);
        ``effective`` passes the plan a window as is; ``max_threads`` and ``reduce_threads``
        (None: the same) play the main and reduce pipelines' maxTotalThreadsPerThreadgroup;
        ``dv``: the values' head dim (None: D)."""
        out, error = Plan(), ctypes.create_string_buffer(1024)
        window = effective_window(window, t) if effective is None else effective
        if self._lib.mbd_emu_plan(self._shape(b, h_q, h_kv, rows, t, d, window, dtype, max_threads, False, False,
                                              reduce_threads, dv, packed), out, error, 1024):
            raise HarnessError(error.value.decode())
        plan = {name: getattr(out, name) for name, _ in Plan._fields_}
        for name in ("kernel", "reduce_kernel"):
            plan[name] = plan[name].decode()
        for name in ("grid", "group", "reduce_grid", "reduce_group"):
            plan[name] = tuple(plan[name])
        return plan

    def attention(self, queries: np.ndarray, keys: np.ndarray, values: np.ndarray, valid_lens: np.ndarray,
                  dtype: str, scale: float, *, kv_starts: np.ndarray | None = None, window: int | None = None,
                  sinks: np.ndarray | None = None, max_threads: int = 1024, backend: str = "fibers",
                  nan_margins: bool = True, unreadable: np.ndarray | None = None, shift: int = 0,
                  ring_offset: np.ndarray | None = None, reduce_threads: int | None = None,
                  softcap: float | None = None, query_starts: np.ndarray | None = None) -> np.ndarray:
        """Runs the emulated kernels; returns the [B, H_q, L, Dv] output ([N, H_q, Dv] packed) in
        the storage dtype.

        ``kv_starts``, ``window`` (an int >= 1) and ``sinks``: the op's options,
        None when absent; ``max_threads`` and ``reduce_threads`` (None: the same) play the
        main and reduce pipelines' maxTotalThreadsPerThreadgroup; ``backend`` is "fibers" (deterministic)
        or "threads"; ``nan_margins``, see ``_device_copy``; ``unreadable``, bool
        [B, T]: K/V positions (all heads) that AddressSanitizer reports any read
        of (an AddressSanitizer build only); ``shift``: the first elements of Q, K
        and V sit this many elements past a 16-byte boundary (1: too few for
        any vector load); ``ring_offset``: int32 [B] (any stride) or None, the dense ring
        (logical position j of request b in slot (j + ring_offset[b]) mod T), given to the
        kernel as is, without the op's modulo; ``softcap``: None, or c > 0: each score s
        becomes c * tanh(s / c); ``query_starts``: None, or int32 [B + 1] (any stride) of packed
        queries [N, H_q, D], given to the kernel as is.
        """
        (b, h_q, rows, d), q_strides = _query_view(queries, query_starts)
        h_kv, t, dv = keys.shape[1], keys.shape[2], values.shape[3]
        if window is not None and window < 1:
            raise ValueError("window must be >= 1, or None for no window")
        for name, array in (("queries", queries), ("keys", keys), ("values", values)):
            if array.dtype != STORAGE[dtype] or (array.size and array.strides[-1] != array.itemsize):
                raise ValueError(f"{name}: expected {STORAGE[dtype].__name__} with a contiguous last axis")
        itemsize = queries.itemsize
        strides = [*q_strides, *keys.strides[:3], *values.strides[:3]]
        if any(s % itemsize for s in strides):
            raise ValueError("strides must be whole elements")
        for name, array, kind in (("valid_lens", valid_lens, np.int32), ("kv_starts", kv_starts, np.int32),
                                  ("sinks", sinks, np.float32), ("ring_offset", ring_offset, np.int32)):
            if array is not None and (array.dtype != kind or array.strides[0] % 4):
                raise ValueError(f"{name} must be {kind.__name__} with a stride of whole elements")
        # The buffers stay alive in ``copies`` while the kernels read them at ``addresses``.
        copies = [None if a is None else _device_copy(a, nan_margins, shift * itemsize if i < 3 else 0)
                  for i, a in enumerate((queries, keys, values, valid_lens, kv_starts, sinks))]
        addresses = [None if c is None else c[1] for c in copies]
        spans = (ctypes.c_ulonglong * 6)(*(0 if c is None else c[2] for c in copies))
        option_strides = [0 if a is None else a.strides[0] // 4 for a in (kv_starts, sinks)]
        ring = None if ring_offset is None else _device_copy(ring_offset, nan_margins)
        starts_copy, starts_args = _query_starts_args(query_starts, nan_margins)
        buffer, out = _output((rows, h_q, dv) if query_starts is not None else (b, h_q, rows, dv), dtype)
        error = ctypes.create_string_buffer(4096)
        if unreadable is not None:
            self._poison(copies[1:3], [keys, values], unreadable)
        status = self._lib.mbd_emu_attention(
            self._shape(b, h_q, h_kv, rows, t, d, effective_window(window, t), dtype, max_threads,
                        kv_starts is not None, sinks is not None, reduce_threads, dv, query_starts is not None),
            (ctypes.c_longlong * 12)(*(s // itemsize for s in strides), valid_lens.strides[0] // 4, *option_strides),
            *addresses, spans, out.ctypes.data, scale, softcap or 0.0, BACKENDS[backend], error, 4096, None,
            None if ring is None else ring[1], 0 if ring is None else ring_offset.strides[0] // 4,
            0 if ring is None else ring[2], *starts_args)
        if unreadable is not None:
            for copy, _, _ in copies[1:3]:
                self._lib.mbd_emu_poison(copy.ctypes.data, copy.nbytes, 0)
        if status:
            raise HarnessError(error.value.decode())
        _check_output(buffer, out)
        return out

    def paged_attention(self, queries: np.ndarray, key_pages: np.ndarray, value_pages: np.ndarray,
                        block_tables: np.ndarray, valid_lens: np.ndarray, dtype: str, scale: float, *,
                        window: int | None = None, sinks: np.ndarray | None = None, max_threads: int = 1024,
                        nan_margins: bool = True, softcap: float | None = None,
                        query_starts: np.ndarray | None = None) -> np.ndarray:
        """Runs the emulated kernels on paged caches, as eval_gpu of PagedDecodeAttention binds
        them: pools [NB, BS, H_kv, D] and [NB, BS, H_kv, Dv] (any strides, last axis contiguous),
        block_tables int32 [B, MB] in the place of kv_starts; returns [B, H_q, L, Dv] (packed
        queries, see ``attention``: [N, H_q, Dv]) in the storage dtype."""
        (b, h_q, rows, d), q_strides = _query_view(queries, query_starts)
        dv = value_pages.shape[3]
        nb, bs, h_kv = key_pages.shape[:3]
        t = block_tables.shape[1] * bs
        for name, array in (("queries", queries), ("key_pages", key_pages), ("value_pages", value_pages)):
            if array.dtype != STORAGE[dtype] or array.strides[-1] != array.itemsize:
                raise ValueError(f"{name}: expected {STORAGE[dtype].__name__} with a contiguous last axis")
        if block_tables.dtype != np.int32 or valid_lens.dtype != np.int32:
            raise ValueError("block_tables and valid_lens must be int32")
        itemsize = queries.itemsize
        strides = [*q_strides, key_pages.strides[0], key_pages.strides[2], key_pages.strides[1],
                   value_pages.strides[0], value_pages.strides[2], value_pages.strides[1]]
        copies = [None if a is None else _device_copy(a, nan_margins)
                  for a in (queries, key_pages, value_pages, valid_lens, block_tables, sinks)]
        addresses = [None if c is None else c[1] for c in copies]
        spans = (ctypes.c_ulonglong * 6)(*(0 if c is None else c[2] for c in copies))
        starts_copy, starts_args = _query_starts_args(query_starts, nan_margins)
        buffer, out = _output((rows, h_q, dv) if query_starts is not None else (b, h_q, rows, dv), dtype)
        error = ctypes.create_string_buffer(4096)
        paged = (ctypes.c_longlong * 4)(bs, nb, block_tables.strides[0] // 4, block_tables.strides[1] // 4)
        status = self._lib.mbd_emu_attention(
            self._shape(b, h_q, h_kv, rows, t, d, effective_window(window, t), dtype, max_threads, False,
                        sinks is not None, None, dv, query_starts is not None),
            (ctypes.c_longlong * 12)(*(s // itemsize for s in strides), valid_lens.strides[0] // 4, 0,
                                     0 if sinks is None else sinks.strides[0] // 4),
            *addresses, spans, out.ctypes.data, scale, softcap or 0.0, BACKENDS["fibers"], error, 4096, paged, None,
            0, 0, *starts_args)
        if status:
            raise HarnessError(error.value.decode())
        _check_output(buffer, out)
        return out

    def quantized_attention(self, queries: np.ndarray, keys: tuple, values: tuple, valid_lens: np.ndarray,
                            dtype: str, scale: float, bits: int, group_size: int, scales_dtype: str, *,
                            kv_starts: np.ndarray | None = None, window: int | None = None,
                            sinks: np.ndarray | None = None, max_threads: int = 1024,
                            backend: str = "fibers", softcap: float | None = None,
                            query_starts: np.ndarray | None = None) -> np.ndarray:
        """Runs the emulated quantized kernel and its reduce; returns [B, H_q, L, Dv] (packed queries,
        see ``attention``: [N, H_q, Dv]) in the storage dtype.

        ``keys``: (packed uint32 [B, H_kv, T, D * bits / 32], scales, biases [B, H_kv, T,
        D / group_size] in the storage of ``scales_dtype``), any strides but the words' last axis;
        ``values`` the same of head dim Dv; the rest as ``attention`` (NaN margins around every buffer).
        """
        (b, h_q, rows, d), q_strides = _query_view(queries, query_starts)
        h_kv, t = keys[0].shape[1], keys[0].shape[2]
        dv = values[0].shape[-1] * 32 // bits
        for name, triple in (("keys", keys), ("values", values)):
            if triple[0].dtype != np.uint32 or (triple[0].size and triple[0].strides[-1] != 4):
                raise ValueError(f"{name}: packed words must be uint32 with a contiguous last axis")
            if any(a.dtype != STORAGE[scales_dtype] for a in triple[1:]):
                raise ValueError(f"{name}: scales and biases must be stored as {scales_dtype}")
        itemsize = queries.itemsize
        strides = [*(s // itemsize for s in q_strides), *(s // 4 for s in keys[0].strides[:3]),
                   *(s // 4 for s in values[0].strides[:3])]
        arrays = (queries, keys[0], values[0], valid_lens, kv_starts, sinks, keys[1], keys[2], values[1], values[2])
        copies = [None if a is None else _device_copy(a, True) for a in arrays]
        addresses = [None if c is None else c[1] for c in copies]
        spans = (ctypes.c_ulonglong * 10)(*(0 if c is None else c[2] for c in copies))
        option_strides = [0 if a is None else a.strides[0] // 4 for a in (kv_starts, sinks)]
        scale_itemsize = keys[1].itemsize
        quantized_strides = [s // scale_itemsize for a in arrays[6:] for s in a.strides]
        starts_copy, starts_args = _query_starts_args(query_starts, True)
        buffer, out = _output((rows, h_q, dv) if query_starts is not None else (b, h_q, rows, dv), dtype)
        error = ctypes.create_string_buffer(4096)
        status = self._lib.mbd_emu_quantized_attention(
            self._shape(b, h_q, h_kv, rows, t, d, effective_window(window, t), dtype, max_threads,
                        kv_starts is not None, sinks is not None, None, dv, query_starts is not None),
            (ctypes.c_longlong * 12)(*strides, valid_lens.strides[0] // 4, *option_strides),
            (ctypes.c_longlong * 16)(*quantized_strides), (ctypes.c_int * 3)(bits, group_size, DTYPES[scales_dtype]),
            *addresses[:6], (ctypes.c_void_p * 4)(*addresses[6:]), spans, out.ctypes.data, scale, softcap or 0.0,
            BACKENDS[backend], error, 4096, *starts_args)
        if status:
            raise HarnessError(error.value.decode())
        _check_output(buffer, out)
        return out

    def _poison(self, copies, views, unreadable: np.ndarray) -> None:
        """Poisons the rows of positions ``unreadable`` [B, T] in the device copies of K/V views."""
        for (_, address, _), view in zip(copies, views):
            row = view.shape[3] * view.itemsize
            for b, t in zip(*np.nonzero(unreadable)):
                for h in range(view.shape[1]):
                    start = address + int(b * view.strides[0] + h * view.strides[1] + t * view.strides[2])
                    if self._lib.mbd_emu_poison(start, row, 1):
                        raise HarnessError("unreadable positions need an AddressSanitizer build")

    def ragged_attention(self, queries: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                         valid_lens: np.ndarray, dtype: str, scale: float, *, kv_starts: np.ndarray | None = None,
                         window: int | None = None, sinks: np.ndarray | None = None, max_threads: int = 1024,
                         backend: str = "fibers", nan_margins: bool = True,
                         unreadable: list[np.ndarray] | None = None, softcap: float | None = None,
                         query_starts: np.ndarray | None = None) -> np.ndarray:
        """Runs the emulated ragged kernel and its reduce, bound as eval_gpu of RaggedDecodeAttention
        binds them; returns [B, H_q, L, Dv] (packed queries, see ``attention``: [N, H_q, Dv]) in
        the storage dtype.

        ``keys[b]``, ``values[b]``: request b's [1, H_kv, T_b, D] and [1, H_kv, T_b, Dv] (or 3-d) views
        (any strides, last axis contiguous); views of one numpy buffer share one device copy
        and one slot, as arrays of one MLX buffer do (``ragged_buffers``). ``unreadable[b]``,
        bool [T_b]: positions of request b (all heads, keys and values) that AddressSanitizer
        reports any read of. The rest as ``attention``.
        """
        (b, h_q, rows, d), q_strides = _query_view(queries, query_starts)
        dv = values[0].shape[-1]
        if window is not None and window < 1:
            raise ValueError("window must be >= 1, or None for no window")
        if queries.dtype != STORAGE[dtype] or queries.strides[-1] != queries.itemsize:
            raise ValueError(f"queries: expected {STORAGE[dtype].__name__} with a contiguous last axis")
        bound = ragged_buffers.bind([*keys, *values], STORAGE[dtype], nan_margins, _device_copy)
        h_kv, t = bound.heads, max(bound.lengths[:b], default=0)
        itemsize = queries.itemsize
        copies = [None if a is None else _device_copy(a, nan_margins) for a in (queries, valid_lens, kv_starts, sinks)]
        addresses = [None if c is None else c[1] for c in copies]
        spans = (ctypes.c_ulonglong * 4)(*(0 if c is None else c[2] for c in copies))
        option_strides = [0 if a is None else a.strides[0] // 4 for a in (kv_starts, sinks)]
        starts_copy, starts_args = _query_starts_args(query_starts, nan_margins)
        buffer, out = _output((rows, h_q, dv) if query_starts is not None else (b, h_q, rows, dv), dtype)
        error = ctypes.create_string_buffer(4096)
        rows_bytes = [d * itemsize] * b + [dv * itemsize] * b
        if unreadable is not None:
            self._poison_ragged(bound, [*unreadable, *unreadable], rows_bytes, 1)
        status = self._lib.mbd_emu_ragged_attention(
            self._shape(b, h_q, h_kv, rows, t, d, effective_window(window, t), dtype, max_threads,
                        kv_starts is not None, sinks is not None, None, dv, query_starts is not None),
            (ctypes.c_longlong * 12)(*(s // itemsize for s in q_strides), *[0] * 6,
                                     valid_lens.strides[0] // 4, *option_strides),
            *addresses, spans, bound.arrays, bound.buffers, bound.buffer_bytes, bound.strides,
            (ctypes.c_int * b)(*bound.lengths[:b]), out.ctypes.data, scale, softcap or 0.0, BACKENDS[backend], error,
            4096, *starts_args)
        if unreadable is not None:
            self._poison_ragged(bound, [*unreadable, *unreadable], rows_bytes, 0)
        if status:
            raise HarnessError(error.value.decode())
        _check_output(buffer, out)
        return out

    def _poison_ragged(self, bound, unreadable: list[np.ndarray], rows: list[int], poison: int) -> None:
        """(Un)poisons the rows (``rows[i]`` bytes) of positions ``unreadable[i]`` [T_b] of array i in its
        device copy."""
        for i, (positions, row) in enumerate(zip(unreadable, rows)):
            head, seq = bound.strides[2 * i] * bound.itemsize, bound.strides[2 * i + 1] * bound.itemsize
            for t in np.nonzero(positions)[0]:
                for h in range(bound.heads):
                    if self._lib.mbd_emu_poison(bound.arrays[i] + h * head + int(t) * seq, row, poison):
                        raise HarnessError("unreadable positions need an AddressSanitizer build")

    def ragged_layout(self, buffers: list[int], offsets: list[int], strides: list[tuple[int, int]],
                      lengths: list[int], h_kv: int, itemsize: int, slots: int = RAGGED_SLOTS):
        """``make_ragged_layout`` of csrc/metal/ragged_launch_plan.h for B requests: array i (keys,
        then values; 2B) lies ``offsets[i]`` bytes into buffer ``buffers[i]`` (any distinct
        integers name distinct buffers), with (head, position) strides ``strides[i]``. Returns
        the table (B RaggedRequest as dicts) and the groups as (first, count, slots)."""
        n = len(lengths)
        table = (RaggedRequest * max(n, 1))()
        groups = (ctypes.c_int * ((2 + RAGGED_SLOTS) * max(n, 1)))()
        error = ctypes.create_string_buffer(1024)
        arrays = (ctypes.c_void_p * (2 * n))(*(b + o for b, o in zip(buffers, offsets)))
        array_strides = (ctypes.c_longlong * (4 * n))(*(s for pair in strides for s in pair))
        count = self._lib.mbd_emu_ragged_layout(n, arrays, (ctypes.c_void_p * (2 * n))(*buffers), array_strides,
                                                (ctypes.c_int * n)(*lengths), h_kv, itemsize, slots, table, groups,
                                                error, 1024)
        if count < 0:
            raise HarnessError(error.value.decode())
        width = 2 + RAGGED_SLOTS
        rows = [groups[g * width:(g + 1) * width] for g in range(count)]
        return ([{name: getattr(r, name) for name, _ in RaggedRequest._fields_} for r in table[:n]],
                [(row[0], row[1], [s for s in row[2:] if s >= 0]) for row in rows])

    def dispatches(self) -> int:
        """Dispatches of the main pass in the last emulated call (the groups of a ragged call)."""
        launch = Launch()
        self._lib.mbd_emu_last_launch(ctypes.byref(launch))
        return launch.dispatches

    def vector_loads(self) -> bool:
        """Whether the last ``attention`` call loaded whole vectors (the launch plan's
        ``vector_loads``: every Q, K and V row on the vector width) or scalars."""
        launch = Launch()
        self._lib.mbd_emu_last_launch(ctypes.byref(launch))
        return bool(launch.vector_loads)

    def loads(self) -> dict[str, dict[str, int]]:
        """Bytes the last ``attention`` call loaded from each buffer, per pass:
        ``{"main": {"keys": n, ...}, "reduce": {...}}`` (a "loads" build only)."""
        if not self.counts_loads:
            raise HarnessError('load counts need build_library(..., sanitize="loads")')
        launch = Launch()
        self._lib.mbd_emu_last_launch(ctypes.byref(launch))
        return {name: dict(zip(BUFFERS, counts)) for name, counts in zip(("main", "reduce"), launch.loaded)}

    def library_name(self, source_hash: str, dtype: str, d: int, ragged: bool = False, dv: int | None = None,
                     bits: int = 0) -> str:
        """``library_name`` (``ragged_library_name``; bits 4 or 8: ``quantized_library_name``) of
        csrc/metal/kernel_library.h: the run-time library of (dtype, D, Dv; None: D)."""
        out = ctypes.create_string_buffer(128)
        self._lib.mbd_emu_library_name(source_hash.encode(), DTYPES[dtype], d, dv or 0, int(ragged), bits, out)
        return out.value.decode()

    def library_source(self, source: str, dtype: str, d: int, ragged: bool = False, dv: int | None = None,
                       bits: int = 0) -> str:
        """``library_source`` (``ragged_library_source``; bits: ``quantized_library_source``) of
        csrc/metal/kernel_library.h: what eval_gpu compiles for (dtype, D, Dv; None: D)."""
        args = (source.encode(), DTYPES[dtype], d, dv or 0, int(ragged), bits)
        size = self._lib.mbd_emu_library_source(*args, None, 0)
        out = ctypes.create_string_buffer(size + 1)
        self._lib.mbd_emu_library_source(*args, out, size + 1)
        return out.value.decode()

    def metal_backend(self, metal_present: bool, metallib_on_disk: bool) -> str | None:
        """``choose_metal_backend`` of csrc/metal/backend_choice.h, by name."""
        name = self._lib.mbd_emu_metal_backend(int(metal_present), int(metallib_on_disk))
        return None if name is None else name.decode()
