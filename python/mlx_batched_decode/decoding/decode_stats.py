"""``DecodeStats``: the prefill and decode work a ``BatchedDecoder`` has counted."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeStats:
    """Work a ``BatchedDecoder`` has done since it was made: prefill and decode, counted apart.

    ``steps`` counts decode steps (speculative rounds with a draft model; the draft's forward
    passes are part of their time). ``draft_tokens`` counts the draft tokens proposed
    (``num_draft_tokens`` per request and round) and ``accepted_tokens`` those the target agreed
    with, whether or not a budget or stop token then cut the request short. With
    ``kv_layout="paged"``, ``prefix_hit_tokens`` counts the prompt tokens (of ``prompt_tokens``)
    whose keys/values came from cached blocks instead of prefill, and ``blocks_in_use`` is the
    number of blocks requests hold now (0 with the slot layout).
    """

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    steps: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    prefix_hit_tokens: int = 0
    blocks_in_use: int = 0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 without a draft model)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
