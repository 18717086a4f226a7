"""A request's sampling knobs, the ones ``mlx_lm.server`` takes, checked once when made.

``SamplingParams`` is frozen and hashable; ``to_dict`` / ``from_dict`` carry it as plain
JSON values (tensor-parallel ranks send it that way), 64-bit seeds included.

The penalties follow mlx-lm's ``make_logits_processors``: each reads the last
``*_context_size`` tokens of the request's context (prompt, then generated tokens); a context
size of 0 reads the whole context, as mlx-lm's ``tokens[-0:]`` does.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any, Optional

# ``context_size`` of a request whose penalty reads its whole context (a context size of 0):
# slicing ``history[-WHOLE_HISTORY:]`` keeps everything.
WHOLE_HISTORY = sys.maxsize
# The most top logprobs a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20
_SEEDS = 2**64


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _token(name: str, value: Any) -> int:
    token = _integer(name, value)
    if token < 0:
        raise ValueError(f"{name}: token ids must be >= 0, got {token}")
    return token


def _bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token id, bias)`` pairs, from pairs or a mapping."""
    pairs = value.items() if isinstance(value, Mapping) else value
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise ValueError(f"logit_bias must be (token id, bias) pairs or a mapping, got {value!r}")
    out = []
    for pair in pairs:
        plain = isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable)
        entry = () if plain else tuple(pair)
        if len(entry) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        out.append((_token("logit_bias", entry[0]), _number("logit_bias", entry[1])))
    if len({token for token, _ in out}) != len(out):
        raise ValueError(f"logit_bias names a token id twice: {value!r}")
    return tuple(out)


@dataclass(frozen=True)
class SamplingParams:
    """One request's knobs (mlx-lm's ``make_sampler`` and ``make_logits_processors``).

    ``temperature`` 0 picks the argmax of the processed logits; ``top_p`` 1, ``top_k`` 0,
    ``min_p`` 0, ``xtc_probability`` 0 and penalties of 0 are off (a ``repetition_penalty`` of
    1 changes nothing either). ``logit_bias`` also accepts a mapping; ``seed`` gives the
    request its own random stream; ``logprobs`` k reports the chosen token's logprob and the
    k most likely tokens' (``None``: nothing).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] = ()
    seed: Optional[int] = None
    logprobs: Optional[int] = None

    def __post_init__(self):
        def set_(name, value):
            object.__setattr__(self, name, value)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "xtc_probability", "xtc_threshold"):
            set_(name, _number(name, getattr(self, name)))
        for name in ("top_k", "repetition_context_size", "presence_context_size",
                     "frequency_context_size"):
            set_(name, _integer(name, getattr(self, name)))
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        ranges = {
            "temperature": (0.0, math.inf), "min_p": (0.0, 1.0),
            "repetition_penalty": (0.0, math.inf), "xtc_probability": (0.0, 1.0),
            "xtc_threshold": (0.0, 0.5),
        }
        for name, (low, high) in ranges.items():
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {getattr(self, name)}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        set_("logit_bias", _bias(self.logit_bias))
        special = self.xtc_special_tokens
        if isinstance(special, (str, bytes)) or not isinstance(special, Iterable):
            raise ValueError(f"xtc_special_tokens must be token ids, got {special!r}")
        set_("xtc_special_tokens", tuple(_token("xtc_special_tokens", t) for t in special))
        if self.seed is not None:
            set_("seed", _integer("seed", self.seed))
            if not 0 <= self.seed < _SEEDS:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None:
            set_("logprobs", _integer("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def penalty_windows(self) -> dict[str, int]:
        """The penalties in use (``"repetition"``, ``"presence"``, ``"frequency"``), each to
        its context size (0: the whole context)."""
        on = {
            "repetition": self.repetition_penalty not in (0.0, 1.0),
            "presence": self.presence_penalty != 0.0,
            "frequency": self.frequency_penalty != 0.0,
        }
        return {kind: getattr(self, f"{kind}_context_size") for kind, used in on.items() if used}

    @property
    def context_size(self) -> int:
        """The most context tokens the penalties in use read: 0 when none is in use,
        ``WHOLE_HISTORY`` when one reads the whole context."""
        sizes = self.penalty_windows().values()
        if not sizes:
            return 0
        return WHOLE_HISTORY if 0 in sizes else max(sizes)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` when a ``logit_bias`` or ``xtc_special_tokens`` id is not
        below ``vocab_size``."""
        for name, tokens in (("logit_bias", [t for t, _ in self.logit_bias]),
                             ("xtc_special_tokens", self.xtc_special_tokens)):
            bad = [t for t in tokens if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token ids {bad} not below the vocabulary size {vocab_size}"
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: lists for the tuples (``logit_bias`` as ``[id, bias]`` pairs)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["logit_bias"] = [[token, bias] for token, bias in self.logit_bias]
        out["xtc_special_tokens"] = list(self.xtc_special_tokens)
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SamplingParams":
        """The inverse of ``to_dict`` (missing fields take their defaults)."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        return cls(**values)
