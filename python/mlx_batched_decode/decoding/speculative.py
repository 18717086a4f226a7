"""Speculative decoding, the runner's strategy with a draft model: the draft proposes k tokens
per running request, the target verifies the k + 1 tokens of every request in one pass.

Invariant between rounds: the target's and the draft's caches both hold every committed token of
a request but its last one, ``next_token`` (t0), at positions ``0 .. seq_len - 1``. One round:

1. The draft runs k + 1 single-token steps over the batch: it feeds t0, then each token it has
   just sampled, d1 .. dk. The last step only writes dk's keys/values (its logits are never
   computed), so a fully accepted round leaves nothing for the draft to catch up on and every
   draft step has L = 1. Its first step also feeds the step's prompt chunks (its cache needs
   the prompts too), its next ones the running requests alone.
2. The target feeds ``[t0, d1 .. dk]`` (L = k + 1) and the chunks: one call of the attention op
   per layer, the new keys/values written at ``seq_len .. seq_len + k``. Its sampler picks y_j,
   the token after position ``seq_len + j``, at each of the k + 1 positions (``ModelRunner``).
3. The draft tokens are accepted while ``y_j == d_{j+1}``: with a accepted, the request's new
   tokens are ``y_0 .. y_a`` (= d1 .. da, then the target's own next token), and both caches'
   lengths advance by a + 1. Rejected positions are rolled back by not counting them: the
   next round writes over them.

Each emitted y_j is the target's sample given exactly the tokens emitted before it, so greedy
output is the target's greedy output, and temperature sampling keeps the target's distribution.

Grammar-constrained requests: the draft proposes without its grammar (the target decides); the
target's row j is masked by the grammar's state after d1 .. dj (``ModelRunner``), so a draft
token the grammar rejects is never the target's sample there and acceptance ends before it.

Dimension legend: R = running requests, k = draft tokens per request.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import mlx.core as mx

from .layouts.base import KVLayout
from .packing import pack_contexts, pack_tokens
from .plan import StepPlan
from .sampling import Sampler, sample_rows


def accepted_length(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """a: how many leading draft tokens equal the target's tokens at the same positions."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def draft_proposals(
    draft: KVLayout, plan: StepPlan, samplers: Sequence[Sampler], firsts: mx.array
) -> Optional[mx.array]:
    """The draft's k + 1 passes of a round (step 1 of the module docstring): int32
    ``[R, k + 1]``, each running row's token ``firsts [R]`` and its k draft tokens (lazy;
    ``None`` without running rows)."""
    k = plan.num_draft_tokens
    running = [b for b, t in enumerate(plan.next_tokens) if t is not None]
    counts = [1 if t is not None else len(c) for t, c in zip(plan.next_tokens, plan.chunks)]
    ends = list(itertools.accumulate(counts))
    tokens = pack_tokens(plan, firsts[:, None])
    contexts = pack_contexts(plan, running)
    drafts = []
    for j in range(k + 1):
        rows = [ends[b] - 1 for b in running] if j == 0 else list(range(len(running)))
        seq_lens = [s + j if t is not None else s for s, t in zip(plan.seq_lens, plan.next_tokens)]
        logits = draft.forward(
            tokens, plan, seq_lens, counts, rows if j < k else [],
            plan.first_chunks if j == 0 else (),
        )
        if j < k and running:
            # Each row's context, then the tokens drafted after it.
            seen = None if contexts is None else mx.concatenate(
                [contexts, *(d[:, None] for d in drafts)], axis=1
            )[:, -contexts.shape[1]:]
            tokens = sample_rows([samplers[b] for b in running], logits, seen).tokens
            # Start computing this draft token while the next pass's graph is built.
            mx.async_eval(tokens)
            drafts.append(tokens)
        # Passes after the first feed the running requests' draft tokens alone.
        counts = [1 if t is not None else 0 for t in plan.next_tokens]
        if not running:
            break
    return mx.stack([firsts, *drafts], axis=1) if running else None
