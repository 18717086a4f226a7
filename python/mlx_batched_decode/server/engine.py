"""The decoding thread: one ``EngineCore`` stepped on a thread of its own.

HTTP handlers (on the asyncio loop) ``submit`` checked requests and read each one's ``Piece``s
from an ``asyncio.Queue``; the thread hands each new submission to the engine's scheduler
(whose waiting queue is the only one: it admits up to ``max_batch_size`` requests), steps it,
turns each request's tokens into text (``TextStream``) and hands the pieces over with
``call_soon_threadsafe``. ``max_batch_size + max_queue`` requests are accepted at once: the
next one is refused with 503 before anything is queued, however fast the thread admits.

A request ends as its ``StepResult`` says (an end-of-sequence token, ``max_tokens``), with its
stop string (the text stream finds it; the engine is told it finished with ``"stop"``), or
when its handler ``cancel``s it (a client that hung up): the engine frees its row or blocks at
once. A step that raises ends the requests it held with an error; the thread goes on with the
next. With tensor parallelism the thread runs on rank 0 and sends each step's plan to the other
ranks first (``lockstep.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..decoding.engine_core import EngineCore
from ..decoding.plan import StepPlan, StepResult
from ..decoding.request import FinishReason
from ..decoding.sampling import Sampler
from .lockstep import Lockstep
from .metrics import ServerMetrics
from .protocol import APIError, usage_counts
from .text_stream import Piece, TextStream

log = logging.getLogger("mlx_batched_decode.server")


@dataclass(eq=False)
class Submission:
    """One accepted request, shared by its handler and the decoding thread.

    ``pieces`` receives the request's ``Piece``s, then ``None`` once it has ended (``error``
    set if it failed). ``completion_tokens`` and ``cached_tokens`` count for its usage.
    ``temperature``, ``top_p`` and ``seed`` are how it samples (``sampler``); ``stop_tokens``
    (the tokenizer's end-of-sequence ids) end it."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int]
    stream: TextStream
    loop: asyncio.AbstractEventLoop
    stop_tokens: Sequence[int] = ()
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
    """Steps ``core`` on its own thread for the submissions of the HTTP handlers.

    Args:
        core: the ``EngineCore`` (this thread is the only one that touches it but for
            ``check_request``); its scheduler's ``max_batch_size`` bounds the requests it runs.
        metrics: the server's metrics, updated after every step.
        max_queue: the most accepted requests waiting beyond ``max_batch_size``.
        lockstep: with tensor parallelism (rank 0), where each step's plan goes first; a
            submission without a seed then gets one.
    """

    def __init__(
        self,
        core: EngineCore,
        metrics: ServerMetrics,
        max_queue: int,
        lockstep: Optional[Lockstep] = None,
    ):
        self.max_batch_size = core.config.scheduler.max_batch_size
        if self.max_batch_size is None:
            raise ValueError("[Engine] the engine's scheduler needs a max_batch_size")
        self.core = core
        self.metrics = metrics
        self.max_queue = max_queue
        self.lockstep = lockstep
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Handed over from the handlers; the thread moves them into the scheduler at once.
        self._arrived: list[Submission] = []
        self._cancels: list[Submission] = []
        self._accepted = 0
        self._stopping = False
        self._live: dict[int, Submission] = {}
        self._thread = threading.Thread(target=self._run, name="mbd-decoder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def accepted(self) -> int:
        """Requests accepted and not yet ended."""
        return self._accepted

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
            self._arrived.append(submission)
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
                while not (self._arrived or self._cancels or self._live or self._stopping):
                    self._wake.wait()
                if self._stopping and not (self._arrived or self._live):
                    if self.lockstep is not None:
                        self.lockstep.send(None)
                    return
                arrived, self._arrived = self._arrived, []
                cancels, self._cancels = self._cancels, []
            for submission in arrived:
                self._add(submission)
            for submission in cancels:
                self._finish(submission, FinishReason.CANCELLED)
            plan = self.core.schedule()
            if plan is not None:
                if self.lockstep is not None:
                    self.lockstep.send(plan)
                self._step(plan)
            self._update_gauges()

    def _add(self, submission: Submission) -> None:
        """Hand ``submission`` to the engine's scheduler."""
        if self.lockstep is not None and submission.seed is None:
            # Every rank samples alike only from the same seed.
            submission.seed = random.getrandbits(63)
            submission.sampler = Sampler(submission.temperature, submission.top_p, submission.seed)
        try:
            submission.uid = self.core.add_request(
                submission.prompt, submission.max_tokens,
                stop_tokens=submission.stop_tokens, sampler=submission.sampler,
            )
        except ValueError as error:
            # Checked before it was accepted: this is a bug, reported to the client alone.
            log.exception("a request could not be added")
            self._end(submission, FinishReason.ERROR, str(error))
            return
        self._live[submission.uid] = submission

    def _step(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        try:
            result = self.core.run(plan)
        except Exception as error:  # noqa: BLE001 - the thread must outlive any one step
            log.exception("a decoder step failed; its requests end with an error")
            for uid in plan.uids:
                submission = self._live.get(uid)
                if submission is not None:
                    message = f"the decoder step failed: {error}"
                    self._finish(submission, FinishReason.ERROR, message)
            return
        now = time.perf_counter()
        self.metrics.step_time.observe(now - start)
        self._count(result)
        for uid in result.finished:
            if uid in self._live:
                self._live[uid].cached_tokens = result.cached_tokens[uid]
        for uid, tokens in result.tokens.items():
            submission = self._live.get(uid)
            if submission is not None:
                self._emit(submission, tokens, now)
        for uid in result.finished:
            submission = self._live.pop(uid, None)
            if submission is None:
                continue
            reason = result.reasons[uid]
            if reason is FinishReason.STOP:
                # The end-of-sequence token ended it: the stream finishes as on a stop sequence.
                submission.put(submission.stream.end_of_sequence())
            self._end(submission, reason)

    def _emit(self, submission: Submission, tokens: list[int], now: float) -> None:
        if submission.last_emitted is None:
            self.metrics.ttft.observe(now - submission.arrived)
        else:
            self.metrics.itl.observe(now - submission.last_emitted)
        submission.last_emitted = now
        for token in tokens:
            try:
                piece = submission.stream.feed(token)
            except Exception as error:  # noqa: BLE001 - one request's failure ends it alone
                log.exception("detokenizing a request failed")
                self._finish(submission, FinishReason.ERROR, f"detokenizing failed: {error}")
                return
            submission.put(piece)
            if piece.finish_reason is not None:
                # Its stop string, or its last token (the engine ends it in this step too).
                self._finish(submission, FinishReason(piece.finish_reason))
                return

    def _finish(
        self, submission: Submission, reason: FinishReason, error: Optional[str] = None
    ) -> None:
        """End ``submission`` with ``reason``: the engine frees what it held at once."""
        if submission.uid is not None and self._live.pop(submission.uid, None) is not None:
            request = self.core.finish(submission.uid, reason)
            if request is not None:
                submission.cached_tokens = request.prefix_hit_tokens
        self._end(submission, reason, error)

    def _end(
        self, submission: Submission, reason: FinishReason, error: Optional[str] = None
    ) -> None:
        if submission.ended:
            return
        submission.ended = True
        submission.error = error
        self.metrics.requests.labels(reason.value).inc()
        with self._lock:
            self._accepted -= 1
        submission.put(None)

    def _count(self, result: StepResult) -> None:
        metrics = self.metrics
        metrics.prompt_tokens.inc(result.prompt_tokens)
        metrics.prefix_hit_tokens.inc(result.prefix_hit_tokens)
        metrics.generation_tokens.inc(sum(len(t) for t in result.tokens.values()))
        metrics.draft_tokens.inc(result.draft_tokens)
        metrics.accepted_tokens.inc(result.accepted_tokens)

    def _update_gauges(self) -> None:
        snapshot = self.core.snapshot()
        self.metrics.running.set(snapshot.running)
        self.metrics.waiting.set(snapshot.waiting)
        self.metrics.kv_usage.set(snapshot.kv_usage)
