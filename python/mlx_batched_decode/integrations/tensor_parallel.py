"""Tensor parallelism on ``mx.distributed``: sharding an mlx-lm model and what its all-reduces cost.

mlx-lm's models shard themselves (``model.shard(group)``): each attention layer keeps
``H_q / N`` query heads and ``H_kv / N`` key/value heads of ``q_proj``/``k_proj``/``v_proj``
(split by output rows) and the matching input columns of ``o_proj``; each MLP keeps ``1 / N`` of
its hidden units (``gate_proj``/``up_proj`` rows, ``down_proj`` columns). Embeddings, norms and
the output head stay whole on every rank. ``o_proj`` and ``down_proj`` then sum the ranks'
partial outputs with one all-reduce each: two per layer and decode step, of ``[B, 1, hidden]``
activations. ``BatchedDecoder`` needs nothing else: the op sees each rank's heads, and each
rank's slot caches hold its own ``H_kv / N`` heads.

Dimension legend: B = requests in a step, N = ranks in the group, H_q / H_kv = query /
key-value heads.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import mlx.nn as nn


def shard(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """Shard ``model`` in place over ``group`` with mlx-lm's own ``model.shard``; returns it.

    Raises ``ValueError`` (``[tensor_parallel] ...``) for a model without ``shard`` or whose
    head counts are not divisible by the group size.
    """
    n = group.size()
    if not hasattr(model, "shard"):
        raise ValueError(f"[tensor_parallel] {type(model).__module__} has no shard(group) method")
    args = getattr(model, "args", None)
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(args, name, None)
        if heads is not None and heads % n != 0:
            raise ValueError(
                f"[tensor_parallel] {name} = {heads} is not divisible by the {n} ranks"
            )
    model.shard(group)
    mx.eval(model.parameters())
    return model


def all_reduce_seconds(
    group: mx.distributed.Group, shape: tuple[int, ...], count: int, repeats: int = 20
) -> float:
    """Median seconds of ``count`` chained float32 all-reduces of ``shape`` over ``group``
    (one decode step's worth when ``count = 2 * layers``, ``shape = (B, 1, hidden)``).

    Every rank must call it with the same arguments: it is a collective.
    """
    x = mx.ones(shape, dtype=mx.float32)
    mx.eval(x)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        y = x
        for _ in range(count):
            # Each sum depends on the previous one, as the layers' do.
            y = mx.distributed.all_sum(y, group=group) * (1.0 / group.size())
        mx.eval(y)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])
