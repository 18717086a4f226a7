"""The decoding thread: one ``EngineCore`` stepped on a thread of its own.

HTTP handlers (on the asyncio loop) ``submit`` checked requests, one ``Submission`` per prompt
with its choices, and read their ``Piece``s from an ``asyncio.Queue``; the thread hands each
new submission to the engine's scheduler (``add_choices``: the prompt fed once, its cache
shared by the choices; the waiting queue is the only one: it admits up to ``max_batch_size``
requests), steps it, turns each choice's tokens into text (``TextStream``) and hands the
pieces, with their logprobs, over with ``call_soon_threadsafe``. ``max_batch_size +
max_queue`` choices are accepted at once: the next request is refused with 503 before
anything is queued, however fast the thread admits.

A request ends as its ``StepResult`` says (an end-of-sequence token, ``max_tokens``), with its
stop string (the text stream finds it; the engine is told it finished with ``"stop"``), or
when its handler ``cancel``s it (a client that hung up): the engine frees its row or blocks at
once. A step that raises ends the requests it held with an error; the thread goes on with the
next (any other fault of the thread ends every request it holds, and it goes on too; a fault
that ends the thread still ends them, and new requests are refused). With tensor parallelism
the thread runs on rank 0 and sends each step's plan to the other ranks first
(``lockstep.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from ..decoding.engine_core import EngineCore
from ..decoding.plan import StepPlan, StepResult, TokenLogprobs
from ..decoding.request import FinishReason
from ..decoding.sampling import Sampler
from ..decoding.sampling_params import SamplingParams
from .lockstep import Lockstep
from .metrics import ServerMetrics
from .protocol import APIError
from .responses import LogprobRow, usage_counts
from .text_stream import Piece, TextStream

log = logging.getLogger("mlx_batched_decode.server")


@dataclass(eq=False)
class Choice:
    """One choice of a submission: the engine request ``uid``, its tokens' text (``stream``),
    ``index`` in the response's choices (and the seed's stream it samples from)."""

    index: int
    stream: TextStream
    uid: Optional[int] = None
    ended: bool = False


@dataclass
class PromptRows:
    """The logprobs of a prompt's tokens fed in one step, for the choices of ``first`` ..
    (one prompt's choices share them)."""

    first: int
    rows: list[LogprobRow]


@dataclass(eq=False)
class Submission:
    """One accepted prompt and its choices, shared by its handler and the decoding thread.

    ``pieces`` receives the choices' ``Piece``s (``index`` says whose) and ``PromptRows``, then
    ``None`` once every choice has ended (``error`` set if it failed); several submissions of
    one request may share it. ``stop_tokens`` (the tokenizer's end-of-sequence ids) end a
    choice; ``prompt_logprobs``: the alternatives each prompt token's logprob comes with
    (``None``: none reported); ``grammar``: the ``GrammarSpec`` its answers match, from the
    token after ``grammar_after`` if that is set. ``cached_tokens`` counts for its usage."""

    prompt: list[int]
    max_tokens: int
    choices: list[Choice]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    pieces: asyncio.Queue
    stop_tokens: Sequence[int] = ()
    prompt_logprobs: Optional[int] = None
    grammar: Optional[Any] = None
    grammar_after: Optional[int] = None
    arrived: float = field(default_factory=time.perf_counter)
    last_emitted: Optional[float] = None
    ended: bool = False
    error: Optional[str] = None
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return sum(choice.stream.tokens for choice in self.choices)

    def put(self, piece: Union[Piece, PromptRows, None]) -> None:
        self.loop.call_soon_threadsafe(self.pieces.put_nowait, piece)


def usage(submissions: Sequence[Submission]) -> dict:
    """The usage counts of one request's submissions: each prompt counted once."""
    return usage_counts(
        sum(len(s.prompt) for s in submissions),
        sum(s.completion_tokens for s in submissions),
        sum(s.cached_tokens for s in submissions),
    )


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
        # Set when the thread ended by a fault, not a stop: nothing is accepted any more.
        self._gone = False
        self._live: dict[int, tuple[Submission, Choice]] = {}
        # Every submission the thread took and has not ended (what a fault ends).
        self._held: list[Submission] = []
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

    def submit(self, submissions: Sequence[Submission]) -> None:
        """Accept one request's ``submissions`` (all or none) or raise ``APIError`` 503 (full,
        or shutting down); each choice counts."""
        count = sum(len(s.choices) for s in submissions)
        with self._lock:
            if self._stopping:
                raise APIError(503, "the server is shutting down", "unavailable_error")
            if self._gone:
                raise APIError(503, "the decoding thread is gone", "unavailable_error")
            if self._accepted + count > self.max_batch_size + self.max_queue:
                raise APIError(
                    503,
                    f"the server holds {self._accepted} requests, its most "
                    f"(--max-batch-size {self.max_batch_size} + --max-queue {self.max_queue})",
                    "unavailable_error",
                    "queue_full",
                    {"Retry-After": "1"},
                )
            self._accepted += count
            self._arrived += submissions
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
        try:
            self._loop()
        finally:
            # Ended by what no turn survives (not a stop): no request is left waiting.
            with self._lock:
                self._gone = not self._stopping
                waiting, self._arrived = self._held + self._arrived, []
            for submission in waiting:
                if not submission.ended:
                    self._fail(submission, "the decoding thread is gone")

    def _loop(self) -> None:
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
            self._held += arrived
            try:
                self._turn(arrived, cancels)
            except Exception as error:  # noqa: BLE001 - the thread must outlive any fault
                # Beyond a step's own failure (_step): what the engine holds is unknown now.
                log.exception("the decoding thread failed; the requests it held end")
                for submission in list(self._held):
                    self._fail(submission, f"the server failed: {error}")
            self._held = [s for s in self._held if not s.ended]

    def _turn(self, arrived: list[Submission], cancels: list[Submission]) -> None:
        """One turn of the thread: admissions, cancels, a step."""
        for submission in arrived:
            self._add(submission)
        for submission in cancels:
            self._end_all(submission, FinishReason.CANCELLED)
        plan = self.core.schedule()
        if plan is not None:
            if self.lockstep is not None:
                self.lockstep.send(plan)
            self._step(plan)
        self._update_gauges()

    def _add(self, submission: Submission) -> None:
        """Hand ``submission``'s choices to the engine's scheduler."""
        choices, params = submission.choices, submission.params
        if self.lockstep is not None and params.seed is None:
            # Every rank samples alike only from the same seed (each choice its own stream).
            params = dataclasses.replace(params, seed=random.getrandbits(64))
        try:
            samplers = [Sampler.from_params(params, choice.index) for choice in choices]
            uids = self.core.add_choices(
                submission.prompt, submission.max_tokens, samplers,
                stop_tokens=submission.stop_tokens, prompt_logprobs=submission.prompt_logprobs,
                grammar=submission.grammar, grammar_after=submission.grammar_after,
            )
        except Exception as error:  # noqa: BLE001 - checked before it was accepted: a bug
            log.exception("a request could not be added")
            self._fail(submission, str(error))
            return
        for choice, uid in zip(choices, uids):
            choice.uid = uid
            self._live[uid] = (submission, choice)

    def _step(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        try:
            result = self.core.run(plan)
        except Exception as error:  # noqa: BLE001 - the thread must outlive any one step
            log.exception("a decoder step failed; its requests end with an error")
            for uid in plan.uids:
                if uid in self._live:
                    self._fail(self._live[uid][0], f"the decoder step failed: {error}")
            return
        now = time.perf_counter()
        self.metrics.step_time.observe(now - start)
        self._count(result)
        for uid, entries in result.prompt_logprobs.items():
            if uid in self._live:
                submission, choice = self._live[uid]
                submission.put(PromptRows(choice.index, [_row(e) for e in entries]))
        for uid in result.finished:
            if uid in self._live and self._live[uid][1] is self._live[uid][0].choices[0]:
                self._live[uid][0].cached_tokens = result.cached_tokens[uid]
        for uid, tokens in result.tokens.items():
            if uid in self._live:
                self._emit(*self._live[uid], tokens, result.logprobs.get(uid), now)
        for uid in result.finished:
            if uid not in self._live:
                continue
            submission, choice = self._live.pop(uid)
            reason = result.reasons[uid]
            if reason is FinishReason.STOP:
                # The end-of-sequence token ended it: the stream finishes as on a stop sequence.
                piece = choice.stream.end_of_sequence()
            else:
                # It ended with no token of its own to say so (max_tokens 0).
                piece = Piece("", "", None, reason.value)
            piece.index = choice.index
            submission.put(piece)
            self._end(submission, choice, reason)

    def _emit(
        self, submission: Submission, choice: Choice, tokens: list[int],
        entries: Optional[list], now: float,
    ) -> None:
        if submission.last_emitted is None:
            self.metrics.ttft.observe(now - submission.arrived)
        else:
            self.metrics.itl.observe(now - submission.last_emitted)
        submission.last_emitted = now
        for i, token in enumerate(tokens):
            try:
                piece = choice.stream.feed(token)
            except Exception as error:  # noqa: BLE001 - one request's failure ends it alone
                log.exception("detokenizing a request failed")
                self._fail(submission, f"detokenizing failed: {error}")
                return
            piece.index = choice.index
            if entries is not None:
                piece.logprob = _row(entries[i])
            submission.put(piece)
            if piece.finish_reason is not None:
                # Its stop string, or its last token (the engine ends it in this step too).
                self._finish(submission, choice, FinishReason(piece.finish_reason))
                return

    def _finish(self, submission: Submission, choice: Choice, reason: FinishReason) -> None:
        """End ``choice`` with ``reason``: the engine frees what it held at once."""
        if choice.uid is not None and self._live.pop(choice.uid, None) is not None:
            request = self.core.finish(choice.uid, reason)
            if request is not None and choice is submission.choices[0]:
                submission.cached_tokens = request.prefix_hit_tokens
        self._end(submission, choice, reason)

    def _end_all(self, submission: Submission, reason: FinishReason) -> None:
        for choice in submission.choices:
            self._finish(submission, choice, reason)

    def _fail(self, submission: Submission, error: str) -> None:
        """End every choice of ``submission`` with ``error`` (the engine told, if it can be)."""
        submission.error = submission.error or error
        for choice in submission.choices:
            try:
                self._finish(submission, choice, FinishReason.ERROR)
            except Exception:  # noqa: BLE001 - the engine may be what failed
                log.exception("freeing a failed request failed")
                self._live.pop(choice.uid, None)
                self._end(submission, choice, FinishReason.ERROR)

    def _end(self, submission: Submission, choice: Choice, reason: FinishReason) -> None:
        if choice.ended:
            return
        choice.ended = True
        self.metrics.requests.labels(reason.value).inc()
        with self._lock:
            self._accepted -= 1
        if all(c.ended for c in submission.choices):
            submission.ended = True
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


def _row(entry: TokenLogprobs) -> LogprobRow:
    return LogprobRow(entry.token, entry.logprob, entry.top)
