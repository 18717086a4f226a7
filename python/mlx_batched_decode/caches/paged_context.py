"""The per-step decode context of the paged layout: block tables and write slots, once per step.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
M = entries per block table (the longest table of the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

from .context import BatchedDecodeContext
from .packed_context import PackedDecodeContext


def padded_tables(owner: str, tables: Sequence[Sequence[int]], batch_size: int) -> mx.array:
    """int32 ``[B, M]``: one block table per request, padded with ``-1`` (never read: past the
    request's length)."""
    if len(tables) != batch_size:
        raise ValueError(
            f"[{owner}] need one block table per request, got {len(tables)} for {batch_size} "
            "requests"
        )
    width = max(len(t) for t in tables)
    return mx.array([list(t) + [-1] * (width - len(t)) for t in tables], dtype=mx.int32)


@dataclass
class BlockTableFields:
    """The fields a paged context adds to its base: ``tables`` (B host lists of block ids;
    request ``b``'s logical position ``j`` lives in row ``j % block_size`` of block
    ``tables[b][j // block_size]``, up to the step's last new token), ``block_size``, and the
    derived ``block_tables`` int32 ``[B, M]`` (``padded_tables``) and ``write_blocks``,
    ``write_rows``: the block and the row in it where each new token is written, the slot
    mapping of the one scatter per layer and pool."""

    tables: Sequence[Sequence[int]] = ()
    block_size: int = 16
    block_tables: mx.array = field(init=False)
    write_blocks: mx.array = field(init=False)
    write_rows: mx.array = field(init=False)


@dataclass
class PagedDecodeContext(BlockTableFields, BatchedDecodeContext):
    """A ``BatchedDecodeContext`` whose requests keep their keys/values in the blocks of a
    ``PagedKVCache``; every layer reads the same tables (block ids are the same in every layer).
    ``BlockTableFields`` as its fields say, ``write_blocks`` and ``write_rows`` ``[B, L]``; the
    tables cover every position up to ``seq_lens[b] + L - 1``.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self.block_tables = padded_tables("PagedDecodeContext", self.tables, self.batch_size)
        positions = [[s + i for i in range(self.query_len)] for s in self.seq_lens]
        self.write_blocks = mx.array(
            [[t[p // self.block_size] for p in row] for t, row in zip(self.tables, positions)],
            dtype=mx.int32,
        )
        self.write_rows = mx.array(
            [[p % self.block_size for p in row] for row in positions], dtype=mx.int32
        )


@dataclass
class PagedPackedContext(BlockTableFields, PackedDecodeContext):
    """A ``PackedDecodeContext`` whose requests keep their keys/values in the blocks of a
    ``PagedKVCache``: ``BlockTableFields``, the tables covering every position up to
    ``seq_lens[b] + query_lens[b] - 1``, ``write_blocks`` and ``write_rows`` ``[N, 1]`` (one
    per packed token).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self.block_tables = padded_tables("PagedPackedContext", self.tables, self.batch_size)
        blocks, rows = [], []
        for table, start, count in zip(self.tables, self.seq_lens, self.query_lens):
            for p in range(start, start + count):
                blocks.append(table[p // self.block_size])
                rows.append(p % self.block_size)
        self.write_blocks = mx.array(blocks, dtype=mx.int32)[:, None]
        self.write_rows = mx.array(rows, dtype=mx.int32)[:, None]
