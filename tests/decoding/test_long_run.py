"""Long-run stability: a simulated server with requests joining and leaving at random.

The default run is sized for CI; ``MBD_SOAK_STEPS=10000`` (or ``python benchmarks/soak.py
--steps 10000``) runs the full soak.
"""

import os

import mlx.core as mx
import numpy as np

from mlx_batched_decode import BatchedDecodeContext, SlotAttention, SlotKVCache
from tests.support.server_sim import Server, SoakConfig


def test_simulated_server_stays_exact_and_does_not_leak():
    cfg = SoakConfig(steps=int(os.environ.get("MBD_SOAK_STEPS", SoakConfig.steps)))
    report = Server(cfg).run()  # raises at the first wrong output or lost token
    assert report.steps == cfg.steps
    # The run exercised what it claims to: drains, checks, capacity boundaries, departures.
    assert report.drains >= cfg.steps // cfg.cycle
    assert report.checkpoints >= report.decode_steps // cfg.check_every
    assert report.boundary_steps > 0 and report.cancelled > 0 and report.finished > 0
    assert report.peak_active == cfg.max_active
    # Live memory at every drain is exactly the caches, and nothing once they are released.
    assert report.excess_with_caches == [0] * report.drains
    assert report.memory_after_drain == [report.baseline_memory] * report.drains


def test_growth_at_exact_capacity_boundaries_loses_no_token():
    # Prompts of step - 1, step and step + 1 tokens, then decode steps across two boundaries.
    step, H_kv, G, D = 4, 2, 2, 64
    rng = np.random.default_rng(7)
    prompts = [step - 1, step, step + 1, 0]
    total = max(prompts) + 2 * step + 1
    keys = rng.standard_normal((len(prompts), H_kv, total, D)).astype(np.float32)
    values = rng.standard_normal((len(prompts), H_kv, total, D)).astype(np.float32)
    cache, attention = SlotKVCache(step), SlotAttention()
    for slot, n in enumerate(prompts):
        if n:
            k, v = keys[slot, None, :, :n], values[slot, None, :, :n]
            cache.write_prompt(slot, mx.array(k), mx.array(v))
    lens = list(prompts)
    capacities = set()
    for _ in range(2 * step + 1):
        context = BatchedDecodeContext(len(lens), lens, [cache])
        new_k = mx.array(np.stack([keys[b, :, n, None] for b, n in enumerate(lens)]))
        new_v = mx.array(np.stack([values[b, :, n, None] for b, n in enumerate(lens)]))
        q = mx.ones((len(lens), H_kv * G, 1, D))
        mx.eval(attention(context, 0, q, new_k, new_v))
        lens = [n + 1 for n in lens]
        capacities.add(cache.capacity)
        for b, n in enumerate(lens):
            assert np.array_equal(np.array(cache.keys[b, :, :n]), keys[b, :, :n])
            assert np.array_equal(np.array(cache.values[b, :, :n]), values[b, :, :n])
    # The cache grew several times, one chunk at a time.
    assert len(capacities) >= 3 and all(c % step == 0 for c in capacities)
