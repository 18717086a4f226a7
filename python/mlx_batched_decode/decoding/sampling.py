"""Choosing each row's next token from a step's logits, every row in one batched pass.

A request's ``Sampler`` holds its knobs (``temperature``, ``top_p``) and, with a ``seed``, its
own random stream, so that its tokens do not depend on the requests beside it. ``sample_rows``
turns the step's samplers into per-row arrays and samples every row at once: greedy rows take
the argmax, the others the Gumbel-max of their tempered, top-p-truncated logits, the noise of
a seeded row drawn from its own key (one ``vmap`` over the keys) and of the others from MLX's
global random state.

Dimension legend: R = logit rows of a step, V = vocabulary size.
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
        seed: the request's own random stream (the same tokens alone or in any batch, for the
            same schedule of its own steps); ``None`` uses MLX's global random state.
        stream: which of the seed's streams (requests sharing one seed each take their own).

    A subclass that overrides ``__call__`` chooses its rows' tokens itself: ``sample_rows``
    calls it once per step with its rows (a test's spy); every plain ``Sampler`` is sampled
    in the one batched pass.
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stream: int = 0,
    ):
        if temperature < 0:
            raise ValueError(f"[Sampler] temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"[Sampler] top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.stream = stream
        self._key = None
        if seed is not None:
            key = mx.random.key(seed)
            self._key = mx.random.split(key, stream + 1)[stream] if stream else key

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def next_key(self) -> Optional[mx.array]:
        """The next key of its own stream (``None`` without a seed)."""
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key

    def __call__(self, logits: mx.array) -> mx.array:
        """``logits [R, V]`` -> int32 token ids ``[R]``, every row with these knobs."""
        return _sample([self] * logits.shape[0], logits)


def _custom(sampler: Sampler) -> bool:
    return type(sampler).__call__ is not Sampler.__call__


def sample_rows(samplers: Sequence[Sampler], logits: mx.array) -> mx.array:
    """``logits [R, V]``, row ``r`` chosen by ``samplers[r]`` -> int32 token ids ``[R]``: one
    batched pass over the plain samplers' rows (per-row knobs as arrays), and one call of each
    custom sampler (``Sampler``'s docstring) over its own rows."""
    custom = {id(s): s for s in samplers if _custom(s)}
    if not custom:
        return _sample(samplers, logits)
    chosen = mx.zeros((len(samplers),), dtype=mx.int32)
    groups: dict[int, list[int]] = {}
    for row, sampler in enumerate(samplers):
        groups.setdefault(id(sampler) if id(sampler) in custom else 0, []).append(row)
    for owner, rows in groups.items():
        index = mx.array(rows, dtype=mx.int32)
        sampler = custom.get(owner)
        picked = (
            sampler(logits[index]) if sampler is not None
            else _sample([samplers[r] for r in rows], logits[index])
        )
        chosen[index] = picked.astype(mx.int32)
    return chosen


def _sample(samplers: Sequence[Sampler], logits: mx.array) -> mx.array:
    """The batched pass of ``sample_rows`` over plain samplers."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all(s.greedy for s in samplers):
        return greedy
    temperatures = mx.array([s.temperature or 1.0 for s in samplers], dtype=mx.float32)
    scaled = logits.astype(mx.float32) / temperatures[:, None]
    if any(s.top_p < 1.0 for s in samplers):
        top_p = mx.array([s.top_p for s in samplers], dtype=mx.float32)
        order = mx.argsort(-scaled, axis=-1)
        probs = mx.softmax(mx.take_along_axis(scaled, order, axis=-1), axis=-1)
        # A token stays if the mass before it is below top_p: the most likely always stays.
        keep = (mx.cumsum(probs, axis=-1) - probs) < top_p[:, None]
        # Back in vocabulary order, where each token meets its own noise whatever the knobs.
        keep = mx.put_along_axis(mx.zeros(keep.shape, dtype=mx.bool_), order, keep, axis=-1)
        scaled = mx.where(keep, scaled, -mx.inf)
    choice = mx.argmax(scaled + _gumbel(samplers, logits.shape[-1]), axis=-1)
    chosen = choice.astype(mx.int32)
    if any(s.greedy for s in samplers):
        is_greedy = mx.array([s.greedy for s in samplers])
        chosen = mx.where(is_greedy, greedy, chosen)
    return chosen


def _gumbel(samplers: Sequence[Sampler], vocab: int) -> mx.array:
    """float32 ``[R, V]`` Gumbel noise: a seeded row's from its own next key, the others' from
    MLX's global random state (greedy rows take some too; their choice is the argmax)."""
    keys = [None if s.greedy else s.next_key() for s in samplers]
    seeded = [r for r, key in enumerate(keys) if key is not None]
    if not seeded:
        return mx.random.gumbel((len(samplers), vocab))
    own = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(
        mx.stack([keys[r] for r in seeded])
    )
    if len(seeded) == len(samplers):
        return own
    noise = mx.random.gumbel((len(samplers), vocab))
    noise[mx.array(seeded, dtype=mx.int32)] = own
    return noise
