"""Choosing each request's next token from the step's logits.

Dimension legend: B = requests in the step, R = logit rows of a step, V = vocabulary size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx


class Sampler:
    """Greedy (``temperature == 0``, the default) or temperature sampling with optional top-p.

    Args:
        temperature: divides the logits before sampling; 0 picks the argmax.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``
            (1.0 keeps all).
        seed: makes sampling reproducible for the same schedule of steps; ``None`` uses MLX's
            global random state.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None):
        if temperature < 0:
            raise ValueError(f"[Sampler] temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"[Sampler] top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_p = top_p
        self._key = None if seed is None else mx.random.key(seed)

    def _next_key(self) -> Optional[mx.array]:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key

    def __call__(self, logits: mx.array) -> mx.array:
        """``logits [B, V]`` -> int32 token ids ``[B]``."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        logits = logits.astype(mx.float32) / self.temperature
        key = self._next_key()
        if self.top_p >= 1.0:
            return mx.random.categorical(logits, key=key).astype(mx.int32)
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        # A token stays if the mass before it is below top_p: the most likely always stays.
        keep = (mx.cumsum(probs, axis=-1) - probs) < self.top_p
        choice = mx.random.categorical(mx.where(keep, sorted_logits, -mx.inf), key=key)
        return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(mx.int32)


def sample_rows(samplers: Sequence[Sampler], logits: mx.array) -> mx.array:
    """``logits [R, V]``, row ``r`` chosen by ``samplers[r]`` -> int32 token ids ``[R]``: one
    call per distinct sampler, over its rows (requests may each bring their own)."""
    first = samplers[0]
    if all(s is first for s in samplers):
        return first(logits)
    groups: dict[int, list[int]] = {}
    for row, sampler in enumerate(samplers):
        groups.setdefault(id(sampler), []).append(row)
    order = [row for rows in groups.values() for row in rows]
    chosen = mx.concatenate(
        [samplers[rows[0]](logits[mx.array(rows)]) for rows in groups.values()]
    )
    # chosen[i] is row order[i]'s token: put the rows back in order.
    where = [0] * len(order)
    for i, row in enumerate(order):
        where[row] = i
    return chosen[mx.array(where)]
