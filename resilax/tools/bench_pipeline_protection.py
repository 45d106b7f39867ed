"""`resilax bench pipeline --protection`: per-stage protection at the step's end vs in the bubbles.

For each config and schedule it places every stage's protection work of a step (a
device-to-host snapshot and a peer copy, every step) with
:func:`resilax._src.pipeline.protection.place` and replays the healthy table with it, at the
step's end (every stage at once after the step's last update) and in each stage's idle time
after its own update. Pure Python: no JAX.

The work is not measured here (`PipelineExecutor` dispatches these ops on CPU devices, whose
times mean nothing for a real job); it is derived from the cost model's defaults
(:class:`resilax.tools.costmodel.CostModel`, each figure with its source): one domain = one stage of one replica of the Llama 3 405B layout
(16,384 GPUs, 8 per domain), a snapshot copies each GPU's share of the state to its host
(``bytes_per_device / host_bytes_s``, the GPUs of a domain in parallel), a peer copy sends
the domain's share over one NIC (``bytes_per_domain / dcn_bytes_s``), and a cost unit is
the model's step time over the config's healthy ticks. So the work per step is a fixed share
of the step (about 1%) in every config. ``max_fit_units`` says how much work per stage the
bubbles hold per step, whatever the bytes.
"""

from __future__ import annotations

from typing import Sequence

from resilax._src.pipeline import protection as pp
from resilax._src.pipeline import schedule as ps

# (replicas, stages, microbatches): the shapes the issue names first, then the bench's others
PROTECTION_CONFIGS = ((2, 4, 8), (4, 2, 16))
CHUNK = 0.25  # assumed: a copy splits into pieces of a quarter op (a few tens of ms at this scale)
BUDGET = 0.01


def assumed_work(healthy_ticks: float, cost=None) -> dict:
    """``{"work": {"snapshot": u, "peer": u}, "unit_s": s, "sources": {...}}``: one stage's
    protection work per step in cost units of a step of ``healthy_ticks`` units, from the
    cost model (defaults unless ``cost`` is given)."""
    from resilax.tools.costmodel import CostModel

    cm = cost or CostModel()
    unit_s = cm.step_s / healthy_ticks
    snapshot_s = cm.bytes_per_device / cm.host_bytes_s
    peer_s = cm.bytes_per_domain / cm.dcn_bytes_s
    return {"work": {"snapshot": snapshot_s / unit_s, "peer": peer_s / unit_s}, "unit_s": unit_s,
            "snapshot_s": snapshot_s, "peer_s": peer_s,
            "sources": {"unit_s": f"CostModel.step_s {cm.step_s} s ({cm.sources['step_s']}) / healthy ticks",
                        "snapshot_s": f"CostModel.bytes_per_device {cm.bytes_per_device:.4g} B / host_bytes_s "
                                      f"{cm.host_bytes_s:.4g} B/s ({cm.sources['host_bytes_s']})",
                        "peer_s": f"CostModel.bytes_per_domain {cm.bytes_per_domain:.4g} B / dcn_bytes_s "
                                  f"{cm.dcn_bytes_s:.4g} B/s ({cm.sources['dcn_bytes_s']})"}}


def protection_row(D: int, S: int, M: int, schedule: str, *, chunk: float = CHUNK, budget: float = BUDGET,
                   work=None) -> dict:
    """One config x schedule: the plan's overheads, capacities and cadences (JSON-able)."""
    table = ps.healthy(schedule, D, S, M)
    healthy_ticks = ps.simulate(table).step_time
    assumed = assumed_work(healthy_ticks)
    plan = pp.place(table, work or assumed["work"], chunk=chunk)
    pp.validate_plan(plan)
    bub, end = pp.cadence(plan, budget), pp.cadence(plan, budget, bubbles=False)
    deferred = [v for v in plan.deferred.values()]
    return {
        "replicas": D, "stages": S, "microbatches": M, "schedule": schedule,
        "healthy_ticks": healthy_ticks, "base_ticks": plan.base_ticks,
        "end_ticks": plan.end_ticks, "bubble_ticks": plan.bubble_ticks,
        "end_overhead": plan.end_overhead, "bubble_overhead": plan.bubble_overhead,
        "work_units": dict(work or assumed["work"]), "unit_s": assumed["unit_s"],
        "work_share_of_step": sum((work or assumed["work"]).values()) / plan.base_ticks,
        # the largest work per stage the idle time holds every step (whole pieces of chunk)
        "max_fit_units": min(plan.capacity.values()),
        "max_fit_share_of_step": min(plan.capacity.values()) / plan.base_ticks,
        "spill_units": max(plan.spill.values()),
        "deferred_steps": (None if any(v is None for v in deferred) else max(deferred)) if deferred else 1,
        "cadence_bubbles": bub.every, "cadence_end": end.every,
    }


def bench_protection(configs: Sequence[tuple[int, int, int]], *, chunk: float = CHUNK, budget: float = BUDGET,
                     check=None, check_max_domains: int = 8, check_schedules: Sequence[str] = ("zb-h1",)) -> dict:
    """Rows for every config (the issue's first, then the others, without repeats) x schedule.
    ``check(D, S, M, schedule, work) -> dict`` (optional, `bench_pipeline_measure.protection_check`):
    runs the executor with the row's work on configs of at most ``check_max_domains`` domains
    and the schedules ``check_schedules``; its keys join the row."""
    seen, rows = set(), []
    for cfg in tuple(PROTECTION_CONFIGS) + tuple(configs):
        if cfg in seen:
            continue
        seen.add(cfg)
        for schedule in ps.SCHEDULES:
            row = protection_row(*cfg, schedule, chunk=chunk, budget=budget)
            if check is not None and cfg[0] * cfg[1] <= check_max_domains and schedule in check_schedules:
                row.update(check(*cfg, schedule, row["work_units"]))
            rows.append(row)
    sample = assumed_work(rows[0]["healthy_ticks"])
    return {"rows": rows, "chunk_units": chunk, "budget": budget, "every_steps": {"peer": 1, "snapshot": 1},
            "work_sources": sample["sources"], "snapshot_s": sample["snapshot_s"], "peer_s": sample["peer_s"],
            "note": "overheads are protection's added share of the healthy step (steady per-step ticks of the "
                    "replay); a protection op occupies its domain like any op; executed_as_planned (rows the "
                    "executor ran, 8 CPU devices): PipelineExecutor(checkpoint_every=1, peer_every=1) with the row's "
                    "work dispatched every piece where the plan put it"}


def print_protection(p: dict) -> None:
    print(f"\nprotection every step (snapshot {p['snapshot_s'] * 1e3:.1f} ms + peer copy {p['peer_s'] * 1e3:.1f} ms "
          f"per stage, cost model defaults; chunk {p['chunk_units']} units): added share of the healthy step")
    print(f"{'D x S':>7} {'M':>3} {'schedule':>8} {'ticks':>6} {'work':>6} {'at end':>7} {'bubbles':>8} "
          f"{'fits':>6} {'fits %':>7} {'every (end/bub)':>15}")
    for x in p["rows"]:
        work = sum(x["work_units"].values())
        every = f"{x['cadence_end'] or '-'}/{x['cadence_bubbles'] or '-'}"
        print(f"{x['replicas']:>3} x {x['stages']:<2} {x['microbatches']:>3} {x['schedule']:>8} "
              f"{x['base_ticks']:>6.1f} {work:>6.3f} {x['end_overhead']:>7.2%} {x['bubble_overhead']:>8.2%} "
              f"{x['max_fit_units']:>6.2f} {x['max_fit_share_of_step']:>7.2%} {every:>15}")
    print("columns: work = units per stage per step; fits = units per stage the bubbles hold every step; "
          f"every = cheapest cadence at <= {p['budget']:.0%} of the step (end placement / bubbles)")
    for x in p["rows"]:
        if "executed_as_planned" in x:
            print(f"executor {x['replicas']}x{x['stages']} M={x['microbatches']} {x['schedule']}, checkpoint + "
                  f"peer copy every step: {x['pieces_per_step']} pieces per step, "
                  f"{'all where the plan put them' if x['executed_as_planned'] else 'NOT as planned'}, "
                  f"{'bitwise' if x['bitwise_with_protection'] else 'NOT bitwise'} vs no protection")


def gantt(ax, D: int = 2, S: int = 4, M: int = 8, schedule: str = "zb-h1", work=None) -> None:
    """Two replayed steps of ``D x S`` with the protection ops (black) in the bubbles."""
    table = ps.healthy(schedule, D, S, M)
    w = work or assumed_work(ps.simulate(table).step_time)["work"]
    plan = pp.place(table, w)
    ins = {d: [(o.cycle, o.before, o.units) for o in ops] for d, ops in plan.ops.items()}
    rep = pp.replay(table, steps=plan.steps, inserts=ins)
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "BW": "tab:red", "U": "tab:purple"}
    doms = sorted(table.order, key=lambda d: (d[1], d[0]))
    lo, hi = rep["u_end"][0], rep["u_end"][2]
    for y, d in enumerate(doms):
        kinds = [op.kind for op in table.order[d]] + ["U"]
        for st, i, a, b in rep["items"][d]:
            if b > lo and a < hi:
                ax.barh(y, b - a, left=a, color=colors[kinds[i]], edgecolor="white", linewidth=0.4)
        for a, b in rep["protection"][d]:
            if b > lo and a < hi:
                ax.barh(y, b - a, left=a, color="black", height=0.5)
    ax.set_xlim(lo, hi)
    ax.set_yticks(range(len(doms)), [f"r{r} s{s}" for r, s in doms], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ticks (purple: staggered update U; black: protection placed in the bubbles)")
    share = sum(w.values()) / plan.base_ticks
    ax.set_title(f"{D}x{S} M={M} {schedule}, two steady steps: protection {share:.1%} of the step per stage, "
                 f"added {plan.bubble_overhead:.2%} in the bubbles vs {plan.end_overhead:.2%} at the end", fontsize=9)
