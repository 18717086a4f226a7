"""``Scheduler``: which tokens of which request go into the next step; host ints only.

It owns the requests: the waiting queue (arrival order) and the running rows (row ``b`` is the
``b``-th running request, prefilling or decoding). ``schedule`` admits waiting requests while
``max_batch_size`` and the KV layout's capacity allow (a paged request reserves blocks for its
whole length and starts past its cached prefix), then plans the step: every running request's
decode tokens (1, or k + 1 with a draft model) always, then chunks of the prompts being fed,
first come first served, up to ``max_step_tokens`` (and, where rings keep windowed layers, at
most the smallest window per chunk). ``update`` takes the tokens the runner produced, applies
stop tokens, ``max_tokens`` and the ends of grammars the runner reports, and ends finished requests: their rows are released (the last
row's request moves in, told to the runner by the next plan) and nothing of them is kept.

A request of n choices is admitted with rows held for its n - 1 forks; its prompt is fed once,
and the step that ends it samples every choice's first token from its last logits. The forks
then take their rows, starting from its keys/values (``KVLayout.fork``). The plan and the
result are plain records (``plan.py``); no array is made here.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

from .config import SchedulerConfig
from .layouts.base import KVLayout
from .plan import Admission, Release, RunnerOutput, Snapshot, StepPlan, StepResult
from .request import FinishReason, Request, RequestStatus


class Scheduler:
    """Plans steps for the requests it holds.

    Args:
        config: the token budget and the most requests at once.
        layout: the target model's KV layout, whose capacity admission checks.
        num_draft_tokens: k, draft tokens per running request and step (0 without a draft).
        chunk_limit: the most prompt tokens one request feeds in a step.
    """

    def __init__(
        self, config: SchedulerConfig, layout: KVLayout, num_draft_tokens: int, chunk_limit: int
    ):
        self.config = config
        self.max_batch_size = config.max_batch_size
        self.layout = layout
        self.num_draft_tokens = num_draft_tokens
        self.chunk_limit = chunk_limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Rows released and admitted since the last plan, in order.
        self._row_changes: list[Union[Release, Admission]] = []
        self._admitted_hits = 0
        # Rows held for the forks of admitted requests whose prompts are being fed.
        self._held_rows = 0

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def check(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """``ValueError`` unless a request of ``prompt_len`` prompt tokens, ``max_tokens`` and
        ``n`` choices can be served: a prompt of at least one token, ``max_tokens >= 0`` (0:
        its prompt only), rows for its choices, and no more than the layout can ever hold.
        Nothing is queued."""
        if prompt_len < 1:
            raise ValueError("[BatchedDecoder] a prompt needs at least one token")
        if max_tokens < 0:
            raise ValueError(f"[BatchedDecoder] max_tokens must be >= 0, got {max_tokens}")
        if n < 1 or (self.max_batch_size is not None and n > self.max_batch_size):
            raise ValueError(
                f"[BatchedDecoder] n must be in [1, max_batch_size={self.max_batch_size}], got {n}"
            )
        self.layout.check(prompt_len, max_tokens, n)

    def add(self, request: Request) -> None:
        """Queue ``request`` (checked: ``check``) and admit what fits now."""
        self.check(len(request.prompt), request.max_tokens, 1 + len(request.forks))
        self.waiting.append(request)
        self._admit_waiting()

    def add_running(self, request: Request) -> None:
        """Give ``request`` (whose first ``num_cached`` positions the caller stores) a row at
        once, past any waiting request; ``ValueError`` when none is free."""
        if not self._rows_free(1):
            raise ValueError(
                f"[BatchedDecoder] all {self.max_batch_size} rows are taken: a prefilled "
                "request needs a free one"
            )
        if self.layout.admit(request) is None:
            raise ValueError("[BatchedDecoder] the KV layout has no room for this request now")
        self._start(request, 0)

    def _rows_free(self, count: int) -> bool:
        """Whether ``count`` more rows fit beside the running ones and those held for forks."""
        taken = len(self.running) + self._held_rows
        return self.max_batch_size is None or taken + count <= self.max_batch_size

    def _start(self, request: Request, hit: int) -> None:
        """``request`` takes the next row, ``hit`` of its prompt tokens cached already; rows
        are held for its forks."""
        row = len(self.running)
        request.status = RequestStatus.PREFILLING
        request.prefix_hit_tokens = hit
        self.running.append(request)
        self._held_rows += len(request.forks)
        forks = [(f.uid, f.sampler) for f in request.forks]
        self._row_changes.append(
            Admission(request.uid, row, request.sampler, forks,
                      grammar=request.grammar, grammar_after=request.grammar_after)
        )

    def _admit_waiting(self) -> None:
        """Give waiting requests rows, first come first, while ``max_batch_size`` and the
        layout hold them; a request starts past the cached blocks its prompt begins with."""
        while self.waiting:
            request = self.waiting[0]
            if not self._rows_free(1 + len(request.forks)):
                return
            feeding = [r for r in self.running if r.prefilling]
            if self.layout.awaits_shared_blocks(request, feeding):
                return
            hit = self.layout.admit(request)
            if hit is None:
                return
            self.waiting.popleft()
            request.num_cached = hit
            self._admitted_hits += hit
            self._start(request, hit)

    @contextmanager
    def limited(self, max_batch_size: Optional[int]) -> Iterator[None]:
        """While in the block, at most ``max_batch_size`` requests run (``None``: the config's)."""
        if max_batch_size is None:
            yield
            return
        saved, self.max_batch_size = self.max_batch_size, max_batch_size
        try:
            yield
        finally:
            self.max_batch_size = saved

    def schedule(self) -> Optional[StepPlan]:
        """The next step's plan, or ``None`` when no request runs (the row changes it would
        carry wait for the next plan)."""
        self._admit_waiting()
        if not self.running:
            return None
        k = self.num_draft_tokens
        running = [not r.prefilling for r in self.running]
        budget = self.config.max_step_tokens - (k + 1) * sum(running)
        plan = StepPlan(
            row_changes=self.take_row_changes(),
            uids=[r.uid for r in self.running],
            seq_lens=[r.num_cached for r in self.running],
            num_draft_tokens=k,
        )
        for request, run in zip(self.running, running):
            count = 0
            if request.prefilling and budget > 0:
                count = min(budget, self.chunk_limit, len(request.prompt) - request.num_cached)
                budget -= count
            chunk = request.prompt[request.num_cached : request.num_cached + count]
            plan.next_tokens.append(request.next_token if run else None)
            plan.chunks.append(chunk)
            # Requests whose chunk ends their prompt sample their first token.
            plan.ending.append(bool(chunk) and request.num_cached + count == len(request.prompt))
        for row, (request, chunk) in enumerate(zip(self.running, plan.chunks)):
            # A prompt's first chunk, its last token aside.
            first = min(len(chunk), len(request.prompt) - 1)
            if request.num_cached == 0 and first > 0:
                plan.first_chunks.append((row, first))
            end = request.num_cached + len(chunk)
            if chunk and request.prompt_logprobs is not None:
                after = request.prompt[end] if end < len(request.prompt) else -1
                plan.prompt_logprobs.append((row, request.prompt_logprobs, after))
            samples = plan.next_tokens[row] is not None or plan.ending[row]
            plan.contexts.append(self._context(request) if samples else None)
        # Room for the longest prompt being fed at once: its chunks grow no cache.
        plan.reserve_len = max(
            (len(r.prompt) for r, c in zip(self.running, plan.chunks) if c), default=0
        )
        self.layout.prepare(plan)
        return plan

    @staticmethod
    def _context(request: Request) -> Optional[list[int]]:
        """The last tokens its (and its forks') penalties read, ``None`` when none does: its
        prompt, then its tokens (the last one being the token the step feeds)."""
        size = max(
            (s.params.context_size for s in request.samplers if s is not None), default=0
        )
        if not size:
            return None
        # The whole history is read only as far back as the longest window.
        tail = request.tokens[-size:]
        return request.prompt[max(len(request.prompt) - (size - len(tail)), 0):] + tail

    def take_row_changes(self) -> list[Union[Release, Admission]]:
        """The rows released and admitted since the last plan, in order, handed over once."""
        changes, self._row_changes = self._row_changes, []
        return changes

    def update(self, plan: StepPlan, output: RunnerOutput) -> StepResult:
        """Apply the runner's ``output`` (each row's new tokens, its forks' first ones) to the
        plan's requests: stop tokens, ``max_tokens`` and the runner's ``grammar_ends`` end them, forks take their rows; the
        result says what each emitted, which finished and why."""
        result = StepResult(
            prompt_tokens=sum(map(len, plan.chunks)) + self._admitted_hits,
            prefix_hit_tokens=self._admitted_hits,
            draft_tokens=output.draft_tokens,
            accepted_tokens=output.accepted_tokens,
        )
        self._admitted_hits = 0
        finished_rows = []
        for row, (request, chunk) in enumerate(zip(self.running, plan.chunks)):
            out = output.tokens[row]
            # Every token's keys/values but the last emitted one are now in the caches.
            request.num_cached += len(chunk) if chunk else len(out or ())
            if chunk:
                self.layout.register(request)
            if row in output.prompt_logprobs:
                result.prompt_logprobs[request.uid] = output.prompt_logprobs[row]
            if not request.prefilling:
                request.status = RequestStatus.RUNNING
            if not out:
                continue
            if request.forks:
                self._start_forks(request, row, output.forks.get(row, []), output, result)
            reason = self._emit(request, out, output.logprobs[row], result)
            reason = reason or output.grammar_ends.get(request.uid)
            if reason is not None:
                finished_rows.append((row, reason))
        for row, reason in reversed(finished_rows):
            request = self.running[row]
            result.finished.insert(0, request.uid)
            result.reasons[request.uid] = reason
            result.cached_tokens[request.uid] = request.prefix_hit_tokens
            self._remove(row, reason)
        result.snapshot = self.snapshot()
        return result

    @staticmethod
    def _emit(
        request: Request, out: list[int], logprobs: Optional[list], result: StepResult
    ) -> Optional[FinishReason]:
        """Add the tokens ``out`` (and their ``logprobs``) that ``request`` emits, up to a stop
        token or ``max_tokens``, to it and to ``result``; returns why it ends, if it does."""
        emitted, reason = [], None
        for token in out:
            if len(request.tokens) + len(emitted) >= request.max_tokens:
                # Only with max_tokens 0: its prompt was all it asked for.
                reason = FinishReason.LENGTH
                break
            if token in request.stop_tokens:
                reason = FinishReason.STOP
                break
            emitted.append(token)
            if len(request.tokens) + len(emitted) >= request.max_tokens:
                reason = FinishReason.LENGTH
                break
        # A request that goes on emitted all of ``out``: its last token is the next to feed.
        request.tokens += emitted
        if emitted:
            result.tokens[request.uid] = emitted
            if logprobs is not None:
                result.logprobs[request.uid] = logprobs[: len(emitted)]
        return reason

    def _start_forks(
        self,
        request: Request,
        row: int,
        firsts: Sequence[tuple[int, int, Optional[Any]]],
        output: RunnerOutput,
        result: StepResult,
    ) -> None:
        """``request``'s prompt is fed: each fork still held takes the first token it sampled
        (``firsts``: uid, token, logprobs) and a row starting from ``request``'s; one that
        ends with it takes none."""
        forks = {f.uid: f for f in request.forks}
        for uid, token, logprobs in firsts:
            fork = forks.pop(uid, None)
            if fork is None:
                continue
            self._held_rows -= 1
            fork.num_cached = request.num_cached
            fork.prefix_hit_tokens = request.prefix_hit_tokens
            reason = self._emit(fork, [token], None if logprobs is None else [logprobs], result)
            reason = reason or output.grammar_ends.get(fork.uid)
            if reason is not None:
                self.layout.drop_fork(request)
                fork.status, fork.finish_reason = RequestStatus.FINISHED, reason
                result.finished.append(fork.uid)
                result.reasons[fork.uid] = reason
                result.cached_tokens[fork.uid] = fork.prefix_hit_tokens
                continue
            self.layout.fork(request, fork)
            fork.status = RequestStatus.RUNNING
            self._row_changes.append(
                Admission(fork.uid, len(self.running), fork.sampler,
                          source=(row, request.num_cached))
            )
            self.running.append(fork)
        request.forks = list(forks.values())

    def finish(self, uid: int, reason: FinishReason = FinishReason.CANCELLED) -> Optional[Request]:
        """End request ``uid``, waiting or running, with ``reason`` (a client that hung up, a
        stop string found in its text): what it holds is freed at once and it emits nothing
        more; forks whose prompt it was feeding end with it. Returns the request, or ``None``
        when no such request is held."""
        row = next((i for i, r in enumerate(self.running) if r.uid == uid), None)
        if row is not None:
            request = self.running[row]
            for fork in request.forks:
                self._drop_fork(request, fork, reason)
            request.forks = []
            self._remove(row, reason)
            return request
        for request in self.waiting:
            if request.uid == uid:
                # Waiting for room: it holds nothing yet, nor do its forks.
                self.waiting.remove(request)
                for choice in [request, *request.forks]:
                    choice.status, choice.finish_reason = RequestStatus.FINISHED, reason
                return request
        for parent in [*self.running, *self.waiting]:
            fork = next((f for f in parent.forks if f.uid == uid), None)
            if fork is not None:
                if parent in self.running:
                    self._drop_fork(parent, fork, reason)
                else:
                    fork.status, fork.finish_reason = RequestStatus.FINISHED, reason
                parent.forks.remove(fork)
                return fork
        return None

    def _drop_fork(self, parent: Request, fork: Request, reason: FinishReason) -> None:
        """A fork of ``parent`` (admitted) ends before taking its row: what was held goes back."""
        self._held_rows -= 1
        self.layout.drop_fork(parent)
        fork.status, fork.finish_reason = RequestStatus.FINISHED, reason

    def _remove(self, row: int, reason: FinishReason) -> None:
        """Row ``row``'s request ends; the last row's moves into its row."""
        request = self.running[row]
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        last = len(self.running) - 1
        self._row_changes.append(Release(row, last, self.running[last].num_cached))
        self.layout.free(request.uid)
        self.running[row] = self.running[last]
        self.running.pop()

    def snapshot(self) -> Snapshot:
        """The counts a server reports now."""
        usage = self.layout.usage()
        if usage is None:
            usage = (len(self.running), self.max_batch_size or len(self.running))
        return Snapshot(len(self.running), len(self.waiting), *usage)
