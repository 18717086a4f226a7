"""``SeedAttention``: the seed design of DESIGN.md section 1, kept as the baseline.

Per-request ``ContiguousKVCache``, right padding to ``max_len``, concatenation into one batch,
an additive mask rebuilt per layer, ``mx.fast.scaled_dot_product_attention``. A packed step
(each request feeds its own number of tokens) is padded the same way:
the requests that feed tokens, each one's query rows padded to the most any of them feeds.

Shapes use the dimension legend of the package docstring (``mlx_batched_decode.attention``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import mlx.core as mx

from ..caches.context import BatchedDecodeContext
from ..caches.kv_cache import ContiguousKVCache
from .base import AttendOptions, DecodeAttention


class _PaddedStep(NamedTuple):
    """How the seed pads a packed step of N tokens into ``[B', H, width, D]`` queries.

    requests: the B' requests that feed tokens (their rows of the padded batch, in order).
    width: the most tokens one of them feeds. max_len: the most positions one of them holds.
    gather: int32 ``[B' * width]``, the packed row each padded query row takes (a padding row
        repeats its request's last one). unpad: int32 ``[N]``, the padded row of each packed row.
    query_positions: int32 ``[B', width, 1]``, each padded query row's position.
    """

    requests: list[int]
    width: int
    max_len: int
    gather: mx.array
    unpad: mx.array
    query_positions: mx.array


def _padded_step(context) -> _PaddedStep:
    """The seed's padding of ``context`` (a packed one), from its host ints."""
    requests = [b for b, count in enumerate(context.query_lens) if count]
    width = max(context.query_lens)
    starts = [0]
    for count in context.query_lens:
        starts.append(starts[-1] + count)
    gather, unpad, positions = [], [], []
    for i, b in enumerate(requests):
        count, seq_len = context.query_lens[b], context.seq_lens[b]
        gather += [starts[b] + min(j, count - 1) for j in range(width)]
        unpad += range(i * width, i * width + count)
        positions.append([seq_len + min(j, count - 1) for j in range(width)])
    return _PaddedStep(
        requests,
        width,
        max(context.seq_lens[b] + context.query_lens[b] for b in requests),
        mx.array(gather, dtype=mx.int32),
        mx.array(unpad, dtype=mx.int32),
        mx.array(positions, dtype=mx.int32)[:, :, None],
    )


class SeedAttention(DecodeAttention):
    """The seed baseline: ``context.layer_caches[layer]`` holds B ``ContiguousKVCache``."""

    def update(
        self, context: BatchedDecodeContext, layer: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write each request's new tokens into its own cache at its ``seq_lens[b]`` (forgetting
        any rejected draft tokens there), pad right, concatenate: ``[B, H_kv, max_len, D]``
        from ``[B, H_kv, L, D]``; with a packed context ``[B', H_kv, max_len, D]`` (the
        requests that feed tokens) from the packed ``[N, H_kv, 1, D]``."""
        caches = context.layer_caches[layer]
        if (
            not isinstance(caches, (list, tuple))
            or len(caches) != context.batch_size
            or not all(isinstance(c, ContiguousKVCache) for c in caches)
        ):
            raise TypeError(
                f"[SeedAttention] layer {layer} needs {context.batch_size} ContiguousKVCache"
            )
        if not context.packed:
            rows = [(b, keys[b : b + 1], values[b : b + 1]) for b in range(context.batch_size)]
            pads = context.pad_sizes
        else:
            rows, start = [], 0
            for b, count in enumerate(context.query_lens):
                # [count, H_kv, 1, D] -> the request's [1, H_kv, count, D].
                piece = slice(start, start + count)
                if count:
                    rows.append((b, keys[piece].swapaxes(0, 2), values[piece].swapaxes(0, 2)))
                start += count
            ends = [context.seq_lens[b] + k.shape[2] for b, k, _ in rows]
            pads = [max(ends) - end for end in ends]
        padded_keys, padded_values = [], []
        for (b, new_keys, new_values), pad in zip(rows, pads):
            caches[b].rewind(context.seq_lens[b])
            k, v = caches[b].update_and_fetch(new_keys, new_values)
            if pad:
                widths = [(0, 0), (0, 0), (0, pad), (0, 0)]
                k, v = mx.pad(k, widths), mx.pad(v, widths)
            padded_keys.append(k)
            padded_values.append(v)
        return mx.concatenate(padded_keys, axis=0), mx.concatenate(padded_values, axis=0)

    def attend(self, context, queries, keys, values, *, new_keys_values=None, **options):
        """As ``DecodeAttention.attend``; a packed context's ``[N, H_q, 1, D]`` queries are
        padded per request (``_padded_step``), attended with a mask and unpadded."""
        if not context.packed:
            return super().attend(context, queries, keys, values, **options)
        step = _padded_step(context)
        n, heads, _, dim = queries.shape
        padded = queries[step.gather, :, 0].reshape(len(step.requests), step.width, heads, dim)
        mask = None
        if (
            len(step.requests) < context.batch_size
            or step.width > 1
            or len(set(context.seq_lens)) > 1
            or (options.get("window") is not None and step.max_len > options["window"])
        ):
            keys_at = mx.arange(step.max_len, dtype=mx.int32)
            mask = _mask(step.query_positions, keys_at, options.get("window"))
        out = _sdpa(padded.swapaxes(1, 2), keys, values, mask, AttendOptions(**options))
        out = out.swapaxes(1, 2).reshape(len(step.requests) * step.width, heads, -1)
        return out[step.unpad][:, :, None]

    def _attend(self, context, queries, keys, values, options: AttendOptions) -> mx.array:
        """``queries [B, H_q, L, D]`` over the padded batch, each row masked to its own keys."""
        mask = None
        if (
            context.needs_padding
            or context.query_len > 1
            or (options.window is not None and context.max_len > options.window)
        ):
            mask = _mask(context.new_positions[:, :, None], context.positions, options.window)
        return _sdpa(queries, keys, values, mask, options)


def _mask(query_positions: mx.array, keys: mx.array, window: Optional[int]) -> mx.array:
    """The additive ``[B, 1, L, T]`` float32 mask the seed rebuilds in every layer: the key at
    position ``t`` (``keys``, int32 ``[T]``) is visible to the query row at position ``p``
    (``query_positions``, int32 ``[B, L, 1]``) when ``p - window < t <= p``."""
    visible = keys <= query_positions
    if window is not None:
        visible = visible & (keys > query_positions - window)
    return mx.where(visible, 0.0, -mx.inf)[:, None]


def _sdpa(queries, keys, values, mask: Optional[mx.array], options: AttendOptions) -> mx.array:
    """MLX's fused attention of ``queries [B, H_q, L, D]`` with the seed's mask, if any; with a
    ``softcap``, which the fused attention lacks, the same attention in plain MLX ops."""
    scale = 1.0 / math.sqrt(queries.shape[-1]) if options.scale is None else options.scale
    if mask is not None:
        mask = mask.astype(queries.dtype)
    if options.softcap is not None:
        return _softcapped(queries, keys, values, mask, scale, options)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=options.sinks
    )


def _softcapped(queries, keys, values, mask, scale: float, options: AttendOptions) -> mx.array:
    """Attention with scores ``softcap * tanh(scale * q . k / softcap)``, as Gemma 2 computes it:
    the H_q / H_kv query heads of a group attend their KV head (``[B, H_kv, G, L, D]``), the
    ``[B, 1, L, T]`` mask joins as ``[B, 1, 1, L, T]``. No sinks: no model caps and sinks."""
    if options.sinks is not None:
        raise ValueError("[SeedAttention] softcap with sinks is not supported")
    batch, heads, rows, dim = queries.shape
    kv_heads = keys.shape[1]
    grouped = (queries * scale).reshape(batch, kv_heads, heads // kv_heads, rows, dim)
    scores = grouped @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    scores = mx.tanh(scores / options.softcap) * options.softcap
    if mask is not None:
        scores = scores + mx.expand_dims(mask, 2)
    out = mx.softmax(scores, axis=-1, precise=True) @ mx.expand_dims(values, 2)
    return out.reshape(batch, heads, rows, -1)
