"""Pipeline schedule tables: which op runs on which failure domain, in which order.

A job has D data replicas x S pipeline stages; failure domain ``(r, s)`` holds stage s of
replica r. Each replica processes M micro-batches per step, so a step is D*M micro-batches,
and every table (healthy, ReCycle-rerouted, replica-dropped) processes all of them. Ops:

- ``F`` forward, ``B`` input-gradient backward, ``W`` weight-gradient backward (``zb-h1``);
- ``BW`` the backward in one op (``gpipe``, ``1f1b``).

Dependencies: F(v,m,s) after F(v,m,s-1); B(v,m,s) after F(v,m,s) and B(v,m,s+1) (the last
stage's B after its own F: the loss); W(v,m,s) after B(v,m,s); BW like B. ``Op.replica`` is
the micro-batch's origin replica v (whose gradient accumulator it feeds), not where it runs:
:meth:`Table.domain_of` says where. B, W and BW of (v, m, s) run where F(v, m, s) ran (the
residuals live there).

Tables come from a greedy list scheduler (shared/PIPELINE.md §3.3): every domain runs one op
at a time and, when idle, starts the ready op of its highest-priority kind (zb-h1: B > F > W;
1f1b: BW > F; gpipe: every F of the domain before any BW), oldest-ready first, then lowest
(m, v). 1f1b and zb-h1 start an F only while fewer than ``S - s`` micro-batches are in flight
on the domain (F started, B/BW not finished); a peer absorbing rerouted micro-batches may hold
that many more. The planner uses unit costs (F = B = W = 1, BW = 2) unless given others; the
result is deterministic and cached, so equal arguments return the same object.

:func:`simulate` replays a table's fixed per-domain orders under any costs, for several
back-to-back steps with an optimizer update ``U`` per domain (``global``: after every op of
the step; ``staggered``: stage s's update after every stage-s backward op of the step, as
ReCycle does). ``U`` is a timing op only: it is not in ``Table.order``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import types
from typing import Mapping

__all__ = ["Op", "Table", "Timing", "SCHEDULES", "DEFAULT_COSTS", "healthy", "rerouted", "dropped",
           "simulate", "validate", "throughput_ratio"]

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
DEFAULT_COSTS = types.MappingProxyType({"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0, "U": 1.0})
_PRIORITY = {"zb-h1": ("B", "F", "W"), "1f1b": ("BW", "F"), "gpipe": ("F", "BW")}


@dataclasses.dataclass(frozen=True, order=True)
class Op:
    """One dispatch: ``kind`` in F/B/W/BW of micro-batch ``microbatch`` of origin replica
    ``replica`` at stage ``stage`` (the domain it runs on is ``Table.domain_of``)."""
    kind: str
    replica: int
    microbatch: int
    stage: int


def _kinds(schedule: str) -> tuple[str, ...]:
    return ("F", "B", "W") if schedule == "zb-h1" else ("F", "BW")


def _deps(op: Op, stages: int) -> tuple[Op, ...]:
    """The ops ``op`` waits for (same origin replica and micro-batch)."""
    k, v, m, s = op.kind, op.replica, op.microbatch, op.stage
    if k == "F":
        return (Op("F", v, m, s - 1),) if s > 0 else ()
    if k == "W":
        return (Op("B", v, m, s),)
    return (Op("F", v, m, s),) + ((Op(k, v, m, s + 1),) if s < stages - 1 else ())


@dataclasses.dataclass(frozen=True)
class Table:
    """A step's ops per live domain, in execution order, with the planner's start times.

    ``order[(r, s)]`` lists domain (r, s)'s ops; ``start[(r, s)]`` their start times (planner
    units), strictly increasing. Lost domains and the domains of dropped replicas have no key.

    For an executor: an op with ``op.replica != r`` is a micro-batch of another replica
    (rerouted or of a dropped replica), run with this domain's stage-s weights. F(v, m, s)
    takes its input from ``domain_of(v, m, s - 1)`` (s = 0: micro-batch m of replica v's data)
    and sends its output to ``domain_of(v, m, s + 1)``; B/BW(v, m, s) takes its cotangent from
    ``domain_of(v, m, s + 1)`` (s = S-1: the loss) and sends dx to ``domain_of(v, m, s - 1)``.
    Weight gradients go to an accumulator keyed (v, s) on the running domain, so the stage-s
    gradient can be summed over v in a fixed order wherever micro-batches ran. The optimizer
    update is not in ``order``: it follows the step's last stage-s W/BW on every domain.
    """
    schedule: str
    replicas: int
    stages: int
    microbatches: int
    lost: frozenset
    dropped: frozenset
    order: Mapping[tuple[int, int], tuple[Op, ...]]
    start: Mapping[tuple[int, int], tuple[float, ...]]

    @functools.cached_property
    def _placement(self) -> dict:
        return {(op.replica, op.microbatch, op.stage): d for d, ops in self.order.items() for op in ops
                if op.kind == "F"}

    def domain_of(self, replica: int, microbatch: int, stage: int) -> tuple[int, int]:
        """The domain (r', stage) that runs micro-batch ``microbatch`` of origin ``replica`` at
        ``stage`` (all its F/B/W/BW there). Raises KeyError for a triple not in the step."""
        return self._placement[(replica, microbatch, stage)]

    def dispatch_order(self) -> list[tuple[tuple[int, int], Op]]:
        """Every op with its domain, sorted by (start, domain): an op comes after every op it
        depends on, and each domain's ops keep their ``order``."""
        return list(self._dispatch)

    @functools.cached_property
    def _dispatch(self) -> tuple:
        rows = [(t, d, i, op) for d, ops in self.order.items() for i, (op, t) in enumerate(zip(ops, self.start[d]))]
        rows.sort(key=lambda x: (x[0], x[1], x[2]))
        return tuple((d, op) for _, d, _, op in rows)

    @functools.cached_property
    def _replay_plan(self) -> tuple:
        """Per op in dispatch order: (domain index, kind index in F/B/W/BW, ((dep index,
        cross-domain), ...)), so a replay is list indexing."""
        doms = {d: i for i, d in enumerate(self.order)}
        kind = {"F": 0, "B": 1, "W": 2, "BW": 3}
        S = self.stages
        pos, rows = {}, []  # keyed by plain tuples: hashing Op dataclasses costs several times more
        for i, (d, op) in enumerate(self._dispatch):
            k, v, m, s = key = (op.kind, op.replica, op.microbatch, op.stage)
            pos[key] = (i, d)
            if k == "F":
                deps = (("F", v, m, s - 1),) if s > 0 else ()
            elif k == "W":
                deps = (("B", v, m, s),)
            else:
                deps = (("F", v, m, s),) + (((k, v, m, s + 1),) if s < S - 1 else ())
            rows.append((doms[d], kind[k], deps, d))
        return tuple((di, ki, tuple((pos[x][0], pos[x][1] != d) for x in deps)) for di, ki, deps, d in rows)

    def ops_per_domain(self) -> dict:
        """``{(r, s): {"F": n, "B": n, "W": n, "BW": n}}`` for every live domain."""
        out = {}
        for d, ops in self.order.items():
            c = dict.fromkeys(("F", "B", "W", "BW"), 0)
            for op in ops:
                c[op.kind] += 1
            out[d] = c
        return out

    def rerouted_ops(self) -> dict:
        """``{(r, s): n}``: ops a domain runs for micro-batches of other origin replicas."""
        return {d: sum(op.replica != d[0] for op in ops) for d, ops in self.order.items()}


# -- planning ------------------------------------------------------------------------------------
def _check_shape(schedule, replicas, stages, microbatches) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule expects one of {SCHEDULES}, but got {schedule!r}")
    for name, val in (("replicas", replicas), ("stages", stages), ("microbatches", microbatches)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"pipeline schedule expects {name} to be an int >= 1, but got {val!r}")


def _norm_lost(lost, replicas, stages) -> frozenset:
    out = set()
    for d in lost:
        try:
            r, s = (int(x) for x in d)
        except (TypeError, ValueError):
            raise ValueError(f"pipeline schedule expects lost domains as (replica, stage) pairs, but got {d!r}")
        if not (0 <= r < replicas and 0 <= s < stages):
            raise ValueError(f"pipeline schedule expects lost domains within {replicas} replicas x {stages} "
                             f"stages, but got {d!r}")
        out.add((r, s))
    return frozenset(out)


def _norm_costs(costs) -> tuple:
    c = dict(DEFAULT_COSTS)
    if costs:
        unknown = set(costs) - set(c)
        if unknown:
            raise ValueError(f"pipeline costs expect keys from {tuple(c)}, but got {sorted(unknown)}")
        c.update({k: float(v) for k, v in costs.items()})
    bad = {k: v for k, v in c.items() if k != "U" and not v > 0}
    if bad or c["U"] < 0:
        raise ValueError(f"pipeline costs expect F/B/W/BW > 0 and U >= 0, but got {c}")
    return tuple(sorted(c.items()))


def _norm_comm(comm) -> float:
    if not isinstance(comm, (int, float)) or isinstance(comm, bool) or not comm >= 0:
        raise ValueError(f"pipeline schedule expects comm (time per cross-domain hop) >= 0, but got {comm!r}")
    return float(comm)


def _plan(schedule, S, place, caps, costs, comm):
    """Greedy list schedule of every op in ``place`` ((v, m, s) -> domain); returns
    (order, start) dicts per domain. O(ops log ops)."""
    cost = dict(costs)
    prio = _PRIORITY[schedule]
    bk = "B" if schedule == "zb-h1" else "BW"
    domains = sorted(set(place.values()))
    queues = {d: {k: [] for k in prio} for d in domains}
    inflight = dict.fromkeys(domains, 0)
    f_left = dict.fromkeys(domains, 0)
    for d in place.values():
        f_left[d] += 1
    busy = dict.fromkeys(domains, False)
    order = {d: [] for d in domains}
    start = {d: [] for d in domains}
    pending, ready_at = {}, {}
    events, seq = [], 0
    total = len(place) * len(_kinds(schedule))

    def push_ready(op, t):
        d = place[op[1:]]
        heapq.heappush(queues[d][op[0]], (t, op[2], op[1], op))
        dirty.add(d)

    def dependents(op):
        k, v, m, s = op
        if k == "F":
            out = [(bk, v, m, s)]
            return out + [("F", v, m, s + 1)] if s < S - 1 else out
        if k == "W":
            return []
        out = [("W", v, m, s)] if k == "B" else []
        return out + [(k, v, m, s - 1)] if s > 0 else out

    dirty = set()
    for (v, m, s) in place:
        if s == 0:
            push_ready(("F", v, m, 0), 0.0)
    started = 0
    t = 0.0
    while True:
        for d in sorted(dirty):
            if busy[d]:
                continue
            for k in prio:
                q = queues[d][k]
                if not q:
                    continue
                if k == "F" and caps is not None and inflight[d] >= caps[d]:
                    continue
                if schedule == "gpipe" and k == "BW" and f_left[d]:
                    continue
                _, _, _, op = heapq.heappop(q)
                order[d].append(op)
                start[d].append(t)
                busy[d] = True
                if k == "F":
                    inflight[d] += 1
                    f_left[d] -= 1
                heapq.heappush(events, (t + cost[k], seq, 0, op, d))
                seq += 1
                started += 1
                break
        dirty.clear()
        if not events:
            break
        t = events[0][0]
        while events and events[0][0] == t:
            _, _, typ, op, d = heapq.heappop(events)
            if typ == 1:  # arrived after a cross-domain hop
                push_ready(op, t)
                continue
            busy[d] = False
            dirty.add(d)
            if op[0] in ("B", "BW"):
                inflight[d] -= 1
            for nxt in dependents(op):
                nd = place[nxt[1:]]
                arrive = t + (comm if nd != d else 0.0)
                need = pending.get(nxt)
                if need is None:
                    need = 1 if nxt[0] in ("W", "F") or nxt[3] == S - 1 else 2  # len(_deps(nxt))
                need -= 1
                pending[nxt] = need
                ready_at[nxt] = max(ready_at.get(nxt, 0.0), arrive)
                if need == 0:
                    if ready_at[nxt] > t:
                        heapq.heappush(events, (ready_at[nxt], seq, 1, nxt, nd))
                        seq += 1
                    else:
                        push_ready(nxt, t)
    if started != total:  # the caps below cannot deadlock (the last stage always drains); a guard
        raise RuntimeError(f"pipeline planner stalled after {started} of {total} ops ({schedule}, caps {caps})")
    return ({d: tuple(Op(*op) for op in o) for d, o in order.items()}, {d: tuple(x) for d, x in start.items()})


def _default_caps(schedule, S, place, replicas_of_domain):
    if schedule == "gpipe":
        return None
    caps = {}
    for d in set(place.values()):
        caps[d] = S - d[1]
    for (v, _m, _s), d in place.items():
        if v != d[0] and v not in replicas_of_domain:  # a rerouted micro-batch raises its peer's cap
            caps[d] += 1
    return caps


@functools.lru_cache(maxsize=32)  # a 64x16 M=32 table holds ~10^5 ops
def _build(schedule, D, S, M, lost, mode, cap, costs, comm) -> Table:
    place = {(v, m, s): (v, s) for v in range(D) for m in range(M) for s in range(S)}
    drop = frozenset()
    if mode == "rerouted":
        for s in range(S):
            gone = sorted(r for r, ss in lost if ss == s)
            if not gone:
                continue
            alive = [r for r in range(D) if (r, s) not in lost]
            if not alive:
                raise ValueError(f"pipeline rerouting expects a live stage-{s} domain in some replica, but all "
                                 f"{D} replicas lost stage {s} (lost {sorted(lost)}): rerouting cannot help; "
                                 "re-partition or restore from a checkpoint")
            load = dict.fromkeys(alive, M)
            for r in gone:  # balanced: least-loaded survivor first, ties to the nearest replica after r
                for m in range(M):
                    p = min(alive, key=lambda q: (load[q], (q - r) % D))
                    place[(r, m, s)] = (p, s)
                    load[p] += 1
    elif mode == "dropped":
        drop = frozenset(r for r, _ in lost)
        survivors = [r for r in range(D) if r not in drop]
        if not survivors:
            raise ValueError(f"pipeline drop expects a replica without a lost domain, but every one of the {D} "
                             f"replicas holds one (lost {sorted(lost)})")
        load = dict.fromkeys(survivors, M)
        for v in sorted(drop):
            for m in range(M):
                p = min(survivors, key=lambda q: (load[q], (q - v) % D))
                for s in range(S):
                    place[(v, m, s)] = (p, s)
                load[p] += 1
    if cap is None:
        caps = _default_caps(schedule, S, place, drop)
    elif schedule == "gpipe":
        raise ValueError("pipeline schedule 'gpipe' keeps every micro-batch in flight: activation_cap expects "
                         f"None for it, but got {dict(cap) if isinstance(cap, tuple) else cap!r}")
    else:
        base = dict(cap) if isinstance(cap, tuple) else {}
        caps = {d: base.get(d, cap if isinstance(cap, int) else S - d[1]) for d in set(place.values())}
    order, start = _plan(schedule, S, place, caps, costs, comm)
    return Table(schedule, D, S, M, lost if mode != "healthy" else frozenset(), drop,
                 types.MappingProxyType(order), types.MappingProxyType(start))


def _cap_key(activation_cap):
    if activation_cap is None:
        return None
    if isinstance(activation_cap, Mapping):
        items = tuple(sorted(((int(r), int(s)), int(c)) for (r, s), c in activation_cap.items()))
        if any(c < 1 for _, c in items):
            raise ValueError(f"pipeline rerouting expects activation caps >= 1, but got {dict(items)}")
        return items
    if not isinstance(activation_cap, int) or isinstance(activation_cap, bool) or activation_cap < 1:
        raise ValueError(f"pipeline rerouting expects activation_cap None, an int >= 1 or a mapping "
                         f"{{(r, s): int}}, but got {activation_cap!r}")
    return activation_cap


def healthy(schedule: str, replicas: int, stages: int, microbatches: int, *, costs=None,
            comm: float = 0.0) -> Table:
    """The table with every domain alive. ``costs`` ({kind: time}, default unit, BW = 2) and
    ``comm`` (time per cross-domain hop) are what the planner assumes. Raises ValueError on
    an unknown schedule or a size < 1."""
    _check_shape(schedule, replicas, stages, microbatches)
    return _build(schedule, replicas, stages, microbatches, frozenset(), "healthy", None, _norm_costs(costs),
                  _norm_comm(comm))


def rerouted(schedule: str, replicas: int, stages: int, microbatches: int, lost, *, activation_cap=None,
             costs=None, comm: float = 0.0) -> Table:
    """ReCycle: the stage-s ops of every micro-batch of a lost domain (r, s) run on surviving
    stage-s domains (r', s) (same weights), balanced (least-loaded first, ties to the nearest
    replica after r); the micro-batch's other stages stay on replica r. ``activation_cap``:
    None (S - s per domain, plus the rerouted micro-batches a peer holds), an int for every
    domain, or ``{(r, s): cap}`` (others S - s). Raises ValueError when every replica lost
    some stage s (rerouting cannot help: the caller re-partitions or restores)."""
    _check_shape(schedule, replicas, stages, microbatches)
    lost = _norm_lost(lost, replicas, stages)
    return _build(schedule, replicas, stages, microbatches, lost, "rerouted", _cap_key(activation_cap),
                  _norm_costs(costs), _norm_comm(comm))


def dropped(schedule: str, replicas: int, stages: int, microbatches: int, lost, *, costs=None,
            comm: float = 0.0) -> Table:
    """The drop-the-replica baseline: every replica holding a lost domain runs nothing; its
    micro-batches (keeping their origin replica in ``Op.replica``) run whole on the surviving
    replicas, least-loaded first. Raises ValueError when no replica survives."""
    _check_shape(schedule, replicas, stages, microbatches)
    lost = _norm_lost(lost, replicas, stages)
    return _build(schedule, replicas, stages, microbatches, lost, "dropped", None, _norm_costs(costs),
                  _norm_comm(comm))


# -- timing --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
    """What :func:`simulate` measures. Times in cost units.

    ``makespan``: the first step's last op end (no update); ``step_time``: end of the last
    update of ``steps`` back-to-back steps over ``steps`` (the per-step time a run sees);
    ``busy``: per-domain op time in one step; ``bubble_fraction``: 1 - sum(busy) / (live
    domains x makespan); ``peak_inflight``: per-domain most micro-batches whose F started and
    whose B/BW had not finished; ``start``: per-domain op start times of the first step."""
    makespan: float
    step_time: float
    busy: Mapping[tuple[int, int], float]
    bubble_fraction: float
    peak_inflight: Mapping[tuple[int, int], int]
    start: Mapping[tuple[int, int], tuple[float, ...]]
    steps: int
    optimizer: str | None


def _optimizer(optimizer, table: Table, where: str) -> str | None:
    """``optimizer`` of `simulate` (and of replays like it) resolved: ``"auto"`` is zb-h1
    staggered, the others global."""
    if optimizer == "auto":
        optimizer = "staggered" if table.schedule == "zb-h1" else "global"
    if optimizer not in (None, "staggered", "global"):
        raise ValueError(f"{where} expects optimizer 'auto', 'staggered', 'global' or None, but got {optimizer!r}")
    return optimizer


def _update_ends(free, finish, plan, doms, S, u: float, optimizer) -> list:
    """When each domain's update ``U`` (cost ``u``) ends, given when its last op of the step
    ends (``free``) and every op's end (``finish``): ``global`` after every op of the step,
    ``staggered`` after the stage's own last W/BW; None: no update (``free`` as it is)."""
    if optimizer == "global":
        done = max(free, default=0.0)
        return [done + u] * len(doms)
    if optimizer == "staggered":
        last = [0.0] * S
        for i, (di, ki, _) in enumerate(plan):
            if ki >= 2 and finish[i] > last[doms[di][1]]:  # W or BW: the stage's gradient is done
                last[doms[di][1]] = finish[i]
        return [max(f, last[d[1]]) + u for f, d in zip(free, doms)]
    return list(free)


def simulate(table: Table, costs=None, comm: float = 0.0, *, steps: int = 3, optimizer: str | None = "auto"
             ) -> Timing:
    """Replays ``table``'s per-domain orders (not re-planned) under ``costs`` ({kind: time};
    defaults F = B = W = U = 1, BW = 2) and ``comm`` per cross-domain hop, for ``steps``
    back-to-back steps. ``optimizer``: ``"auto"`` (zb-h1 staggered, others global, as
    shared/PIPELINE.md §3.3), ``"staggered"``, ``"global"`` or None (no update op, so
    ``step_time`` is the makespan). The next step's ops on a domain wait for its update.
    Cost O(steps x ops)."""
    optimizer = _optimizer(optimizer, table, "pipeline simulate")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"pipeline simulate expects steps >= 1, but got {steps!r}")
    cost = dict(_norm_costs(costs))
    comm = _norm_comm(comm)
    S = table.stages
    doms = list(table.order)
    plan = table._replay_plan
    kinds = [cost[k] for k in ("F", "B", "W", "BW")]
    free = [0.0] * len(doms)
    busy = [0.0] * len(doms)
    first_start: list = [[] for _ in doms]
    finish = [0.0] * len(plan)
    makespan = 0.0
    for step in range(steps):
        for i, (di, ki, deps) in enumerate(plan):
            t = free[di]
            for j, cross in deps:
                x = finish[j] + (comm if cross else 0.0)
                if x > t:
                    t = x
            f = finish[i] = t + kinds[ki]
            free[di] = f
            if step == 0:
                first_start[di].append(t)
                busy[di] += kinds[ki]
        if step == 0:
            makespan = max(finish, default=0.0)
        free = _update_ends(free, finish, plan, doms, S, cost["U"], optimizer)
    free = dict(zip(doms, free))
    busy = dict(zip(doms, busy))
    first_start = dict(zip(doms, first_start))
    end = max(free.values(), default=0.0)
    peak = {}
    for d, ops in table.order.items():
        cur = top = 0
        for op in ops:
            if op.kind == "F":
                cur += 1
                top = max(top, cur)
            elif op.kind in ("B", "BW"):
                cur -= 1
        peak[d] = top
    live = len(table.order)
    bubble = 1.0 - sum(busy.values()) / (live * makespan) if live and makespan else 0.0
    return Timing(makespan, end / steps, types.MappingProxyType(busy), bubble, types.MappingProxyType(peak),
                  types.MappingProxyType({d: tuple(x) for d, x in first_start.items()}), steps, optimizer)


def throughput_ratio(degraded: Table, reference: Table | None = None, **simulate_kw) -> float:
    """Throughput of ``degraded`` relative to ``reference`` (default: the healthy table of the
    same shape): reference step time / degraded step time (both process D*M micro-batches)."""
    if reference is None:
        reference = healthy(degraded.schedule, degraded.replicas, degraded.stages, degraded.microbatches)
    return simulate(reference, **simulate_kw).step_time / simulate(degraded, **simulate_kw).step_time


# -- validation ----------------------------------------------------------------------------------
def validate(table: Table) -> None:
    """Raises ValueError naming the first problem found: a domain out of range, lost or of a
    dropped replica that runs ops; an op on a domain of another stage; an op kind the schedule
    does not use; a (kind, v, m, s) missing or repeated; B/W/BW away from their F; a
    rerouted table moving ops it need not move; start times not strictly increasing per
    domain; or an op ordered (per domain or in ``dispatch_order``) before one it depends on."""
    if table.schedule not in SCHEDULES:
        raise ValueError(f"pipeline table expects a schedule in {SCHEDULES}, but got {table.schedule!r}")
    D, S, M = table.replicas, table.stages, table.microbatches
    kinds = _kinds(table.schedule)
    where: dict = {}
    for d, ops in table.order.items():
        r, s = d
        if not (0 <= r < D and 0 <= s < S):
            raise ValueError(f"pipeline table expects domains within {D}x{S}, but has {d}")
        if d in table.lost:
            raise ValueError(f"pipeline table runs {len(ops)} ops on lost domain {d}" if ops else
                             f"pipeline table lists lost domain {d}")
        if r in table.dropped:
            raise ValueError(f"pipeline table runs ops on domain {d} of dropped replica {r}")
        times = table.start.get(d)
        if times is None or len(times) != len(ops):
            raise ValueError(f"pipeline table expects {len(ops)} start times for domain {d}, but got "
                             f"{None if times is None else len(times)}")
        if any(b <= a for a, b in zip(times, times[1:])):
            raise ValueError(f"pipeline table expects strictly increasing start times on domain {d}, got {times}")
        for op in ops:
            if op.kind not in kinds:
                raise ValueError(f"pipeline table ({table.schedule}) expects op kinds {kinds}, but domain {d} "
                                 f"has {op}")
            if op.stage != s:
                raise ValueError(f"pipeline table runs {op} on domain {d} of stage {s}")
            if not (0 <= op.replica < D and 0 <= op.microbatch < M):
                raise ValueError(f"pipeline table expects ops within {D} replicas x {M} micro-batches, got {op}")
            if op in where:
                raise ValueError(f"pipeline table runs {op} twice: on {where[op]} and {d}")
            where[op] = d
    for v in range(D):
        for m in range(M):
            home = None
            for s in range(S):
                for k in kinds:
                    if Op(k, v, m, s) not in where:
                        raise ValueError(f"pipeline table expects one {Op(k, v, m, s)}, but it has none")
                d = where[Op("F", v, m, s)]
                for k in kinds[1:]:
                    if where[Op(k, v, m, s)] != d:
                        raise ValueError(f"pipeline table runs {Op(k, v, m, s)} on {where[Op(k, v, m, s)]}, "
                                         f"expected where its F ran: {d}")
                if table.dropped:  # a dropped replica's micro-batch runs whole on one survivor
                    home = d[0] if home is None else home
                    if d[0] != home or (v not in table.dropped and d[0] != v):
                        raise ValueError(f"pipeline table (dropped) runs stage {s} of micro-batch {(v, m)} on "
                                         f"replica {d[0]}, expected {v if v not in table.dropped else home}")
                elif (v, s) not in table.lost and d != (v, s):
                    raise ValueError(f"pipeline table moves {Op('F', v, m, s)} to {d} though {(v, s)} is alive")
    pos = {op: i for i, (_, op) in enumerate(table._dispatch)}
    for op, i in pos.items():
        for dep in _deps(op, S):
            if pos[dep] >= i:
                raise ValueError(f"pipeline table dispatches {op} (at {i}) before {dep} (at {pos[dep]}), "
                                 "which it depends on")
