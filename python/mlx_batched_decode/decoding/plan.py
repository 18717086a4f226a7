"""The plain records the engine's parts pass each other: a step's plan and a step's result.

``StepPlan`` is what the scheduler decides for one step and the runner executes: which request
sits in which row, the tokens each row feeds, which rows sample, what the layouts must do first
(rows to release and compact, requests to load) and reserve. Plain ints and lists only, so that
it can be sent to tensor-parallel followers as it is. ``StepResult`` is what the scheduler's ``update``
reports: the tokens each request emitted, the requests that finished and why, and a
``Snapshot`` of the counts a server shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .request import FinishReason


@dataclass
class Release:
    """Row ``row``'s request left since the last plan: row ``last``'s request (``length``
    positions cached) moves into its row, so the rows stay ``0..B-1``."""

    row: int
    last: int
    length: int


@dataclass
class Admission:
    """A request given row ``row`` since the last plan, and its ``Sampler`` (``None``: the
    step's default; a tensor-parallel plan carries its knobs and seed, ``lockstep``).

    A request of several choices (``EngineCore.add_choices``) is admitted with ``forks``: the
    other choices' ids and samplers, which sample their first tokens from its prompt's last
    logits. Each fork is then admitted with ``source``: the row holding that prompt and its
    length, whose keys/values it starts from (copied, or its blocks shared).

    ``grammar``: the ``GrammarSpec`` its output (and each fork's) must match, ``None`` for
    none; ``grammar_after``: the token id after whose first occurrence it applies
    (``GrammarMatcher``). The runner makes every choice's matcher from them when the
    request's admission arrives; a fork's own admission carries none."""

    uid: int
    row: int
    sampler: Optional[Any] = None
    forks: list[tuple[int, Optional[Any]]] = field(default_factory=list)
    source: Optional[tuple[int, int]] = None
    grammar: Optional[Any] = None
    grammar_after: Optional[int] = None


@dataclass
class TokenLogprobs:
    """A token's log-probability and the ``top`` most likely tokens' ``(id, logprob)``, best
    first (as many as the request asked)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepPlan:
    """One step, row by row (row ``b`` is the ``b``-th running request).

    Attributes:
        row_changes: the ``Release``s and ``Admission``s since the last plan, in the order they
            happened (the runner's layouts apply them in that order before the step).
        uids: each row's request id.
        seq_lens: each row's positions cached before the step.
        next_tokens: a running row's token to feed (its last one), ``None`` for a prefilling row.
        chunks: a prefilling row's prompt tokens this step (maybe none).
        ending: whether the row's chunk ends its prompt (it samples its first token).
        first_chunks: ``(row, count)`` of each prompt's first chunk, its last token aside (over
            a quantized cache they attend themselves unquantized, as mlx-lm's prefill does).
        reserve_len: positions the slot caches make room for (the longest prompt being fed).
        num_draft_tokens: k, the draft tokens of every running row (0 without a draft model).
        block_tables: each row's block table (paged layout), ``None`` otherwise.
        contexts: each row's last tokens (prompt, then generated) that its sampler's penalties
            read, ``None`` for a row whose sampler has none.
        prompt_logprobs: ``(row, k, next)`` of each chunk whose every token's logits are
            kept: its prompt tokens' logprobs with the top k, ``next`` the prompt token after
            the chunk (-1 when the chunk ends the prompt).
    """

    row_changes: list[Union[Release, Admission]] = field(default_factory=list)
    uids: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    next_tokens: list[Optional[int]] = field(default_factory=list)
    chunks: list[list[int]] = field(default_factory=list)
    ending: list[bool] = field(default_factory=list)
    first_chunks: list[tuple[int, int]] = field(default_factory=list)
    reserve_len: int = 0
    num_draft_tokens: int = 0
    block_tables: Optional[list[list[int]]] = None
    contexts: list[Optional[list[int]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def fed_prompts(self) -> bool:
        """Whether the step feeds prompt tokens."""
        return any(self.chunks)


@dataclass
class RunnerOutput:
    """What the runner made of a step, row by row.

    ``tokens[b]``: row ``b``'s new tokens (``None``: it sampled none); ``logprobs[b]``: theirs
    (``None`` unless its sampler asks). ``forks[b]``: the ``(uid, token, logprobs)`` each fork
    of row ``b``'s request sampled from its prompt's last logits. ``prompt_logprobs[b]``: the
    logprobs of the prompt tokens after row ``b``'s chunk's (``StepPlan.prompt_logprobs``).
    ``draft_tokens`` proposed and ``accepted_tokens`` accepted in the step.
    ``grammar_ends[uid]``: why a constrained request (or fork) must end after its tokens:
    ``STOP`` when its grammar admits nothing more, ``ERROR`` when it consumed a token its
    grammar forbids.
    """

    tokens: list[Optional[list[int]]]
    logprobs: list[Optional[list[TokenLogprobs]]] = field(default_factory=list)
    forks: dict[int, list[tuple[int, int, Optional[TokenLogprobs]]]] = field(
        default_factory=dict
    )
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    grammar_ends: dict[int, FinishReason] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """The counts a server reports, after a step: requests running (prefilling or decoding)
    and waiting, and the KV capacity in use (rows or blocks held, and their total)."""

    running: int = 0
    waiting: int = 0
    kv_in_use: int = 0
    kv_capacity: int = 0

    @property
    def kv_usage(self) -> float:
        """The share of the KV capacity in use, 0..1."""
        return self.kv_in_use / self.kv_capacity if self.kv_capacity else 0.0


@dataclass
class StepResult:
    """What one step produced.

    ``tokens[uid]``: the tokens each request emitted, in order (one per step without a draft
    model, up to ``num_draft_tokens + 1`` with one; requests that emitted nothing are absent,
    and a stop token is never emitted). ``finished``: the ids of the requests that ended in
    this step, in row order, and ``reasons[uid]`` why; ``cached_tokens[uid]``: the prompt tokens
    each finished request took from cached blocks. ``snapshot``: the counts after the step.
    ``prompt_tokens``: the prompt tokens fed or taken from cached blocks (``prefix_hit_tokens``
    of them) since the last step; ``draft_tokens`` proposed and ``accepted_tokens`` accepted.
    ``logprobs[uid]``: one ``TokenLogprobs`` per token of ``tokens[uid]`` for requests whose
    sampler asks; ``prompt_logprobs[uid]``: those of the prompt tokens this step fed (from the
    second on: the first has none) for requests added with ``prompt_logprobs``.
    """

    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)
    reasons: dict[int, FinishReason] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    snapshot: Snapshot = field(default_factory=Snapshot)
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
