"""``DecodeStats``: the prefill and decode work a ``BatchedDecoder`` has counted, and when each
request's tokens came out (``RequestTiming``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestTiming:
    """When one request's tokens came out, in ``time.perf_counter()`` seconds.

    ``arrived``: when ``add_request`` took it. ``first_token``: the end of the step that emitted
    its first token (``None`` before). ``gaps``: seconds between consecutive steps that emitted
    its tokens; a speculative round that emits several tokens counts as one. ``finished``: the
    end of the step that finished it, or its ``cancel`` (``None`` while it is queued or runs).
    ``prefix_hit_tokens``: its prompt tokens taken from cached blocks (paged prefix sharing).
    """

    arrived: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    finished: Optional[float] = None
    cancelled: bool = False
    prefix_hit_tokens: int = 0

    @property
    def time_to_first_token(self) -> Optional[float]:
        """Seconds from ``add_request`` to the step that emitted the first token."""
        return None if self.first_token is None else self.first_token - self.arrived

    def emitted(self, count: int, now: float) -> None:
        """``count`` tokens came out of the step that ended at ``now``."""
        if self.first_token is None:
            self.first_token = now
        else:
            self.gaps.append(now - self.last_token)
        self.last_token = now
        self.tokens += count


@dataclass
class DecodeStats:
    """Work a ``BatchedDecoder`` has done since it was made: prefill and decode, counted apart.

    ``steps`` counts steps (speculative rounds with a draft model; the draft's forward passes
    are part of their time). ``prefill_seconds`` is the time of the steps that fed prompt tokens
    (with the decode tokens they carried too),
    ``decode_seconds`` that of the ``decode_steps`` steps that fed decode tokens alone, which
    emitted ``decode_step_tokens`` of the ``generated_tokens``. ``draft_tokens`` counts the draft
    tokens proposed (``num_draft_tokens`` per request and round) and ``accepted_tokens`` those
    the target agreed with, whether or not a budget or stop token then cut the request short.
    ``prompt_tokens`` counts the prompt tokens fed or taken from cached blocks; with
    ``kv_layout="paged"``, ``prefix_hit_tokens`` counts those taken from cached blocks, and
    ``blocks_in_use`` is the number of blocks requests hold now (0 with the slot layout).

    ``requests`` maps each request id to its ``RequestTiming``, from ``add_request`` on. Entries
    stay after a request finishes; a long-running caller pops those it has read.
    """

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    steps: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_step_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    prefix_hit_tokens: int = 0
    blocks_in_use: int = 0
    requests: dict[int, RequestTiming] = field(default_factory=dict)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the steps that fed decode tokens alone."""
        return self.decode_step_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 without a draft model)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
