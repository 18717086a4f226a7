"""Requests arriving over time at an HTTP server, for ``bench_server.py --arrivals`` and
``--soak``: each request is a streaming greedy ``/v1/completions`` sent at its arrival time,
every streamed chunk timed on the client (one word is one token with the benchmark tokenizer,
so a chunk is a token).

Scenarios (prompts and lengths from ``arrivals.py``, the in-process decoder benchmark's, its
token ids mapped to words):

- ``burst``: 4 requests of 64-token prompts decode (400 tokens each), then, 1 s later, 4
  prompts of 1,800 tokens arrive at once: the decoding requests' largest gap between two tokens,
  and the median of their gaps while the long prompts are fed (one full step on the native
  server);
- ``trace``: the seeded trace of 32 requests (prompts 64-2,048 tokens, outputs 16-256, Poisson
  arrivals at 0.5/s): total time, time to first token p50, inter-token p50 / p99;
- ``shared``: the trace's requests behind one shared 1,024-token system prompt (for the prefix
  sharing row), as the trace.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

import arrivals
from mlx_batched_decode.tools.local_server import sse_chunks
from mlx_batched_decode.tools.model_folder import SPECIAL_TOKENS, word

REQUEST_TIMEOUT_S = 1800


@dataclass
class Timed:
    """One request as its client saw it: when it was sent, each chunk's arrival, its text, and
    its error if it failed (times are ``time.perf_counter()``)."""

    at: float
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    text: str = ""
    error: Optional[str] = None

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.chunks))


def words_of(tokens: list[int], vocab: int) -> str:
    """Token ids as the benchmark tokenizer's words (one token each, no special token)."""
    specials = len(SPECIAL_TOKENS)
    return " ".join(word(specials + t % (vocab - specials)) for t in tokens)


def stream(port: int, prompt: str, max_tokens: int, timed: Timed) -> None:
    """Send one streaming greedy completion now and time its chunks into ``timed``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    body = json.dumps({"model": "default_model", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    try:
        timed.sent = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            timed.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return
        for chunk in sse_chunks(response):
            if chunk["choices"] and chunk["choices"][0]["text"]:
                timed.chunks.append(time.perf_counter())
                timed.text += chunk["choices"][0]["text"]
    except Exception as error:  # recorded against the server, the run goes on
        timed.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()


def replay(port: int, trace: list, vocab: int, prefix: str = "") -> tuple[float, list[Timed]]:
    """Every request of ``trace`` (``arrivals.Arrival``) sent at its time from now on, its prompt
    after ``prefix``; returns the start and the requests in trace order."""
    start = time.perf_counter()
    out = [Timed(start + a.at) for a in trace]

    def client(i):
        time.sleep(max(0.0, out[i].at - time.perf_counter()))
        prompt = (prefix + " " if prefix else "") + words_of(trace[i].prompt, vocab)
        stream(port, prompt, trace[i].max_tokens, out[i])

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(trace))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + max(a.at for a in trace))
    return start, out


def percentile(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def burst(port: int, vocab: int, seed: int) -> dict:
    """The burst scenario's row."""
    # The long prompts arrive 1 s after the decoding requests, which decode long past them.
    trace = arrivals.burst_trace(vocab, 1.0, seed)
    for early in trace[:4]:
        early.max_tokens = 400
    _, out = replay(port, trace, vocab)
    early, late = out[:4], out[4:]
    began = late[0].at
    fed = max((t.chunks[0] for t in late if t.chunks), default=began)
    during = [b - a for t in early for a, b in zip(t.chunks, t.chunks[1:]) if a >= began and b <= fed]
    largest = max((g for t in early for g in t.gaps), default=float("nan"))
    return {"scenario": "burst", "requests": len(out), "failed": sum(t.error is not None for t in out),
            "largest_gap_s": largest, "step_during_prefill_s": percentile(during, 50),
            "texts": [t.text for t in out], "errors": [t.error for t in out if t.error]}


def trace_row(name: str, port: int, vocab: int, seed: int, rate: float, prefix: str = "") -> dict:
    """The trace scenario's row (``prefix``: a shared system prompt before every prompt)."""
    trace = arrivals.seeded_trace(vocab, seed, rate=rate)
    start, out = replay(port, trace, vocab, prefix)
    done = [t for t in out if t.chunks]
    gaps = [g for t in done for g in t.gaps]
    return {"scenario": name, "requests": len(out), "failed": sum(t.error is not None for t in out),
            "seconds": max(t.chunks[-1] for t in done) - start if done else float("nan"),
            "ttft_p50_s": percentile([t.chunks[0] - t.sent for t in done], 50),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "texts": [t.text for t in out], "errors": [t.error for t in out if t.error]}
