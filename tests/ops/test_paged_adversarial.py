"""Random adversarial block tables and lengths: the paged kernel reads only what it may.

Each case draws tables whose entries mix valid ids, -1, huge and negative values, lengths
below 0 and past MB * BS, shared and repeated blocks, and pools that are small strided views
of a larger buffer, then compares with float64. Under tests/kernels/cpu/test_sanitizers.py the same cases
run with AddressSanitizer, which reports any read outside the pools or tables.

Dimensions: B requests, NB blocks, BS rows per block, MB table entries per request.
"""

import mlx.core as mx
import numpy as np
import pytest
from tests.metal_emu.reference import paged_reference_attention

import mlx_batched_decode as mbd
from tests.support.numerics import max_abs_error, to_numpy64


def adversarial_case(seed):
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 3, 8, 16, 32, 64]))
    nb = int(rng.integers(1, 12))
    B, mb = int(rng.integers(1, 9)), int(rng.integers(1, 10))
    pool = rng.integers(0, nb, (B, mb))
    wild = rng.choice([-1, -2, nb, nb + 1, 2**31 - 1, -(2**31), 7 * nb], (B, mb))
    tables = np.where(rng.random((B, mb)) < 0.25, wild, pool).astype(np.int32)
    # Copies of one request's table: blocks shared at the same positions.
    for b in range(1, B):
        if rng.random() < 0.5:
            tables[b] = tables[0]
    lens = rng.integers(-5, mb * bs + 20, B)
    lens[rng.random(B) < 0.3] = mb * bs
    lens[0] = rng.choice([lens[0], 2**31 - 1, -(2**31)])
    return bs, nb, tables, lens.astype(np.int32)


@pytest.mark.parametrize("seed", range(40))
def test_adversarial_tables(seed):
    bs, nb, tables, lens = adversarial_case(seed)
    rng = np.random.default_rng(seed + 1000)
    B, D, G, L = tables.shape[0], 64, 2, int(rng.integers(1, 4))
    window = [None, 1, 5, 40][seed % 4]
    # The pools are views into the middle of a bigger buffer, so a read past them would land
    # in memory that holds NaN and ASan would not see it: the results catch it instead.
    big = mx.array(rng.standard_normal((nb + 2, bs, 2, D)).astype(np.float32)).astype(mx.float16)
    big[0] = float("nan")
    big[-1] = float("nan")
    k = big[1:-1]
    v = mx.array(rng.standard_normal((nb, bs, 2, D)).astype(np.float32)).astype(mx.float16)
    q = mx.array(rng.standard_normal((B, 2 * G, L, D)).astype(np.float32)).astype(mx.float16)
    out = mbd.paged_decode_attention(q, k, v, mx.array(tables), mx.array(lens), window=window)
    expected = paged_reference_attention(
        to_numpy64(q), to_numpy64(k), to_numpy64(v), tables, lens, 1 / np.sqrt(D), window
    )
    assert max_abs_error(out, expected) < 4e-3
    assert not np.isnan(np.array(out.astype(mx.float32))).any()
