"""Choosing each row's next token from a step's logits, every row in one batched pass.

A request's ``Sampler`` holds its ``SamplingParams`` and, with a seed, its own random stream,
so that its tokens do not depend on the requests beside it: a seeded draw is a function of
(seed, stream, step, slot) computed on the host, so the draws of a step's seeded rows travel
as one array (and a tensor-parallel follower's rebuilt sampler draws the same numbers). ``sample_rows`` turns the step's
knobs into per-row arrays and follows mlx-lm (``generate_step`` with ``make_logits_processors``
and ``make_sampler``) for every row at once:

1. processors on the float32 logits: ``logit_bias``, then the repetition, presence and
   frequency penalties, each over its own window of the row's context;
2. ``logprobs = processed - logsumexp(processed)`` (what the request's logprobs report);
   a grammar-constrained row's logits have -inf for its forbidden tokens before step 1, so
   its logprobs are those of the constrained distribution, as vLLM's (which applies the
   grammar bitmask to the logits before its sampler computes logprobs);
3. greedy rows take the argmax; the others truncate the logprobs in mlx-lm's order top-p,
   min-p, XTC, top-k, and sample the softmax of the truncated logprobs over the temperature
   by its inverse CDF: one uniform draw per row (after XTC's), of a seeded row from its own
   counter-based stream (``Sampler.uniform``), of the others from MLX's global random state. Top-k keeps every token tied with the
   k-th; a top-k of V or more keeps all (mlx-lm refuses it).

Each stage runs only when some row of the step uses it.

Dimension legend: R = logit rows of a step, V = vocabulary size, C = context columns,
K = top logprobs reported, P = prompt positions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import fields
from typing import Callable, NamedTuple, Optional, Sequence

import mlx.core as mx

from .sampling_params import SamplingParams


_MASK64 = (1 << 64) - 1
# splitmix64's increment (2^64 / the golden ratio) and a float32-exact 2^-24.
_GAMMA = 0x9E3779B97F4A7C15
_UNIT = 1.0 / (1 << 24)


def _mix64(z: int) -> int:
    """splitmix64's output function: a bijection of 64-bit ints whose outputs at consecutive
    positions pass BigCrush."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """A request's ``SamplingParams`` and its random stream.

    Args:
        temperature, top_p, seed: as ``SamplingParams`` (``seed``: the request's own random
            stream, the same tokens alone or in any batch for the same schedule of its own
            steps; ``None`` uses MLX's global random state).
        stream: which of the seed's streams (requests sharing one seed each take their own).
        **knobs: the other ``SamplingParams`` fields (``logit_bias`` may be a mapping).

    A subclass that overrides ``__call__`` chooses its rows' tokens itself: ``sample_rows``
    calls it once per step with its rows' processed logits (a test's spy); every plain
    ``Sampler`` is sampled in the one batched pass.
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stream: int = 0,
        **knobs,
    ):
        self.params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, **knobs)
        if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
            raise ValueError(f"stream must be an integer >= 0, got {stream!r}")
        self.stream = stream
        # Its stream's origin in splitmix64's sequence and the steps it has drawn (host ints).
        self._origin = None
        if self.seed is not None:
            base = _mix64((self.seed + _GAMMA) & _MASK64)
            self._origin = _mix64((base + (stream + 1) * _GAMMA) & _MASK64)
        self._steps = 0
        # The vocabulary size its token ids were last checked against.
        self._vocab = None

    @classmethod
    def from_params(cls, params: SamplingParams, stream: int = 0) -> "Sampler":
        knobs = {f.name: getattr(params, f.name) for f in fields(params)}
        return cls(stream=stream, **knobs)

    temperature = property(lambda self: self.params.temperature)
    top_p = property(lambda self: self.params.top_p)
    seed = property(lambda self: self.params.seed)
    greedy = property(lambda self: self.params.greedy)

    def next_step(self) -> Optional[int]:
        """The index of its stream's next step, counting it as drawn (``None`` without a
        seed): that step's draws are ``uniform(step, slot)``."""
        if self._origin is None:
            return None
        self._steps += 1
        return self._steps - 1

    def uniform(self, step: int, slot: int) -> float:
        """Draw ``slot`` (0: XTC's, 1: the token's) of step ``step`` of its stream, in
        [0, 1) on a grid of 2^-24 (exact in float32): splitmix64 at its own position, a
        function of (seed, stream, step, slot) alone."""
        position = (self._origin + (2 * step + slot + 1) * _GAMMA) & _MASK64
        return (_mix64(position) >> 40) * _UNIT

    def check_vocab(self, vocab_size: int) -> None:
        """``SamplingParams.check_vocab``, once per vocabulary size."""
        if self._vocab != vocab_size:
            self.params.check_vocab(vocab_size)
            self._vocab = vocab_size

    def __call__(self, logits: mx.array, contexts: Optional[mx.array] = None) -> mx.array:
        """``logits [R, V]`` (and ``contexts``, as ``sample_rows``) -> int32 token ids
        ``[R]``, every row with these knobs."""
        self.check_vocab(logits.shape[-1])
        samplers = [self] * logits.shape[0]
        processed = _process([self.params] * logits.shape[0], logits, contexts)
        return _choose(samplers, processed, _log_softmax(processed))


class Sampled(NamedTuple):
    """A step's choices: ``tokens`` int32 ``[R]``; with some row asking for logprobs,
    ``logprobs`` float32 ``[R]`` (each chosen token's) and, when some row asks for K > 0 top
    logprobs, ``top_ids`` int32 ``[R, K]`` and ``top_logprobs`` float32 ``[R, K]``, best first
    (K the most any row asks, at most V; rows asking fewer use their first entries)."""

    tokens: mx.array
    logprobs: Optional[mx.array] = None
    top_ids: Optional[mx.array] = None
    top_logprobs: Optional[mx.array] = None


def _custom(sampler: Sampler) -> bool:
    return type(sampler).__call__ is not Sampler.__call__


def sample_rows(
    samplers: Sequence[Sampler],
    logits: mx.array,
    contexts: Optional[mx.array] = None,
    masks: Optional[tuple[Optional[Sequence[int]], mx.array]] = None,
) -> Sampled:
    """Row ``r`` of ``logits [R, V]`` chosen by ``samplers[r]``.

    ``contexts``: int32 ``[R, C]``, row r's last C context tokens (prompt then generated
    tokens, the token fed at that row last), left-padded with -1; each penalty reads the last
    columns of its own context size (all C for a size of 0). Needed only when some sampler
    penalizes. ``masks``: ``(rows, bitmask)``, the grammar-constrained rows (``R_c``
    ascending indices, ``None``: all R) and their allowed tokens (int32 ``[R_c, W]``, token t allowed
    where bit ``t % 32`` of word ``t // 32`` is set; tokens past ``32 W`` are not). One
    batched pass over the plain samplers' rows (per-row knobs as arrays), and one call of each
    custom sampler (``Sampler``'s docstring) over its own rows.
    """
    vocab = logits.shape[-1]
    for sampler in samplers:
        sampler.check_vocab(vocab)
    if masks is not None:
        logits = _constrain(logits, *masks)
    params = [s.params for s in samplers]
    processed = _process(params, logits, contexts)
    # Lazy: computed only where a sampled row or a logprobs report reads it.
    logprobs = _log_softmax(processed)
    tokens = _choose_all(samplers, processed, logprobs)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        return Sampled(tokens)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return Sampled(tokens, chosen, *_top(logprobs, max(asked)))


# float32 -inf's bits as an int32 (0xFF800000): a forbidden token's addend.
_NEG_INF_BITS = -8388608


def _constrain(logits: mx.array, rows: Optional[Sequence[int]], bitmask: mx.array) -> mx.array:
    """``logits [R, V]`` with -inf for the tokens ``bitmask [R_c, W]`` forbids in ``rows``
    (``R_c`` ascending row indices, ``None``: every row), before any processor: the
    penalties, the logprobs, greedy choice and every truncation see only allowed tokens.

    The bits unpack on the device into an addend (0.0 or -inf, bit patterns made with integer
    ops: MLX's CPU ``where`` costs several times an add); the constrained rows' slices get it
    added and one concatenation puts the rows back in order (a scatter costs 3x that on the
    CPU), so the other rows are only copied."""
    vocab, width = logits.shape[-1], bitmask.shape[-1]
    bits = ((bitmask[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1) - 1
    addend = (bits & _NEG_INF_BITS).reshape(bitmask.shape[0], 32 * width)
    if 32 * width >= vocab:
        addend = addend[:, :vocab]
    else:
        addend = mx.pad(addend, [(0, 0), (0, vocab - 32 * width)], constant_values=_NEG_INF_BITS)
    addend = mx.view(addend, mx.float32).astype(logits.dtype)
    if rows is None:
        return logits + addend
    pieces, done = [], 0
    # Runs of consecutive rows: (position in rows, row) pairs whose difference is constant.
    for _, run in itertools.groupby(enumerate(rows), lambda pair: pair[1] - pair[0]):
        run = list(run)
        (i, start), count = run[0], len(run)
        if start > done:
            pieces.append(logits[done:start])
        pieces.append(logits[start : start + count] + addend[i : i + count])
        done = start + count
    if done < logits.shape[0]:
        pieces.append(logits[done:])
    return mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def prompt_logprobs(
    logits: mx.array, targets: mx.array, k: int
) -> tuple[mx.array, Optional[mx.array], Optional[mx.array]]:
    """Raw ``logits [P, V]`` (no processors) and int32 ``targets [P]`` -> the targets'
    float32 logprobs ``[P]``, and the ``k`` most likely tokens' int32 ids ``[P, k]`` and
    float32 logprobs ``[P, k]``, best first (``None`` for ``k == 0``)."""
    logprobs = _log_softmax(logits)
    chosen = mx.take_along_axis(logprobs, targets.astype(mx.int32)[:, None], axis=-1)[:, 0]
    return (chosen, *_top(logprobs, k))


def _log_softmax(logits: mx.array) -> mx.array:
    """float32 ``logits - logsumexp(logits)`` over the last axis, its sum in blocks."""
    logits = logits.astype(mx.float32)
    shifted = logits - mx.max(logits, axis=-1, keepdims=True)
    return shifted - mx.log(_blocked_sum(mx.exp(shifted)))


_BLOCK = 256


def _blocked_sum(values: mx.array) -> mx.array:
    """``values [R, V]`` summed over V ``[R, 1]``: blocks of ``_BLOCK`` columns first, then
    their sums (a CPU sum runs in one sequence, off by 3e-5 for V = 32000 in float32)."""
    whole = values.shape[-1] - values.shape[-1] % _BLOCK
    if whole == 0:
        return values.sum(axis=-1, keepdims=True)
    rows = values.shape[0]
    total = values[:, :whole].reshape(rows, -1, _BLOCK).sum(axis=-1).sum(axis=-1, keepdims=True)
    if whole < values.shape[-1]:
        total = total + values[:, whole:].sum(axis=-1, keepdims=True)
    return total


def _top(logprobs: mx.array, k: int) -> tuple[Optional[mx.array], Optional[mx.array]]:
    """The ``k`` (at most V) largest of ``logprobs [R, V]``: int32 ids and their values
    ``[R, k]``, best first; ``(None, None)`` for ``k == 0``."""
    k = min(k, logprobs.shape[-1])
    if k == 0:
        return None, None
    # A partition finds the k, a sort of k columns orders them.
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    return ids, mx.take_along_axis(values, order, axis=-1)


def _process(
    params: Sequence[SamplingParams], logits: mx.array, contexts: Optional[mx.array]
) -> mx.array:
    """``logits [R, V]`` after each row's logit bias and penalties (float32), or ``logits``
    itself when no row has any."""
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    windows = [p.penalty_windows() for p in params]
    if not bias and not any(windows):
        return logits
    x = logits.astype(mx.float32)
    if bias:
        r, t, b = zip(*bias)
        x = x.at[mx.array(r), mx.array(t)].add(mx.array(b, dtype=mx.float32))
    if not any(windows):
        return x
    if contexts is None:
        raise ValueError("sample_rows: a sampler penalizes repetitions but no contexts were given")
    return _penalize(params, windows, x, contexts.astype(mx.int32))


def _penalize(
    params: Sequence[SamplingParams], windows: Sequence[dict[str, int]], x: mx.array,
    contexts: mx.array,
) -> mx.array:
    """float32 ``x [R, V]`` after each row's penalties over its windows of ``contexts``
    (``sample_rows``), as one scatter-add over the context entries: the work scales with
    R x C, not with the vocabulary."""
    rows, columns = contexts.shape
    known = contexts >= 0
    tokens = mx.where(known, contexts, 0)
    at = (mx.arange(rows)[:, None], tokens)
    cols = mx.arange(columns)[None, :]
    # A token is in a window (a suffix of the columns) when its last occurrence is; that
    # occurrence alone carries the once-per-token penalties.
    last = mx.zeros(x.shape, dtype=mx.int32).at[at].maximum(mx.where(known, cols + 1, 0))
    is_last = known & (cols == mx.take_along_axis(last, tokens, axis=-1) - 1)

    def window(kind: str) -> mx.array:
        sizes = [w.get(kind, -1) for w in windows]
        sizes = [0 if size < 0 else columns if size == 0 else min(size, columns) for size in sizes]
        return cols >= columns - mx.array(sizes, dtype=mx.int32)[:, None]

    def factor(kind: str) -> mx.array:
        return mx.array([getattr(p, f"{kind}_penalty") for p in params], dtype=mx.float32)[:, None]

    def used(kind: str) -> bool:
        return any(kind in w for w in windows)

    delta = mx.zeros(contexts.shape, dtype=mx.float32)
    if used("repetition"):
        penalty = factor("repetition")
        picked = mx.take_along_axis(x, tokens, axis=-1)
        penalized = mx.where(picked < 0, picked * penalty, picked / mx.where(penalty > 0, penalty, 1.0))
        delta = delta + mx.where(is_last & window("repetition"), penalized - picked, 0.0)
    if used("presence"):
        delta = delta - mx.where(is_last & window("presence"), factor("presence"), 0.0)
    if used("frequency"):
        delta = delta - mx.where(known & window("frequency"), factor("frequency"), 0.0)
    return x.at[at].add(delta)


def _choose_all(samplers: Sequence[Sampler], processed: mx.array, logprobs: mx.array) -> mx.array:
    """int32 ``[R]``: the plain samplers' rows in one ``_choose``, each custom sampler's rows
    in one call of its own."""
    custom = {id(s): s for s in samplers if _custom(s)}
    if not custom:
        return _choose(samplers, processed, logprobs)
    chosen = mx.zeros((len(samplers),), dtype=mx.int32)
    groups: dict[int, list[int]] = {}
    for row, sampler in enumerate(samplers):
        groups.setdefault(id(sampler) if id(sampler) in custom else 0, []).append(row)
    for owner, rows in groups.items():
        index = mx.array(rows, dtype=mx.int32)
        sampler = custom.get(owner)
        picked = (
            sampler(processed[index]) if sampler is not None
            else _choose([samplers[r] for r in rows], processed[index], logprobs[index])
        )
        chosen[index] = picked.astype(mx.int32)
    return chosen


def _choose(samplers: Sequence[Sampler], processed: mx.array, logprobs: mx.array) -> mx.array:
    """The batched pass over plain samplers: ``processed [R, V]`` logits and their
    ``logprobs [R, V]`` -> int32 tokens ``[R]``."""
    greedy = mx.argmax(processed, axis=-1).astype(mx.int32)
    live = [not s.greedy for s in samplers]
    if not any(live):
        return greedy
    # Greedy rows take their knobs' neutral values: their choice is the argmax anyway.
    params = [s.params if on else _NEUTRAL for s, on in zip(samplers, live)]
    # Top-p and XTC read probabilities; the other truncations and the sampling are the same
    # on the logits, which spares an exp over the vocabulary.
    reads_probs = any(p.top_p < 1.0 or p.xtc_probability > 0.0 for p in params)
    # Each seeded row's step: its XTC draw (slot 0) and its token's (slot 1).
    steps = [s.next_step() if on else None for s, on in zip(samplers, live)]
    masked = _truncate(samplers, steps, params, logprobs if reads_probs else processed.astype(mx.float32))
    temperatures = mx.array([p.temperature or 1.0 for p in params], dtype=mx.float32)[:, None]
    chosen = _inverse_cdf(masked, _LOG2_E / temperatures, _uniform(samplers, steps, 1, live))
    if not all(live):
        chosen = mx.where(mx.array(live), chosen, greedy)
    return chosen


_LOG2_E = 1.0 / math.log(2.0)


def _inverse_cdf(masked: mx.array, scale: mx.array, uniform: mx.array) -> mx.array:
    """A token of each row of ``softmax(masked [R, V] / temperature)`` (float32, -inf for
    ruled-out tokens; ``scale [R, 1]`` is log2(e) / temperature) from its one uniform draw in
    [0, 1) ``[R]``: int32 ``[R]``, the first token whose cumulative mass reaches
    ``1 - uniform`` of the row's total.

    ``1 - uniform`` lies in (0, 1], so the threshold is above 0 and at most the total: a token
    of zero probability repeats its predecessor's cumulative mass (adding 0 is exact), so it is
    counted as below the threshold whenever the predecessor is, and never chosen. The draw
    resolves masses down to about 2^-24 of the total, as a float32 uniform does."""
    # 2^(x log2 e) is e^x: MLX's CPU exp costs 2-3x its power, with the same error (2e-6).
    exponent = (masked - mx.max(masked, axis=-1, keepdims=True)) * scale
    cdf = mx.cumsum(mx.power(2.0, exponent), axis=-1)
    threshold = (1.0 - uniform)[:, None] * cdf[:, -1:]
    return (cdf < threshold).sum(axis=-1).astype(mx.int32)


def _truncate(
    samplers: Sequence[Sampler], steps: Sequence[Optional[int]], params: Sequence[SamplingParams],
    logprobs: mx.array,
) -> mx.array:
    """``logprobs [R, V]`` with -inf for the tokens row r's ``params[r]`` rules out, in
    mlx-lm's order: top-p, min-p, XTC (drawing from step ``steps[r]`` of ``samplers[r]``'s
    stream, ``None``: MLX's global random state), top-k. Without
    top-p and XTC, logits (logprobs plus a row's constant) give the same tokens."""
    vocab = logprobs.shape[-1]

    def column(read: Callable[[SamplingParams], float]) -> mx.array:
        return mx.array([read(p) for p in params], dtype=mx.float32)[:, None]

    masked = logprobs
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    nucleus = [p.top_p < 1.0 for p in params]
    # A row under top-k and no XTC keeps at most its top k whatever top-p keeps: top-p's cut
    # is then found among those k (_top_k), without a sort of the vocabulary.
    among_top_k = all(k and p.xtc_probability == 0.0 for k, p, on in zip(top_k, params, nucleus) if on)
    if any(nucleus) and not among_top_k:
        masked = _top_p(masked, column(lambda p: p.top_p), nucleus)
    if any(p.min_p > 0.0 for p in params):
        # Tokens less likely than min_p times the most likely one go.
        floor = column(lambda p: math.log(p.min_p) if p.min_p > 0 else -math.inf)
        floor = mx.max(masked, axis=-1, keepdims=True) + floor
        masked = mx.where(masked < floor, -mx.inf, masked)
    if any(p.xtc_probability > 0.0 for p in params):
        masked = _xtc(samplers, steps, params, masked)
    if any(top_k):
        masked = _top_k(masked, top_k, column(lambda p: p.top_p) if any(nucleus) and among_top_k else None)
    return masked


_NEUTRAL = SamplingParams()


def _top_p(logprobs: mx.array, top_p: mx.array, uses: Sequence[bool]) -> mx.array:
    """mlx-lm's ``apply_top_p`` per row (``top_p [R, 1]``; 1 keeps all): in ascending order,
    the tokens whose mass above reaches ``top_p`` of the total go. Only the rows that ``uses``
    it are sorted (a sort of V columns costs ten times the rest of a row's sampling)."""
    rows = None if all(uses) else mx.array([r for r, on in enumerate(uses) if on], dtype=mx.int32)
    some, p = (logprobs, top_p) if rows is None else (logprobs[rows], top_p[rows])
    ascending = mx.sort(some, axis=-1)
    probs = mx.exp(ascending)
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = above[:, :1] + probs[:, :1]
    dropped = (above >= p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ascending, dropped, axis=-1)
    if rows is not None:
        # The other rows keep every token.
        threshold = mx.full(top_p.shape, -mx.inf).at[rows].maximum(threshold)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def _xtc(
    samplers: Sequence[Sampler], steps: Sequence[Optional[int]], params: Sequence[SamplingParams],
    logprobs: mx.array,
) -> mx.array:
    """mlx-lm's ``apply_xtc`` per row: with probability ``xtc_probability`` (a uniform draw,
    ``_uniform``'s slot 0), every token above ``xtc_threshold`` but the least likely of them
    goes, the row's ``xtc_special_tokens`` never."""
    uses = [p.xtc_probability > 0.0 for p in params]
    draws = _uniform(samplers, steps, 0, uses)
    chance = mx.array([p.xtc_probability for p in params], dtype=mx.float32)
    applied = mx.array(uses) & (draws <= chance)
    threshold = mx.array([p.xtc_threshold for p in params], dtype=mx.float32)[:, None]
    probs = mx.softmax(logprobs, axis=-1)
    least = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    remove = (probs > least) & applied[:, None]
    special = [(r, t) for r, p in enumerate(params) if uses[r] for t in p.xtc_special_tokens]
    if special:
        rows, tokens = zip(*special)
        kept = mx.zeros(logprobs.shape, dtype=mx.bool_)
        kept[mx.array(rows), mx.array(tokens)] = True
        remove = remove & ~kept
    return mx.where(remove, -mx.inf, logprobs)


def _top_k(logprobs: mx.array, top_k: Sequence[int], top_p: Optional[mx.array] = None) -> mx.array:
    """Row r keeps the tokens at least as likely as its ``top_k[r]``-th most likely (0: all),
    found with a partition of the largest k: the first of them when every row has that k,
    else from a sort of those k columns.

    With ``top_p [R, 1]`` (``_truncate``'s rows under top-p all have a top-k and no XTC, and
    their ``logprobs`` are normalized, with min-p's -inf at most a tail of the k), top-p's cut
    comes from the same k columns: the last whose mass above (mlx-lm's, summed from the most
    likely down, the total taken as 1) stays under ``top_p``, if it comes before the k-th."""
    most, vocab = max(top_k), logprobs.shape[-1]
    # A partition at V - k leaves the k largest last, unordered: no negations over R x V.
    largest = mx.partition(logprobs, kth=vocab - most, axis=-1)[:, vocab - most :]
    if top_p is None and len(set(top_k)) == 1:
        threshold = largest[:, :1]
    else:
        ascending = mx.sort(largest, axis=-1)
        k = mx.array(top_k, dtype=mx.int32)[:, None]
        # The k-th largest sits at index most - k of the ascending k.
        index = most - mx.maximum(k, 1)
        if top_p is not None:
            above = mx.cumsum(mx.exp(ascending), axis=-1, reverse=True, inclusive=False)
            under = (above < top_p).sum(axis=-1, keepdims=True)
            index = mx.where(top_p < 1.0, mx.maximum(index, most - under), index)
        threshold = mx.where(k > 0, mx.take_along_axis(ascending, index, axis=-1), -mx.inf)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def _uniform(
    samplers: Sequence[Sampler], steps: Sequence[Optional[int]], slot: int, uses: Sequence[bool]
) -> mx.array:
    """float32 draws in [0, 1) ``[R]``: a row that ``uses`` one and is seeded takes draw
    ``slot`` of its step ``steps[r]`` (computed on the host: one array, not ops per row), the
    others draw from MLX's global random state (rows not using theirs: any value)."""
    seeded = [on and step is not None for on, step in zip(uses, steps)]
    if not any(seeded):
        return mx.random.uniform(shape=(len(samplers),))
    own = mx.array(
        [s.uniform(step, slot) if on else 0.0 for s, step, on in zip(samplers, steps, seeded)],
        dtype=mx.float32,
    )
    if all(own_row or not on for on, own_row in zip(uses, seeded)):
        return own
    return mx.where(mx.array(seeded), own, mx.random.uniform(shape=(len(samplers),)))
