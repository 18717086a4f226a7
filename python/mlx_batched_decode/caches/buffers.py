"""How slot-cache buffers grow and where their memory lives, shared by every cache kind."""

from __future__ import annotations

from typing import Iterable, Optional

import mlx.core as mx

from ..ops import advise_huge_pages


def check_step(owner: str, step: int) -> int:
    """``step``, the positions a cache grows by, or ValueError ``[owner] ...`` unless >= 1."""
    if step < 1:
        raise ValueError(f"[{owner}] step must be >= 1, got {step}")
    return step


def round_up(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step


def slot_growth(
    slots: int,
    length: int,
    current_slots: int,
    current_capacity: int,
    step: int,
    limit: Optional[int] = None,
) -> Optional[list[tuple[int, int]]]:
    """The ``mx.pad`` widths that grow ``[S, H_kv, capacity, *]`` buffers to hold ``slots``
    slots of ``length`` positions, or ``None`` when they already do.

    Slots at least double, so admitting B requests one by one copies the buffers O(log B)
    times, not B times; positions grow by whole chunks of ``step``, to at most ``limit``
    (a ring's size) when given.
    """
    if length <= current_capacity and slots <= current_slots:
        return None
    new_slots = max(slots, 2 * current_slots) if slots > current_slots else current_slots
    new_capacity = max(first_capacity(length, step, limit), current_capacity)
    return [(0, new_slots - current_slots), (0, 0), (0, new_capacity - current_capacity), (0, 0)]


def first_capacity(length: int, step: int, limit: Optional[int] = None) -> int:
    """Positions a buffer needs for ``length`` of them: whole chunks of ``step``, at least one,
    at most ``limit`` when given."""
    capacity = round_up(max(length, 1), step)
    return capacity if limit is None else min(capacity, limit)


def reserve_length(context) -> int:
    """Positions a slot cache makes room for in a step: the step's ``max_len``, or the
    context's ``reserve_len`` (the end of the longest prompt being fed) when larger."""
    return max(context.max_len, context.reserve_len)


def place_on_huge_pages(buffers: Iterable[mx.array]) -> None:
    """Put new cache buffers on transparent huge pages, where the kernel streams them faster.

    New buffers only: the in-place writes of later steps keep the memory, and with it the pages.
    The pages are chosen once the memory exists, so this costs a sync per growth.
    """
    buffers = list(buffers)
    mx.eval(buffers)
    for buffer in buffers:
        advise_huge_pages(buffer)


class SlotBuffers:
    """The key and value buffers ``[slots, H_kv, capacity, D]`` of a slot cache, made on its
    first write (``None`` before): what every slot-cache kind reports of them. A cache written
    with ``values=None`` keeps keys only (multi-head latent attention reads its values as the
    keys' first columns) and its ``values`` stay ``None``."""

    keys: Optional[mx.array] = None
    values: Optional[mx.array] = None

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers())

    def buffers(self) -> list[mx.array]:
        """The buffers made so far: keys, then values (if kept)."""
        return [b for b in (self.keys, self.values) if b is not None]

    def scatter(
        self,
        rows: mx.array,
        positions: mx.array,
        slots: int,
        length: int,
        keys: mx.array,
        values: Optional[mx.array],
    ) -> tuple[mx.array, Optional[mx.array]]:
        """Write new ``[M, H_kv, L, D]`` keys/values of slots ``rows`` at ``positions`` ``[M, L]``
        (M = B requests of L tokens, or N packed tokens of one) and return the strided views
        ``[slots, H_kv, length, D]`` attention reads in place.

        One scatter per buffer for the whole step; MLX updates the buffer in place. The two
        index arrays broadcast to [M, L] and sit apart, so the updates are [M, L, H_kv, D].
        """
        self.keys[rows, :, positions] = keys.swapaxes(1, 2)
        if values is None:
            return self.keys[:slots, :, :length], None
        self.values[rows, :, positions] = values.swapaxes(1, 2)
        return self.keys[:slots, :, :length], self.values[:slots, :, :length]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src``'s buffers into slot ``dst``."""
        if length == 0:
            return
        # Materialise the pieces first: a live view of a buffer would stop MLX from
        # updating the buffer in place and turn this into a copy of the whole buffer.
        buffers = self.buffers()
        pieces = [mx.contiguous(b[src : src + 1, :, :length]) for b in buffers]
        mx.eval(pieces)
        for buffer, piece in zip(buffers, pieces):
            buffer[dst : dst + 1, :, :length] = piece
