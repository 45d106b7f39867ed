"""`Timings`: the durations of an action repeated every few steps, in bounded memory."""

from __future__ import annotations

import collections
import statistics


class Timings:
    """How many times an action ran and its total seconds over the whole run, and its last
    ``keep`` durations (iterating gives those; `median` is theirs). A list of every
    duration grew by one float per stored step or check: a million-step run held millions."""

    def __init__(self, keep: int = 1024):
        self.count, self.total = 0, 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=keep)

    def append(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.recent.append(seconds)

    def median(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self.recent)

    def __repr__(self) -> str:
        return f"Timings(count={self.count}, total={self.total:.6g}, last={list(self.recent)[-3:]})"
