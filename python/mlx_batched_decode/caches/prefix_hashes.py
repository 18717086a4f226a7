"""Names for prompt prefixes: the chained hash of every full block of a request's tokens.

Equal hashes mean equal prefixes (as vLLM's automatic prefix caching): block ``i``'s hash covers
its own tokens and, through block ``i - 1``'s hash, every token before it. ``PagedKVCache`` looks
them up in its ``BlockAllocator`` to share the blocks of a cached prefix.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of every full block of ``tokens``: block ``i``'s hash covers its own
    tokens and, through block ``i - 1``'s hash, every token before it (128-bit SHA-256 prefix)."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        # int64 little-endian, as numpy's tobytes of the block on the machines MLX runs on.
        block = struct.pack(f"<{block_size}q", *tokens[start : start + block_size])
        parent = hashlib.sha256(parent + block).digest()[:16]
        hashes.append(int.from_bytes(parent, "little"))
    return hashes
