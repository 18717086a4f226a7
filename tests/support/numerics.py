"""Shared test helpers: random decode inputs and a float64 numpy reference.

Dimension legend: B requests, H_q query heads, H_kv key/value heads,
G = H_q / H_kv, T padded length, D head dim.
"""

import mlx.core as mx
import numpy as np

from tests.metal_emu.reference import reference_attention as float64_attention

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
HEAD_DIMS = [64, 80, 96, 128, 256]

# Max abs error against the float64 reference, per dtype: the output is rounded
# to the dtype (|out| < ~3 for unit-normal values) and K/V are rounded on input.
TOLERANCE = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def dtype_id(dtype):
    return str(dtype).split(".")[-1]


def make_inputs(B, H_q, H_kv, T, D, dtype, seed=0, L=1):
    """Unit-normal queries [B, H_q, L, D] and keys/values [B, H_kv, T, D]."""
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((B, H_q, L, D), key=kq).astype(dtype)
    k = mx.random.normal((B, H_kv, T, D), key=kk).astype(dtype)
    v = mx.random.normal((B, H_kv, T, D), key=kv).astype(dtype)
    mx.eval(q, k, v)
    return q, k, v


def to_numpy64(x):
    return np.array(x.astype(mx.float32)).astype(np.float64)


def numpy_reference(q, k, v, valid_lens, scale=None, kv_starts=None, window=None, sinks=None, softcap=None):
    """Float64 attention of each query row over its own range of keys, for MLX inputs.

    The numpy-only reference of the Metal harness (tests/metal_emu/reference.py),
    written independently of the library: a loop over requests, rows and heads.
    """
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    lens = np.asarray(valid_lens, dtype=np.int64)
    starts = None if kv_starts is None else np.asarray(kv_starts, dtype=np.int64)
    sinks = None if sinks is None else to_numpy64(mx.array(sinks))
    return float64_attention(
        to_numpy64(q), to_numpy64(k), to_numpy64(v), lens, scale, starts, window, sinks, softcap
    )


def max_abs_error(out, expected):
    return float(np.max(np.abs(to_numpy64(out) - expected), initial=0.0))
