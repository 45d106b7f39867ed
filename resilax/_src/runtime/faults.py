"""Fault injection (chaos testing): faults at a named step and phase, from Python or the CLI.

A fault is ``kind@step[:phase][/target]``, e.g. ``kill_process@7:during_save``. ``step`` is
the number of steps completed when it fires; phases are points in `ResilientStep.__call__`:

- ``before_step``: before step ``step+1`` is dispatched;
- ``after_step``: after the step that makes ``step`` steps completed;
- ``during_save``: right after the checkpoint of ``step`` was dispatched (its background
  write is in flight);
- ``mid_step``: step ``step+1`` was dispatched and is in flight;
- ``during_peer_copy``: same, on a step that also makes the peer copy.

``fail_slice`` (registered by ``_recovery``) loses failure domain ``target``: every buffer
resilax holds there is deleted and the step continues on the surviving domains.

``kill_process`` is a real ``SIGKILL`` of this process: no handler, no cleanup, no flush.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
from typing import Callable, Iterable

from resilax._src.errors import ConfigError

PHASES = ("before_step", "after_step", "during_save", "mid_step", "during_peer_copy")
KINDS = ("kill_process",)

_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<phase>[a-z_]+))?(?:/(?P<target>\d+))?$")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    phase: str = "after_step"
    target: int | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ConfigError(f"resilax.Fault: kind must be one of {sorted(_KINDS)}, but got {self.kind!r}")
        if self.phase not in PHASES:
            raise ConfigError(f"resilax.Fault: phase must be one of {PHASES}, but got {self.phase!r}")
        if self.step < 0:
            raise ConfigError(f"resilax.Fault: step must be >= 0, but got {self.step}")

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        """Parses ``kind@step[:phase][/target]``."""
        m = _SPEC.match(spec.strip())
        if not m:
            raise ConfigError(
                f"resilax.Fault.parse: expected 'kind@step[:phase][/target]' such as 'kill_process@7:during_save', "
                f"but got {spec!r}"
            )
        return cls(m["kind"], int(m["step"]), m["phase"] or "after_step", int(m["target"]) if m["target"] else None)


def _kill(fault, ctx):
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# Other modules register the kinds they implement (slice failure, NaN injection, ...).
_KINDS: dict[str, Callable] = {"kill_process": _kill}


def register_kind(name: str, handler: Callable) -> None:
    _KINDS[name] = handler


class FaultPlan:
    """The faults of one run; each fires once, at its step and phase."""

    def __init__(self, faults: Iterable[Fault | str] = ()):
        self._pending = [f if isinstance(f, Fault) else Fault.parse(f) for f in faults]
        self.fired: list[Fault] = []

    def __bool__(self):
        return bool(self._pending)

    def add(self, fault: Fault | str) -> None:
        self._pending.append(fault if isinstance(fault, Fault) else Fault.parse(fault))

    def fire(self, phase: str, step: int, ctx=None) -> list[Fault]:
        if not self._pending:
            return []
        due = [f for f in self._pending if f.phase == phase and f.step == step]
        for f in due:
            self._pending.remove(f)
            self.fired.append(f)
            _KINDS[f.kind](f, ctx)
        return due
