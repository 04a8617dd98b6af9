"""Seconds between named steps, each from the end of the one before (a fetch's steps, a worker's start)."""

from __future__ import annotations

import time


class Laps:
    """``lap(name)`` records the seconds since the previous lap (or since creation) in ``phases``,
    rounded to ``digits`` when given."""

    def __init__(self, digits: int | None = None) -> None:
        self.phases: dict[str, float] = {}
        self.digits = digits
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        seconds = now - self._last
        self.phases[name] = seconds if self.digits is None else round(seconds, self.digits)
        self._last = now
