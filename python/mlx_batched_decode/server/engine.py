"""The decoding thread: one ``BatchedDecoder`` stepped on a thread of its own.

HTTP handlers (on the asyncio loop) ``submit`` checked requests and read each one's ``Piece``s
from an ``asyncio.Queue``; the thread admits up to ``max_batch_size`` requests into the decoder,
steps it, turns each request's tokens into text (``TextStream``) and hands the pieces over with
``call_soon_threadsafe``. ``max_batch_size + max_queue`` requests are accepted at once: the
next one is refused with 503 before anything is queued, however fast the thread admits.

A request ends with its stop sequence or ``max_tokens``, or when its handler ``cancel``s it (a
client that hung up): the decoder then drops it at the next step, its slot or blocks free. A
step that raises ends the requests it held with an error; the thread goes on with the next.
With tensor parallelism the thread runs on rank 0 and sends each step's plan to the other
ranks first (``lockstep.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from ..decoding.decoder import BatchedDecoder
from ..decoding.sampling import Sampler
from .lockstep import Admission, Lockstep, Plan
from .metrics import ServerMetrics
from .protocol import APIError, usage_counts
from .text_stream import Piece, TextStream

log = logging.getLogger("mlx_batched_decode.server")


@dataclass(eq=False)
class Submission:
    """One accepted request, shared by its handler and the decoding thread.

    ``pieces`` receives the request's ``Piece``s, then ``None`` once it has ended (``error``
    set if it failed). ``completion_tokens`` and ``cached_tokens`` count for its usage.
    ``temperature``, ``top_p`` and ``seed`` are how it samples (``sampler``)."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stream: TextStream
    loop: asyncio.AbstractEventLoop
    pieces: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    last_emitted: Optional[float] = None
    uid: Optional[int] = None
    ended: bool = False
    error: Optional[str] = None
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.temperature, self.top_p, self.seed)

    @property
    def completion_tokens(self) -> int:
        return self.stream.tokens

    def usage(self) -> dict:
        """Its usage counts (``usage_counts``)."""
        return usage_counts(len(self.prompt), self.completion_tokens, self.cached_tokens)

    def put(self, piece: Optional[Piece]) -> None:
        self.loop.call_soon_threadsafe(self.pieces.put_nowait, piece)


class Engine:
    """Steps ``decoder`` on its own thread for the submissions of the HTTP handlers.

    Args:
        decoder: the ``BatchedDecoder`` (this thread is the only one that touches it).
        metrics: the server's metrics, updated after every step.
        max_batch_size: the most requests the decoder holds at once.
        max_queue: the most accepted requests waiting for the decoder.
        lockstep: with tensor parallelism (rank 0), where each step's plan goes first; every
            submission then carries a seed.
    """

    def __init__(
        self,
        decoder: BatchedDecoder,
        metrics: ServerMetrics,
        max_batch_size: int,
        max_queue: int,
        lockstep: Optional[Lockstep] = None,
    ):
        self.decoder = decoder
        self.metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._incoming: deque[Submission] = deque()
        self._cancels: list[Submission] = []
        self._accepted = 0
        self._stopping = False
        self._live: dict[int, Submission] = {}
        self.lockstep = lockstep
        # Requests taken out of the decoder since the last plan (finished early, or failed).
        self._dropped: list[int] = []
        self._counted = {name: 0 for name in _COUNTERS}
        self._thread = threading.Thread(target=self._run, name="mbd-decoder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, submission: Submission) -> None:
        """Accept ``submission`` or raise ``APIError`` 503 (full, or shutting down)."""
        with self._lock:
            if self._stopping:
                raise APIError(503, "the server is shutting down", "unavailable_error")
            if self._accepted >= self.max_batch_size + self.max_queue:
                raise APIError(
                    503,
                    f"the server holds {self._accepted} requests, its most "
                    f"(--max-batch-size {self.max_batch_size} + --max-queue {self.max_queue})",
                    "unavailable_error",
                    "queue_full",
                    {"Retry-After": "1"},
                )
            self._accepted += 1
            self._incoming.append(submission)
            self._wake.notify()

    def cancel(self, submission: Submission) -> None:
        """End ``submission`` early (its client is gone); nothing more is sent to it."""
        with self._lock:
            if not submission.ended:
                self._cancels.append(submission)
                self._wake.notify()

    def stop(self, timeout: float) -> None:
        """Accept nothing more, let the requests held end, then end the thread (waiting at most
        ``timeout`` seconds for it)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._incoming or self._cancels or self._live or self._stopping):
                    self._wake.wait()
                if self._stopping and not (self._incoming or self._live):
                    if self.lockstep is not None:
                        self.lockstep.send(Plan(cancels=self._take_dropped(), stop=True))
                    return
                cancels, self._cancels = self._cancels, []
                for submission in cancels:
                    if submission in self._incoming:
                        self._incoming.remove(submission)
                admitted = []
                while self._incoming and len(self._live) + len(admitted) < self.max_batch_size:
                    admitted.append(self._incoming.popleft())
            for submission in cancels:
                self._drop(submission)
                self._end(submission, "cancelled")
            plan = Plan(cancels=self._take_dropped(), step=False)
            for submission in admitted:
                if self._admit(submission):
                    plan.admits.append(Admission(submission.prompt, submission.max_tokens,
                                                 submission.temperature, submission.top_p,
                                                 submission.seed))
            plan.step = bool(self._live)
            if self.lockstep is not None:
                self.lockstep.send(plan)
            if plan.step:
                self._step()
            self._update_gauges()

    def _take_dropped(self) -> list[int]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def _admit(self, submission: Submission) -> bool:
        """Add ``submission`` to the decoder; whether it went in."""
        try:
            submission.uid = self.decoder.add_request(
                submission.prompt, submission.max_tokens, sampler=submission.sampler
            )
        except ValueError as error:
            # Checked before it was accepted: this is a bug, reported to the client alone.
            log.exception("a request could not be added")
            self._end(submission, "error", str(error))
            return False
        self._live[submission.uid] = submission
        return True

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            result = self.decoder.step()
        except Exception as error:  # noqa: BLE001 - the thread must outlive any one step
            log.exception("a decoder step failed; its requests end with an error")
            for submission in list(self._live.values()):
                self._drop(submission)
                self._end(submission, "error", f"the decoder step failed: {error}")
            return
        now = time.perf_counter()
        self.metrics.step_time.observe(now - start)
        for uid, tokens in result.tokens.items():
            submission = self._live.get(uid)
            if submission is not None:
                self._emit(submission, tokens, now)
        for uid in result.finished:
            self.decoder.stats.requests.pop(uid, None)
            submission = self._live.pop(uid, None)
            if submission is not None:
                # The decoder's budget ran out with the last token (already sent as "length").
                self._end(submission, "length")

    def _emit(self, submission: Submission, tokens: list[int], now: float) -> None:
        if submission.last_emitted is None:
            self.metrics.ttft.observe(now - submission.arrived)
            timing = self.decoder.stats.requests.get(submission.uid)
            submission.cached_tokens = 0 if timing is None else timing.prefix_hit_tokens
        else:
            self.metrics.itl.observe(now - submission.last_emitted)
        submission.last_emitted = now
        for token in tokens:
            try:
                piece = submission.stream.feed(token)
            except Exception as error:  # noqa: BLE001 - one request's failure ends it alone
                log.exception("detokenizing a request failed")
                self._drop(submission)
                self._end(submission, "error", f"detokenizing failed: {error}")
                return
            submission.put(piece)
            if piece.finish_reason is not None:
                self._drop(submission)
                self._end(submission, piece.finish_reason)
                return

    def _drop(self, submission: Submission) -> None:
        """Take ``submission`` out of the decoder (its slot or blocks free now)."""
        if submission.uid is not None and self._live.pop(submission.uid, None) is not None:
            self.decoder.cancel(submission.uid)
            self.decoder.stats.requests.pop(submission.uid, None)
            self._dropped.append(submission.uid)

    def _end(self, submission: Submission, reason: str, error: Optional[str] = None) -> None:
        if submission.ended:
            return
        submission.ended = True
        submission.error = error
        self.metrics.requests.labels(reason).inc()
        with self._lock:
            self._accepted -= 1
        submission.put(None)

    def _update_gauges(self) -> None:
        decoder, metrics = self.decoder, self.metrics
        with self._lock:
            metrics.waiting.set(len(self._incoming))
        metrics.running.set(len(self._live))
        cache = decoder.paged_cache
        if cache is None:
            metrics.kv_usage.set(len(self._live) / self.max_batch_size)
        else:
            capacity = cache.allocator.max_blocks or cache.num_blocks
            metrics.kv_usage.set(cache.blocks_in_use / max(capacity, 1))
        for name in _COUNTERS:
            value = getattr(decoder.stats, name)
            getattr(metrics, _COUNTERS[name]).inc(value - self._counted[name])
            self._counted[name] = value


# DecodeStats counters -> the ServerMetrics counters that follow them.
_COUNTERS: dict[str, str] = {
    "prompt_tokens": "prompt_tokens",
    "prefix_hit_tokens": "prefix_hit_tokens",
    "generated_tokens": "generation_tokens",
    "draft_tokens": "draft_tokens",
    "accepted_tokens": "accepted_tokens",
}

