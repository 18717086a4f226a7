"""Tensor-parallel serving: rank 0's decoder operations replayed on every rank, in lockstep.

Under ``mlx.launch`` with ``--tensor-parallel`` every rank holds its shard of the model and its
own ``BatchedDecoder``; only rank 0 serves HTTP. Before each step rank 0's decoding thread
sends a ``Plan`` (the requests it dropped or cancelled since the last step, those it admitted,
whether it steps, whether it stops) to the other ranks, which apply it to their decoders in the
same order (``follow``). Their decoders then hold the same requests in the same rows, and the
step's all-reduces line up. Every request samples with a seed (rank 0 draws one where the
request gives none), so that every rank picks the same tokens.

A plan travels as int32 values over ``mx.distributed.all_sum``, rank 0 contributing them and the
others zeros: first its length, then the values.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
import mlx.core as mx

from ..decoding.decoder import BatchedDecoder
from ..decoding.sampling import Sampler


@dataclass
class Admission:
    """One request as ``BatchedDecoder.add_request`` takes it, sampling seeded."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int

    def sampler(self) -> Sampler:
        return Sampler(self.temperature, self.top_p, self.seed)


@dataclass
class Plan:
    """What rank 0 did to its decoder since its last step, in order: ``cancels`` (request ids),
    then ``admits`` (in the order their ids were given), then a step if ``step``; ``stop`` ends
    the followers."""

    cancels: list[int] = field(default_factory=list)
    admits: list[Admission] = field(default_factory=list)
    step: bool = False
    stop: bool = False


def _float_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def encode(plan: Plan) -> list[int]:
    """``plan`` as int32 values (floats by their float32 bits)."""
    values = [int(plan.stop), int(plan.step), len(plan.cancels), *plan.cancels, len(plan.admits)]
    for a in plan.admits:
        values += [len(a.prompt), a.max_tokens, _float_bits(a.temperature),
                   _float_bits(a.top_p), a.seed, *a.prompt]
    return values


def decode(values: list[int]) -> Plan:
    """The inverse of ``encode``."""
    plan = Plan(stop=bool(values[0]), step=bool(values[1]))
    i = 3 + values[2]
    plan.cancels = values[3:i]
    count, i = values[i], i + 1
    for _ in range(count):
        n, max_tokens, temperature, top_p, seed = values[i : i + 5]
        prompt = values[i + 5 : i + 5 + n]
        plan.admits.append(
            Admission(prompt, max_tokens, _bits_float(temperature), _bits_float(top_p), seed)
        )
        i += 5 + n
    return plan


class Lockstep:
    """Plans over ``group``: rank 0 ``send``s, the other ranks ``receive``."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def _all_sum(self, values: list[int]) -> list[int]:
        out = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        return out.tolist()

    def send(self, plan: Plan) -> None:
        values = encode(plan)
        self._all_sum([len(values)])
        self._all_sum(values)

    def receive(self) -> Plan:
        (length,) = self._all_sum([0])
        return decode(self._all_sum([0] * length))


def follow(decoder: BatchedDecoder, lockstep: Lockstep) -> None:
    """A follower rank's loop: apply rank 0's plans to ``decoder`` until one says stop."""
    while True:
        plan = lockstep.receive()
        for uid in plan.cancels:
            decoder.cancel(uid)
            decoder.stats.requests.pop(uid, None)
        for a in plan.admits:
            decoder.add_request(a.prompt, a.max_tokens, sampler=a.sampler())
        if plan.step:
            result = decoder.step()
            for uid in result.finished:
                decoder.stats.requests.pop(uid, None)
        if plan.stop:
            return
