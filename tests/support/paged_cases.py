"""Adversarial paged caches shared by the paged kernel tests (CPU, emulated Metal, ASan).

Dimension legend: B requests, H_q/H_kv query/KV heads, G = H_q / H_kv, L query rows,
D head dim, NB blocks in the pool, BS rows per block, MB table entries per request.
"""

import numpy as np
from tests.metal_emu.reference import row_range

# Requests 0 and 1 are two samples of one prompt (same length, same table); 3 shares the
# first pages of 0; 2 repeats a block; 5 holds out-of-pool entries inside its length; 4 is
# empty; 6 has only out-of-pool entries; every entry past a length is garbage.
LENGTHS = [53, 53, 40, 61, 0, 70, 9]
GARBAGE = [-1, 2**31 - 1, -(2**31), 10**9]


def paged_tables(block_size, seed=0):
    """(tables int32 [B, MB], num_blocks) for LENGTHS with the sharing described above."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // block_size) for n in LENGTHS]
    mb = max(pages) + 2
    num_blocks = sum(pages) + 3
    ids = iter(rng.permutation(num_blocks).tolist())
    tables = np.array([[GARBAGE[(b + j) % 4] for j in range(mb)] for b in range(len(LENGTHS))], np.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = [next(ids) for _ in range(n)]
    tables[1, : pages[1]] = tables[0, : pages[0]]
    shared = 40 // block_size
    tables[3, :shared] = tables[0, :shared]
    if pages[2] >= 3:
        tables[2, 2] = tables[2, 0]
    else:
        tables[2, pages[2] - 1] = tables[0, 0]
    tables[5, pages[5] // 3] = num_blocks + 3
    tables[5, pages[5] // 2] = -2
    tables[6, : pages[6]] = [num_blocks + j for j in range(pages[6])]
    tables[4, 0] = 0
    return tables, num_blocks


def read_rows(tables, lengths, num_blocks, block_size, rows, window):
    """bool [NB, BS]: the pool rows some query row of some request attends."""
    read = np.zeros((num_blocks, block_size), dtype=bool)
    t = tables.shape[1] * block_size
    for b, n in enumerate(lengths):
        n = int(np.clip(n, 0, t))
        for i in range(rows):
            lo, hi = row_range(n, 0, rows, i, window)
            for p in range(lo, hi):
                blk = int(tables[b, p // block_size])
                if 0 <= blk < num_blocks:
                    read[blk, p % block_size] = True
    return read
