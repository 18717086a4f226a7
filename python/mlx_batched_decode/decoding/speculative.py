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

``packed_round`` is the round of a packed step (``PackedDecodeContext``), beside prompt chunks:
the draft's first step also feeds the chunks (its cache needs the prompts too), its next ones
the running requests alone, and the target's pass feeds the k + 1 tokens of every running
request and the chunks; a request whose chunk ends its prompt samples its first token from it.
Without a draft model it is the plain packed step: one pass, one token per running request.

Dimension legend: B = requests in the round, k = draft tokens per request, V = vocabulary size.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Sequence

import mlx.core as mx

from .sampling import Sampler, sample_rows
from .served_model import ServedModel


def accepted_length(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """a: how many leading draft tokens equal the target's tokens at the same positions."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


class PackedRound(NamedTuple):
    """What one packed step feeds, per request row: ``next_tokens[b]`` (a running request's
    last token, else ``None``), ``chunks[b]`` (a prefilling request's prompt tokens this step,
    maybe none), ``ending[b]`` (its chunk ends its prompt: it samples its first token),
    ``seq_lens[b]`` (its positions cached), ``first_chunks`` (``PackedDecodeContext``'s) and
    ``samplers[b]`` (how it chooses its tokens, the draft's proposals too); ``reserve_len``:
    ``PackedDecodeContext``'s."""

    next_tokens: list[Optional[int]]
    chunks: list[list[int]]
    ending: list[bool]
    seq_lens: list[int]
    first_chunks: list[tuple[int, int]]
    samplers: list[Sampler]
    reserve_len: int = 0


def packed_round(
    target: ServedModel,
    draft: Optional[ServedModel],
    step: PackedRound,
    num_draft_tokens: int,
) -> tuple[list[Optional[list[int]]], int, int]:
    """One packed step of ``target``: without a draft, one pass over every running request's
    token and every chunk; with one, a speculative round for the running requests (the draft's
    first pass also takes the chunks, its next ones the running requests alone) whose target
    pass takes the chunks too. Returns each row's new tokens (``None``: it emits none), the
    draft tokens proposed and how many of them were accepted; one device-to-host read."""
    k = num_draft_tokens if draft is not None else 0
    running = [b for b, t in enumerate(step.next_tokens) if t is not None]
    firsts = mx.array([step.next_tokens[b] for b in running], dtype=mx.int32)
    drafts = []
    if draft is not None:
        counts = [1 if t is not None else len(c) for t, c in zip(step.next_tokens, step.chunks)]
        ends = list(itertools.accumulate(counts))
        tokens = _pack(step, firsts[:, None])
        for j in range(k + 1):
            rows = [ends[b] - 1 for b in running] if j == 0 else list(range(len(running)))
            seq_lens = [
                s + j if t is not None else s for s, t in zip(step.seq_lens, step.next_tokens)
            ]
            logits = draft.forward_packed(
                tokens, seq_lens, counts, rows if j < k else [],
                step.first_chunks if j == 0 else (), step.reserve_len,
            )
            if j < k and running:
                tokens = sample_rows([step.samplers[b] for b in running], logits)
                # Start computing this draft token while the next pass's graph is built.
                mx.async_eval(tokens)
                drafts.append(tokens)
            # Passes after the first feed the running requests' draft tokens alone.
            counts = [1 if t is not None else 0 for t in step.next_tokens]
            if not running:
                break
    proposal = mx.stack([firsts, *drafts], axis=1) if running else None
    counts = [k + 1 if t is not None else len(c) for t, c in zip(step.next_tokens, step.chunks)]
    ends = list(itertools.accumulate(counts))
    logit_rows, row_samplers = [], []
    for b, count in enumerate(counts):
        if step.next_tokens[b] is not None:
            logit_rows += range(ends[b] - count, ends[b])
            row_samplers += [step.samplers[b]] * count
        elif step.ending[b]:
            logit_rows.append(ends[b] - 1)
            row_samplers.append(step.samplers[b])
    tokens = _pack(step, proposal)
    logits = target.forward_packed(
        tokens, step.seq_lens, counts, logit_rows, step.first_chunks, step.reserve_len
    )
    outputs = [target.cache_arrays()] + ([draft.cache_arrays()] if draft is not None else [])
    if not logit_rows:
        # Only chunks that end no prompt: their keys/values are the step's whole output.
        mx.eval(outputs)
        return [None] * len(counts), 0, 0
    sampled = sample_rows(row_samplers, logits)
    mx.eval(sampled, outputs, *([proposal] if running else []))
    sampled, proposed = sampled.tolist(), proposal.tolist() if running else []
    out: list[Optional[list[int]]] = [None] * len(counts)
    accepted, position, i = 0, 0, 0
    for b in range(len(counts)):
        if step.next_tokens[b] is not None:
            targets = sampled[position : position + k + 1]
            a = accepted_length(proposed[i][1:], targets)
            accepted += a
            out[b] = targets[: a + 1]
            position, i = position + k + 1, i + 1
        elif step.ending[b]:
            out[b] = [sampled[position]]
            position += 1
    return out, k * len(running), accepted


def _pack(step: PackedRound, running_tokens: Optional[mx.array]) -> mx.array:
    """int32 ``[N]``: each row's tokens in row order, a running request's from its row of
    ``running_tokens [R, c]`` (the running rows in order; ``None`` without any), a chunk's from
    the host."""
    if not any(step.chunks):
        # Decode tokens alone: the running rows' tokens, already in order.
        return running_tokens.reshape(-1)
    pieces, i = [], 0
    for token, chunk in zip(step.next_tokens, step.chunks):
        if token is not None:
            pieces.append(running_tokens[i])
            i += 1
        elif chunk:
            pieces.append(mx.array(chunk, dtype=mx.int32))
    return mx.concatenate(pieces)
