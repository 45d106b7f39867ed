"""`Timings`: the durations of an action repeated every few steps, in bounded memory."""

from __future__ import annotations

import collections
import statistics


class Timings:
    """How many times an action ran (`count`) and its total seconds (`total`) over the whole
    run, and its last ``keep`` durations (`recent`; iterating gives those, `median` is
    theirs). No ``len``: the count and the recent durations differ once there are more than
    ``keep``. A list of every duration grew by one float per stored step or check: a
    million-step run held millions."""

    def __init__(self, keep: int = 1024):
        self.count, self.total = 0, 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=keep)

    def append(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.recent.append(seconds)

    def median(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None

    def __iter__(self):
        return iter(self.recent)

    def __repr__(self) -> str:
        return f"Timings(count={self.count}, total={self.total:.6g}, last={list(self.recent)[-3:]})"
