"""Batched speculative decoding: a draft model proposes k tokens per request, the target model
verifies the k + 1 tokens of every request in one forward pass.

Invariant between rounds: the target's and the draft's caches both hold every committed token of
a request but its last one, ``next_token`` (t0), at positions ``0 .. seq_len - 1``. One round:

1. The draft runs k + 1 single-token steps over the batch: it feeds t0, then each token it has
   just sampled, d1 .. dk. The last step only writes dk's keys/values (its logits are never
   computed), so a fully accepted round leaves nothing for the draft to catch up on and every
   draft step has L = 1.
2. The target feeds ``[t0, d1 .. dk]`` (L = k + 1): one call of the attention op per layer, the
   new keys/values written at ``seq_len .. seq_len + k``. Its sampler picks y_j, the token after
   position ``seq_len + j``, at each of the k + 1 positions.
3. The draft tokens are accepted while ``y_j == d_{j+1}``: with a accepted, the request's new
   tokens are ``y_0 .. y_a`` (= d1 .. da, then the target's own next token), and both caches'
   lengths advance by a + 1. Rejected positions are rolled back by not counting them: the
   next round writes over them.

Each emitted y_j is the target's sample given exactly the tokens emitted before it, so greedy
output is the target's greedy output, and temperature sampling keeps the target's distribution.

Dimension legend: B = requests in the round, k = draft tokens per request, V = vocabulary size.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import mlx.core as mx

from .sampling import Sampler
from .served_model import ServedModel


class SpeculativeRound(NamedTuple):
    """One round's outcome: each request's new tokens ``y_0 .. y_a`` (a + 1 of them, before stop
    tokens and budgets), the draft tokens proposed and how many of them the target accepted."""

    tokens: list[list[int]]
    drafted: int
    accepted: int


def accepted_length(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """a: how many leading draft tokens equal the target's tokens at the same positions."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def speculative_round(
    target: ServedModel,
    draft: ServedModel,
    next_tokens: Sequence[int],
    seq_lens: Sequence[int],
    num_draft_tokens: int,
    sampler: Sampler,
) -> SpeculativeRound:
    """Propose, verify and accept for every request of the batch (rows ``0..B-1`` of both
    models); one device-to-host read, after the target's pass."""
    batch, k = len(next_tokens), num_draft_tokens
    fed = [mx.array(next_tokens, dtype=mx.int32)[:, None]]
    for j in range(k + 1):
        logits = draft.forward(fed[-1], [s + j for s in seq_lens])
        if j < k:
            token = sampler(logits[:, -1, :])[:, None]
            # Start computing this draft token while the next step's graph is built.
            mx.async_eval(token)
            fed.append(token)
    proposal = mx.concatenate(fed, axis=1)
    logits = target.forward(proposal, seq_lens)
    sampled = sampler(logits.reshape(batch * (k + 1), -1)).reshape(batch, k + 1)
    mx.eval(sampled, proposal, draft.cache_arrays())
    tokens, accepted = [], 0
    for drafts, targets in zip(proposal[:, 1:].tolist(), sampled.tolist()):
        a = accepted_length(drafts, targets)
        accepted += a
        tokens.append(targets[: a + 1])
    return SpeculativeRound(tokens, batch * k, accepted)
