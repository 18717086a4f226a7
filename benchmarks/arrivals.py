"""Requests arriving over time, for ``bench_decode.py --arrivals``: what a serving loop on
``BatchedDecoder`` gives each request, read from the decoder's own per-request timing.

A trace is a list of ``Arrival`` (time after the start, prompt, max_tokens). ``replay`` runs it in
real time: before each step it adds every request that has arrived (``add_request``; a decoder
that prefills there stalls the step), then steps. Per request, from ``decoder.stats.requests``
(``RequestTiming``): time to first token (its first token's step end - its arrival in the trace,
so the wait for the loop to reach it counts) and the gaps between its tokens. With no request to
step it sleeps until the next arrival.

Scenarios (``run_scenarios``), each on the same random-weight model:

- ``burst``: 4 requests decode, then 4 prompts of 1,800 tokens arrive at once; the decoding
  requests' largest gap between two tokens against the median step at the full budget (the steps
  that feed the long prompts) and the median step of decode tokens alone (before the burst);
- ``trace``: a seeded trace of 32 requests, prompts 64-2,048 tokens, outputs 16-256 tokens,
  Poisson arrivals: total time, time to first token p50 / p99, inter-token p50 / p99;
- ``prefill``: 8 prompts of 300-2,000 tokens arriving at once, one token each: prompt tokens/s,
  against mlx-lm's ``batch_generate`` on the same prompts (it pads them into one batch).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Arrival:
    at: float
    prompt: list[int]
    max_tokens: int


@dataclass
class Replay:
    """One replayed trace: its start (``time.perf_counter()``), each request's arrival (seconds
    from the start) and ``RequestTiming`` in trace order, and each step's (start, end) from the
    start."""

    start: float
    arrived: list[float]
    timings: list = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)
    seconds: float = 0.0

    def ttft(self) -> list[float]:
        return [t.first_token - self.start - a for a, t in zip(self.arrived, self.timings) if t.first_token]

    def gaps(self, requests=None) -> list[float]:
        rows = self.timings if requests is None else [self.timings[i] for i in requests]
        return [g for t in rows for g in t.gaps]

    def generated(self) -> int:
        return sum(t.tokens for t in self.timings)


def replay(decoder, trace: list[Arrival]) -> Replay:
    """Runs ``trace`` through ``decoder`` in real time."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].at)
    start, pending = time.perf_counter(), 0
    out = Replay(start, arrived=[a.at for a in trace], timings=[None] * len(trace))
    while pending < len(order) or decoder.num_active or decoder.num_waiting:
        now = time.perf_counter() - start
        while pending < len(order) and trace[order[pending]].at <= now:
            i = order[pending]
            uid = decoder.add_request(trace[i].prompt, trace[i].max_tokens)
            out.timings[i] = decoder.stats.requests[uid]
            pending += 1
        if not (decoder.num_active or decoder.num_waiting):
            time.sleep(max(0.0, trace[order[pending]].at - (time.perf_counter() - start)))
            continue
        begin = time.perf_counter() - start
        decoder.step()
        out.steps.append((begin, time.perf_counter() - start))
    out.seconds = time.perf_counter() - start
    return out


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def random_prompt(rng, n, vocab):
    return [int(t) for t in rng.integers(0, vocab, n)]


def burst_trace(vocab, at, seed=0, prompt=1800, decoding=4, arriving=4):
    """``decoding`` requests of 64-token prompts from time 0, and ``arriving`` prompts of
    ``prompt`` tokens at ``at`` seconds; the first ones decode 64 tokens past the burst, however
    the decoder spreads its prefill over steps."""
    rng = np.random.default_rng(seed)
    early = [Arrival(0.0, random_prompt(rng, 64, vocab), 8 + 64 + prompt * arriving // 256) for _ in range(decoding)]
    late = [Arrival(at, random_prompt(rng, prompt, vocab), 8) for _ in range(arriving)]
    return early + late


def seeded_trace(vocab, seed=0, count=32, prompts=(64, 2048), outputs=(16, 256), rate=0.5):
    """``count`` requests with uniform prompt and output lengths, Poisson arrivals at ``rate``/s."""
    rng = np.random.default_rng(seed)
    at = np.cumsum(rng.exponential(1.0 / rate, count))
    at[0] = 0.0
    return [
        Arrival(float(t), random_prompt(rng, int(rng.integers(prompts[0], prompts[1] + 1)), vocab),
                int(rng.integers(outputs[0], outputs[1] + 1)))
        for t in at
    ]


def prefill_trace(vocab, seed=0, count=8, prompts=(300, 2000)):
    rng = np.random.default_rng(seed)
    return [Arrival(0.0, random_prompt(rng, int(n), vocab), 1) for n in rng.integers(prompts[0], prompts[1] + 1, count)]


CONFIG = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=32,
    rms_norm_eps=1e-5,
    vocab_size=1024,
    tie_word_embeddings=False,
)


def mlx_lm_prefill(model, trace):
    """Seconds mlx-lm's ``BatchGenerator`` takes to give every request of ``trace`` its one
    token, all of them in one prefill batch (it pads the prompts to the longest)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(trace), prefill_batch_size=len(trace))
    start = time.perf_counter()
    gen.insert([a.prompt for a in trace], [a.max_tokens for a in trace])
    answered = 0
    while answered < len(trace):
        answered += len(gen.next_generated())
    seconds = time.perf_counter() - start
    gen.close()
    return seconds


def run_scenarios(decoder_factory, model, seed=0, rate=0.5, stream=None):
    """The three scenarios' rows (dicts) on decoders from ``decoder_factory()``."""
    stream = stream or sys.stderr
    vocab = CONFIG["vocab_size"]
    rows = []

    # The first requests alone, to place the burst about 8 steps after their first token.
    early = burst_trace(vocab, 0.0, seed, arriving=0)
    probe = replay(decoder_factory(), [Arrival(0.0, a.prompt, 16) for a in early])
    step = float(np.median([b - a for a, b in probe.steps[1:]]))
    trace = burst_trace(vocab, probe.steps[0][1] + 8 * step, seed)
    burst = replay(decoder_factory(), trace)
    decode_step = float(np.median([b - a for a, b in burst.steps if b < trace[-1].at]))
    # Steps at the full budget: from the burst until the last long prompt's first token.
    fed = max(t.first_token for t in burst.timings[len(early):]) - burst.start
    full_step = float(np.median([b - a for a, b in burst.steps if a >= trace[-1].at and b <= fed]))
    largest = max(burst.gaps(range(len(early))))
    rows.append({"scenario": "burst", "requests": len(trace), "seconds": burst.seconds,
                 "step_ms": decode_step * 1e3, "full_step_ms": full_step * 1e3, "largest_gap_s": largest,
                 "gap_over_full_step": largest / full_step})
    print(f"burst: largest gap of the decoding requests {largest:.2f} s, {largest / full_step:.2f}x the median "
          f"step at the full budget ({full_step * 1e3:.0f} ms; decode alone {decode_step * 1e3:.1f} ms)",
          file=stream, flush=True)

    trace = seeded_trace(vocab, seed, rate=rate)
    run = replay(decoder_factory(), trace)
    ttft, gaps = run.ttft(), run.gaps()
    rows.append({"scenario": "trace", "requests": len(trace), "seconds": run.seconds,
                 "prompt_tokens": sum(len(a.prompt) for a in trace),
                 "generated": run.generated(), "ttft_p50_s": percentile(ttft, 50),
                 "ttft_p99_s": percentile(ttft, 99), "itl_p50_s": percentile(gaps, 50),
                 "itl_p99_s": percentile(gaps, 99)})
    print(f"trace: {run.seconds:.1f} s, ttft p50 {percentile(ttft, 50):.2f} s, inter-token p99 "
          f"{percentile(gaps, 99):.3f} s", file=stream, flush=True)

    trace = prefill_trace(vocab, seed)
    tokens = sum(len(a.prompt) for a in trace)
    run = replay(decoder_factory(), trace)
    peer = mlx_lm_prefill(model, trace)
    rows.append({"scenario": "prefill", "requests": len(trace), "seconds": run.seconds, "prompt_tokens": tokens,
                 "tok_s": tokens / run.seconds, "peer_s": peer, "peer_tok_s": tokens / peer,
                 "speedup": peer / run.seconds})
    print(f"prefill: {tokens / run.seconds:.0f} prompt tok/s, mlx-lm batch_generate {tokens / peer:.0f}",
          file=stream, flush=True)
    return rows


def budget_sweep(decoder_factory, budgets, seed=0, decoding=4, stream=None):
    """Per ``max_step_tokens`` budget: the median time of a decode step of ``decoding`` requests
    and of a step that also feeds a long prompt's chunk (the rest of the budget), and the prompt
    tokens/s of those steps: the gap a running request sees while a prompt arrives."""
    stream = stream or sys.stderr
    vocab = CONFIG["vocab_size"]
    rng = np.random.default_rng(seed)
    rows = []
    for budget in budgets:
        decoder = decoder_factory(budget)
        uids = [decoder.add_request(random_prompt(rng, 64, vocab), 10**6) for _ in range(decoding)]
        while any(decoder.stats.requests[u].first_token is None for u in uids):
            decoder.step()  # the short prompts

        def timed_step():
            start = time.perf_counter()
            decoder.step()
            return time.perf_counter() - start

        decode = float(np.median([timed_step() for _ in range(5)]))
        decoder.add_request(random_prompt(rng, 4 * budget, vocab), 1)
        mixed = float(np.median([timed_step() for _ in range(3)]))
        chunk = budget - decoding
        rows.append({"budget": budget, "decode_ms": decode * 1e3, "mixed_ms": mixed * 1e3,
                     "gap_over_decode": mixed / decode, "chunk": chunk, "prompt_tok_s": chunk / mixed})
        print(f"budget {budget}: decode step {decode * 1e3:.1f} ms, with a {chunk}-token chunk "
              f"{mixed * 1e3:.0f} ms ({chunk / mixed:.0f} prompt tok/s)", file=stream, flush=True)
    return rows
