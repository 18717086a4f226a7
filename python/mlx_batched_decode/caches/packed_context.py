"""The per-step context of a packed step: each request feeds its own number of tokens.

A step of ``BatchedDecoder`` carries decode tokens and prefill chunks together: request ``b``
feeds ``q_b`` tokens (1 decoding, a chunk of its prompt while prefilling, 0 to sit the step out)
at positions ``seq_lens[b] .. seq_lens[b] + q_b - 1``. The model sees the N tokens as N rows of
one token each (``[N, 1]``), so projections and MLPs run over all of them at once and RoPE takes
each token's own position; attention is one call of the op per layer with ``query_starts``.

Dimension legend: B = requests (cache slots 0..B-1), N = tokens in the step (the sum of the
q_b), H_q / H_kv = query / key-value heads, T = key/value positions, D = head dimension, R =
positions of a ring cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import mlx.core as mx

from .ring_step import RingStep, ring_step


@dataclass
class PackedDecodeContext:
    """Everything the layers of one packed step share, computed once in ``__post_init__`` from
    host ints (one host-to-device copy per array, no device read).

    Args:
        seq_lens: B host ints, tokens already in each request's cache (request ``b`` owns slot
            ``b`` of every batched cache).
        query_lens: B host ints >= 0, the tokens each request feeds this step, packed in
            request order.
        layer_caches: one entry per layer, as ``BatchedDecodeContext``'s.
        ring_sizes: the distinct ring sizes of the layers' ring caches.
        first_chunks: ``(b, count)`` of each request whose first prompt tokens (``count`` of
            its ``query_lens[b]``, its prompt's last token never among them) this step feeds:
            over a quantized cache they attend their own new keys unquantized, as mlx-lm's
            prefill does (``QuantizedSlotAttention``).
        reserve_len: positions the slot caches make room for at least (the end of the longest
            prompt being fed), so that a prompt fed in chunks grows them once, not per chunk.

    Derived fields:
        batch_size: B. num_tokens: N. query_len: 1, the tokens per row the model sees.
        max_query_len: the most tokens a request feeds (what a ring must make room for).
        uniform_query_len: L when every request feeds L tokens (a step of decode tokens
            only, 1 or k + 1 each), else ``None``: attention then takes the queries as
            ``[B, H_q, L, D]`` without ``query_starts``, the op's plain layout.
        query_starts: int32 ``[B + 1]``, the packed rows of request ``b`` are
            ``query_starts[b] .. query_starts[b + 1] - 1``.
        offsets: int32 ``[N]``, each token's position: its RoPE offset and where it is written.
        new_positions: int32 ``[N, 1]``, ``offsets`` as the one scatter per layer takes them.
        rows: int32 ``[N, 1]``, each token's cache slot.
        valid_lens: int32 ``[B]``, ``seq_lens[b] + q_b``: the lengths the kernel attends over.
        max_len: the longest of them.
        rings: ``{R: RingStep}`` for each of ``ring_sizes`` (``ring_step``).
        first_chunk_rows: the packed ``(start, end)`` rows of ``first_chunks``.
    """

    seq_lens: Sequence[int]
    query_lens: Sequence[int]
    layer_caches: Sequence[Any]
    ring_sizes: Sequence[int] = ()
    first_chunks: Sequence[tuple[int, int]] = ()
    reserve_len: int = 0
    batch_size: int = field(init=False)
    num_tokens: int = field(init=False)
    query_len: int = field(init=False, default=1)
    max_query_len: int = field(init=False)
    uniform_query_len: Optional[int] = field(init=False)
    query_starts: mx.array = field(init=False)
    offsets: mx.array = field(init=False)
    new_positions: mx.array = field(init=False)
    rows: mx.array = field(init=False)
    valid_lens: mx.array = field(init=False)
    max_len: int = field(init=False)
    rings: dict[int, RingStep] = field(init=False)
    first_chunk_rows: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.query_lens) or not self.seq_lens:
            raise ValueError(
                f"[PackedDecodeContext] need one seq_len and one query_len per request (at least "
                f"one), got {len(self.seq_lens)} and {len(self.query_lens)}"
            )
        if min(self.seq_lens) < 0 or min(self.query_lens) < 0 or not any(self.query_lens):
            raise ValueError(
                "[PackedDecodeContext] seq_lens and query_lens must be >= 0, with some tokens"
            )
        self.batch_size = len(self.seq_lens)
        starts, positions, rows = [0], [], []
        for b, (seq_len, count) in enumerate(zip(self.seq_lens, self.query_lens)):
            starts.append(starts[-1] + count)
            positions += range(seq_len, seq_len + count)
            rows += [b] * count
        self.num_tokens = starts[-1]
        self.max_query_len = max(self.query_lens)
        uniform = min(self.query_lens) == self.max_query_len
        self.uniform_query_len = self.max_query_len if uniform else None
        ends = [s + q for s, q in zip(self.seq_lens, self.query_lens)]
        self.max_len = max(ends)
        self.query_starts = mx.array(starts, dtype=mx.int32)
        self.offsets = mx.array(positions, dtype=mx.int32)
        self.new_positions = self.offsets[:, None]
        self.rows = mx.array(rows, dtype=mx.int32)[:, None]
        self.valid_lens = mx.array(ends, dtype=mx.int32)
        self.rings = {
            size: ring_step(size, self.max_len, self.valid_lens, self.new_positions)
            for size in self.ring_sizes
        }
        self.first_chunk_rows = [(starts[b], starts[b] + count) for b, count in self.first_chunks]
