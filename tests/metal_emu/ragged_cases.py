"""Inputs of the emulated ragged-kernel tests: one buffer per request, in every layout.

Request b's keys and values are [1, H_kv, T_b, D] or [H_kv, T_b, D] views, laid out as
``LAYOUTS`` say; every position no query row of a request attends holds NaN (keys) or inf
(values), and so does every element of a buffer outside the views (capacity, row padding).

Dimensions: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows per
request (packed queries: q_b of request b), T_b request b's positions, D head dim of
queries and keys, Dv of values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .cases import attended
from .reference import packed_reference, reference_attention, request_rows, to_dtype, to_float64

# How a request's keys and values are held:
#   slice: cache[:, :, :T_b, :D] of a [1, H_kv, capacity, D + pad] cache each;
#   token_major: cache[:, :T_b, :, :D] of [1, capacity, H_kv, D + pad], transposed to [1, H_kv, T_b, D];
#   3d: cache[:, :T_b, :D] of [H_kv, capacity, D + pad];
#   shared: slot j of one [n, 2, H_kv, capacity, D + pad] buffer that every "shared" request's
#     keys (j, 0) and values (j, 1) are views of (3-d for odd j, 4-d for even j);
#   exact: arrays of their own, [1, H_kv, T_b, D] exactly (no capacity, no padding).
LAYOUTS = ("slice", "token_major", "3d", "shared", "exact")


@dataclass
class RaggedCase:
    """One call: per-request storage views, the op's options (None when absent)."""

    dtype: str
    queries: np.ndarray  # [B, H_q, L, D], or packed [N, H_q, D]
    keys: list[np.ndarray]  # B views
    values: list[np.ndarray]
    valid_lens: np.ndarray  # int32 [B]
    scale: float
    kv_starts: np.ndarray | None = None
    window: int | None = None
    sinks: np.ndarray | None = None
    softcap: float | None = None  # c > 0: each score s becomes c * tanh(s / c)
    query_starts: np.ndarray | None = None  # int32 [B + 1] of packed queries, given to the kernel raw

    def run(self, lib, **kwargs) -> np.ndarray:
        """The emulated kernels' output [B, H_q, L, Dv] ([N, H_q, Dv] packed); ``kwargs`` go to
        ``EmulatedLibrary.ragged_attention``."""
        return lib.ragged_attention(self.queries, self.keys, self.values, self.valid_lens, self.dtype, self.scale,
                                    kv_starts=self.kv_starts, window=self.window, sinks=self.sinks,
                                    softcap=self.softcap, query_starts=self.query_starts, **kwargs)

    def request_reference(self, b: int, queries: np.ndarray) -> np.ndarray:
        """float64 output of request b's query rows ``queries`` [1, H_q, L, D] (float64) over its own keys."""
        k, v = (a[0] if a.ndim == 4 else a for a in (self.keys[b], self.values[b]))
        return reference_attention(
            queries, to_float64(k, self.dtype)[None], to_float64(v, self.dtype)[None], self.valid_lens[b:b + 1],
            self.scale, None if self.kv_starts is None else self.kv_starts[b:b + 1], self.window,
            None if self.sinks is None else self.sinks.astype(np.float64), self.softcap)

    def reference(self) -> np.ndarray:
        """float64 output: each request over its own keys, its length clamped to [0, T_b]."""
        queries = to_float64(self.queries, self.dtype)
        if self.query_starts is not None:
            return packed_reference(self.request_reference, queries, self.query_starts, self.values[0].shape[-1])
        return np.concatenate([self.request_reference(b, queries[b:b + 1]) for b in range(len(self.keys))])

    def rows(self) -> list[int]:
        """The query rows of each request (request_rows)."""
        return request_rows(self.queries, self.query_starts, len(self.valid_lens))

    def unread(self) -> list[np.ndarray]:
        """bool [T_b] per request: the positions no query row attends."""
        lengths = [(k[0] if k.ndim == 4 else k).shape[1] for k in self.keys]
        return unread_positions(lengths, self.valid_lens, self.kv_starts, self.rows(), self.window)


def unread_positions(lengths, valid_lens, starts, rows, window: int | None) -> list[np.ndarray]:
    """bool [T_b] per request of ``lengths`` (T_b): the positions no query row attends; ``rows``:
    L, or the rows of each request."""
    per_request = [rows] * len(lengths) if np.isscalar(rows) else rows
    return [~attended(valid_lens[n:n + 1], None if starts is None else starts[n:n + 1], per_request[n], t, window)[0]
            for n, t in enumerate(lengths)]


def _request_views(layout: str, j: int, t: int, d: int, dv: int) -> tuple[Callable, Callable]:
    """Views of request j's keys (D columns) and values (Dv) in its buffers, by layout (see LAYOUTS)."""
    if layout == "slice":
        return (lambda x: x[:, :, :t, :d]), (lambda x: x[:, :, :t, :dv])
    if layout == "token_major":
        return (lambda x: x[:, :t, :, :d].transpose(0, 2, 1, 3)), (lambda x: x[:, :t, :, :dv].transpose(0, 2, 1, 3))
    if layout == "3d":
        return (lambda x: x[:, :t, :d]), (lambda x: x[:, :t, :dv])
    if layout == "shared":
        if j % 2:
            return lambda x: x[j, 0, :, :t, :d], lambda x: x[j, 1, :, :t, :dv]
        return lambda x: x[j:j + 1, 0, :, :t, :d], lambda x: x[j:j + 1, 1, :, :t, :dv]
    return (lambda x: x), (lambda x: x)


def make_ragged_case(rng: np.random.Generator, dtype: str, d: int, h_kv: int, g: int, lengths: list[int],
                     valid_lens: list[int] | None = None, *, layouts: tuple[str, ...] = ("slice",), rows: int = 1,
                     starts: list[int] | None = None, window: int | None = None, sinks: bool = False,
                     extra_capacity: int = 5, row_pad: int = 0, dv: int | None = None,
                     query_rows: list[int] | None = None) -> RaggedCase:
    """Request b has ``lengths[b]`` positions in layout ``layouts[b % len(layouts)]`` and
    length ``valid_lens[b]`` (default: its T_b, as the op's); buffers other than "exact" ones
    hold ``extra_capacity`` more positions and rows of max(D, Dv) + ``row_pad`` elements
    (values: Dv = ``dv`` or D columns of them). Queries are every other row of a larger
    buffer, packed [N, H_q, D] with ``query_rows`` (request b's q_b); sinks (when asked
    for) every other element of one."""
    b = len(lengths)
    dv = d if dv is None else dv
    lens = list(lengths) if valid_lens is None else list(valid_lens)
    width = max(d, dv) + row_pad
    kinds = [layouts[n % len(layouts)] for n in range(b)]
    shared = [n for n in range(b) if kinds[n] == "shared"]
    capacity = max([lengths[n] for n in shared], default=0) + extra_capacity
    buffers: list[np.ndarray] = []  # float64, NaN or inf wherever no view reads
    if shared:
        buffers.append(np.full((len(shared), 2, h_kv, capacity, width), np.nan))
    # Per request: (keys buffer, keys view, values buffer, values view).
    placed = []
    for n, (kind, t) in enumerate(zip(kinds, lengths)):
        k_view, v_view = _request_views(kind, shared.index(n) if kind == "shared" else 0, t, d, dv)
        if kind == "shared":
            placed.append((0, k_view, 0, v_view))
            continue
        shape = {"slice": (1, h_kv, t + extra_capacity, width), "token_major": (1, t + extra_capacity, h_kv, width),
                 "3d": (h_kv, t + extra_capacity, width), "exact": (1, h_kv, t, d)}[kind]
        value_shape = (1, h_kv, t, dv) if kind == "exact" else shape
        buffers += [np.full(shape, np.nan), np.full(value_shape, np.inf)]
        placed.append((len(buffers) - 2, k_view, len(buffers) - 1, v_view))
    per_request = rows if query_rows is None else list(query_rows)
    unread = unread_positions(lengths, lens, starts, per_request, window)
    for n, (kb, k_view, vb, v_view) in enumerate(placed):
        for buffer, view, poison in ((kb, k_view, np.nan), (vb, v_view, np.inf)):
            x = view(buffers[buffer])
            x = x[0] if x.ndim == 4 else x
            x[...] = rng.standard_normal(x.shape)
            x[:, unread[n]] = poison
    if query_rows is None:
        q_buffer = rng.standard_normal((b, h_kv * g, 2 * rows, width))
    else:
        q_buffer = rng.standard_normal((2 * sum(query_rows), h_kv * g, width))
    q_buffer[..., d:] = np.nan
    stored = [to_dtype(x, dtype) for x in buffers]
    case = RaggedCase(
        dtype=dtype,
        queries=to_dtype(q_buffer, dtype)[:, :, 1::2, :d] if query_rows is None else to_dtype(q_buffer, dtype)[1::2, :, :d],
        keys=[k_view(stored[kb]) for kb, k_view, _, _ in placed],
        values=[v_view(stored[vb]) for _, _, vb, v_view in placed],
        valid_lens=np.array(lens, dtype=np.int32),
        scale=float(d) ** -0.5,
        kv_starts=None if starts is None else np.array(starts, dtype=np.int32),
        window=window,
        query_starts=None if query_rows is None else np.cumsum([0, *query_rows], dtype=np.int32),
    )
    if sinks:
        case.sinks = (1.5 * rng.standard_normal(2 * h_kv * g)).astype(np.float32)[::2]
    return case
