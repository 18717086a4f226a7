"""What each decode mask of mlx-lm's batch caches says, recorded when the cache builds it.

mlx-lm's models build one mask per forward pass with ``cache.make_mask(N, ...)`` on one layer's
cache and hand that array to every layer of its kind. For a decode step (N = 1) on a
``BatchKVCache`` or a ``BatchRotatingKVCache`` the mask allows, per request, the keys from its
left padding to the new token, within ``window_size`` when the model passes one. ``MaskTags``
records, for each mask array such a ``make_mask`` returns, the facts that decide it (the cache
kind, its length before the step's write, the window, whether the ring had wrapped), so the
attention that later receives the array knows which keys it allows without reading it. Masks
are keyed by identity and held through weak references: a tag lives exactly as long as its mask.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx


@dataclass(frozen=True)
class MaskTag:
    """The facts behind one decode mask built by a batch cache's ``make_mask``.

    Attributes:
        kind: the class of the cache that built it (``BatchKVCache`` or ``BatchRotatingKVCache``).
        length: positions the cache held before the step's write: ``_idx`` of a
            ``BatchKVCache``, ``_offset`` of a ``BatchRotatingKVCache``.
        window: the ``window_size`` the model asked for (``None``: none).
        wrapped: a ``BatchRotatingKVCache`` whose ring had wrapped (its mask is rolled to the
            ring's slots); always ``False`` for a ``BatchKVCache``.
    """

    kind: type
    length: int
    window: Optional[int]
    wrapped: bool


class MaskTags:
    """Tags of the live decode masks, looked up by the mask array itself."""

    def __init__(self) -> None:
        self._tags: dict[int, tuple[weakref.ref, MaskTag]] = {}
        # Reentrant: a weak-reference callback can run inside add() when an allocation there
        # lets the garbage collector free another mask.
        self._lock = threading.RLock()

    def add(self, mask: mx.array, tag: MaskTag) -> None:
        key = id(mask)

        def forget(ref: weakref.ref) -> None:
            with self._lock:
                if self._tags.get(key, (None,))[0] is ref:
                    del self._tags[key]

        with self._lock:
            self._tags[key] = (weakref.ref(mask, forget), tag)

    def get(self, mask: Any) -> Optional[MaskTag]:
        """The tag of ``mask``, or ``None`` if no batch cache built this object."""
        with self._lock:
            entry = self._tags.get(id(mask))
        if entry is None or entry[0]() is not mask:
            return None
        return entry[1]


def tagging_batch_kv_make_mask(original: Callable, tags: MaskTags) -> Callable:
    """``BatchKVCache.make_mask`` that also tags the decode masks it returns."""

    @functools.wraps(original)
    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = original(self, N, return_array=return_array, **kwargs)
        if N == 1:
            tags.add(mask, MaskTag(type(self), self._idx, kwargs.get("window_size"), False))
        return mask

    return make_mask


def tagging_batch_rotating_make_mask(original: Callable, tags: MaskTags) -> Callable:
    """``BatchRotatingKVCache.make_mask`` that also tags the decode masks it returns."""

    @functools.wraps(original)
    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        mask = original(self, N, window_size=window_size, return_array=return_array)
        if N == 1:
            # mlx-lm rolls the mask to the ring's slots from the step whose write wraps it.
            wrapped = bool(self.rotated or self._idx >= self.max_size)
            tags.add(mask, MaskTag(type(self), self._offset, window_size, wrapped))
        return mask

    return make_mask
