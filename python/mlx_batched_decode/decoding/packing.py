"""The packed arrays of a step: each row's tokens in row order, and the rows' contexts.

Dimension legend: N = tokens of the step, R = running rows, c = tokens per running row,
C = the longest context.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from .plan import StepPlan


def pack_tokens(plan: StepPlan, running_tokens: Optional[mx.array]) -> mx.array:
    """int32 ``[N]``: a running row's tokens from its row of ``running_tokens [R, c]`` (the
    running rows in order; ``None`` without any), a prefilling row's chunk from the host."""
    if not plan.fed_prompts:
        # Decode tokens alone: the running rows' tokens, already in order.
        return running_tokens.reshape(-1)
    pieces, i = [], 0
    for token, chunk in zip(plan.next_tokens, plan.chunks):
        if token is not None:
            pieces.append(running_tokens[i])
            i += 1
        elif chunk:
            pieces.append(mx.array(chunk, dtype=mx.int32))
    return mx.concatenate(pieces)


def pack_contexts(plan: StepPlan, rows: Sequence[int]) -> Optional[mx.array]:
    """int32 ``[len(rows), C]``: the contexts (``StepPlan.contexts``) of plan rows ``rows``,
    left-padded with -1; ``None`` when no row of the plan has one."""
    width = max((len(c) for c in plan.contexts if c), default=0)
    if not width:
        return None
    padded = [[-1] * (width - len(plan.contexts[b] or ())) + list(plan.contexts[b] or ())
              for b in rows]
    return mx.array(padded, dtype=mx.int32).reshape(len(rows), width)
