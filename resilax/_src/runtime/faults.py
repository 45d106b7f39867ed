"""Fault injection (chaos testing): faults at a named step and phase, from Python or the CLI.

A fault is ``kind@step[:phase][/target]``, e.g. ``kill_process@7:during_save``. ``step`` is
the number of steps completed when it fires; phases are points in `ResilientStep.__call__`:

- ``before_step``: before step ``step+1`` is dispatched;
- ``after_step``: after the step that makes ``step`` steps completed;
- ``during_save``: right after the checkpoint of ``step`` was dispatched (its background
  write is in flight);
- ``mid_step``: step ``step+1`` was dispatched and is in flight;
- ``during_peer_copy``: same, on a step that also makes the peer copy (``N + 1`` a multiple
  of ``PeersConfig.every``; checked at wrap). Where the mesh makes no copies at all (state
  replicated across domains is its own backup) it is a mid-step failure, and the failure's
  record says ``copy_in_flight: False``.

Kinds:

- ``kill_process``: a real ``SIGKILL`` of this process: no handler, no cleanup, no flush.
  ``/P``: only the process with index ``P`` of a multi-process run (the others go on).
- ``fail_slice@N[:phase]/K``: failure domain ``K`` is lost: every buffer resilax holds there
  is deleted, nothing is dispatched there again, and the step continues on the survivors.
  Failing a domain that is already dead does nothing (an event says so).
- ``rejoin@N[:phase]/K``: failure domain ``K`` comes back (a repaired or replacement
  slice, fresh memory) at a step boundary (``before_step`` or ``after_step``): the mesh
  grows to include it, the state is copied to it from the live domains, training goes on
  (`ResilientStep._rejoin_domain`). Rejoining a live domain does nothing (an event says so).
- ``repair_slice@N[:phase]/K``: failed domain ``K``'s hardware is back (repaired or
  replaced, fresh memory), at a step boundary. Unlike ``rejoin`` nothing is called: the
  liveness watchdog must see it answer its probe, and the driver then rejoins it at the next
  step boundary (`HealthConfig.rejoin_answering`). Emulated like ``hang_slice``: a failed
  domain is probed only once its repair was emulated. Needs the watchdog (one process).
- ``bitflip@N[:phase]/K``: one bit of the live state flips on domain ``K``'s first device
  (silent data corruption: the largest floating leaf, a mantissa bit, so no NaN), at a
  step boundary; `HealthConfig`'s replica check must find it.
- ``hang_slice@N[:phase]/K``: failure domain ``K`` stops answering at a step boundary, its
  memory intact (emulated at resilax's dispatch: see ``runtime/health.py``); the liveness
  watchdog (`HealthConfig.hang_detect_s`) must find it, by its probes or the step deadline,
  and the domain is then failed like a lost slice. Needs the watchdog (one process).
- ``slow_slice@N[:phase]/K``: failure domain ``K`` becomes a straggler: its work (each step,
  each probe) starts ``health.SLOW_SLICE_S`` late from then on (emulated likewise);
  `HealthConfig.straggler_factor` must report it.
- ``nan@N``: step ``N``'s recorded values are NaN (inside the grad part, where real NaNs
  appear); ``spike@N``: step ``N``'s watched metric is multiplied by 1000 (a loss spike).

Every fault is checked when `resilax.wrap` gets it (`FaultPlan.validate`): an unknown kind,
a missing or out-of-range target, a phase the kind has no use for, or a ``during_save`` at a
step that saves no checkpoint is a `ConfigError` before anything runs.

**A plan on a restart** (`FaultPlan.resume`, called by `ResilientStep.init` once it knows the
step ``R`` it resumes at). Chaos testing restarts a killed process with the same command, so
the same plan; the restart must end bitwise where the uninterrupted run with that plan ends:

- ``nan@N``/``spike@N`` belong to step index ``N`` (the step from ``N`` to ``N + 1``),
  whatever their phase. ``N < R``: the step is in the record (its verdict in the log entry
  replayed, or already applied to the checkpointed state): dropped. ``N >= R``: the step is
  computed again, so the fault is injected again (``after_step@R`` fires before step ``R``).
- a process-ending fault (``kill_process``, ``hang``) fires once per run: before it fires it
  is written to ``faults_fired.json`` in the run's directory (`Config.run_dir`, else the
  checkpoint directory, else the record log's), fsynced; a restart drops the faults listed
  there. Without any directory nothing can be resumed and nothing is remembered.
- every other fault fires in the call it belongs to (``before_step``/``mid_step``/
  ``during_peer_copy@N``: call ``N``; ``after_step``/``during_save@N``: call ``N - 1``).
  It is dropped when its call is before ``R`` (completed by the process that died), or
  when it comes, in time order, no later than the newest kill recorded for this plan (it
  happened to the process that died, the kill's own (step, phase) group included; the
  restart is a new process on the whole topology). Later ones fire as planned.

So a restart with the same plan applies every ``nan``/``spike`` exactly as the
uninterrupted run with that plan does (bitwise on the same mesh); a slice lost before the
kill is whole again in the restart (the bit-exact mode still ends bitwise; the default mode
then runs on another mesh: the same maths up to reduction order).

Dropped faults are listed in `FaultPlan.settled`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import sys
import time
from typing import Callable, Iterable

from resilax._src.errors import ConfigError, StorageError

PHASES = ("before_step", "after_step", "during_save", "mid_step", "during_peer_copy")
GRAD_KINDS = ("nan", "spike")
DOMAIN_KINDS = ("fail_slice", "rejoin", "repair_slice", "bitflip", "hang_slice", "slow_slice")  # a domain target
BOUNDARY_KINDS = ("rejoin", "repair_slice", "bitflip", "hang_slice", "slow_slice")  # only between steps
WATCHDOG_KINDS = ("hang_slice", "slow_slice", "repair_slice")  # need the liveness watchdog (one process)
ENDING_KINDS = ("kill_process", "hang")  # end (or stall for good) the process: fire once per run
FIRED_FILE = "faults_fired.json"

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

    def spec(self) -> str:
        return f"{self.kind}@{self.step}:{self.phase}" + (f"/{self.target}" if self.target is not None else "")

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
    import jax

    if fault.target is not None and jax.process_index() != fault.target:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_slice(fault, ctx):
    ctx._fail_domain(fault.target, fault.phase)


def _bitflip(fault, ctx):
    ctx._corrupt_domain(fault.target, fault.phase)


def _hang_slice(fault, ctx):
    ctx._hang_domain(fault.target, fault.phase)


def _slow_slice(fault, ctx):
    ctx._slow_domain(fault.target, fault.phase)


def _rejoin(fault, ctx):
    ctx._rejoin_domain(fault.target, fault.phase)


def _repair_slice(fault, ctx):
    ctx._repair_domain(fault.target, fault.phase)


def _grad_fault(fault, ctx):
    ctx._inject(fault.kind, ctx.step)


def _hang(fault, ctx):
    """The calling thread stops for good (the process stays alive, its other threads run):
    under `resilax launch` the others wait in the next collective and the supervisor's step
    deadline must find and kill this one. ``/target``: only the process with that index."""
    import jax

    if fault.target is not None and jax.process_index() != fault.target:
        return
    sys.stdout.flush()
    while True:
        time.sleep(3600)


_KINDS: dict[str, Callable] = {"kill_process": _kill, "fail_slice": _fail_slice, "nan": _grad_fault,
                               "spike": _grad_fault, "hang": _hang, "rejoin": _rejoin,
                               "bitflip": _bitflip, "hang_slice": _hang_slice, "slow_slice": _slow_slice,
                               "repair_slice": _repair_slice}


def register_kind(name: str, handler: Callable) -> None:
    _KINDS[name] = handler


class FaultPlan:
    """The faults of one run; each fires once, at its step and phase."""

    def __init__(self, faults: Iterable[Fault | str] = ()):
        self._pending = [f if isinstance(f, Fault) else Fault.parse(f) for f in faults]
        self.fired: list[Fault] = []
        self.settled: list[Fault] = []  # dropped by `resume`: done before the step resumed at
        self._fired_file: str | None = None

    def __bool__(self):
        return bool(self._pending)

    def add(self, fault: Fault | str) -> None:
        self._pending.append(fault if isinstance(fault, Fault) else Fault.parse(fault))

    @property
    def pending(self) -> list[Fault]:
        return list(self._pending)

    def validate(self, topology, config) -> None:
        """Checks every fault against the run it is given to (see the module docstring).

        Raises:
          ConfigError: naming the fault and what is wrong with it.
        """
        for f in self._pending:
            where = f"resilax fault {f.spec()!r}"
            if f.kind in DOMAIN_KINDS:
                if f.target is None:
                    raise ConfigError(f"{where}: {f.kind} needs a target failure domain: {f.kind}@STEP[:phase]/K")
                if not 0 <= f.target < topology.num_domains:
                    raise ConfigError(f"{where}: target {f.target} is not a failure domain of topology "
                                      f"{topology.name!r} (domains 0..{topology.num_domains - 1})")
            elif f.kind in ENDING_KINDS:  # target: a process index (a multi-process run), or none: every process
                import jax

                from resilax._src.runtime import worker  # (a re-formed job of one process may grow back)

                if f.target not in (None, 0) and jax.process_count() == 1 and worker.env() is None:
                    raise ConfigError(f"{where}: target {f.target} is a process index, and this run has one "
                                      f"process (0): the fault would never fire")
            elif f.target is not None:
                raise ConfigError(f"{where}: {f.kind} takes no target")
            if f.kind in WATCHDOG_KINDS:
                h = config.health
                if h is None or h.hang_detect_s is None:
                    raise ConfigError(f"{where}: {f.kind} needs the liveness watchdog: Config(health=HealthConfig()) "
                                      f"with hang_detect_s set")
                if f.kind == "slow_slice" and h.straggler_factor is None:
                    raise ConfigError(f"{where}: straggler detection is off (HealthConfig.straggler_factor is None)")
                import jax

                if jax.process_count() > 1:
                    raise ConfigError(f"{where}: {f.kind} emulates a domain of one process; under resilax launch "
                                      f"use the fault hang (a real hung worker)")
            if f.kind in BOUNDARY_KINDS and f.phase not in ("before_step", "after_step"):
                raise ConfigError(f"{where}: {f.kind} happens at a step boundary: phase before_step or after_step, "
                                  f"not {f.phase}")
            if f.kind in GRAD_KINDS and f.phase not in ("before_step", "after_step"):
                raise ConfigError(f"{where}: {f.kind} applies to the next step's grad part; its phase can be "
                                  f"before_step or after_step, not {f.phase}")
            if f.kind == "spike" and config.anomaly is not None and config.anomaly.spike_zscore is None:
                raise ConfigError(f"{where}: spike detection is off (AnomalyConfig.spike_zscore is None)")
            if f.phase == "during_peer_copy":
                pc = config.peers
                if pc is None:
                    raise ConfigError(f"{where}: during_peer_copy needs peer copies (Config.peers is None)")
                if pc.every == "auto":
                    raise ConfigError(f"{where}: during_peer_copy needs a fixed PeersConfig.every: with 'auto' the "
                                      f"steps that copy are chosen by measurement while the run goes")
                if (f.step + 1) % pc.every:
                    raise ConfigError(f"{where}: step {f.step + 1} makes no peer copy (PeersConfig.every = "
                                      f"{pc.every}); use a step N with N + 1 a multiple of it")
            if f.phase == "during_save":
                ck = config.checkpoint
                if ck is None:
                    raise ConfigError(f"{where}: during_save needs checkpoints (Config.checkpoint is None)")
                if not ck.every or f.step % ck.every or f.step == 0:
                    raise ConfigError(f"{where}: no checkpoint is saved after step {f.step} "
                                      f"(CheckpointConfig.every = {ck.every})")

    def resume(self, step: int, directory: str | None, process: int = 0) -> list[Fault]:
        """A run (re)starts at ``step`` (steps completed, 0 when fresh): drops the faults that
        belong before it and the process-ending ones a killed process of this run already
        fired (listed in ``directory``); see the module docstring. From now on a
        process-ending fault is recorded in ``directory`` before it fires. Returns the faults
        dropped (also kept in `settled`).

        Raises:
          StorageError: the record of fired faults in ``directory`` is unreadable or corrupt
            (rather than firing a kill again, or silently not).
        """
        name = FIRED_FILE if process == 0 else f"faults_fired.{process}.json"
        self._fired_file = os.path.join(directory, name) if directory else None
        done = set(_read_fired(self._fired_file)) if self._fired_file else set()
        killed = [_when(f) for f in self._pending if f.kind in ENDING_KINDS and f.spec() in done]
        horizon = max(killed, default=None)
        keep, dropped = [], []
        for f in self._pending:
            if f.kind in GRAD_KINDS:
                gone = f.step < step
                if not gone and f.step == step and f.phase == "after_step":
                    f = dataclasses.replace(f, phase="before_step")  # same step index, no step completes to N
            else:
                gone = _when(f)[0] < step or (horizon is not None and _when(f) <= horizon)
            (dropped if gone else keep).append(f)
        self._pending = keep
        self.settled += dropped
        return dropped

    def fire(self, phase: str, step: int, ctx=None) -> list[Fault]:
        if not self._pending:
            return []
        due = [f for f in self._pending if f.phase == phase and f.step == step]
        for f in due:
            self._pending.remove(f)
            self.fired.append(f)
            if f.kind in ENDING_KINDS and self._fired_file:
                _record_fired(self._fired_file, f)
            _KINDS[f.kind](f, ctx)
        return due


def _when(f: Fault) -> tuple[int, int]:
    """(call, position in the call) of a fault: its time order (call ``k`` runs step ``k``)."""
    return {"before_step": (f.step, 0), "mid_step": (f.step, 1), "during_peer_copy": (f.step, 2),
            "after_step": (f.step - 1, 3), "during_save": (f.step - 1, 4)}[f.phase]


def _read_fired(path: str) -> list[str]:
    """The fault specs recorded in ``path`` (none when it does not exist)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise StorageError(f"resilax FaultPlan: cannot read the record of fired faults {path!r}: {e}") from e
    try:
        doc = json.loads(raw)
        fired = doc["fired"]
        ok = (isinstance(fired, list) and all(isinstance(x, str) for x in fired)
              and doc["sha256"] == hashlib.sha256(json.dumps(fired).encode()).hexdigest())
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise StorageError(
            f"resilax FaultPlan: the record of fired faults {path!r} is truncated or corrupt ({len(raw)} bytes; "
            f"its sha256 does not match); a restart cannot tell which kill already fired. Delete it to fire every "
            f"planned fault again")
    return fired


def _record_fired(path: str, fault: Fault) -> None:
    """Appends ``fault`` to the record (written to a temporary file, fsynced, renamed)."""
    fired = _read_fired(path) + [fault.spec()]
    doc = json.dumps({"fired": fired, "sha256": hashlib.sha256(json.dumps(fired).encode()).hexdigest()})
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(doc)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
