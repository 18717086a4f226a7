"""``RingStep``: what a decode step's ring caches of one size read and write, derived once.

A ring of ``R`` positions per request keeps position ``p`` of a request at ring slot ``p mod R``:
its last ``R`` positions, ``len - R .. len - 1`` once it holds ``len > R``. The op sees them in
time order as logical positions ``0 .. min(len, R) - 1`` through ``ring_offset = max(len - R, 0)``
(logical ``j`` in slot ``(j + ring_offset) mod R``), so the L new tokens stay the last logical
positions and a window of ``R - L + 1`` keys or fewer reaches only positions the ring holds.

Dimension legend: B = requests in the step, L = new tokens per request in the step,
R = ring positions per request.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class RingStep(NamedTuple):
    """One step's arrays for every ring cache of ``size`` positions, shared by their layers.

    Attributes:
        size: R.
        max_len: ``min(max_len, R)``, the positions attention reads: ``R`` once some request
            holds more, every request's length (offsets all 0) before.
        valid_lens: int32 ``[B]``, ``min(len_b, R)``: the logical lengths after this step's tokens.
        ring_offset: int32 ``[B]``, ``max(len_b - R, 0)``: the op's ``ring_offset``.
        new_slots: int32 ``[B, L]``, ``new_positions mod R``: where the new tokens are written.
    """

    size: int
    max_len: int
    valid_lens: mx.array
    ring_offset: mx.array
    new_slots: mx.array


def ring_step(size: int, max_len: int, valid_lens: mx.array, new_positions: mx.array) -> RingStep:
    """The ``RingStep`` of rings of ``size`` positions for a step whose requests reach int32
    ``valid_lens [B]`` (``max_len`` the longest) with new tokens at ``new_positions [B, L]``;
    derived on the device, no host copy."""
    if size < new_positions.shape[1]:
        raise ValueError(
            f"[BatchedDecodeContext] a ring of {size} positions cannot hold the "
            f"{new_positions.shape[1]} new tokens of a request"
        )
    return RingStep(
        size=size,
        max_len=min(max_len, size),
        valid_lens=mx.minimum(valid_lens, size),
        ring_offset=mx.maximum(valid_lens - size, 0),
        new_slots=new_positions % size,
    )
