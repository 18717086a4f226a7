"""A simulated decode server for long-run tests: requests join and leave at random.

Runs the Python layer as a server would: one ``SlotKVCache`` per layer, one
``BatchedDecodeContext`` per step, ``SlotAttention`` per layer, the batch kept dense by moving
the last request into a freed slot. Every request's keys, values and queries are a pure function
of (seed, request id), so its isolated attention can be recomputed from scratch at any step.

Dimension legend: B active requests, L layers, H_q / H_kv query / key-value heads, D head dim.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_batched_decode import BatchedDecodeContext, SlotAttention, SlotKVCache


@dataclass
class SoakConfig:
    """Sizes and rates of a run; the defaults keep about ten requests active."""

    steps: int = 3000
    layers: int = 2
    h_kv: int = 2
    group: int = 2
    head_dim: int = 64
    # Small cache chunks, so that capacity boundaries are crossed often.
    kv_step: int = 16
    max_prompt: int = 96
    max_new: int = 120
    max_active: int = 12
    arrival: float = 0.2
    cancel: float = 0.004
    # Arrivals pause for the last ``quiet`` steps of every ``cycle``, so that the batch drains.
    cycle: int = 400
    quiet: int = 130
    check_every: int = 25
    seed: int = 0


@dataclass
class SoakReport:
    """What a run did and measured. Memory is MLX active memory in bytes."""

    steps: int = 0
    decode_steps: int = 0
    tokens: int = 0
    joined: int = 0
    finished: int = 0
    cancelled: int = 0
    peak_active: int = 0
    checkpoints: int = 0
    outputs_checked: int = 0
    boundary_steps: int = 0
    drains: int = 0
    max_error: float = 0.0
    baseline_memory: int = 0
    # At each drain: memory beyond the baseline and the caches, then after releasing the caches.
    excess_with_caches: list[int] = field(default_factory=list)
    memory_after_drain: list[int] = field(default_factory=list)
    peak_memory: int = 0
    seconds: float = 0.0


class Request:
    """One request: its whole K/V/Q history, made up front from (seed, id)."""

    def __init__(self, rid: int, prompt: int, new: int, cfg: SoakConfig):
        rng = np.random.default_rng([cfg.seed, rid])
        n, L, D = prompt + new, cfg.layers, cfg.head_dim
        self.keys = rng.standard_normal((L, cfg.h_kv, n, D)).astype(np.float32)
        self.values = rng.standard_normal((L, cfg.h_kv, n, D)).astype(np.float32)
        self.queries = rng.standard_normal((L, cfg.h_kv * cfg.group, n, D)).astype(np.float32)
        self.seq_len = prompt
        self.end = n


def isolated_attention(req: Request, layer: int, group: int) -> np.ndarray:
    """Float64 attention of the request's query at ``seq_len`` over its own keys ``0..seq_len``:
    ``[H_q, D]``."""
    s = req.seq_len
    q = req.queries[layer, :, s].astype(np.float64)
    k = np.repeat(req.keys[layer, :, : s + 1], group, axis=0).astype(np.float64)
    v = np.repeat(req.values[layer, :, : s + 1], group, axis=0).astype(np.float64)
    scores = np.einsum("hd,htd->ht", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("ht,htd->hd", p / p.sum(axis=-1, keepdims=True), v)


def new_tokens(active: list[Request], table: str, layer: int) -> mx.array:
    """``[B, H, 1, D]``: row ``seq_len`` of each request's ``table`` (queries, keys or values)."""
    return mx.array(np.stack([getattr(r, table)[layer, :, r.seq_len, None] for r in active]))


def active_memory() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


class Server:
    """The scheduler: admits, steps, checks and retires requests."""

    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.attention = SlotAttention()
        self.caches = self.new_caches()
        self.active: list[Request] = []
        self.next_id = 0
        self.report = SoakReport()

    def new_caches(self) -> list[SlotKVCache]:
        return [SlotKVCache(self.cfg.kv_step) for _ in range(self.cfg.layers)]

    def admit(self) -> None:
        cfg = self.cfg
        prompt = int(self.rng.integers(0, cfg.max_prompt + 1))
        req = Request(self.next_id, prompt, int(self.rng.integers(1, cfg.max_new + 1)), cfg)
        self.next_id += 1
        slot = len(self.active)
        if prompt:
            for layer, cache in enumerate(self.caches):
                cache.write_prompt(
                    slot,
                    mx.array(req.keys[layer, None, :, :prompt]),
                    mx.array(req.values[layer, None, :, :prompt]),
                )
        self.active.append(req)
        self.report.joined += 1

    def retire(self, row: int) -> None:
        # Keep the batch dense, as BatchedDecoder does: the last request takes the freed slot.
        last = len(self.active) - 1
        if row != last:
            for cache in self.caches:
                cache.move(last, row, self.active[last].seq_len)
            self.active[row] = self.active[last]
        self.active.pop()

    def step(self, check: bool) -> None:
        """One decode step of every active request; ``check`` compares outputs and caches."""
        cfg, active = self.cfg, self.active
        capacity = self.caches[0].capacity
        # The token written now fills the last position of the capacity, or forces growth.
        at_boundary = any(r.seq_len >= capacity - 1 for r in active)
        context = BatchedDecodeContext(len(active), [r.seq_len for r in active], self.caches)
        outs = []
        for layer in range(cfg.layers):
            q, k, v = (new_tokens(active, name, layer) for name in ("queries", "keys", "values"))
            outs.append(self.attention(context, layer, q, k, v))
        mx.eval(outs)
        self.report.boundary_steps += at_boundary
        if check or at_boundary:
            self.check(outs)
        for r in active:
            r.seq_len += 1
        self.report.tokens += len(active)

    def check(self, outs: list[mx.array]) -> None:
        """Each request's output equals its isolated attention, and its cached tokens are intact."""
        self.report.checkpoints += 1
        for layer, out in enumerate(outs):
            got = np.array(out[:, :, 0])
            keys = np.array(self.caches[layer].keys)
            values = np.array(self.caches[layer].values)
            for b, r in enumerate(self.active):
                n = r.seq_len + 1
                error = float(np.max(np.abs(got[b] - isolated_attention(r, layer, self.cfg.group))))
                self.report.max_error = max(self.report.max_error, error)
                if error > 2e-5:
                    raise AssertionError(f"request {b} layer {layer} at length {n}: error {error}")
                if not (
                    np.array_equal(keys[b, :, :n], r.keys[layer, :, :n])
                    and np.array_equal(values[b, :, :n], r.values[layer, :, :n])
                ):
                    raise AssertionError(f"request {b} layer {layer}: cache lost a token of {n}")
                self.report.outputs_checked += 1

    def drained(self) -> None:
        """At an empty batch: live memory is the baseline plus the caches, then the baseline."""
        report = self.report
        held = sum(c.nbytes for c in self.caches)
        report.excess_with_caches.append(active_memory() - report.baseline_memory - held)
        self.caches = self.new_caches()
        report.memory_after_drain.append(active_memory())
        report.drains += 1

    def run(self) -> SoakReport:
        cfg, report = self.cfg, self.report
        report.baseline_memory = active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        was_busy = False
        for step in range(cfg.steps):
            accepting = step % cfg.cycle < cfg.cycle - cfg.quiet
            if accepting and len(self.active) < cfg.max_active and self.rng.random() < cfg.arrival:
                self.admit()
            if self.active:
                self.step(check=step % cfg.check_every == 0)
                report.decode_steps += 1
                report.peak_active = max(report.peak_active, len(self.active))
                for row in reversed(range(len(self.active))):
                    r = self.active[row]
                    if r.seq_len == r.end:
                        report.finished += 1
                        self.retire(row)
                    elif self.rng.random() < cfg.cancel:
                        report.cancelled += 1
                        self.retire(row)
                was_busy = True
            elif was_busy:
                self.drained()
                was_busy = False
            report.steps += 1
        report.seconds = time.perf_counter() - start
        report.peak_memory = mx.get_peak_memory()
        return report
