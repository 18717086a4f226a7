"""One request as the scheduler keeps it: its prompt, its budget, where it stands.

A request is ``WAITING`` until the scheduler admits it, ``PREFILLING`` while steps feed its
prompt in chunks, ``RUNNING`` once it decodes, and ``FINISHED`` with a ``FinishReason``: it
sampled a stop token, reached ``max_tokens``, was cancelled, or failed. The scheduler forgets it
in the step that finishes it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended, named as OpenAI's ``finish_reason`` where it has one."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(eq=False)
class Request:
    """A request's state: plain ints and lists, no arrays.

    ``num_cached`` counts the positions whose keys/values the caches hold: the prompt tokens
    fed so far, then every generated token but ``next_token`` (the last, which the next step
    feeds). ``sampler`` is how it chooses its tokens (the runner's concern; ``None``:
    greedy). ``block_names``: its prompt's full blocks' names (paged prefix sharing), once
    computed. ``prompt_logprobs``: report its prompt tokens' logprobs with the top k
    (``None``: not). ``forks``: its other choices (``EngineCore.add_choices``), which start
    from its cache once its prompt is fed. ``grammar``/``grammar_after``: the constraint on
    its output (``Admission``), ``None`` for none.
    """

    uid: int
    prompt: list[int]
    max_tokens: int
    stop_tokens: frozenset[int] = frozenset()
    sampler: Optional[Any] = None
    num_cached: int = 0
    tokens: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    prefix_hit_tokens: int = 0
    block_names: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None
    forks: list["Request"] = field(default_factory=list)
    grammar: Optional[Any] = None
    grammar_after: Optional[int] = None

    @property
    def next_token(self) -> int:
        """The token the next decode step feeds: the last one generated (or the prompt's)."""
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are left to feed."""
        return self.num_cached < len(self.prompt)

    @property
    def total_len(self) -> int:
        """The most positions it writes: every prompt token and generated token but the last
        (all of the prompt's with ``max_tokens`` 0)."""
        return len(self.prompt) - 1 + max(self.max_tokens, 1)

    @property
    def samplers(self) -> list[Any]:
        """Its sampler, then its forks'."""
        return [self.sampler, *(f.sampler for f in self.forks)]
