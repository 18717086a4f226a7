"""A step's block tables: where a paged cache's requests keep their positions, derived once.

Dimension legend: B = requests in the step, M = entries per block table (the longest table of
the step), W = the step's new tokens as the model rows hold them (``[B, L]`` of a uniform step,
``[N, 1]`` of a packed one).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx


class BlockTables:
    """The block tables of one step, part of its ``BatchedDecodeContext``.

    Request ``b``'s logical position ``j`` lives in row ``j % block_size`` of block
    ``tables[b][j // block_size]``; the tables cover every position up to the step's last new
    token. Every layer reads the same tables (block ids are the same in every layer).

    Attributes:
        block_size: positions per block.
        block_tables: int32 ``[B, M]``, one table per request padded with ``-1`` (never read:
            past the request's length).
        write_blocks, write_rows: int32 ``W``, the block and the row in it where each new token
            is written: the slot mapping of the one scatter per layer and pool.
    """

    def __init__(
        self,
        tables: Sequence[Sequence[int]],
        block_size: int,
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        packed: bool,
    ):
        if len(tables) != len(seq_lens):
            raise ValueError(
                f"[BatchedDecodeContext] need one block table per request, got {len(tables)} "
                f"for {len(seq_lens)} requests"
            )
        self.block_size = block_size
        width = max(len(t) for t in tables)
        self.block_tables = mx.array(
            [list(t) + [-1] * (width - len(t)) for t in tables], dtype=mx.int32
        )
        positions = [range(s, s + q) for s, q in zip(seq_lens, query_lens)]
        blocks = [[t[p // block_size] for p in row] for t, row in zip(tables, positions)]
        rows = [[p % block_size for p in row] for row in positions]
        if packed:
            # One model row per token: [N, 1].
            blocks = [[b] for row in blocks for b in row]
            rows = [[r] for row in rows for r in row]
        self.write_blocks = mx.array(blocks, dtype=mx.int32)
        self.write_rows = mx.array(rows, dtype=mx.int32)
