"""One timed shape per op, against ``mx.fast.scaled_dot_product_attention`` on the same inputs.

Each op is timed in turns with the peer (a boolean mask of each request's length over the
dense float cache the op's inputs hold: gathered from the pages, dequantized, padded from the
per-request buffers) and with the device's read-bandwidth probe, and its output is checked
against the reference. GB/s counts the bytes the op must read: every valid key and value row
(packed words, scales and biases when quantized) plus the queries and the output.

Dimension legend: B requests, H_q query heads, H_kv key/value heads, L query rows, T padded
length, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..bandwidth import GpuReadBandwidth, ReadBandwidth
from ..timing import interleaved_medians
from .cases import Case
from .compare import Comparison, compare
from .layouts import Prepared, prepare

# Llama-3-8B attention heads (32 / 8, D = 128) in float16, 8 requests of 512 to 2048 keys:
# 84 MB of K/V, more than most last-level caches, so the calls read memory.
LENS = (512, 2048, 768, 1792, 1024, 1280, 1536, 640)


@dataclass(frozen=True)
class Speed:
    """One op's timing: medians in seconds, bytes it reads, the probe's GB/s, its check."""

    case: Case
    seconds: float
    sdpa_seconds: float
    nbytes: int
    read_gbs: float
    check: Comparison

    @property
    def gbs(self) -> float:
        return self.nbytes / self.seconds / 1e9


def speed_case(op: str) -> Case:
    """The timed shape of ``op``: 32 query heads on 8 KV heads, D = 128, float16, L = 1."""
    return Case(op, mx.float16, 128, 4, LENS, kv_heads=8)


def bytes_read(case: Case) -> int:
    """Bytes ``case``'s op must read or write at least: K/V rows in range, queries, output."""
    itemsize = case.dtype.size
    d, rows = case.head_dim, sum(case.lens)
    if case.op == "quantized":
        row = d * case.bits // 8 + 2 * (d // case.group_size) * itemsize
    else:
        row = d * itemsize
    queries = len(case.lens) * case.kv_heads * case.group * case.variant.rows * d * itemsize
    return rows * case.kv_heads * 2 * row + 2 * queries


def sdpa_peer(prepared: Prepared, dtype: mx.Dtype) -> Callable[[], mx.array]:
    """``mx.fast.scaled_dot_product_attention`` on the truth's keys and values in ``dtype``
    (unread positions zeroed, as a padded cache holds them) with a mask of each length."""
    truth = prepared.truth
    zeroed = [mx.where(mx.isnan(x), 0.0, x).astype(dtype) for x in (truth.keys, truth.values)]
    queries = truth.queries.astype(dtype)
    mask = (mx.arange(truth.keys.shape[2])[None, :] < truth.lens[:, None])[:, None, None, :]
    scale = 1.0 / math.sqrt(queries.shape[-1])
    mx.eval(zeroed, queries, mask)
    return lambda: mx.fast.scaled_dot_product_attention(queries, *zeroed, scale=scale, mask=mask)


def measure(
    op: str,
    quick: bool,
    probe: ReadBandwidth | GpuReadBandwidth,
    expected: Callable[[Prepared], mx.array],
) -> Speed:
    """Times ``op`` on its speed case in turns with the SDPA peer and ``probe`` (median of 3,
    of 11 unless ``quick``: the peer takes ~100x the op's time on a CPU), and checks the op's
    output against ``expected(prepared)``."""
    case = speed_case(op)
    prepared = prepare(case)
    peer = sdpa_peer(prepared, case.dtype)
    check = compare(prepared.run(), expected(prepared), case.dtype)
    seconds, sdpa_seconds, probe_seconds = interleaved_medians(
        [lambda: mx.eval(prepared.run()), lambda: mx.eval(peer()), probe.probe],
        warmup=1 if quick else 2,
        repeats=3 if quick else 11,
    )
    return Speed(case, seconds, sdpa_seconds, bytes_read(case), probe.gbs(probe_seconds), check)
