"""``ModelRunner``: executes a step plan on the model (and its draft) and samples.

It applies the plan's row changes to the KV layouts (a released row compacted, an admitted
request's row and sampler), then runs the step: without a draft model, one packed forward pass
over every running row's token and every prompt chunk; with one, the draft's proposals first
(``speculative``) and the target's pass verifying them. Each pass builds the step's one context
(the layout's) shared by every layer. The target's logits are computed only for the rows that
sample (a running row's k + 1 tokens, a chunk that ends its prompt) and the chunks of prompts
whose logprobs are asked, and every row is sampled in one batched pass (``sample_rows``), each
with its request's sampler over its context (penalties), the forks of a request whose prompt
ends from its last logits. One evaluation per step, then the host reads the sampled tokens and
the logprobs asked for.

Grammar-constrained requests (structured output) keep a ``GrammarMatcher`` here, per choice,
made when their admission arrives. A step whose sampled rows include constrained ones starts
the forward pass (``mx.async_eval``), fills those rows' token bitmasks on the host meanwhile
(llguidance's threads; a running row's k + 1 verification rows get the masks after each
draft token in turn), and ``sample_rows`` applies them to those rows alone; the emitted tokens
are then consumed into the matchers. Steps without constrained rows do none of this.

Dimension legend: B = rows of the step, R = running rows, k = draft tokens per running row.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Optional, Sequence, Union

import mlx.core as mx

from .grammar import GrammarCompiler, GrammarMatcher, MaskRequest, fill_bitmasks
from .layouts.base import KVLayout
from .packing import pack_contexts, pack_tokens
from .plan import Admission, Release, RunnerOutput, StepPlan, TokenLogprobs
from .request import FinishReason
from .sampling import Sampler, prompt_logprobs, sample_rows
from .speculative import accepted_length, draft_proposals


# One layer's keys and values, as ``KVLayout.load`` takes them.
KeysValues = tuple[mx.array, mx.array]


class ModelRunner:
    """Runs plans on ``target`` (a ``KVLayout``), speculatively with ``draft`` (another);
    ``grammar_compiler`` makes the matchers of constrained requests."""

    def __init__(
        self, target: KVLayout, draft: Optional[KVLayout] = None,
        grammar_compiler: Optional[GrammarCompiler] = None,
    ):
        self.target = target
        self.draft = draft
        self.grammar_compiler = grammar_compiler
        # Each constrained choice's matcher, from its request's admission until it ends.
        self.grammars: dict[int, GrammarMatcher] = {}
        # Each running request's sampler (None: the step's default).
        self.samplers: dict[int, Optional[Sampler]] = {}
        # The forks of requests feeding their prompts, and the forks' samplers until they run.
        self.forks: dict[int, list[int]] = {}
        self.fork_samplers: dict[int, Optional[Sampler]] = {}

    @property
    def layouts(self) -> list[KVLayout]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    def forget(self, uids: Sequence[int]) -> None:
        """Drop what it keeps of requests that ended (their rows go with the next plan)."""
        for uid in uids:
            self.samplers.pop(uid, None)
            self.fork_samplers.pop(uid, None)
            self.grammars.pop(uid, None)
            for fork in self.forks.pop(uid, ()):
                self.fork_samplers.pop(fork, None)
                self.grammars.pop(fork, None)

    def execute(self, plan: StepPlan, default: Optional[Sampler] = None) -> RunnerOutput:
        """Apply ``plan``'s row changes and run its step; requests without a sampler of their
        own choose with ``default`` (greedy if ``None``)."""
        self.apply(plan.row_changes)
        if len(self.samplers) > len(plan.uids):
            held = set(plan.uids)
            self.samplers = {u: s for u, s in self.samplers.items() if u in held}
        if self.grammars:
            # A follower is told of ended requests only by their rows' release.
            held = {*plan.uids, *(f for u in plan.uids for f in self.forks.get(u, ()))}
            self.grammars = {u: g for u, g in self.grammars.items() if u in held}
        default = default or Sampler()
        samplers = [self.samplers.get(uid) or default for uid in plan.uids]
        running = [b for b, token in enumerate(plan.next_tokens) if token is not None]
        firsts = mx.array([plan.next_tokens[b] for b in running], dtype=mx.int32)
        if self.draft is not None and plan.num_draft_tokens:
            proposal = draft_proposals(self.draft, plan, samplers, firsts)
        else:
            proposal = firsts[:, None] if running else None
        return self._verify(plan, samplers, default, proposal)

    def apply(
        self,
        row_changes: Sequence[Union[Release, Admission]],
        loads: Optional[Mapping[int, Sequence[Optional[Sequence[KeysValues]]]]] = None,
    ) -> None:
        """Releases and admissions, in order, on every layout; ``loads[uid]``: an admitted
        request's first positions, one ``KVLayout.load`` argument per layout; a fork starts
        from its source row."""
        for change in row_changes:
            if isinstance(change, Release):
                for layout in self.layouts:
                    layout.release(change.row, change.last, change.length)
                continue
            # A fork keeps the sampler its first token was drawn with (its stream goes on).
            self.samplers[change.uid] = self.fork_samplers.pop(change.uid, change.sampler)
            if change.grammar is not None:
                self._add_grammars(change)
            if change.forks:
                self.forks[change.uid] = [uid for uid, _ in change.forks]
                self.fork_samplers.update(change.forks)
            if change.source is not None:
                src, length = change.source
                for layout in self.layouts:
                    layout.copy_row(src, change.row, length)
                continue
            layers = (loads or {}).get(change.uid, [None] * len(self.layouts))
            for layout, layers_kv in zip(self.layouts, layers):
                layout.load(change.row, layers_kv)

    def _add_grammars(self, admission: Admission) -> None:
        """A matcher of ``admission.grammar`` for its request and each of its forks."""
        if self.grammar_compiler is None:
            raise ValueError("[BatchedDecoder] a request has a grammar but the runner no compiler")
        for uid in [admission.uid, *(f for f, _ in admission.forks)]:
            matcher = self.grammar_compiler.matcher(admission.grammar)
            self.grammars[uid] = GrammarMatcher(matcher, admission.grammar_after)

    def _mask_requests(
        self, plan: StepPlan, proposed: Optional[list[list[int]]]
    ) -> tuple[list[MaskRequest], list[int]]:
        """The constrained sampled rows: what ``fill_bitmasks`` fills (bitmask row i for the
        i-th) and their positions among the step's sampled rows (``_verify``'s order)."""
        k = plan.num_draft_tokens
        requests: list[MaskRequest] = []
        rows: list[int] = []
        position, i = 0, 0
        for b, uid in enumerate(plan.uids):
            if plan.next_tokens[b] is not None:
                grammar = self.grammars.get(uid)
                if grammar is not None:
                    drafts = proposed[i][1:] if k else []
                    first = grammar.first_constrained(drafts)
                    if first <= k:
                        requests.append(MaskRequest(grammar.matcher, len(rows), drafts[first:]))
                        rows += range(position + first, position + k + 1)
                position, i = position + k + 1, i + 1
            elif plan.ending[b]:
                choices = [uid, *self.forks.get(uid, [])]
                for j, choice in enumerate(choices):
                    grammar = self.grammars.get(choice)
                    if grammar is not None and grammar.active:
                        requests.append(MaskRequest(grammar.matcher, len(rows)))
                        rows.append(position + j)
                position += len(choices)
        return requests, rows

    def _consume(self, uid: int, tokens: Sequence[int], output: RunnerOutput) -> None:
        """Constrained ``uid``'s emitted ``tokens`` into its matcher; its end, if it ends."""
        grammar = self.grammars.get(uid)
        if grammar is None:
            return
        grammar.consume(tokens)
        if grammar.error is not None:
            output.grammar_ends[uid] = FinishReason.ERROR
        elif grammar.stopped:
            output.grammar_ends[uid] = FinishReason.STOP

    def _verify(
        self,
        plan: StepPlan,
        samplers: list[Sampler],
        default: Sampler,
        proposal: Optional[mx.array],
    ) -> RunnerOutput:
        """The target's pass over every running row's ``proposal [R, k + 1]`` (its token, then
        the draft's) and every chunk; a running row keeps the draft tokens its own samples
        agree with, then its own next one (``speculative``)."""
        k = plan.num_draft_tokens
        counts = [k + 1 if t is not None else len(c) for t, c in zip(plan.next_tokens, plan.chunks)]
        ends = list(itertools.accumulate(counts))
        prompt_rows = {row: (top, after) for row, top, after in plan.prompt_logprobs}
        # The packed rows whose logits are computed; which of them sample, with which sampler.
        logit_rows: list[int] = []
        sample_at, row_samplers, sampled_rows = [], [], []
        spans: dict[int, int] = {}
        for b, count in enumerate(counts):
            start = ends[b] - count
            if plan.next_tokens[b] is not None:
                sample_at += range(len(logit_rows), len(logit_rows) + count)
                logit_rows += range(start, ends[b])
                row_samplers += [samplers[b]] * count
                sampled_rows += [b] * count
                continue
            if b in prompt_rows:
                spans[b] = len(logit_rows)
                logit_rows += range(start, ends[b])
            elif plan.ending[b]:
                logit_rows.append(ends[b] - 1)
            if plan.ending[b]:
                forks = self.forks.get(plan.uids[b], [])
                sample_at += [len(logit_rows) - 1] * (1 + len(forks))
                row_samplers += [samplers[b], *(self.fork_samplers.get(f) or default for f in forks)]
                sampled_rows += [b] * (1 + len(forks))
        tokens = pack_tokens(plan, proposal)
        logits = self.target.forward(
            tokens, plan, plan.seq_lens, counts, logit_rows, plan.first_chunks
        )
        outputs = [layout.cache_arrays() for layout in self.layouts]
        if not logit_rows:
            # Only chunks that end no prompt: their keys/values are the step's whole output.
            mx.eval(outputs)
            return RunnerOutput([None] * len(counts), [None] * len(counts))
        pending: list = []
        sampled = None
        proposed = None
        masks = None
        if sample_at and self.grammars:
            if k and any(self.grammars.get(u) for u, t in zip(plan.uids, plan.next_tokens) if t is not None):
                # The draft tokens decide the masks; the target's pass waits for them anyway.
                proposed = proposal.tolist()
            requests, mask_rows = self._mask_requests(plan, proposed)
            if requests:
                # The forward pass runs while the host fills the masks.
                mx.async_eval(logits)
                width = (self.grammar_compiler.vocab_size + 31) // 32
                bitmask = fill_bitmasks(
                    self.grammar_compiler.executor, requests, len(mask_rows), width
                )
                every = len(mask_rows) == len(sample_at)
                masks = (None if every else mask_rows, mx.array(bitmask))
        if sample_at:
            rows = logits if len(sample_at) == len(logit_rows) else logits[mx.array(sample_at)]
            contexts = _contexts(plan, sampled_rows, proposal, k)
            sampled = sample_rows(row_samplers, rows, contexts, masks)
            pending += [x for x in sampled if x is not None]
        prompt = {}
        for b, start in spans.items():
            top, after = prompt_rows[b]
            targets = plan.chunks[b][1:] + ([after] if after >= 0 else [])
            if targets:
                span = logits[start : start + len(targets)]
                prompt[b] = (targets, prompt_logprobs(span, mx.array(targets, dtype=mx.int32), top))
                pending += [x for x in prompt[b][1] if x is not None]
        mx.eval(pending, outputs, *([] if proposal is None else [proposal]))
        output = RunnerOutput([None] * len(counts), [None] * len(counts))
        for b, (targets, values) in prompt.items():
            output.prompt_logprobs[b] = _token_logprobs(targets, *values)
        if sampled is None:
            return output
        chosen = sampled.tokens.tolist()
        entries = _token_logprobs(chosen, *sampled[1:])
        if proposed is None:
            proposed = [] if proposal is None or not k else proposal.tolist()
        position, i = 0, 0
        for b in range(len(counts)):
            if plan.next_tokens[b] is not None:
                targets = chosen[position : position + k + 1]
                a = accepted_length(proposed[i][1:], targets) if k else 0
                output.accepted_tokens += a
                output.tokens[b] = targets[: a + 1]
                output.logprobs[b] = _asked(samplers[b], entries[position : position + a + 1])
                self._consume(plan.uids[b], output.tokens[b], output)
                position, i = position + k + 1, i + 1
            elif plan.ending[b]:
                output.tokens[b] = [chosen[position]]
                output.logprobs[b] = _asked(samplers[b], entries[position : position + 1])
                forks = self.forks.pop(plan.uids[b], [])
                output.forks[b] = [
                    (f, chosen[position + 1 + j],
                     _one(self.fork_samplers.get(f), entries[position + 1 + j]))
                    for j, f in enumerate(forks)
                ]
                self._consume(plan.uids[b], output.tokens[b], output)
                for f, token, _ in output.forks[b]:
                    self._consume(f, [token], output)
                position += 1 + len(forks)
        output.draft_tokens = k * i
        return output


def _contexts(
    plan: StepPlan, rows: Sequence[int], proposal: Optional[mx.array], k: int
) -> Optional[mx.array]:
    """int32 ``[S, C]``: each sampled row's context (``pack_contexts``), a running row's j-th
    draft row's followed by the draft tokens before it; ``None`` when no row has one."""
    if not k:
        return pack_contexts(plan, rows)
    groups = [(b, len(list(g))) for b, g in itertools.groupby(rows)]
    base = pack_contexts(plan, [b for b, _ in groups])
    if base is None:
        return None
    # The window of C tokens that ends at row j's token: j + 0 .. j + C - 1 of base + drafts.
    windows = mx.arange(k + 1)[:, None] + mx.arange(base.shape[1])[None]
    pieces, i = [], 0
    for g, (b, count) in enumerate(groups):
        if plan.next_tokens[b] is None:
            pieces.append(mx.repeat(base[g : g + 1], count, axis=0))
            continue
        pieces.append(mx.concatenate([base[g], proposal[i, 1:]])[windows])
        i += 1
    return mx.concatenate(pieces)


def _token_logprobs(
    tokens: Sequence[int],
    logprobs: Optional[mx.array],
    top_ids: Optional[mx.array],
    top_logprobs: Optional[mx.array],
) -> list[Optional[TokenLogprobs]]:
    """Each token's ``TokenLogprobs`` (``None`` for all when no logprobs were computed)."""
    if logprobs is None:
        return [None] * len(tokens)
    ids = [[]] * len(tokens) if top_ids is None else top_ids.tolist()
    values = [[]] * len(tokens) if top_logprobs is None else top_logprobs.tolist()
    return [
        TokenLogprobs(t, lp, list(zip(i, v)))
        for t, lp, i, v in zip(tokens, logprobs.tolist(), ids, values)
    ]


def _one(sampler: Optional[Sampler], entry: Optional[TokenLogprobs]) -> Optional[TokenLogprobs]:
    """``entry`` cut to the top logprobs ``sampler`` asks for (``None`` if it asks none)."""
    asked = None if sampler is None else sampler.params.logprobs
    if asked is None or entry is None:
        return None
    return TokenLogprobs(entry.token, entry.logprob, entry.top[:asked])


def _asked(sampler: Sampler, entries: Sequence[Optional[TokenLogprobs]]) -> Optional[list]:
    """``entries`` as ``sampler`` asks for them (``None`` if it asks none)."""
    if sampler.params.logprobs is None:
        return None
    return [_one(sampler, e) for e in entries]
