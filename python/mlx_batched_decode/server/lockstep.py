"""Tensor-parallel serving: rank 0's step plans executed on every rank, in lockstep.

Under ``mlx.launch`` with ``--tensor-parallel`` every rank holds its shard of the model; only
rank 0 serves HTTP and schedules. Before each step rank 0's decoding thread sends the step's
``StepPlan`` (the rows released and admitted since the last plan, with the forks an admission
brings and the row a fork starts from, each row's tokens, the block
tables of the paged layout, the penalties' contexts, the chunks whose prompt logprobs are
kept) to the other ranks, whose runners execute the same plan on their shards (``follow``):
their rows hold the same requests, and the step's all-reduces line up. Every request samples
with a seed (rank 0 draws one where the request gives none), so that every rank picks the
same tokens. A ``None`` plan stops the followers.

A plan travels as int32 values over ``mx.distributed.all_sum``, rank 0 contributing them and the
others zeros: first its length, then the values. An admission's sampler travels as its
``SamplingParams.to_dict()`` in JSON, its UTF-8 bytes packed four to an int32: every value a
request may carry (64-bit seeds, ``logit_bias``, every knob) arrives exactly. An admission's
grammar travels the same way (``GrammarSpec.to_dict()``), with the token it starts after:
every rank makes the same matchers, so the same masks constrain the same rows.
"""

from __future__ import annotations

import json
import struct
from typing import Optional

import mlx.core as mx

from ..decoding.grammar import GrammarSpec
from ..decoding.plan import Admission, Release, StepPlan
from ..decoding.runner import ModelRunner
from ..decoding.sampling import Sampler
from ..decoding.sampling_params import SamplingParams

_RELEASE, _ADMISSION = 0, 1


def _packed(data: dict) -> list[int]:
    """``data`` as int32 values: its JSON's byte count, then its bytes four to a value."""
    data = json.dumps(data).encode()
    padded = data + b"\0" * (-len(data) % 4)
    return [len(data), *struct.unpack(f"<{len(padded) // 4}i", padded)]


def _unpacked(read: _Reader) -> dict:
    size = read.one()
    words = read.take((size + 3) // 4)
    data = struct.pack(f"<{len(words)}i", *words)[:size]
    return json.loads(data)


def _sampler(sampler: Sampler) -> list[int]:
    return [sampler.stream, *_packed(sampler.params.to_dict())]


def _read_sampler(read: _Reader) -> Sampler:
    stream = read.one()
    return Sampler.from_params(SamplingParams.from_dict(_unpacked(read)), stream)


def _grammar(admission: Admission) -> list[int]:
    """0 for none, else 1, the token it starts after (-1: none) and the spec."""
    if admission.grammar is None:
        return [0]
    after = -1 if admission.grammar_after is None else admission.grammar_after
    return [1, after, *_packed(admission.grammar.to_dict())]


def _read_grammar(read: _Reader) -> tuple[Optional[GrammarSpec], Optional[int]]:
    if not read.one():
        return None, None
    after = read.one()
    return GrammarSpec.from_dict(_unpacked(read)), None if after < 0 else after


def _ints(values: list[int]) -> list[int]:
    return [len(values), *values]


def encode(plan: Optional[StepPlan]) -> list[int]:
    """``plan`` as int32 values (``None``: stop); every sampler it admits has a seed."""
    if plan is None:
        return [0]
    values = [1, len(plan.row_changes)]
    for change in plan.row_changes:
        if isinstance(change, Release):
            values += [_RELEASE, change.row, change.last, change.length]
            continue
        values += [_ADMISSION, change.uid, change.row, *_sampler(change.sampler)]
        values += [len(change.forks)]
        values += [x for uid, sampler in change.forks for x in (uid, *_sampler(sampler))]
        values += [-1] if change.source is None else list(change.source)
        values += _grammar(change)
    values += _ints(plan.uids) + _ints(plan.seq_lens)
    values += _ints([-1 if t is None else t for t in plan.next_tokens])
    values += [len(plan.chunks)] + [x for c in plan.chunks for x in _ints(c)]
    values += _ints([int(e) for e in plan.ending])
    values += _ints([x for pair in plan.first_chunks for x in pair])
    values += [plan.reserve_len, plan.num_draft_tokens]
    tables = plan.block_tables
    values += [-1] if tables is None else [len(tables)] + [x for t in tables for x in _ints(t)]
    values += [len(plan.contexts)]
    values += [x for c in plan.contexts for x in ([-1] if c is None else _ints(c))]
    values += _ints([x for triple in plan.prompt_logprobs for x in triple])
    return values


class _Reader:
    def __init__(self, values: list[int]):
        self.values, self.at = values, 0

    def take(self, count: int = 1) -> list[int]:
        self.at += count
        return self.values[self.at - count : self.at]

    def one(self) -> int:
        return self.take()[0]

    def ints(self) -> list[int]:
        return self.take(self.one())


def decode(values: list[int]) -> Optional[StepPlan]:
    """The inverse of ``encode``."""
    read = _Reader(values)
    if not read.one():
        return None
    plan = StepPlan()
    for _ in range(read.one()):
        if read.one() == _RELEASE:
            plan.row_changes.append(Release(*read.take(3)))
            continue
        uid, row = read.take(2)
        sampler = _read_sampler(read)
        forks = []
        for _ in range(read.one()):
            fork = read.one()
            forks.append((fork, _read_sampler(read)))
        row_of_source = read.one()
        source = None if row_of_source < 0 else (row_of_source, read.one())
        grammar, after = _read_grammar(read)
        plan.row_changes.append(Admission(uid, row, sampler, forks, source, grammar, after))
    plan.uids, plan.seq_lens = read.ints(), read.ints()
    plan.next_tokens = [None if t < 0 else t for t in read.ints()]
    plan.chunks = [read.ints() for _ in range(read.one())]
    plan.ending = [bool(e) for e in read.ints()]
    pairs = read.ints()
    plan.first_chunks = list(zip(pairs[::2], pairs[1::2]))
    plan.reserve_len, plan.num_draft_tokens = read.take(2)
    count = read.one()
    plan.block_tables = None if count < 0 else [read.ints() for _ in range(count)]
    for _ in range(read.one()):
        size = read.one()
        plan.contexts.append(None if size < 0 else read.take(size))
    triples = read.ints()
    plan.prompt_logprobs = list(zip(triples[::3], triples[1::3], triples[2::3]))
    return plan


class Lockstep:
    """Plans over ``group``: rank 0 ``send``s, the other ranks ``receive``."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def _all_sum(self, values: list[int]) -> list[int]:
        out = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        return out.tolist()

    def send(self, plan: Optional[StepPlan]) -> None:
        values = encode(plan)
        self._all_sum([len(values)])
        self._all_sum(values)

    def receive(self) -> Optional[StepPlan]:
        (length,) = self._all_sum([0])
        return decode(self._all_sum([0] * length))


def follow(runner: ModelRunner, lockstep: Lockstep) -> int:
    """A follower rank's loop: execute rank 0's plans on ``runner`` until a ``None`` plan;
    returns the steps executed."""
    steps = 0
    while (plan := lockstep.receive()) is not None:
        runner.execute(plan)
        steps += 1
    return steps
