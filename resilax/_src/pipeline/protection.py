"""Protection in the bubbles (BAFT): each stage's snapshot, peer copy and record-log entry
placed into that stage's idle time, costed by replaying the schedule.

A pipeline step leaves every domain idle for a while (its bubbles); with a staggered update
the last stage can finish its update first (1f1b does; the greedy zb-h1 tables end stages
1..S-1 together, stage 0 last), and then its window after the update is the longest
(shared/PIPELINE.md §4). :func:`place` takes a schedule :class:`~.schedule.Table` and the
protection work of each stage (in the simulator's cost units, as :func:`work_units` derives
from bytes and bandwidths), replays the table for a few back-to-back steps (the event model
of :func:`~.schedule.simulate`, with the update ``U`` an explicit op per domain), finds every
domain's idle gaps and fills them, in time order, with whole pieces of the work of at most
``chunk`` units (how finely a copy can be split). The work of step k is available once the domain's update ``U_k`` ends and must be
off the device before ``U_{k+1}`` rewrites the state it copies; that interval is the
domain's *cycle* k. What does not fit a cycle's gaps *spills*: it runs on the critical path,
right before ``U_{k+1}``, and the replay measures what that costs. With a cadence of N steps
(``every``) a protected step's work may use the N cycles up to the next protected step; the
state it copies must then stay readable past the updates in between (the host snapshot
placed first, then only the peer copy and log deferred, or a device-side copy).

Two placements are compared, both replayed:

- **end**: the way protection runs today, at the step's end on every stage at once: after
  the step's last update (a barrier), every domain runs its work, and the next step's ops
  on the domain wait for it;
- **bubbles**: the plan above.

Model (a conservative one): a protection op occupies its domain like any op (one at a time,
no overlap with compute), although a device-to-host copy and a NIC transfer use engines
that compute does not; every live domain of stage s runs stage s's work; the kinds of one
domain run one after the other in the order given (``snapshot`` before ``peer``: the peer
copy sends the host snapshot). Nothing here runs JAX: `PipelineExecutor` dispatches the
``snapshot`` (checkpoint parts) and ``peer`` ops of :meth:`ProtectionPlan.dispatch`
(`bubbles`, `peers`); the executor keeps no record log, so it has no ``log`` ops.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from typing import Mapping

from resilax._src.pipeline import schedule as ps

__all__ = ["ProtectionOp", "ProtectionPlan", "Cadence", "place", "replay", "validate_plan", "cadence",
           "work_units"]

_EPS = 1e-9  # float slack when comparing replayed times built from sums of unit costs
KINDS = ("snapshot", "peer", "log")


@dataclasses.dataclass(frozen=True)
class ProtectionOp:
    """A run of ``chunks`` consecutive pieces (from piece ``chunk``) of one kind of stage
    ``stage``'s protection work for the state after step ``step``'s update, on one domain.

    ``cycle``: the op runs while step ``cycle + 1`` runs (``cycle == step`` unless the work
    was deferred), right before that step's item ``before`` on its domain (its ops in
    ``Table.order``; ``len(order[d])`` is the update), as soon as the previous item ends.
    ``start``/``end``: replayed times (cost units from the start of step 0). ``spill``: it did not fit the cycle's idle time
    and runs on the critical path."""
    kind: str
    stage: int
    chunk: int
    chunks: int
    units: float
    step: int
    cycle: int
    before: int
    start: float
    end: float
    spill: bool = False


@dataclasses.dataclass(frozen=True)
class Cadence:
    """Protect every ``every`` steps (None: no cadence up to ``max_every`` meets the budget);
    ``overhead``: estimated added share of the step at that cadence; ``bubbles``: whether idle
    time counted as free budget."""
    every: int | None
    overhead: float
    budget: float
    bubbles: bool


@dataclasses.dataclass(frozen=True)
class ProtectionPlan:
    """Where each domain's protection work runs, and what it costs. Times in cost units.

    ``ops[(r, s)]``: the placed protection ops of every simulated cycle, by start time.
    ``windows[(r, s)]``: the idle gaps of the last simulated (steady) cycle, as ``(before,
    start, length)``: idle from ``start`` until item ``before`` of the step.
    ``work[s]``: ``{kind: units}`` per stage. ``capacity[(r, s)]``: units of work (whole
    pieces of ``chunk``, greedily, in a steady cycle) the domain's idle time holds per step.
    ``spill[(r, s)]``: units per protected step that ran on the critical path.
    ``deferred[(r, s)]``: for a domain whose work does not fit one cycle, the steps its idle
    time takes to hold it (None: it has no idle time); empty when everything fits.
    ``base_ticks``/``end_ticks``/``bubble_ticks``: steady per-step time (the replay's update
    ends, last step minus first, over the steps between) without protection, with it at the
    step's end, with it in the bubbles. ``end_overhead``/``bubble_overhead``: the added
    share of ``base_ticks``. ``healthy_ticks``: :func:`~.schedule.simulate`'s step time of
    the same table (what ``resilax bench pipeline`` reports)."""
    table: ps.Table
    work: Mapping[int, Mapping[str, float]]
    chunk: float
    every: int
    steps: int
    costs: Mapping[str, float]
    ops: Mapping[tuple[int, int], tuple[ProtectionOp, ...]]
    windows: Mapping[tuple[int, int], tuple[tuple[int, float, float], ...]]
    capacity: Mapping[tuple[int, int], float]
    spill: Mapping[tuple[int, int], float]
    deferred: Mapping[tuple[int, int], int | None]
    base_ticks: float
    end_ticks: float
    bubble_ticks: float
    healthy_ticks: float
    optimizer: str | None = "auto"
    comm: float = 0.0

    @property
    def end_overhead(self) -> float:
        return _share(self.end_ticks, self.base_ticks)

    @property
    def bubble_overhead(self) -> float:
        return _share(self.bubble_ticks, self.base_ticks)

    def work_of(self, domain) -> float:
        """Units of protection work of ``domain`` per protected step."""
        return sum(self.work.get(domain[1], {}).values())

    def dispatch(self, domain, cycle: int | None = None) -> tuple[ProtectionOp, ...]:
        """The executor's view: ``domain``'s protection ops to run while step ``cycle + 1``
        runs (default: the last cycle the plan simulated, a steady one), each right before
        item ``op.before`` of that step on that domain (see :class:`ProtectionOp`)."""
        ops = self.ops.get(tuple(domain), ())
        if cycle is None:
            cycle = max((o.cycle for o in ops), default=0)
        return tuple(o for o in ops if o.cycle == cycle)

    def steady(self, domain, offset: int = 0) -> tuple[ProtectionOp, ...]:
        """The executor's view with a cadence: ``domain``'s ops of a steady protected step
        ``k``'s work that run while step ``k + offset + 1`` runs (``0 <= offset < every``),
        each right before item ``op.before`` of that step; in the last one, what did not fit
        (``spill``) runs before its update. With ``every == 1``, :meth:`dispatch`'s ops.
        Raises ValueError on an offset out of range."""
        if not (isinstance(offset, int) and 0 <= offset < self.every):
            raise ValueError(f"pipeline protection plan expects 0 <= offset < every ({self.every}), but got {offset!r}")
        k = (self.steps - 1 - self.every) // self.every * self.every  # the last protected step simulated whole
        return tuple(o for o in self.ops.get(tuple(domain), ()) if o.step == k and o.cycle == k + offset)


def _share(t: float, base: float) -> float:
    x = t / base - 1.0
    return 0.0 if abs(x) < _EPS else x  # sums of float pieces end a hair past a gap: not a delay


# -- work -----------------------------------------------------------------------------------------
def work_units(stage_bytes, *, bandwidth, unit_s: float, peer_link: str = "dcn",
               host_bytes=None, log_bytes=0.0) -> dict:
    """Per-stage protection work in cost units from bytes and bandwidths.

    ``stage_bytes``: bytes of one domain's stage state (an int/float for every stage, or a
    sequence per stage) sent to a peer; ``host_bytes``: bytes each device copies to host,
    in parallel with the domain's other devices (default ``stage_bytes``: one device per
    domain); ``bandwidth``: a ``resilax.Topology`` or its ``bandwidth`` table, GB/s per
    link (``host`` for the snapshot, ``peer_link`` for the
    peer copy; ``log`` bytes go over ``peer_link`` too); ``unit_s``: seconds of one cost
    unit (a measured or assumed F op). Returns ``{"snapshot": u, "peer": u[, "log": u]}``
    for scalar bytes, ``{stage: {...}}`` for per-stage bytes (both as :func:`place` takes).
    Raises ValueError on a missing or non-positive bandwidth or ``unit_s``."""
    bandwidth = getattr(bandwidth, "bandwidth", bandwidth)  # a resilax.Topology or its bandwidth table
    if not unit_s > 0:
        raise ValueError(f"pipeline work_units expects unit_s > 0 (seconds per cost unit), but got {unit_s!r}")
    for link in ("host", peer_link):
        if not (bandwidth.get(link) or 0) > 0:
            raise ValueError(f"pipeline work_units expects bandwidth[{link!r}] > 0 GB/s, but got "
                             f"{bandwidth.get(link)!r} (bandwidth {dict(bandwidth)})")
    def one(b, h):
        w = {"snapshot": h / (bandwidth["host"] * 1e9) / unit_s, "peer": b / (bandwidth[peer_link] * 1e9) / unit_s}
        if log_bytes:
            w["log"] = log_bytes / (bandwidth[peer_link] * 1e9) / unit_s
        return w

    if not isinstance(stage_bytes, (list, tuple)):
        return one(stage_bytes, stage_bytes if host_bytes is None else host_bytes)
    hosts = host_bytes if isinstance(host_bytes, (list, tuple)) else [host_bytes] * len(stage_bytes)
    if len(hosts) != len(stage_bytes):
        raise ValueError(f"pipeline work_units expects host_bytes per stage like stage_bytes ({len(stage_bytes)}), "
                         f"but got {len(hosts)}")
    return {s: one(b, b if h is None else h) for s, (b, h) in enumerate(zip(stage_bytes, hosts))}


def _norm_work(work, stages) -> dict:
    """``work`` as ``{stage: {kind: units}}`` for every stage; a flat ``{kind: units}`` means
    every stage."""
    if not isinstance(work, Mapping):
        raise ValueError(f"pipeline protection expects work as {{kind: units}} or {{stage: {{kind: units}}}}, "
                         f"but got {work!r}")
    flat = all(isinstance(k, str) for k in work)
    per = {s: work for s in range(stages)} if flat else dict(work)
    out = {}
    for s in range(stages):
        w = per.get(s, {})
        if not isinstance(w, Mapping):
            raise ValueError(f"pipeline protection expects stage {s}'s work as {{kind: units}}, but got {w!r}")
        bad = {k: v for k, v in w.items() if k not in KINDS or not (isinstance(v, (int, float)) and v >= 0)}
        if bad:
            raise ValueError(f"pipeline protection expects work kinds from {KINDS} with units >= 0, but stage {s} "
                             f"has {bad}")
        out[s] = types.MappingProxyType({k: float(v) for k, v in w.items() if v > 0})
    extra = set(per) - set(range(stages))
    if extra:
        raise ValueError(f"pipeline protection expects work for stages 0..{stages - 1}, but got stages {sorted(extra)}")
    return out


# -- replay ---------------------------------------------------------------------------------------
def replay(table: ps.Table, costs=None, comm: float = 0.0, *, steps: int = 4, optimizer: str | None = "auto",
           inserts: Mapping | None = None, end_work: Mapping | None = None) -> dict:
    """Replays ``table`` like :func:`~.schedule.simulate` (same dependencies, costs, update
    placement), with protection ops on the domains.

    ``inserts[(r, s)]``: ``[(step, before, units), ...]``: run ``units`` on the domain right
    before item ``before`` of step ``step + 1`` (``before == len(order[d])``: its update),
    as soon as the domain is free. ``end_work[(r, s)]``: units each domain runs after the
    step's last update (all domains; the next step's ops there wait for it), after every
    step but the last. Returns ``{"items": {d: [(step, index, start, end), ...]},
    "protection": {d: [(start, end), ...]}, "u_end": [max update end per step]}``; index
    ``len(order[d])`` is the update. Cost O(steps x ops)."""
    optimizer = ps._optimizer(optimizer, table, "pipeline protection replay")
    cost = dict(ps._norm_costs(costs))
    comm = ps._norm_comm(comm)
    doms = list(table.order)
    S = table.stages
    plan = table._replay_plan
    kinds = [cost[k] for k in ("F", "B", "W", "BW")]
    idx_in_dom = []
    seen = [0] * len(doms)
    for di, _, _ in plan:
        idx_in_dom.append(seen[di])
        seen[di] += 1
    ins = {}
    for d, rows in (inserts or {}).items():
        for step, before, units in rows:
            ins.setdefault((doms.index(tuple(d)), step + 1, before), []).append(units)
    free = [0.0] * len(doms)
    finish = [0.0] * len(plan)
    items = {d: [] for d in doms}
    prot = {d: [] for d in doms}
    u_end = []

    def run_inserts(di, step, before):
        for u in ins.get((di, step, before), ()):
            prot[doms[di]].append((free[di], free[di] + u))
            free[di] += u

    for step in range(steps):
        for i, (di, ki, deps) in enumerate(plan):
            run_inserts(di, step, idx_in_dom[i])
            t = free[di]
            for j, cross in deps:
                x = finish[j] + (comm if cross else 0.0)
                if x > t:
                    t = x
            f = finish[i] = t + kinds[ki]
            free[di] = f
            items[doms[di]].append((step, idx_in_dom[i], t, f))
        for di in range(len(doms)):
            run_inserts(di, step, seen[di])
        ends = ps._update_ends(free, finish, plan, doms, S, cost["U"], optimizer)
        if optimizer is not None:
            for di, d in enumerate(doms):
                items[d].append((step, seen[di], ends[di] - cost["U"], ends[di]))
        free = ends
        u_end.append(max(ends, default=0.0))
        if end_work and step < steps - 1:  # at the step's end: a barrier, then every domain at once
            barrier = u_end[-1]
            for di, d in enumerate(doms):
                w = end_work.get(d, 0.0)
                if w > 0:
                    prot[d].append((barrier, barrier + w))
                free[di] = max(free[di], barrier + w) if w > 0 else free[di]
    return {"items": items, "protection": prot, "u_end": u_end}


def _period(u_end) -> float:
    return (u_end[-1] - u_end[0]) / (len(u_end) - 1)


# -- placement ------------------------------------------------------------------------------------
def _pieces(work: Mapping[str, float], chunk: float):
    """The work of one step as pieces: (kind, piece index, units), kinds in order."""
    out = []
    for kind in KINDS:
        u = work.get(kind, 0.0)
        n = max(1, math.ceil(u / chunk - _EPS)) if u > 0 else 0
        for i in range(n):
            out.append((kind, i, min(chunk, u - i * chunk)))
    return out


def _gaps(items, step, n_ops):
    """Idle gaps of cycle ``step`` on one domain: (before, start, length) for each item of
    step ``step + 1`` (its ops, then its update ``before == n_ops``), after U_step ends."""
    by = {(st, i): (a, b) for st, i, a, b in items}
    t = by[(step, n_ops)][1]
    out = []
    for i in range(n_ops + 1):
        a, b = by[(step + 1, i)]
        out.append((i, t, a - t))
        t = b
    return out


def place(table: ps.Table, work, *, costs=None, comm: float = 0.0, chunk: float = 0.25, every: int = 1,
          steps: int | None = None, optimizer: str | None = "auto") -> ProtectionPlan:
    """Places ``work`` (``{kind: units}`` for every stage, or ``{stage: {kind: units}}``;
    kinds ``snapshot``, ``peer``, ``log``) into the idle time of ``table``'s domains and
    costs it against end-of-step placement, both replayed.

    A protected step's work becomes available when the domain's update ends and is placed
    greedily into the gaps of the following cycles in time order, whole pieces of at most
    ``chunk`` units (each kind split into ``ceil(units / chunk)`` pieces); a piece never
    shortens a gap below zero, so it delays nothing. With ``every`` N a step is protected
    every N steps and its work may take the N cycles up to the next one; what is left then
    spills before the domain's update (on the critical path). ``steps`` (default ``2N + 1``,
    at least 4) back-to-back steps are replayed; ``costs``, ``comm`` and ``optimizer`` as
    :func:`~.schedule.simulate` (``"auto"``: zb-h1 staggered, the others global). Raises
    ValueError on bad work, ``chunk`` <= 0 or ``every`` < 1. Cost O(steps x ops)."""
    if not (isinstance(chunk, (int, float)) and chunk > 0):
        raise ValueError(f"pipeline protection expects chunk > 0 (cost units), but got {chunk!r}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"pipeline protection expects every to be an int >= 1, but got {every!r}")
    if optimizer is None:  # a step's protection copies the state its update wrote
        raise ValueError("pipeline protection expects optimizer 'auto', 'staggered' or 'global' (protection "
                         "follows each domain's update), but got None")
    steps = steps or max(4, 2 * every + 1)
    if steps < 3:
        raise ValueError(f"pipeline protection expects steps >= 3 (a steady cycle), but got {steps!r}")
    w = _norm_work(work, table.stages)
    cost = dict(ps._norm_costs(costs))
    base = replay(table, costs, comm, steps=steps, optimizer=optimizer)
    cycles = steps - 1  # cycle k lies between U_k and U_{k+1}
    inserts, ops, spill, capacity, deferred, windows = {}, {}, {}, {}, {}, {}
    for d, seq in table.order.items():
        n_ops = len(seq)
        pieces = _pieces(w[d[1]], chunk)
        gaps = [_gaps(base["items"][d], k, n_ops) for k in range(cycles)]
        windows[d] = tuple(gaps[-1])
        capacity[d] = _capacity(gaps[-1], chunk)
        need = _steps_needed(pieces, gaps[-1]) if pieces else 1
        if need != 1:  # greedy whole pieces: a total under the capacity may still not fit
            deferred[d] = need
        rows, placed, todo, spilled = [], [], collections.deque(), 0.0
        for k in range(cycles):
            if k % every == 0:
                todo = collections.deque((k, p) for p in pieces)
            for before, t, length in gaps[k]:
                left = length
                while todo and todo[0][1][2] <= left + _EPS:
                    st, (kind, i, u) = todo.popleft()
                    rows.append((k, before, u))
                    placed.append([kind, d[1], i, 1, u, st, k, before, t, t + u, False])
                    t += u
                    left -= u
            if (k + 1) % every == 0 and todo:  # the next protected step comes: what is left runs now
                for st, (kind, i, u) in todo:
                    rows.append((k, n_ops, u))
                    placed.append([kind, d[1], i, 1, u, st, k, n_ops, math.nan, math.nan, True])
                    spilled += u
                todo = collections.deque()
        spill[d] = spilled / max(1, len(range(0, cycles, every)))
        inserts[d] = rows
        ops[d] = placed
    prot = replay(table, costs, comm, steps=steps, optimizer=optimizer, inserts=inserts)
    for d, placed in ops.items():  # times from the replay, not the plan: what an executor would see
        for row, (a, b) in zip(placed, prot["protection"][d]):
            row[8], row[9] = a, b
        ops[d] = tuple(_merge(placed))
    end = replay(table, costs, comm, steps=steps, optimizer=optimizer,
                 end_work={d: sum(w[d[1]].values()) for d in table.order})
    return ProtectionPlan(
        table=table, work=types.MappingProxyType(w), chunk=float(chunk), every=every, steps=steps,
        costs=types.MappingProxyType(cost), ops=types.MappingProxyType(ops), windows=types.MappingProxyType(windows),
        capacity=types.MappingProxyType(capacity), spill=types.MappingProxyType(spill),
        deferred=types.MappingProxyType(deferred), base_ticks=_period(base["u_end"]),
        end_ticks=_period(end["u_end"]), bubble_ticks=_period(prot["u_end"]),
        healthy_ticks=ps.simulate(table, costs, comm, optimizer=optimizer).step_time,
        optimizer=optimizer, comm=float(comm))


def _merge(rows):
    """Consecutive pieces of one kind, step and slot, back to back, as one op."""
    out = []
    for kind, stage, i, n, u, step, cycle, before, a, b, sp in rows:
        if out:
            p = out[-1]
            same = (p.kind, p.step, p.cycle, p.before, p.spill) == (kind, step, cycle, before, sp)
            if same and p.chunk + p.chunks == i and abs(p.end - a) <= _EPS:
                out[-1] = dataclasses.replace(p, chunks=p.chunks + n, units=p.units + u, end=b)
                continue
        out.append(ProtectionOp(kind, stage, i, n, u, step, cycle, before, a, b, sp))
    return out


def _fit_cycle(todo, gaps) -> list:
    """Greedy: the pieces of ``todo`` (a deque, consumed from the front) that fit ``gaps``."""
    got = []
    for _, _, length in gaps:
        left = length
        while todo and todo[0][2] <= left + _EPS:
            p = todo.popleft()
            got.append(p)
            left -= p[2]
    return got


def _left_per_cycle(pieces, gaps, limit: int) -> list[float]:
    """Units still unplaced after 1, 2, ... steady cycles (stops at 0 or ``limit`` cycles)."""
    todo, total, out = collections.deque(pieces), sum(p[2] for p in pieces), []
    while len(out) < limit:
        got = _fit_cycle(todo, gaps)
        total -= sum(p[2] for p in got)
        out.append(max(0.0, total))
        if not todo or not got:
            break
    return out


def _capacity(gaps, chunk) -> float:
    """Units of whole ``chunk`` pieces one cycle's gaps hold."""
    return sum(math.floor(length / chunk + _EPS) * chunk for _, _, length in gaps)


def _steps_needed(pieces, gaps, limit: int = 100_000) -> int | None:
    left = _left_per_cycle(pieces, gaps, limit)
    return len(left) if left and left[-1] <= _EPS else None


# -- checks and cadence ---------------------------------------------------------------------------
def validate_plan(plan: ProtectionPlan) -> None:
    """Replays ``plan``'s in-bubble ops (not its spills) and raises ValueError naming the
    first problem: an F/B/W/BW/U op on any domain that starts or ends at another time than
    without protection (a protection op delayed it); a protection op overlapping an op of its
    domain, starting before the update of the step it protects, or replayed at another time
    than the plan says."""
    table = plan.table
    base = replay(table, plan.costs, plan.comm, steps=plan.steps, optimizer=plan.optimizer)
    inserts = {d: [(o.cycle, o.before, o.units) for o in ops if not o.spill] for d, ops in plan.ops.items()}
    got = replay(table, plan.costs, plan.comm, steps=plan.steps, optimizer=plan.optimizer, inserts=inserts)
    for d in table.order:
        for x, y in zip(base["items"][d], got["items"][d]):
            if abs(x[2] - y[2]) > _EPS or abs(x[3] - y[3]) > _EPS:
                raise ValueError(f"pipeline protection delays domain {d}'s item {x[1]} of step {x[0]}: starts at "
                                 f"{y[2]}, expected {x[2]} as without protection")
        n_ops = len(table.order[d])
        u_end = {st: b for st, i, _, b in base["items"][d] if i == n_ops}
        busy = sorted((a, b) for _, _, a, b in base["items"][d])
        placed = [o for o in plan.ops.get(d, ()) if not o.spill]
        runs = got["protection"][d]
        planned = sum(o.units for o in placed)
        if abs(sum(b - a for a, b in runs) - planned) > 1e-6:
            raise ValueError(f"pipeline protection plans {planned} units on {d}, but the replay ran "
                             f"{sum(b - a for a, b in runs)}")
        if len(runs) != len(placed):
            raise ValueError(f"pipeline protection plans {len(placed)} ops on {d}, but the replay ran {len(runs)}")
        for (a, b_), st in zip(runs, [o.step for o in placed]):
            if a < u_end[st] - _EPS:
                raise ValueError(f"pipeline protection runs a piece of step {st} on {d} at {a}, before that step's "
                                 f"update ends ({u_end[st]})")
            for x, y in busy:
                if a < y - _EPS and x < b_ - _EPS:
                    raise ValueError(f"pipeline protection runs a piece on {d} at ({a}, {b_}) while an op runs "
                                     f"there ({x}, {y})")
        if not any(plan.spill.values()):
            for o, (a, b_) in zip(placed, runs):  # with no spill the plan's times are the replay's
                if abs(a - o.start) > _EPS or abs(b_ - o.end) > _EPS:
                    raise ValueError(f"pipeline protection plans {o} on {d}, but the replay ran it at ({a}, {b_})")


def cadence(plan: ProtectionPlan, budget: float = 0.01, *, bubbles: bool = True, max_every: int = 10_000
            ) -> Cadence:
    """The smallest N (protect every N steps) at which protection adds at most ``budget`` of
    the step, what ``PeersConfig(every="auto")`` and a checkpoint cadence read.

    ``bubbles=True``: a protected step's work may fill the idle time of the N cycles up to
    the next protected step for free; what is left (on the domain where most is left) is
    charged on the critical path, spread over N steps. ``bubbles=False``: the step's end
    placement's measured overhead, spread over N steps. An estimate: ``place(table, work,
    every=N)`` replays it. Raises ValueError on ``budget`` < 0."""
    if not (isinstance(budget, (int, float)) and budget >= 0):
        raise ValueError(f"pipeline protection cadence expects budget >= 0, but got {budget!r}")
    if not bubbles:
        n = max(1, math.ceil(plan.end_overhead / budget - _EPS)) if budget > 0 else None
        if plan.end_overhead <= _EPS:
            n = 1
        if n is None or n > max_every:
            return Cadence(None, plan.end_overhead / max_every, float(budget), False)
        return Cadence(n, plan.end_overhead / n, float(budget), False)
    T = plan.base_ticks
    lefts = {d: _left_per_cycle(_pieces(plan.work[d[1]], plan.chunk), plan.windows[d], max_every)
             for d in plan.table.order}
    for n in range(1, max_every + 1):
        worst = 0.0
        for d, left in lefts.items():
            if not plan.work_of(d):
                continue
            x = left[n - 1] if n <= len(left) else left[-1]
            worst = max(worst, x)
        if worst / (n * T) <= budget + _EPS:
            return Cadence(n, worst / (n * T), float(budget), True)
    return Cadence(None, worst / (max_every * T), float(budget), True)
