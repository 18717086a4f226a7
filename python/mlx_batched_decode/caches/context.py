"""The per-step decode context: arrays derived from the step's lengths once, read by every layer.

One type for the public API and the engine alike. Request ``b`` has ``seq_lens[b]`` positions
cached and feeds new tokens at ``seq_lens[b] ..``; the model sees them in one of two layouts:

- a uniform step (``query_len`` L, every request feeding L tokens; ``BatchedDecodeContext(B,
  seq_lens, caches, query_len=L)``): the model's rows are the B requests of L tokens each,
  queries ``[B, H_q, L, D]``;
- a packed step (``BatchedDecodeContext.packed_step(seq_lens, query_lens, caches)``): request ``b``
  feeds its own ``query_lens[b]`` tokens (1 decoding, a chunk of its prompt, k + 1 to verify
  drafts, 0 to sit the step out) and the model sees the N tokens as N rows of one token each,
  so projections and MLPs run over all of them at once and RoPE takes each token's own
  position; attention is one call of the op per layer with ``query_starts``, or, when every
  request feeds the same L (``uniform_query_len``), the plain ``[B, H_q, L, D]`` layout (the
  fast path of a decode-only step).

A paged cache's block tables join a context by composition (``block_tables.BlockTables``).

Dimension legend: B = requests (cache slots 0..B-1), L = new tokens per request of a uniform
step, N = tokens of a packed step, H_q / H_kv = query / key-value heads, T = key/value
positions, D = head dimension, R = positions of a ring cache, M = model rows (B uniform, N
packed), Q = tokens per model row (L uniform, 1 packed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import mlx.core as mx

from .block_tables import BlockTables
from .ring_step import RingStep, ring_step


@dataclass
class BatchedDecodeContext:
    """Everything the layers of one decode step share, computed once in ``__post_init__``.

    Build one per step, never per layer; layers only read it. The lengths are host ints the
    scheduler already has, so building the context needs no device-to-host read.

    Args:
        batch_size: B; request ``b`` sits in row (and slot) ``b`` of every batched cache.
        seq_lens: B host ints, tokens already in each request's cache before this step.
        layer_caches: one entry per layer, read by the attention path: a slot cache, a ring,
            a quantized slot cache, a ``PagedKVCache``, or B ``ContiguousKVCache`` (seed path).
        query_len: Q, the tokens per model row: L of a uniform step (whatever a cache held at
            the new positions, rejected draft tokens of an earlier step, is overwritten).
        ring_sizes: the distinct ring sizes of the layers' ring caches.
        query_lens: B host ints >= 0 of a packed step (``packed``), ``None`` for a uniform one.
        first_chunks: ``(b, count)`` of each request whose first prompt tokens (``count`` of
            its ``query_lens[b]``, its prompt's last token never among them) this packed step
            feeds: over a quantized cache they attend their own new keys unquantized, as
            mlx-lm's prefill does (``QuantizedSlotAttention``).
        reserve_len: positions the slot caches make room for at least (the end of the longest
            prompt being fed), so that a prompt fed in chunks grows them once, not per chunk.
        tables: a paged cache's block table of each request, covering its new positions
            (``BlockTables``); ``block_size``: positions per block.

    Derived fields:
        packed: whether the model's rows are tokens (a packed step).
        num_tokens: N, the new tokens of the step. max_query_len: the most one request feeds.
        uniform_query_len: L when every request feeds L tokens, else ``None``.
        query_starts: int32 ``[B + 1]`` (packed): request ``b``'s rows are ``query_starts[b] ..
            query_starts[b + 1] - 1``; ``None`` for a uniform step.
        offsets: int32 ``[M]``, each model row's first position: its RoPE offset.
        new_positions: int32 ``[M, Q]``, the position of each new token, where it is written
            and where its query row sits.
        rows: int32 ``[M, 1]``, each model row's cache slot, broadcast against
            ``new_positions`` by the one scatter per layer that writes every new token.
        valid_lens: int32 ``[B]``, ``seq_lens[b]`` plus the tokens it feeds: the lengths the
            kernel attends over. max_len: the longest of them.
        needs_padding: whether the lengths differ (the seed path pads only then).
        pad_sizes: B host ints, ``max(seq_lens) - seq_lens[b]``: the seed path's right padding.
        positions: int32 ``[max_len]`` ``arange``: key positions, for the seed path's masks.
        rings: ``{R: RingStep}`` for each of ``ring_sizes`` (``ring_step``).
        first_chunk_rows: the packed ``(start, end)`` rows of ``first_chunks``.
        blocks: the ``BlockTables`` of ``tables`` (``None`` without).
    """

    batch_size: int
    seq_lens: Sequence[int]
    layer_caches: Sequence[Any]
    query_len: int = 1
    ring_sizes: Sequence[int] = ()
    query_lens: Optional[Sequence[int]] = None
    first_chunks: Sequence[tuple[int, int]] = ()
    reserve_len: int = 0
    tables: Optional[Sequence[Sequence[int]]] = None
    block_size: int = 16
    packed: bool = field(init=False)
    num_tokens: int = field(init=False)
    max_query_len: int = field(init=False)
    uniform_query_len: Optional[int] = field(init=False)
    query_starts: Optional[mx.array] = field(init=False)
    offsets: mx.array = field(init=False)
    new_positions: mx.array = field(init=False)
    rows: mx.array = field(init=False)
    valid_lens: mx.array = field(init=False)
    max_len: int = field(init=False)
    needs_padding: bool = field(init=False)
    pad_sizes: list[int] = field(init=False)
    positions: mx.array = field(init=False)
    rings: dict[int, RingStep] = field(init=False)
    first_chunk_rows: list[tuple[int, int]] = field(init=False)
    blocks: Optional[BlockTables] = field(init=False)

    @classmethod
    def packed_step(
        cls,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        layer_caches: Sequence[Any],
        **options: Any,
    ) -> "BatchedDecodeContext":
        """The context of a packed step: request ``b`` feeds ``query_lens[b]`` tokens;
        ``options`` are the other keywords (``ring_sizes``, ``first_chunks``, ``reserve_len``,
        ``tables``, ``block_size``)."""
        return cls(len(seq_lens), seq_lens, layer_caches, query_lens=query_lens, **options)

    def __post_init__(self) -> None:
        self.packed = self.query_lens is not None
        counts = self.query_lens if self.packed else [self.query_len] * self.batch_size
        if self.batch_size < 1 or len(self.seq_lens) != self.batch_size or (
            len(counts) != self.batch_size
        ):
            raise ValueError(
                f"[BatchedDecodeContext] need batch_size >= 1 and one seq_len (and query_len) "
                f"per request, got batch_size={self.batch_size}, {len(self.seq_lens)} seq_lens "
                f"and {len(counts)} query_lens"
            )
        if min(self.seq_lens) < 0:
            raise ValueError("[BatchedDecodeContext] seq_lens must be >= 0")
        if self.packed and (min(counts) < 0 or not any(counts)):
            raise ValueError("[BatchedDecodeContext] query_lens must be >= 0, with some tokens")
        if not self.packed and self.query_len < 1:
            raise ValueError(f"[BatchedDecodeContext] query_len must be >= 1, got {self.query_len}")
        if self.packed and self.query_len != 1:
            raise ValueError("[BatchedDecodeContext] a packed step feeds one token per row")
        self.num_tokens = sum(counts)
        self.max_query_len = max(counts)
        uniform = min(counts) == self.max_query_len
        self.uniform_query_len = self.max_query_len if uniform else None
        longest = max(self.seq_lens)
        self.needs_padding = min(self.seq_lens) < longest
        self.pad_sizes = [longest - s for s in self.seq_lens]
        if self.packed:
            self._derive_packed()
        else:
            self.query_starts = None
            self.offsets = mx.array(self.seq_lens, dtype=mx.int32)
            self.max_len = longest + self.query_len
            # Derived on the device from offsets: no second host-to-device copy.
            self.valid_lens = self.offsets + self.query_len
            self.new_positions = self.offsets[:, None] + mx.arange(self.query_len, dtype=mx.int32)
            self.rows = mx.arange(self.batch_size, dtype=mx.int32)[:, None]
            self.first_chunk_rows = []
        self.positions = mx.arange(self.max_len, dtype=mx.int32)
        self.rings = {
            size: ring_step(size, self.max_len, self.valid_lens, self.new_positions)
            for size in self.ring_sizes
        }
        self.blocks = None
        if self.tables is not None:
            self.blocks = BlockTables(
                self.tables, self.block_size, self.seq_lens, counts, self.packed
            )

    def _derive_packed(self) -> None:
        """The packed step's fields, from host ints (one host-to-device copy per array)."""
        starts, positions, rows = [0], [], []
        for b, (seq_len, count) in enumerate(zip(self.seq_lens, self.query_lens)):
            starts.append(starts[-1] + count)
            positions += range(seq_len, seq_len + count)
            rows += [b] * count
        ends = [s + q for s, q in zip(self.seq_lens, self.query_lens)]
        self.max_len = max(ends)
        self.query_starts = mx.array(starts, dtype=mx.int32)
        self.offsets = mx.array(positions, dtype=mx.int32)
        self.new_positions = self.offsets[:, None]
        self.rows = mx.array(rows, dtype=mx.int32)[:, None]
        self.valid_lens = mx.array(ends, dtype=mx.int32)
        self.first_chunk_rows = [(starts[b], starts[b] + count) for b, count in self.first_chunks]
