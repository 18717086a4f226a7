"""A one-line progress bar on stderr for long decoding runs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``[#####-----] done/total label, rate/s``, redrawn in place at most every ``interval``
    seconds (and when done); ``close`` ends the line."""

    def __init__(
        self,
        total: int,
        label: str = "tokens",
        width: int = 30,
        stream: TextIO = sys.stderr,
        interval: float = 0.1,
    ):
        self.total = max(total, 1)
        self.label = label
        self.width = width
        self.stream = stream
        self.interval = interval
        self.done = 0
        self._start = time.perf_counter()
        self._drawn_at = float("-inf")

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._drawn_at < self.interval and self.done < self.total:
            return
        self._drawn_at = now
        filled = self.width * min(self.done, self.total) // self.total
        rate = self.done / max(now - self._start, 1e-9)
        self.stream.write(
            f"\r[{'#' * filled}{'-' * (self.width - filled)}] "
            f"{self.done}/{self.total} {self.label}, {rate:.1f}/s"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
