"""Silent data corruption: replicas of the same state across failure domains must be
bitwise equal, so their checksums are compared before a step uses the state (at the
cadence ``HealthConfig.sdc_every``) and before every checkpoint save (a corrupted state is
never persisted).

Every device checksums its own shard of every leaf replicated across the elastic axis (all
of the state in the bit-exact mode, where every domain computes the same update), in one
executable; only the ``[devices, leaves, 1]`` sums (the position-weighted lane of the checksum: any one-word change changes it) come to the host, and each domain's rows
are its replica's fingerprint. On a mismatch:

- 3 or more domains, and the replicas were equal at the previous step (so the corrupted
  values fed nothing yet): the strict majority's sums are the right ones; every other
  domain is named (event ``sdc``) and treated as failed (`ResilientStep.fail_domain`), so
  the state goes on from the good replicas, bitwise, and the domain can rejoin later;
- 2 domains (or no majority), or found later than that (the corruption may have entered
  every replica's update through the gradients, so the majority is not known to be right):
  the step is rebuilt from the newest checkpoint and the record log (disk entries or
  retained batches, never a live buffer: `ResilientStep.rebuilt_state`) and the replicas
  that match it are the good ones (event ``sdc`` with ``decided_by: rebuilt``); the others
  are failed as above. When none matches, the run goes on from the rebuilt state
  (`ResilientStep.adopt`, ``decided_by: rebuilt_adopted``); a domain outvoted by a strict
  majority is still failed, and what the protections derived from the replicas since the
  last good check is dropped;
- no checkpoint to rebuild from: `SilentDataCorruptionError` is raised, naming the leaves
  and domains, before anything is saved; a restart resumes from the newest checkpoint
  (checked at its save).

Cadence: ``"auto"`` times the first checks and steps (each waited on) and picks the
shortest cadence whose checks cost at most ``sdc_budget`` of a step (at most
``sdc_max_every``); a find up to that many steps late is recovered by the rebuild, so until
a checkpoint is committed (or without one) every step is checked.

Leaves that live in one domain only (the default mode's sharded layout) have no replica to
compare with; an event at the first check says how many leaves are covered. Corruption
inside a computation that feeds every domain (a gradient replica, the combine) leaves the
replicas equal and is not caught here.
"""

from __future__ import annotations

import math
import statistics
import time
import weakref

import jax
import numpy as np

from resilax._src.errors import SilentDataCorruptionError
from resilax._src.timings import Timings
from resilax._src.protect import ring as _ring
from resilax._src.protect.base import Protection
from resilax._src.protect.checksum import replica_sums

CALIBRATION_SAMPLES = 8  # timed steps and checks before the cadence is chosen


class SdcCheck(Protection):
    name = "sdc"

    def __init__(self, cfg):
        self.auto = cfg.sdc_every == "auto"
        self.every = 1 if self.auto else cfg.sdc_every
        self.budget, self.max_every = cfg.sdc_budget, cfg.sdc_max_every
        self.samples = CALIBRATION_SAMPLES
        self.phase = "auto" if self.auto else "fixed"
        self._anchor = 0
        self._checked_at = None
        self._checked_refs = None
        self._good_at = None  # the newest step whose replicas were found equal
        self._told = weakref.WeakSet()  # programs whose coverage event was recorded
        self._fns: dict = {}
        self.seconds = Timings()  # each check's time
        self.decisions: list[dict] = []
        self.why = None
        self._ckpt_seen = False
        self._reset_cadence()

    # ------------------------------------------------------------------ cadence
    def _reset_cadence(self):
        self._costs: list[float] = []  # seconds of a check (the step before it waited on)
        self._steps: list[float] = []  # seconds of a whole step (waited on)
        self._calibrating = False

    def _plan(self, run) -> None:
        """Where the cadence stands on this mesh: ``fixed`` (an int ``sdc_every``, or "auto"
        with no checkpoint to rebuild a late find from: every step), ``calibrate`` (every
        step, each step and check timed), ``set``."""
        if not self.auto or self.phase in ("set", "fixed", "calibrate"):
            return
        if run._checkpointer is None or run._record_log is None:
            self.phase, self.every = "fixed", 1
            self.why = ("no checkpoint and record log to rebuild a late find from: the replicas are checked "
                        "before every step")
            return
        self.phase, self.every = "calibrate", 1

    def _rebuildable(self, run) -> bool:
        """Whether a checkpoint is committed (a late find is rebuilt from one): until then
        the auto cadence checks every step."""
        if not self._ckpt_seen:
            self._ckpt_seen = bool(run.checkpoints.steps())
        return self._ckpt_seen

    def due(self, step: int) -> bool:
        return (step - self._anchor) % self.every == 0

    def blocks(self) -> bool:
        return self.phase == "calibrate" and self._calibrating

    def timed(self, run, seconds: float) -> None:
        self._steps.append(seconds)

    def _decide(self, run, step: int) -> None:
        # the first of each is left out: compiles and queued work
        costs, steps = self._costs[1:], self._steps[1:]
        if min(len(costs), len(steps)) < self.samples:
            return
        cost, step_s = statistics.median(costs), statistics.median(steps)
        every = max(1, min(self.max_every, math.ceil(cost / (self.budget * step_s))))
        d = {"every": every, "check_s": cost, "step_s": step_s, "share": cost / every / step_s,
             "meets_budget": cost / every <= self.budget * step_s, "budget": self.budget, "samples": len(costs)}
        self.decisions.append(d)
        self.phase, self.every, self._anchor = "set", every, step
        self._reset_cadence()
        run._event("sdc_cadence", step, mesh=dict(run._program.mesh.shape), **d)

    def report(self) -> dict:
        out = {"mode": "auto" if self.auto else "fixed", "phase": self.phase, "every": self.every,
               "decisions": list(self.decisions)}
        if self.why and self.phase == "fixed" and self.auto:
            out["why"] = self.why
        return out

    # ------------------------------------------------------------------ per step
    def before_step(self, run, state, step: int) -> None:
        self._plan(run)
        if self._seen(state, step):  # checked by the save at this step, and unchanged since
            return
        if not self.due(step) and (self.phase != "set" or self._rebuildable(run)):
            return
        if self.phase != "calibrate":
            self.check(run, state, step)
            return
        jax.block_until_ready(state)  # the check's own cost, not the wait for the step before
        t0 = time.perf_counter()
        bad = self.check(run, state, step)
        if bad or self.phase != "calibrate":  # a recovery (or a rebuild) restarted the cadence
            return
        self._costs.append(time.perf_counter() - t0)
        self._calibrating = run._background_idle()  # samples with a compile beside them are not the step's
        if not self._calibrating:
            self._costs.pop()
            return
        self._decide(run, step)

    def before_save(self, run, state, step: int) -> None:
        if not self._seen(state, step):
            self.check(run, state, step)

    def _seen(self, state, step: int) -> bool:
        """Whether ``state`` is the very state checked at ``step`` (its leaves the same
        arrays). A save checks the state, and the next step's check is then skipped; but a
        state replaced in between (fault ``bitflip@N:before_step`` after the save of step N)
        must be checked again: skipping it let the corrupted replica feed step N+1's update,
        found one step late but decided as found before use (a silent mismatch)."""
        if self._checked_at != step or self._checked_refs is None:
            return False
        leaves = jax.tree.leaves(state)
        return len(leaves) == len(self._checked_refs) and all(r() is x for r, x in zip(self._checked_refs, leaves))

    def _fn(self, prog, idx, leaves):
        """One executable per program: every device checksums its own shard of the leaves
        replicated across domains (`checksum.replica_sums` on the local block), all in one
        dispatch; the ``[devices, leaves, 1]`` sums come to the host in one transfer. Within a
        domain the shards are laid out alike in every domain, so equal replicas give equal
        rows, domain by domain."""
        key = (id(prog), tuple(idx))
        if key not in self._fns or self._fns[key][0]() is not prog:  # (a dead program's id, reused)
            from jax.sharding import PartitionSpec as P

            mesh = prog.mesh
            specs = [x.sharding.spec for x in leaves]
            body = lambda xs: replica_sums(list(xs))[None]  # noqa: E731  [1, leaves, 1] per device
            self._fns = {k: v for k, v in self._fns.items() if v[0]() is not None}  # programs still alive
            self._fns[key] = (weakref.ref(prog), jax.jit(jax.shard_map(
                body, mesh=mesh, in_specs=(specs,), out_specs=P(tuple(mesh.axis_names)), check_vma=False)))
        return self._fns[key][1]

    def start(self, run, state) -> None:
        self._good_at = run.step  # placed or restored from one copy: the replicas are equal
        self._checked_at = None

    def restart(self, run, state) -> None:
        self._good_at = run.step  # a new mesh: its replicas were made from one good copy
        self._checked_at = None
        if self.auto and self.phase != "fixed":  # a new mesh: its step and check times are measured again
            self.phase, self.every = "auto", 1
            self._reset_cadence()

    def adopted(self, run, state, since: int) -> None:
        self._good_at = run.step

    def check(self, run, state, step: int) -> list[int]:
        """Compares the live domains' replicas; returns the domains found bad (original
        indices; they were failed), or raises when it cannot tell."""
        t0 = time.perf_counter()
        self._checked_at = step
        self._checked_refs = [_ref(x) for x in jax.tree.leaves(state)]  # weak: never keeps a state alive
        prog = run._program
        mesh = prog.mesh
        leaves = jax.tree.leaves(state)
        places = jax.tree.leaves(prog.places)
        idx = [i for i, p in enumerate(places) if p == _ring.REPLICATED]
        live = mesh.shape[prog.spec.elastic_axis]
        multi = jax.process_count() > 1  # another process's domain cannot be read here
        if prog not in self._told:
            self._told.add(prog)
            run._event("sdc_coverage", step, leaves_checked=0 if multi else len(idx), leaves=len(leaves), domains=live,
                      **({"reason": "multi-process run: not built yet"} if multi else {}))
        if live < 2 or not idx or multi:
            return []
        picked = [leaves[i] for i in idx]
        shard_sums = self._fn(prog, idx, picked)
        sums = list(np.asarray(shard_sums(picked)).reshape(live, -1, len(idx), 1))
        self.seconds.append(time.perf_counter() - t0)
        keys = [s.tobytes() for s in sums]
        if len(set(keys)) == 1:
            self._good_at = step
            return []
        alive = list(run.alive_domains)
        groups: dict = {}
        for d, k in enumerate(keys):
            groups.setdefault(k, []).append(d)
        best = max(groups.values(), key=len)
        names = run._leaf_names  # a mismatch: only now are the names needed
        differing = sorted({names[idx[j]] for s in sums for j in np.nonzero(np.any(s != sums[best[0]], axis=(0, 2)))[0]})
        late = self._good_at is None or step - self._good_at > 1
        if 2 * len(best) <= live or late:
            # no majority, or it may be wrong too: rebuild the step from the newest
            # checkpoint and the record log, and keep the replicas that match it
            trusted = -1 if self._good_at is None else self._good_at
            rebuilt = run._rebuilt_state(step, trusted_through=trusted)
            if rebuilt is not None:
                witness, guard = rebuilt
                wl = jax.tree.leaves(witness)
                ws = np.asarray(shard_sums([wl[i] for i in idx])).reshape(live, -1, len(idx), 1)
                good = groups.get(ws[0].tobytes())
                if good is not None:
                    return _decide(run, step, alive, good, differing, "rebuilt", t0)
                # No replica is the rebuilt state: the corrupted values entered every
                # replica's update (found after they were used). The rebuilt state is made
                # from trusted sources only, so the run goes on from it. A domain outvoted
                # by a strict majority still holds its own corruption on top: it is failed.
                bad = [alive[d] for d in range(live) if d not in best] if 2 * len(best) > live else []
                run._adopt(witness, guard, since=trusted)
                run._event("sdc", step, bad_domains=bad, good_domains=[d for d in alive if d not in bad],
                          leaves=differing[:16], decided_by="rebuilt_adopted", trusted_through=trusted,
                          detail="no replica matched the state rebuilt from the newest checkpoint and the record "
                                 "log; the run goes on from the rebuilt state"
                                 + ("" if bad else " (no majority names the bad domain: every domain is kept)"),
                          seconds=time.perf_counter() - t0)
                for d in bad:
                    run._fail_domain(d, "sdc")
                return bad
        if 2 * len(best) <= live:
            raise SilentDataCorruptionError(
                f"resilax: silent data corruption at step {step}: the replicas of the state on failure domains "
                f"{alive} differ in leaves {differing[:8]} and no majority says which is right, and no checkpoint with "
                f"the record log after it can rebuild the step to tell (Config.checkpoint). Nothing was saved from "
                f"them; restart from the newest checkpoint (each one was checked when it was saved)")
        if late:
            bad = [alive[d] for d in range(live) if d not in best]
            # the corruption may have fed a gradient (every replica's update) since the
            # replicas were last seen equal: the majority's state is not known to be right
            raise SilentDataCorruptionError(
                f"resilax: silent data corruption at step {step}: domain(s) {bad} disagree with the majority "
                f"{[alive[d] for d in best]} in leaves {differing[:8]}, but the replicas were last checked equal "
                f"at step {self._good_at}, so the corrupted values may have entered the updates since, and no "
                f"checkpoint with the record log after it can rebuild the step. Nothing was saved from them; "
                f"restart from the newest checkpoint (each one was checked when it was saved). "
                f"HealthConfig(sdc_every=1) checks every step, before the state is used, and recovers in place")
        return _decide(run, step, alive, best, differing, "majority", t0)


def _ref(x):
    try:
        return weakref.ref(x)
    except TypeError:  # a Python scalar leaf: compared by identity all the same
        return lambda: x


def _decide(run, step, alive, good, differing, how, t0) -> list[int]:
    """Keeps the replicas at positions ``good``; fails the other domains."""
    bad = [d for i, d in enumerate(alive) if i not in good]
    run._event("sdc", step, bad_domains=bad, good_domains=[alive[i] for i in good], leaves=differing[:16],
              decided_by=how, seconds=time.perf_counter() - t0)
    for d in bad:
        run._fail_domain(d, "sdc")
    return bad
