"""The fault campaign's oracle (`resilax campaign`) and the trial it judges (`Trial`).

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

MIN_HISTORY = 3  # the anomaly detector's warm-up (`AnomalyConfig.min_history`) in every trial

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


def parse(spec: str):
    kind, rest = spec.split("@")
    target = None
    if "/" in rest:
        rest, t = rest.split("/")
        target = int(t)
    step, phase = (rest.split(":") + ["after_step"])[:2]
    return kind, int(step), phase, target


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

    events = sorted(((_order(s, ph), kind, s, ph, t) for kind, s, ph, t in map(parse, trial.faults)),
                    key=lambda e: e[0])
    groups: list[list] = []  # faults at the same (step, phase) fire together, in list order
    for e in events:
        if groups and groups[-1][0][0] == e[0]:
            groups[-1].append(e)
        else:
            groups.append([e])
    gi = 0

    def run_group(group):
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
