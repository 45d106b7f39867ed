"""Fault campaign: random, seeded schedules of 1-3 faults, each run compared with a
failure-free run of the same config, or expected to raise `StateLostError` exactly when
an independent oracle says no copy survives.

``resilax campaign --trials N --seed S [--json PATH]``; a short hypothesis-driven run is in
the test suite (tests/test_campaign.py).

The oracle (`expect`) knows nothing of resilax's planner. It replays the schedule on a
model of the documented semantics:

- a failure domain's devices hold its shards; state replicated across domains survives
  while any domain lives;
- a leaf that lives in one domain only (its spec includes the elastic axis and its first
  dimension divides the current mesh's devices on that axis) has a ring copy on the next
  live domain, refreshed every step (``PeersConfig(every=1)``) and remade right after each
  recovery on the new mesh: it is lost when a domain and its ring neighbour die in the same
  failure (the condition is the same whichever way the ring turns);
- a checkpoint exists once a save step (a multiple of ``every``, never 0) was reached; the
  host keeps the batches since, so any surviving consistent state is rolled forward;
- every domain dead: lost, whatever else exists;
- faults at the same (step, phase) hit together; in time order the phases of one call are
  ``before_step@k``, ``mid_step@k``, ``during_peer_copy@k``, ``after_step@k+1``,
  ``during_save@k+1``;
- ``nan@N`` skips step ``N``'s update; ``spike@N`` skips it once ``min_history`` earlier
  steps were applied (the detector's warm-up), else changes nothing;
- ``kill_process``: the run is restarted with the same directories and the same plan, on
  the whole topology again (a new process; `FaultPlan.resume` drops what happened to the
  process that died: the kill, its own (step, phase) group and everything before it, except
  ``nan``/``spike``, which belong to their step and are replayed with their recorded verdict
  or injected again); it must end where the failure-free run ends. Faults after the kill
  count as in any run (a spike after it is judged on the detector history the restart
  restored). Without slice faults a kill trial is judged bitwise against the uninterrupted
  run with the same plan (and config); the bit-exact mode always bitwise.
- ``nan``/``spike`` are drawn at the boundaries too: a checkpoint step (the step that runs
  while its save is in flight), one before or after it, right after a failure, and next
  to a kill.

Slice health (drawn in ~40% of the trials, after everything else so older seeds keep their
base schedules; such a trial runs with ``HealthConfig(sdc_every=1)`` and, when a watchdog
fault is drawn, a 0.5 s liveness watchdog probing every 0.1 s):

- faults of one group fire in list order; ``rejoin@N/K`` first recovers the group's failures
  listed before it, then gives ``K`` back (state copied from the live domains; the grown
  mesh's copies are made again and later failures of ``K`` count again); rejoining a live
  domain does nothing;
- ``hang_slice@N/K``: ``K`` is declared hung at the next health gate (the next step's start,
  after its ``before_step`` group, or a save) and failed there, its memory dropped, like a
  ``fail_slice`` on its own; several hung at one gate are declared in one probe round or in
  several (both are followed); every live domain hung is never drawn (nothing is declared);
- ``slow_slice``: reported only (``remove_stragglers`` is off): no effect on the state;
- ``repair_slice@N/K`` of a failed ``K``: it rejoins at some later gate, or never within the
  run (the watchdog must see it answer: timing); of a live one: nothing;
- ``bitflip@N/K`` is found by the replica check at the next step's start or at a save: with
  3+ live replicas ``K`` is outvoted and failed; with 2 and no checkpoint saved yet,
  `SilentDataCorruptionError` (outcome ``expected_sdc``); with 2 and a checkpoint, whether
  it was committed and which replica the rebuild names is timing. Not drawn: a flip in state
  with no replica (the default mode's sharded layout, or one domain left), two flips at one
  check (the emulated flip is the same bit everywhere), a failure or rejoin before the flip
  was checked (the recovery may copy the corrupted replica).

The oracle follows every path those timings allow (``_simulate`` with a ``choose`` for each);
a trial is drawn only when all paths agree on the outcome and none leaves the documented
semantics, so every outcome it judges is certain.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

KINDS = ("fail_slice", "nan", "spike", "kill_process")
HEALTH_KINDS = ("rejoin", "bitflip", "hang_slice", "slow_slice", "repair_slice")
WATCHDOG_KINDS = ("hang_slice", "slow_slice", "repair_slice")  # need the liveness watchdog
PHASES = ("before_step", "mid_step", "during_peer_copy", "after_step", "during_save")
TOPOLOGIES = ((2, 4), (4, 2), (8, 1))
MODELS = ("dropout_mlp", "batchnorm_mlp", "token_lm", "transformer_lm")
MIN_HISTORY = 3
TOL = 1e-4
OUTCOMES = ("ok", "expected_lost", "expected_sdc", "silent_mismatch", "unexpected_exception", "hang", "wrong_lost",
            "missed_lost", "missed_sdc")
BAD = ("silent_mismatch", "unexpected_exception", "hang", "wrong_lost", "missed_lost", "missed_sdc")


@dataclasses.dataclass(frozen=True)
class Trial:
    seed: int
    model: str
    topology: tuple  # (domains, devices per domain)
    layout: str  # "replicated" across domains, or "sharded" over every device
    ckpt_every: int | None
    steps: int
    faults: tuple  # of fault specs
    mode: str = "default"  # or "deterministic": the bit-exact mode, judged bitwise
    health: str | None = None  # "sdc": replica checks every step; "watchdog": and the liveness watchdog

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Trial":
        return cls(**dict(d, topology=tuple(d["topology"]), faults=tuple(d["faults"])))


# ------------------------------------------------------------------ schedules
def _order(step: int, phase: str) -> tuple:
    """Time order of a fault: (call index, position inside the call)."""
    pos = {"before_step": (step, 0), "mid_step": (step, 1), "during_peer_copy": (step, 2),
           "after_step": (step - 1, 3), "during_save": (step - 1, 4)}
    return pos[phase]


def _parse(spec: str):
    kind, rest = spec.split("@")
    target = None
    if "/" in rest:
        rest, t = rest.split("/")
        target = int(t)
    step, phase = (rest.split(":") + ["after_step"])[:2]
    return kind, int(step), phase, target


def random_trial(rng: random.Random, seed: int) -> Trial:
    """One trial drawn from ``rng``: biased toward the edges (dead targets, ring neighbours,
    the step after a failure, step 0, the last step, during a save)."""
    model = rng.choice(MODELS[:3])  # the transformer (5x slower) has its own phase-by-phase test
    d, k = rng.choice(TOPOLOGIES)
    layout = rng.choice(("replicated", "sharded"))
    ckpt_every = rng.choice((None, 2, 3))
    steps = rng.choice((6, 7, 8))
    faults: list[str] = []
    targets: list[int] = []
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        kind = rng.choices(KINDS, weights=(6, 1.5, 1.5, 2))[0]
        if kind == "kill_process" and (any(f.startswith("kill") for f in faults) or ckpt_every is None and rng.random() < 0.5):
            kind = "fail_slice"
        edge = rng.random()
        if edge < 0.15:
            step = 0
        elif edge < 0.3:
            step = steps - 1
        elif edge < 0.5 and faults:
            step = _parse(faults[-1])[1] + rng.choice((0, 1))  # right after (or with) a previous failure
        elif edge < 0.7 and ckpt_every:
            # at a checkpoint step (a grad fault there: the step that runs while its save is
            # in flight), or one before or after it
            step = rng.randrange(ckpt_every, steps, ckpt_every) + rng.choice((-1, 0, 0, 1))
        else:
            step = rng.randrange(0, steps)
        step = min(step, steps - 1)
        if kind in ("nan", "spike"):
            phase = rng.choice(("before_step", "after_step"))
            if phase == "after_step" and step == 0:
                phase = "before_step"
            faults.append(f"{kind}@{step}:{phase}")
            continue
        phases = ["before_step", "mid_step", "during_peer_copy"] + (["after_step"] if step > 0 else [])
        if ckpt_every and step > 0 and step % ckpt_every == 0:
            phases += ["during_save"] * 2
        phase = rng.choice(phases)
        if kind == "kill_process":
            faults.append(f"kill_process@{step}:{phase}")
            continue
        r = rng.random()
        if targets and r < 0.25:
            target = rng.choice(targets)  # an already dead domain
        elif targets and r < 0.6:
            target = (rng.choice(targets) + rng.choice((1, -1))) % d  # a ring neighbour of one
        else:
            target = rng.randrange(d)
        targets.append(target)
        faults.append(f"fail_slice@{step}:{phase}/{target}")
    if any(f.startswith("kill") for f in faults) and not any(f.split("@")[0] in ("nan", "spike") for f in faults) \
            and rng.random() < 0.7:
        # verdicts across a kill: a NaN or spike at the kill's boundary (the kill's step, one
        # before or after it, a checkpoint step), which the restart must replay or inject again
        ks = next(_parse(f)[1] for f in faults if f.startswith("kill"))
        near = [ks - 1, ks, ks + 1] + ([rng.randrange(ckpt_every, steps, ckpt_every)] if ckpt_every else [])
        gs = min(max(rng.choice(near), 0), steps - 1)
        kind = rng.choice(("nan", "spike"))
        faults.append(f"{kind}@{gs}:{'before_step' if gs == 0 else rng.choice(('before_step', 'after_step'))}")
    mode = "deterministic" if rng.random() < 0.3 else "default"  # drawn last: older seeds keep their schedules
    trial = Trial(seed, model, (d, k), layout, ckpt_every, steps, tuple(faults), mode)
    if rng.random() < HEALTH_SHARE:  # drawn after the rest: older seeds keep their schedules
        trial = _with_health(rng, trial, targets)
    return trial


HEALTH_SHARE = 0.4


def _with_health(rng: random.Random, trial: Trial, dead: list) -> Trial:
    """``trial`` with 1-2 slice-health faults (and the `HealthConfig` they need), redrawn until
    the oracle's outcome is certain and documented; unchanged (health checks on, no health
    fault) when 8 draws found none."""
    d = trial.topology[0]
    shapes = _shapes(trial)
    for _ in range(8):
        extra = []
        for _ in range(rng.choice((1, 1, 2))):
            kind = rng.choices(HEALTH_KINDS, weights=(2, 2, 1.5, 0.5, 1.5))[0]
            if kind in ("rejoin", "repair_slice") and dead and rng.random() < 0.8:
                target = rng.choice(dead)  # one failed earlier (a live one: nothing happens)
            else:
                target = rng.randrange(d)
            edge = rng.random()
            if edge < 0.5 and trial.faults:
                step = _parse(rng.choice(trial.faults))[1] + rng.choice((0, 1, 1, 2))  # around another fault
            else:
                step = rng.randrange(0, trial.steps)
            step = min(step, trial.steps - 1)
            phase = rng.choice(("before_step", "after_step")) if step > 0 else "before_step"
            extra.append(f"{kind}@{step}:{phase}/{target}")
        faults = list(trial.faults)
        for f in extra:  # anywhere in the list: the order inside a (step, phase) group matters
            faults.insert(rng.randrange(len(faults) + 1), f)
        watchdog = any(f.split("@")[0] in WATCHDOG_KINDS for f in extra) or rng.random() < 0.3
        t = dataclasses.replace(trial, faults=tuple(faults), health="watchdog" if watchdog else "sdc")
        e = expect(t, shapes)
        if not e.uncertain and e.forbidden is None:
            return t
    return dataclasses.replace(trial, health="sdc")


# ------------------------------------------------------------------ the oracle
@dataclasses.dataclass
class Expect:
    lost: bool
    lost_at: tuple | None  # (step, phase) of the failure that loses the state
    skipped: tuple  # step indices whose update is not applied
    kill: tuple | None  # (step, phase) of the kill
    sdc: bool = False  # SilentDataCorruptionError expected (two replicas disagree, no checkpoint)
    uncertain: bool = False  # the documented semantics allow more than one outcome (timing)
    forbidden: str | None = None  # a schedule whose outcome the docs do not promise (never drawn)


def _single_domain_leaf(shapes, domains: int, alive: int, per: int, layout: str) -> bool:
    """Whether some leaf lives in one domain only on a mesh of ``alive`` domains: the sharded
    layout puts leaves whose first dim divides every device over all of them; on a smaller
    mesh a leaf that no longer divides drops the elastic axis (replicated across domains)."""
    if layout != "sharded" or alive < 2:
        return False
    return any(len(sh) and sh[0] % (domains * per) == 0 and sh[0] % (alive * per) == 0 for sh in shapes)


class _Done(Exception):
    def __init__(self, out):
        self.out = out


def _simulate(trial: Trial, shapes, choose) -> tuple:
    """One path through the documented semantics; ``choose(n)`` picks one of ``n`` outcomes
    the docs leave to timing. Returns ``(lost, lost_at, skipped, kill, sdc, forbidden)``."""
    d, per = trial.topology
    # the bit-exact mode holds the state whole in every domain: no leaf lives in one only
    layout = trial.layout if trial.mode == "default" else "replicated"
    sim = dict(alive=list(range(d)), ckpt_at=None, kill=None)
    skipped: list[int] = []
    stalled: set = set()  # hang_slice: not answering, not yet declared
    repaired: set = set()  # repair_slice of a failed domain: rejoins once the watchdog sees it answer
    flips: list[int] = []  # bitflip: domains whose replica differs, not yet checked

    def end(lost=False, at=None, sdc=False, forbidden=None):
        raise _Done((lost, at, tuple(sorted(set(skipped))), sim["kill"], sdc, forbidden))

    def fail(dead, at):
        """One recovery from losing ``dead`` together."""
        alive = sim["alive"]
        dead = set(dead) & set(alive)
        if not dead:
            return
        if any(f not in dead for f in flips):
            # the recovery may copy the unchecked corrupted replica to the new mesh
            end(forbidden="a recovery while a corrupted replica is unchecked")
        survivors = [a for a in alive if a not in dead]
        if not survivors:
            end(True, at)
        n = len(alive)
        adjacent = n > 1 and any(alive[(alive.index(x) + 1) % n] in dead for x in dead)
        if adjacent and _single_domain_leaf(shapes, d, n, per, layout) and sim["ckpt_at"] is None:
            end(True, at)
        sim["alive"] = survivors
        flips[:] = [f for f in flips if f not in dead]  # its memory is gone
        stalled.difference_update(dead)

    def rejoin(k):
        if k in sim["alive"]:
            return  # a live domain: nothing happens
        if flips:
            end(forbidden="a rejoin copies the state while a corrupted replica is unchecked")
        sim["alive"] = sorted(sim["alive"] + [k])
        repaired.discard(k)
        stalled.discard(k)

    def gate(at):
        """A step boundary's health gate: hung domains are failed, repaired ones may rejoin."""
        hung = stalled & set(sim["alive"])
        if hung:
            if hung == set(sim["alive"]):
                end(forbidden="every live domain hangs: nothing is declared (documented)")
            if len(hung) > 1 and choose(2):  # declared in one probe round, or in several
                for h in sorted(hung):
                    fail({h}, at)
            else:
                fail(hung, at)
            stalled.difference_update(hung)
        for r in sorted(repaired):
            if r not in sim["alive"] and choose(2):  # the watchdog's probe saw it answer by now
                rejoin(r)

    def check(at):
        """The replica check (sdc_every=1), before the state is used or saved."""
        alive = sim["alive"]
        bad = sorted(set(f for f in flips if f in alive))
        if len(bad) != len([f for f in flips if f in alive]):
            end(forbidden="one domain flipped twice (the emulated flip is the same bit: undone)")
        flips.clear()
        if not bad:
            return
        if len(bad) > 1:
            end(forbidden="two domains flipped alike (the emulated flip is the same bit in each)")
        if not (trial.mode == "deterministic" or trial.layout == "replicated") or len(alive) < 2:
            end(forbidden="a flip in state with no replica to compare with (documented: not caught)")
        if len(alive) >= 3:
            fail(set(bad), at)  # outvoted by a strict majority: failed, the run goes on
        elif sim["ckpt_at"] is None:
            end(at=at, sdc=True)  # two replicas, nothing to rebuild from
        else:
            c = choose(3)  # checkpoint not committed yet / the rebuild names the bad one / adopted
            if c == 0:
                end(at=at, sdc=True)
            if c == 1:
                fail(set(bad), at)

    events = sorted(((_order(s, ph), kind, s, ph, t) for kind, s, ph, t in map(_parse, trial.faults)),
                    key=lambda e: e[0])
    groups: list[list] = []  # faults at the same (step, phase) fire together, in list order
    for e in events:
        if groups and groups[-1][0][0] == e[0]:
            groups[-1].append(e)
        else:
            groups.append([e])
    gi = 0

    def run_group(group):
        nonlocal skipped
        pending: set = set()
        at = (group[0][2], group[0][3])
        for _, kind, s, ph, t in group:
            # a nan/spike belongs to step index s: the restart after a kill in this group
            # injects it again or replays its recorded verdict (`FaultPlan.resume`)
            if kind in ("nan", "spike") and (kind == "nan" or applied_before(s, skipped) >= MIN_HISTORY):
                skipped.append(s)  # injected into the grad part of step index s
        for _, kind, s, ph, t in group:
            alive = sim["alive"]
            if kind in ("nan", "spike"):
                pass
            elif kind == "kill_process":
                if sim["kill"] is None:
                    # the restart is a new process on the whole topology, with the same plan:
                    # the faults that come after the kill fire (a spike after it is judged on
                    # the restored history); the kill's own group and everything before it
                    # happened to the process that died (`FaultPlan.resume`)
                    sim.update(kill=(s, ph), alive=list(range(d)))
                    stalled.clear(), repaired.clear(), flips.clear()
                    return
            elif kind == "fail_slice":
                pending.add(t)
            elif kind == "rejoin":
                fail(pending, at)  # failures still pending are recovered first
                pending = set()
                rejoin(t)
            elif kind == "repair_slice":
                if t not in alive:
                    repaired.add(t)
            elif kind == "hang_slice":
                if t in alive and t not in pending:
                    stalled.add(t)
            elif kind == "bitflip":
                if t in pending:
                    end(forbidden="a flip on a domain failed in the same group")
                if t in alive:
                    flips.append(t)
            # slow_slice: reported only (HealthConfig.remove_stragglers is False)
        fail(pending, at)

    for k in range(trial.steps):
        for pos in range(5):
            while gi < len(groups) and groups[gi][0][0] == (k, pos):
                gi += 1
                run_group(groups[gi - 1])
            if pos == 0:
                gate((k, "before_step"))
                check((k, "before_step"))
            if pos == 3 and trial.ckpt_every and (k + 1) % trial.ckpt_every == 0:
                gate((k + 1, "after_step"))  # save(): the health gate, then the replica check
                check((k + 1, "after_step"))
                sim["ckpt_at"] = k + 1  # saved after after_step; a during_save failure comes after it
    end()


def expect(trial: Trial, shapes) -> Expect:
    """The oracle: every path `_simulate` can take (each timing the docs allow); the trial's
    outcome is certain when they all agree."""
    outs, todo = [], [()]
    while todo and len(outs) < 4096:
        path = list(todo.pop())
        i = [0]

        def choose(n):
            j = i[0]
            i[0] += 1
            if j < len(path):
                return path[j]
            todo.extend(tuple(path) + (alt,) for alt in range(1, n))
            path.append(0)
            return 0

        try:
            _simulate(trial, shapes, choose)
        except _Done as done:
            outs.append(done.out)
    lost, at, skipped, kill, sdc, forbidden = outs[0]
    forbidden = next((o[5] for o in outs if o[5]), None)
    uncertain = bool(todo) or len({(o[0], o[2], o[4]) for o in outs}) > 1
    return Expect(lost, at, skipped, kill, sdc, uncertain, forbidden)


def applied_before(idx: int, skipped) -> int:
    return idx - len([s for s in set(skipped) if s < idx])


# ------------------------------------------------------------------ running
def _layout(name, n_devices, per):
    import jax
    from jax.sharding import PartitionSpec as P

    if name == "sharded":
        return lambda st: jax.tree.map(
            lambda x: P(("data", "fsdp")) if np.ndim(x) and np.shape(x)[0] % n_devices == 0 else P(), st)
    return lambda st: jax.tree.map(lambda x: P("fsdp") if np.ndim(x) and np.shape(x)[0] % per == 0 else P(), st)


def _flat(state) -> dict:
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def _config(trial: Trial, workdir: str | None):
    import resilax

    ck = None
    if trial.ckpt_every and workdir:
        ck = resilax.CheckpointConfig(os.path.join(workdir, "ck"), every=trial.ckpt_every)
    log = resilax.LogConfig(directory=os.path.join(workdir, "log") if workdir else None)
    det = resilax.DeterministicConfig() if trial.mode == "deterministic" else None
    health = None
    if trial.health:
        # replica checks before every step (the auto cadence depends on timing); a fast watchdog
        health = resilax.HealthConfig(sdc_every=1, hang_detect_s=HANG_DETECT_S if trial.health == "watchdog" else None,
                                      probe_every_s=0.1, step_deadline_min_s=0.5)
    return resilax.Config(checkpoint=ck, log=log, anomaly=resilax.AnomalyConfig(min_history=MIN_HISTORY),
                          deterministic=det, health=health)


HANG_DETECT_S = 0.5


def faulted_run(trial: Trial, workdir: str, faults=None) -> dict:
    """The trial's run with its faults (resumes from ``workdir`` when something is there)."""
    import resilax
    from resilax.tools.models import CASES

    case = CASES[trial.model]
    d, per = trial.topology
    topo = resilax.Topology.emulated(d, per)
    st = case.make_state(0)
    step = resilax.wrap(case.train_step, topology=topo, state_sharding=_layout(trial.layout, d * per, per)(st),
                        rng=True, metric_reductions=case.metric_reductions, config=_config(trial, workdir),
                        faults=resilax.FaultPlan(trial.faults if faults is None else faults))
    batches = case.make_batches(trial.steps)
    s = step.init(st)
    try:
        while step.step < trial.steps:
            s, _ = step(s, batches[step.step])
        return _flat(s)
    finally:
        step.close()


_REFS: dict = {}


def reference(trial: Trial, skipped) -> dict:
    """The failure-free run: a plain jitted loop (no resilax) that skips ``skipped``."""
    import jax

    from resilax.tools.models import CASES

    key = (trial.model, trial.steps, tuple(skipped))
    if key not in _REFS:
        case = CASES[trial.model]
        state = case.make_state(0)
        fn = jax.jit(case.train_step)
        for i, b in enumerate(case.make_batches(trial.steps)):
            new, _ = fn(state, b, jax.random.fold_in(jax.random.key(0), i))
            state = state if i in skipped else new
        _REFS[key] = _flat(state)
    return _REFS[key]


def deterministic_reference(trial: Trial) -> dict:
    """The bit-exact mode's failure-free run: the trial's config with only its NaN/spike faults."""
    grad_only = tuple(f for f in trial.faults if f.split("@")[0] in ("nan", "spike"))
    key = ("deterministic", trial.model, trial.topology, trial.layout, trial.steps, grad_only)
    if key not in _REFS:
        bare = dataclasses.replace(trial, ckpt_every=None, health=None)
        _REFS[key] = faulted_run(bare, None, faults=grad_only)
    return _REFS[key]


def uninterrupted(trial: Trial) -> dict:
    """The trial's run with the same config and plan but no kill, in a fresh directory."""
    faults = tuple(f for f in trial.faults if not f.startswith("kill"))
    key = ("uninterrupted", trial.model, trial.topology, trial.layout, trial.ckpt_every, trial.steps, faults,
           trial.health)
    if key not in _REFS:
        work = tempfile.mkdtemp(prefix="resilax-campaign-ref-")
        try:
            _REFS[key] = faulted_run(dataclasses.replace(trial, faults=faults), work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _REFS[key]


def rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for k in b:
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        if not np.issubdtype(b[k].dtype, np.floating):
            if not np.array_equal(a[k], b[k]):
                return float("inf")
            continue
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return worst


_SHAPES: dict = {}


def _shapes(trial: Trial):
    if trial.model not in _SHAPES:
        import jax

        from resilax.tools.models import CASES

        _SHAPES[trial.model] = [np.shape(x) for x in jax.tree.leaves(jax.eval_shape(CASES[trial.model].make_state, 0))]
    return _SHAPES[trial.model]


class _Timeout(Exception):
    pass


def run_trial(trial: Trial, *, timeout_s: float = 300.0) -> dict:
    """Runs one trial; returns its record (outcome, seconds, details)."""
    import resilax

    t0 = time.perf_counter()
    exp = expect(trial, _shapes(trial))
    rec: dict[str, Any] = {"trial": trial.to_json(), "expect_lost": exp.lost, "skipped": list(exp.skipped)}
    if exp.sdc:
        rec["expect_sdc"] = True
    work = tempfile.mkdtemp(prefix="resilax-campaign-")

    def alarm(*_):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        if exp.kill is not None:
            child = subprocess.run([sys.executable, "-m", "resilax.tools.campaign", "--child",
                                    json.dumps(trial.to_json()), work], capture_output=True, text=True,
                                   timeout=timeout_s)
            if child.returncode != -signal.SIGKILL:
                rec.update(outcome="unexpected_exception", error=f"child exit {child.returncode}: {child.stderr[-1500:]}")
                return rec
            got = faulted_run(trial, work)  # the same command again: the same plan (`FaultPlan.resume`)
        else:
            got = faulted_run(trial, work)
        domain_faults = any(_parse(f)[0] not in ("nan", "spike", "kill_process") for f in trial.faults)
        if exp.kill is not None and trial.mode != "deterministic" and not domain_faults:
            # kill + resume on the same mesh: bitwise the uninterrupted run with the same plan
            rec["judged"] = "bitwise, uninterrupted run with the same plan"
            diff = rel_diff(got, uninterrupted(trial))
            good = diff == 0.0 and rel_diff(got, reference(trial, exp.skipped)) < TOL
        elif trial.mode == "deterministic":
            # the same config with no failure (the NaN/spike faults are part of the maths): bitwise
            diff = rel_diff(got, deterministic_reference(trial))
            good = diff == 0.0
        else:
            diff = rel_diff(got, reference(trial, exp.skipped))
            good = diff < TOL
        rec["max_rel_diff"] = diff
        if exp.lost:
            rec["outcome"] = "missed_lost"
        elif exp.sdc:
            rec["outcome"] = "missed_sdc"
        else:
            rec["outcome"] = "ok" if good else "silent_mismatch"
    except resilax.StateLostError as e:
        rec["outcome"] = "expected_lost" if exp.lost else "wrong_lost"
        rec["error"] = str(e)[:1500]
    except resilax.SilentDataCorruptionError as e:
        rec["outcome"] = "expected_sdc" if exp.sdc else "unexpected_exception"
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    except (_Timeout, subprocess.TimeoutExpired):
        rec["outcome"] = "hang"
    except Exception as e:  # noqa: BLE001 - the campaign counts every unexpected exception
        import traceback

        rec.update(outcome="unexpected_exception", error=f"{type(e).__name__}: {str(e)[:1500]}",
                   traceback=traceback.format_exc()[-4000:])  # a rare one may not come back on a rerun
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        shutil.rmtree(work, ignore_errors=True)
        rec["seconds"] = time.perf_counter() - t0
    return rec


def run_campaign(trials: int, seed: int, *, json_path: str | None = None, every: int = 10, stream=None,
                 chunk: int = 20) -> dict:
    """``trials`` seeded trials; prints a progress line every ``every`` trials and a summary
    table; writes JSON (counts, per-trial records) when ``json_path`` is given, after every
    progress line too (a long run that is stopped keeps what it measured).

    Trials run in worker processes, ``chunk`` at a time: one process that compiles hundreds
    of distinct programs ran out of memory mappings (LLVM "Cannot allocate memory", then a
    segfault, after ~280 trials). A worker that dies mid-trial (a crash in resilax or JAX)
    counts that trial as ``unexpected_exception`` and the campaign goes on in a new worker.
    """
    stream = stream or sys.stdout
    rng = random.Random(seed)
    todo = [random_trial(rng, seed * 1_000_003 + i) for i in range(trials)]
    records, counts = [], {o: 0 for o in OUTCOMES}
    t0 = time.perf_counter()

    def summary():
        return {"trials": trials, "done": len(records), "seed": seed, "counts": counts,
                "bad": sum(counts[b] for b in BAD), "seconds": time.perf_counter() - t0, "records": records}

    def take(rec):
        i = len(records)
        records.append(rec)
        counts[rec["outcome"]] += 1
        trial = Trial.from_json(rec["trial"])
        if rec["outcome"] in BAD:
            print(f"  trial {i}: {rec['outcome']}: {trial.faults} {trial.model} {trial.topology} {trial.layout} {trial.mode} "
                  f"ckpt={trial.ckpt_every} {rec.get('error', '')[:300]} diff={rec.get('max_rel_diff')}",
                  file=stream, flush=True)
        if (i + 1) % every == 0 or i + 1 == trials:
            print(f"campaign: {i + 1}/{trials} trials, {time.perf_counter() - t0:.0f} s, "
                  + ", ".join(f"{k} {v}" for k, v in counts.items() if v), file=stream, flush=True)
            if json_path:
                from resilax._src.io import write_json

                write_json(json_path, summary())

    while len(records) < trials:
        batch = todo[len(records):len(records) + chunk]
        with tempfile.TemporaryDirectory(prefix="resilax-campaign-worker-") as d:
            out = os.path.join(d, "records.jsonl")
            args = [sys.executable, "-m", "resilax.tools.campaign", "--worker",
                    json.dumps([t.to_json() for t in batch]), out]
            try:
                rc = subprocess.run(args, timeout=400 * len(batch), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
                code, err = rc.returncode, rc.stderr
            except subprocess.TimeoutExpired as e:
                code, err = "timeout", str(e.stderr or "")
            got = []
            if os.path.exists(out):
                with open(out) as f:
                    got = [json.loads(line) for line in f if line.strip()]
        for rec in got:
            take(rec)
        if len(got) < len(batch):  # the worker died in the trial after the last record it wrote
            take({"trial": batch[len(got)].to_json(), "outcome": "unexpected_exception",
                  "error": f"worker process ended ({code}) during the trial: {err[-1200:]}"})
    out = summary()
    print("\n| outcome | trials |\n| --- | --- |", file=stream)
    for k, v in counts.items():
        print(f"| {k} | {v} |", file=stream)
    if json_path:
        from resilax._src.io import write_json

        write_json(json_path, out)
    return out


def register_cli(sub) -> None:
    c = sub.add_parser("campaign", help="random seeded fault schedules, each checked against a failure-free run")
    c.add_argument("--trials", type=int, default=300)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", default=None, help="write counts and per-trial records here")
    c.set_defaults(func=_cli)


def _cli(args) -> int:
    from resilax.tools.runner import configure_cpu_devices

    configure_cpu_devices(8)
    out = run_campaign(args.trials, args.seed, json_path=args.json)
    return 1 if out["bad"] else 0


def _child(trial_json: str, work: str) -> None:
    from resilax.tools.runner import configure_compilation_cache, configure_cpu_devices

    configure_cpu_devices(8)
    configure_compilation_cache()  # the worker's executables: the killed run does not compile them again
    faulted_run(Trial.from_json(json.loads(trial_json)), work)
    sys.exit(3)  # the kill should have fired


def _worker(trials_json: str, out: str) -> None:
    """Runs trials, appending one JSON record per line to ``out`` as each ends."""
    from resilax.tools.runner import configure_compilation_cache, configure_cpu_devices

    configure_cpu_devices(8)
    configure_compilation_cache()
    for t in json.loads(trials_json):
        rec = run_trial(Trial.from_json(t))
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
