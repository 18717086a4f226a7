"""A burst of clients against an OpenAI-compatible server on 127.0.0.1, as a new user's load
would come: a few long-prompt requests, then, ``pause_s`` later, many short completions whose
clients all connect at the same moment (what overflows a small listen backlog).

Every request is a plain non-streaming ``/v1/completions`` with its own socket timeout; its
outcome (HTTP status, text, or the error it ended with) is recorded, never raised.
``new_user_burst`` is the burst the server tests send and ``bench_server.py --burst`` times.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Optional

from mlx_batched_decode.tools.model_folder import SPECIAL_TOKENS, word

# The new user's burst: 8 requests with long prompts, then, 1 s later, 64 short completions.
LONG_REQUESTS = 8
LONG_PROMPT_TOKENS = 1500
LONG_MAX_TOKENS = 16
BURST = 64
SHORT_MAX_TOKENS = 2
PAUSE_S = 1.0


@dataclass
class Outcome:
    """One request: its status (None if it never got a response), its completion's text and
    finish reason or the error it ended with, and times (``time.perf_counter``) of its connect
    call and of its end."""

    status: Optional[int] = None
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    started: float = 0.0
    ended: float = 0.0

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.finish_reason in ("length", "stop")


def complete(
    port: int,
    prompt: str,
    max_tokens: int,
    timeout_s: float,
    start: Optional[threading.Barrier] = None,
) -> Outcome:
    """One greedy completion; connects after ``start`` (if given) releases every client."""
    outcome = Outcome()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    body = json.dumps(
        {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    )
    try:
        if start is not None:
            start.wait(timeout_s)
        outcome.started = time.perf_counter()
        connection.connect()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        outcome.status, payload = response.status, response.read()
        if response.status == 200:
            choice = json.loads(payload)["choices"][0]
            outcome.text, outcome.finish_reason = choice["text"], choice["finish_reason"]
        else:
            outcome.error = f"HTTP {response.status}: {payload[:200]!r}"
    except Exception as e:  # the outcome records why the request failed
        outcome.error = f"{type(e).__name__}: {e}"
    finally:
        outcome.ended = time.perf_counter()
        connection.close()
    return outcome


@dataclass
class BurstResult:
    """The outcomes of a burst, in prompt order."""

    long: list[Outcome]
    short: list[Outcome]
    # From the first long request's start to the last request's end.
    wall_s: float

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.long + self.short if not o.answered]

    def summary(self) -> str:
        """Answered counts and the first error, for assertion messages."""
        answered = [sum(o.answered for o in group) for group in (self.long, self.short)]
        first = next((o.error for o in self.failed), None)
        return (
            f"answered {answered[0]}/{len(self.long)} long and {answered[1]}/{len(self.short)} "
            f"short requests in {self.wall_s:.1f} s; {len(self.failed)} failed, first: {first}"
        )


def burst(
    port: int,
    long_prompts: list[str],
    long_max_tokens: int,
    short_prompts: list[str],
    short_max_tokens: int,
    pause_s: float,
    timeout_s: float,
) -> BurstResult:
    """The long requests at once, then after ``pause_s`` the short ones, all connecting at once.

    Every thread is joined within ``timeout_s`` of its request's start (plus the pause).
    """
    long_out: list[Optional[Outcome]] = [None] * len(long_prompts)
    short_out: list[Optional[Outcome]] = [None] * len(short_prompts)
    gate = threading.Barrier(len(short_prompts) + 1)

    def run(results, i, prompt, max_tokens, start):
        results[i] = complete(port, prompt, max_tokens, timeout_s, start)

    threads = [
        threading.Thread(target=run, args=(long_out, i, p, long_max_tokens, None), daemon=True)
        for i, p in enumerate(long_prompts)
    ]
    # The short clients are started (and parked on the barrier) before the long requests go.
    threads += [
        threading.Thread(target=run, args=(short_out, i, p, short_max_tokens, gate), daemon=True)
        for i, p in enumerate(short_prompts)
    ]
    for t in threads[len(long_prompts) :]:
        t.start()
    begin = time.perf_counter()
    for t in threads[: len(long_prompts)]:
        t.start()
    time.sleep(pause_s)
    gate.wait(timeout_s)
    for t in threads:
        t.join(max(0.0, begin + pause_s + timeout_s + 5 - time.perf_counter()))
    unfinished = Outcome(error="client thread still running")
    long_res = [o or unfinished for o in long_out]
    short_res = [o or unfinished for o in short_out]
    end = max([o.ended for o in long_res + short_res if o.ended] or [begin])
    return BurstResult(long_res, short_res, end - begin)


def burst_prompts(vocab: int) -> tuple[list[str], list[str]]:
    """The new user's long prompts and short ones: seeded random words of model_folder's word
    tokenizer over ``vocab`` token ids, one token each."""
    rng = random.Random(0)
    words = range(len(SPECIAL_TOKENS), vocab)

    def text(n):
        return " ".join(word(rng.choice(words)) for _ in range(n))

    long_prompts = [text(LONG_PROMPT_TOKENS) for _ in range(LONG_REQUESTS)]
    return long_prompts, [text(3 + i % 5) for i in range(BURST)]


def new_user_burst(port: int, vocab: int, timeout_s: float) -> BurstResult:
    """The new user's burst (``burst_prompts``) against the server on ``port``."""
    long_prompts, short_prompts = burst_prompts(vocab)
    return burst(port, long_prompts, LONG_MAX_TOKENS, short_prompts, SHORT_MAX_TOKENS, PAUSE_S,
                 timeout_s)
