"""Peer protection: state that lives in one failure domain only has a copy on the next
domain of the elastic axis (ring), made inside the update executable on copy steps.

Every ``PeersConfig.every`` steps the update part also returns the packed ring copy of the
new state (one collective-permute per dtype); with ``every > 1`` it returns a local copy
too, so a whole consistent step survives while the live state moves on, and the record
log's device entries (ring-copied as well) or its retained batches cover the steps in
between; ``every="auto"`` measures the costs and picks the cadence (``cadence.py``). State
replicated across the elastic axis is its own backup: such a mesh makes no copies at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from resilax._src.protect import base
from resilax._src.protect.cadence import Cadence
from resilax._src.protect.planner import Candidate


@dataclasses.dataclass
class Snapshot:
    step: int
    program: Any
    local: Any  # pytree (every > 1) or None: the live state is this step's local part
    ring: Any  # tuple of packed buffers (one per dtype), or None when nothing is ring-placed
    guard: Any


class Peers(base.Protection):
    name = "peers"

    def __init__(self, cfg, *, has_log: bool):
        self.cadence = Cadence(cfg, has_log=has_log) if cfg.every == "auto" else None
        self._every = None if self.cadence is not None else cfg.every
        self.between = cfg.log_entries_between
        self.snap: Snapshot | None = None

    @property
    def every(self) -> int:
        """The cadence now (the auto cadence's current choice, 1 until it has one)."""
        return self.cadence.every if self.cadence is not None else self._every

    def variants(self) -> tuple:
        """The copy variants this run's update part may use."""
        if self.cadence is not None:
            return ("ring", "ring+local")
        return ("ring",) if self.every == 1 else ("ring+local",)

    def copy_variant(self, run, step_after):
        if not run._program.protects:
            return None
        c = self.cadence
        if c is not None:
            if c.phase == "wait" and c.ready is None:
                c.ready = run._compile_in_background(run._program, (None,) + self.variants())
            return c.plan(step_after, background_idle=run._background_idle(), over_cap=run._log_over_cap())
        if self.every == 1:
            return "ring"
        return "ring+local" if step_after % self.every == 0 or run._log_over_cap() else None

    def log_entries(self) -> bool:
        """Whether a step without a copy keeps its record-log device entry (ring-copied)."""
        if self.cadence is not None:
            return self.cadence.log_ring_wanted()
        return self.between

    def blocks(self) -> bool:
        """Whether the step in flight is a calibration sample (timed to completion)."""
        return self.cadence is not None and self.cadence.blocks()

    def timed(self, run, seconds: float) -> None:
        d = self.cadence.timed(seconds) if self.cadence is not None else None
        if d is not None:
            run._event("peer_cadence", run.step, mesh=dict(run._program.mesh.shape), **d)

    def report(self) -> dict:
        if self.cadence is not None:
            return self.cadence.report()
        return {"mode": "fixed", "every": self.every, "log_entries_between": self.between and self.every > 1}

    def start(self, run, state):
        """A snapshot of the placed state, so step ``run.step`` is covered from the start."""
        p = run._program
        if not p.protects:
            self.snap = None
            if self.cadence is not None:
                self.cadence.reset(copies=False)
            return
        ring, local = p.snapshot(local=self.every > 1 or self.cadence is not None)(state)
        self.snap = Snapshot(run.step, p, local, ring, run._guard)

    def after_step(self, run, rec):
        if rec.copy is not None:
            self.snap = Snapshot(rec.step + 1, rec.program, rec.local, rec.ring, rec.gout.guard)
            run._log_covered(rec.step + 1)

    def held(self):
        if self.snap is None:
            return []
        return [x for x in jax.tree.leaves((self.snap.local, self.snap.ring)) if isinstance(x, jax.Array)]

    def candidates(self, run):
        s = self.snap
        if s is None:
            return []
        if s.local is None and s.step != run.step:
            return []  # the live state moved on: its local part is gone
        p = s.program
        local = s.local if s.local is not None else run._live
        shapes = [x.shape for x in jax.tree.leaves(p.spec.abstract_state)]
        shards = base.leaf_shards(jax.tree.leaves(local), jax.tree.leaves(p.state_sh), shapes,
                                  ring=(p.state_pack, list(s.ring) if s.ring is not None else []))
        return [Candidate("peer", s.step, shards)]

    def adopted(self, run, state, since):
        self.start(run, state)  # the copies may hold corrupted values: a fresh one of the adopted state

    def restart(self, run, state):
        if self.cadence is not None:  # a new mesh: its costs are measured again
            self.cadence.reset()
        self.start(run, state)

    def close(self):
        self.snap = None
