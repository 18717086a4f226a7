"""The on/off state of a plug-in: at most one set of patches in force, swapped under a lock.

The mlx-lm and SGLang plug-ins keep their patches in a ``PluginSwitch`` and expose
``enable``, ``disable``, ``is_enabled``, ``enabled`` and ``stats`` on top of it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, Optional, Protocol, TypeVar


class Patches(Protocol):
    def restore(self) -> None: ...


P = TypeVar("P", bound=Patches)


class PluginSwitch(Generic[P]):
    """The patches in force (``active``), or None while the plug-in is off."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._active: Optional[P] = None

    @property
    def active(self) -> Optional[P]:
        return self._active

    def turn_on(self, make: Callable[[], P], check: Callable[[P], None] = lambda active: None) -> None:
        """Applies ``make()``'s patches if none are in force, else runs ``check`` on those that are
        (it raises when they differ from what the caller asked for)."""
        with self._lock:
            if self._active is None:
                self._active = make()
            else:
                check(self._active)

    def turn_off(self) -> None:
        """Restores what the patches in force replaced, if any."""
        with self._lock:
            if self._active is not None:
                self._active.restore()
                self._active = None

    @contextmanager
    def on_during(self, turn_on: Callable[[], None]) -> Iterator[None]:
        """Runs the block after ``turn_on()``; turns the plug-in off after it unless it was on."""
        was_on = self._active is not None
        turn_on()
        try:
            yield
        finally:
            if not was_on:
                self.turn_off()

    def require(self, caller: str) -> P:
        """The patches in force; ``ValueError`` naming ``caller`` when the plug-in is off."""
        active = self._active
        if active is None:
            raise ValueError(f"{self._prefix} {caller} needs the plug-in enabled")
        return active
