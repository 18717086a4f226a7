"""Each op's inputs for a case, laid out from one float32 truth that the reference attends.

A case's keys and values are drawn once in its dtype; the positions no query row reads hold
NaN, so a kernel that reads one fails its case. The dense op reads a view of a larger cache
(a ring, for ring cases, rotated per request), the paged op a shuffled pool through block
tables, the quantized op views of ``mx.quantize`` triples (the truth is their
``mx.dequantize``), the ragged op one buffer per request. The truth is the dense, logical,
float32 form of what the op reads; every op is compared with ``reference_attention`` on it.

Dimension legend: B requests, H_q query heads, H_kv key/value heads, L query rows per
request, T padded length, D head dim, BS rows per block, MB table entries per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ... import ops
from .cases import Case, row_counts


@dataclass
class Truth:
    """What the reference attends: float32 queries [B, H_q, L, D] (packed rows: [N, H_q, D]), keys
    [B, H_kv, T, D] and values [B, H_kv, T, Dv], int32 lengths [B], and the keyword options of the call."""

    queries: mx.array
    keys: mx.array
    values: mx.array
    lens: mx.array
    options: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """A case ready to run: ``run()`` builds the op's output, ``truth`` what it must equal."""

    run: Callable[[], mx.array]
    truth: Truth


def _read_mask(lens: list[int], starts: list[int], rows: list[int], window: int | None, t: int) -> mx.array:
    """bool [B, 1, T, 1]: the positions some query row of each request attends (rows: each one's)."""
    lo = [max(s, n - r - window + 1 if window else 0, 0) if r else n for n, s, r in zip(lens, starts, rows)]
    pos = mx.arange(t)[None, :]
    mask = (pos >= mx.array(lo)[:, None]) & (pos < mx.array(lens)[:, None])
    return mask[:, None, :, None]


def _draw(case: Case, t: int):
    """(queries, keys, values, sinks, options, read mask) of a case: queries [B, H_q, L, D] (packed
    rows: [N, H_q, D]), keys [B, H_kv, T, D] and values [B, H_kv, T, Dv] in the case's dtype and
    unmasked; ``options`` holds kv_starts, window, sinks, softcap and query_starts as set."""
    b, v = len(case.lens), case.variant
    h_q, d = case.kv_heads * case.group, case.head_dim
    dv = case.value_dim
    kq, kk, kv, ks = mx.random.split(mx.random.key(case.seed), 4)
    rows = row_counts(v, b)
    q_shape = (sum(rows), h_q, d) if v.packed else (b, h_q, v.rows, d)
    queries = mx.random.normal(q_shape, key=kq).astype(case.dtype)
    keys = mx.random.normal((b, case.kv_heads, t, d), key=kk).astype(case.dtype)
    values = mx.random.normal((b, case.kv_heads, t, dv), key=kv).astype(case.dtype)
    starts = [(i * 7) % (n + 1) if v.starts else 0 for i, n in enumerate(case.lens)]
    options = {}
    if v.starts:
        options["kv_starts"] = mx.array(starts, dtype=mx.int32)
    if v.window:
        options["window"] = v.window
    if v.sinks:
        options["sinks"] = mx.random.normal((h_q,), key=ks)
    if v.softcap:
        options["softcap"] = v.softcap
    if v.packed:
        options["query_starts"] = mx.array([0, *itertools.accumulate(rows)], dtype=mx.int32)
    mask = _read_mask(list(case.lens), starts, rows, v.window, t)
    return queries, keys, values, options, mask


def _truth(queries, keys, values, lens, options) -> Truth:
    f32 = mx.float32
    truth = Truth(queries.astype(f32), keys.astype(f32), values.astype(f32), lens, dict(options))
    mx.eval(truth.queries, truth.keys, truth.values)
    return truth


def _unread_to_nan(x: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask, x, mx.array(float("nan"), x.dtype))


def dense(case: Case) -> Prepared:
    """A view ``cache[:, :, :T]`` of a larger cache; for a ring, each request's T slots rotated
    by its offset, and the truth the logical (unrotated) keys."""
    t = max(case.lens) + 5
    queries, keys, values, options, mask = _draw(case, t)
    keys, values = _unread_to_nan(keys, mask), _unread_to_nan(values, mask)
    lens = mx.array(case.lens, dtype=mx.int32)
    truth = _truth(queries, keys, values, lens, options)
    call_options = dict(options)
    if case.variant.ring:
        offsets = [(i * 13 + t // 2) % t for i in range(len(case.lens))]
        keys, values = (
            mx.stack([mx.roll(x[i], shift, axis=1) for i, shift in enumerate(offsets)])
            for x in (keys, values)
        )
        call_options["ring_offset"] = mx.array(offsets, dtype=mx.int32)
    def padded(x):
        return mx.concatenate([x, mx.full((*x.shape[:2], 11, x.shape[3]), float("nan"), case.dtype)], axis=2)

    k_cache, v_cache = padded(keys), padded(values)
    mx.eval(queries, k_cache, v_cache)
    return Prepared(
        lambda: ops.batched_decode_attention(
            queries, k_cache[:, :, :t], v_cache[:, :, :t], lens, **call_options
        ),
        truth,
    )


def paged(case: Case) -> Prepared:
    """A pool [NB, BS, H_kv, D] holding every request's blocks in shuffled order and three
    NaN blocks no table names; table entries past a request's blocks are -1."""
    bs, b = case.block_size, len(case.lens)
    mb = -(-max(case.lens) // bs) + 1
    t = mb * bs
    queries, keys, values, options, mask = _draw(case, t)
    keys, values = _unread_to_nan(keys, mask), _unread_to_nan(values, mask)
    lens = mx.array(case.lens, dtype=mx.int32)
    truth = _truth(queries, keys, values, lens, options)
    num_blocks = b * mb + 3
    perm = mx.random.permutation(num_blocks, key=mx.random.key(case.seed + 1))
    def pool(x):
        width = x.shape[3]
        blocks = x.transpose(0, 2, 1, 3).reshape(b * mb, bs, case.kv_heads, width)
        garbage = mx.full((3, bs, case.kv_heads, width), float("nan"), case.dtype)
        return mx.concatenate([blocks, garbage])[perm]

    key_pages, value_pages = pool(keys), pool(values)
    used = mx.arange(mb)[None, :] < ((lens + bs - 1) // bs)[:, None]
    tables = mx.where(used, mx.argsort(perm)[: b * mb].astype(mx.int32).reshape(b, mb), -1)
    mx.eval(queries, key_pages, value_pages, tables)
    return Prepared(
        lambda: ops.paged_decode_attention(queries, key_pages, value_pages, tables, lens, **options),
        truth,
    )


def quantized(case: Case) -> Prepared:
    """Views ``[:, :, :T]`` of the triples ``mx.quantize`` makes of a larger cache, NaN in the
    scales and biases of unread positions; the truth is their ``mx.dequantize`` in float32."""
    t = max(case.lens) + 5
    queries, keys, values, options, mask = _draw(case, t + 8)
    mask = mask[:, :, :t]
    lens = mx.array(case.lens, dtype=mx.int32)

    def triple(x):
        packed, scales, biases = mx.quantize(x, group_size=case.group_size, bits=case.bits)
        scales, biases = _unread_to_nan(scales[:, :, :t], mask), _unread_to_nan(biases[:, :, :t], mask)
        return packed[:, :, :t], scales, biases

    def dequantized(packed, scales, biases):
        f32 = mx.float32
        return mx.dequantize(packed, scales.astype(f32), biases.astype(f32), case.group_size, case.bits)

    k_triple, v_triple = triple(keys), triple(values)
    truth = _truth(queries, dequantized(*k_triple), dequantized(*v_triple), lens, options)
    mx.eval(queries, k_triple, v_triple)
    return Prepared(
        lambda: ops.quantized_batched_decode_attention(
            queries, k_triple, v_triple, lens, group_size=case.group_size, bits=case.bits, **options
        ),
        truth,
    )


def ragged(case: Case) -> Prepared:
    """One buffer per request, read through a view of its first T_b positions (T_b at or past
    the request's length); one request passes a 3-d array [H_kv, T_b, D]."""
    t = max(case.lens) + 8
    queries, keys, values, options, mask = _draw(case, t)
    keys, values = _unread_to_nan(keys, mask), _unread_to_nan(values, mask)
    lens = mx.array(case.lens, dtype=mx.int32)
    truth = _truth(queries, keys, values, lens, options)
    sizes = [n + i % 3 for i, n in enumerate(case.lens)]

    def buffers(x):
        own = [mx.contiguous(x[i : i + 1, :, : n + 5]) for i, n in enumerate(case.lens)]
        views = [buf[:, :, :size] for buf, size in zip(own, sizes)]
        return [view[0] if i == 1 else view for i, view in enumerate(views)]

    k_list, v_list = buffers(keys), buffers(values)
    mx.eval(queries, k_list, v_list)
    return Prepared(lambda: ops.ragged_decode_attention(queries, k_list, v_list, lens, **options), truth)


LAYOUTS = {"dense": dense, "paged": paged, "quantized": quantized, "ragged": ragged}


def prepare(case: Case) -> Prepared:
    """The case's inputs in its op's layout, evaluated, and its float32 truth."""
    return LAYOUTS[case.op](case)
