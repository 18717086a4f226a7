"""``ModelRunner``: executes a step plan on the model (and its draft) and samples.

It applies the plan's row changes to the KV layouts (a released row compacted, an admitted
request's row and sampler), then runs the step: without a draft model, one packed forward pass
over every running row's token and every prompt chunk; with one, the draft's proposals first
(``speculative``) and the target's pass verifying them. Each pass builds the step's one context
(the layout's) shared by every layer. The target's logits are computed only for the rows that
sample (a running row's k + 1 tokens, a chunk that ends its prompt), and every row is sampled
in one batched pass (``sample_rows``), each with its request's sampler. One device-to-host read
per step: the sampled tokens.

Dimension legend: B = rows of the step, R = running rows, k = draft tokens per running row.
"""

from __future__ import annotations

import itertools
from typing import Mapping, NamedTuple, Optional, Sequence, Union

import mlx.core as mx

from .layouts.base import KVLayout
from .packing import pack_tokens
from .plan import Admission, Release, StepPlan
from .sampling import Sampler, sample_rows
from .speculative import accepted_length, draft_proposals


# One layer's keys and values, as ``KVLayout.load`` takes them.
KeysValues = tuple[mx.array, mx.array]


class RunnerOutput(NamedTuple):
    """Each row's new tokens (``None``: it emits none), and the draft tokens proposed and
    accepted in the step."""

    tokens: list[Optional[list[int]]]
    draft_tokens: int = 0
    accepted_tokens: int = 0


class ModelRunner:
    """Runs plans on ``target`` (a ``KVLayout``), speculatively with ``draft`` (another)."""

    def __init__(self, target: KVLayout, draft: Optional[KVLayout] = None):
        self.target = target
        self.draft = draft
        # Each running request's sampler (None: the step's default).
        self.samplers: dict[int, Optional[Sampler]] = {}

    @property
    def layouts(self) -> list[KVLayout]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    def forget(self, uids: Sequence[int]) -> None:
        """Drop what it keeps of requests that ended (their rows go with the next plan)."""
        for uid in uids:
            self.samplers.pop(uid, None)

    def execute(self, plan: StepPlan, default: Optional[Sampler] = None) -> RunnerOutput:
        """Apply ``plan``'s row changes and run its step; requests without a sampler of their
        own choose with ``default`` (greedy if ``None``)."""
        self.apply(plan.row_changes)
        if len(self.samplers) > len(plan.uids):
            held = set(plan.uids)
            self.samplers = {u: s for u, s in self.samplers.items() if u in held}
        default = default or Sampler()
        samplers = [self.samplers.get(uid) or default for uid in plan.uids]
        running = [b for b, token in enumerate(plan.next_tokens) if token is not None]
        firsts = mx.array([plan.next_tokens[b] for b in running], dtype=mx.int32)
        if self.draft is not None and plan.num_draft_tokens:
            proposal = draft_proposals(self.draft, plan, samplers, firsts)
        else:
            proposal = firsts[:, None] if running else None
        return self._verify(plan, samplers, proposal)

    def apply(
        self,
        row_changes: Sequence[Union[Release, Admission]],
        loads: Optional[Mapping[int, Sequence[Optional[Sequence[KeysValues]]]]] = None,
    ) -> None:
        """Releases and admissions, in order, on every layout; ``loads[uid]``: an admitted
        request's first positions, one ``KVLayout.load`` argument per layout."""
        for change in row_changes:
            if isinstance(change, Release):
                for layout in self.layouts:
                    layout.release(change.row, change.last, change.length)
                continue
            self.samplers[change.uid] = change.sampler
            layers = (loads or {}).get(change.uid, [None] * len(self.layouts))
            for layout, layers_kv in zip(self.layouts, layers):
                layout.load(change.row, layers_kv)

    def _verify(
        self, plan: StepPlan, samplers: list[Sampler], proposal: Optional[mx.array]
    ) -> RunnerOutput:
        """The target's pass over every running row's ``proposal [R, k + 1]`` (its token, then
        the draft's) and every chunk; a running row keeps the draft tokens its own samples
        agree with, then its own next one (``speculative``)."""
        k = plan.num_draft_tokens
        counts = [k + 1 if t is not None else len(c) for t, c in zip(plan.next_tokens, plan.chunks)]
        ends = list(itertools.accumulate(counts))
        logit_rows, row_samplers = [], []
        for b, count in enumerate(counts):
            if plan.next_tokens[b] is not None:
                logit_rows += range(ends[b] - count, ends[b])
                row_samplers += [samplers[b]] * count
            elif plan.ending[b]:
                logit_rows.append(ends[b] - 1)
                row_samplers.append(samplers[b])
        tokens = pack_tokens(plan, proposal)
        logits = self.target.forward(
            tokens, plan, plan.seq_lens, counts, logit_rows, plan.first_chunks
        )
        outputs = [layout.cache_arrays() for layout in self.layouts]
        if not logit_rows:
            # Only chunks that end no prompt: their keys/values are the step's whole output.
            mx.eval(outputs)
            return RunnerOutput([None] * len(counts))
        sampled = sample_rows(row_samplers, logits).tokens
        mx.eval(sampled, outputs, *([] if proposal is None else [proposal]))
        sampled = sampled.tolist()
        proposed = [] if proposal is None or not k else proposal.tolist()
        out: list[Optional[list[int]]] = [None] * len(counts)
        accepted, position, i = 0, 0, 0
        for b in range(len(counts)):
            if plan.next_tokens[b] is not None:
                targets = sampled[position : position + k + 1]
                a = accepted_length(proposed[i][1:], targets) if k else 0
                accepted += a
                out[b] = targets[: a + 1]
                position, i = position + k + 1, i + 1
            elif plan.ending[b]:
                out[b] = [sampled[position]]
                position += 1
        return RunnerOutput(out, k * i, accepted)
