"""Events: what happened to a run (restores, fallbacks, failures, recoveries), time-stamped."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing that happened. ``fields`` holds kind-specific detail (JSON-able)."""

    kind: str
    step: int
    time: float
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "step": self.step, "time": self.time, **dict(self.fields)}


def event(kind: str, step: int, **fields) -> Event:
    return Event(kind, int(step), time.time(), fields)
