"""`resilax simulate --pipeline`, protection: a snapshot and peer copy every step or every N,
at the step's end or in each stage's bubbles, and what that does to goodput.

Per job (D replicas x S stages, N chips per domain) the work of one stage per protected step
comes from the cost model scaled to the job: each chip holds ``state_bytes / (S * N)`` (every
data replica holds its stage's whole state: rerouting needs that), copies it to its host
(``host_bytes_s``) and each host sends its chips' share to a peer over its own NIC
(``dcn_bytes_s``; ``hosts_per_domain = N / devices_per_host``, the cost model's default 8
GPUs per host). A cost unit is the model's step time over the job's healthy ticks.
:func:`resilax._src.pipeline.protection.place` replays the job's healthy table with that work
(one replica's table: with no transfer cost a healthy table's replicas run alike) at the
step's end and in the bubbles, every step and at the cheapest cadence meeting 1%.

Goodput: the ``reroute`` strategy replayed on the job's failure trace with this in-memory
tier (host snapshots plus peer copies) every N steps as what a fallback restarts from (in
place of the hourly persistent checkpoint: the ``restore_in_memory_s`` restore, the work
since the last protected step lost), its added step time charged as the save share.
"""

from __future__ import annotations

from resilax._src.pipeline import protection as pp
from resilax._src.pipeline import schedule as ps

VARIANTS = (("end", 1), ("bubbles", 1), ("end", None), ("bubbles", None))  # None: the 1% cadence
BUDGET = 0.01
CHUNK = 0.25


def job_work(job, cm) -> dict:
    """One stage's protection work per step for ``job`` under the (job-scaled) cost model."""
    per_chip = cm.state_bytes / (job.stages * job.chips_per_domain)
    per_host = min(job.chips_per_domain, 8)  # the cost model's 8 GPUs per host (16,384 on 2,048 hosts)
    ticks = ps.simulate(ps.healthy(job.schedule, 1, job.stages, job.m)).step_time
    unit_s = cm.step_s / ticks
    snapshot_s = per_chip / cm.host_bytes_s
    peer_s = per_chip * per_host / cm.dcn_bytes_s
    return {"bytes_per_chip": per_chip, "snapshot_s": snapshot_s, "peer_s": peer_s, "unit_s": unit_s,
            "healthy_ticks": ticks, "work": {"snapshot": snapshot_s / unit_s, "peer": peer_s / unit_s}}


def job_protection(job, cm, rates, degraded, trace, horizon, rng_for) -> dict:
    """Overheads and goodput per variant (placement, cadence) for one job. ``rates`` and
    ``degraded`` are simulate_pipeline's ``Rates(job)`` and ``_degraded``; ``rng_for(k)`` a
    seeded generator per variant."""
    from resilax.tools.simulate import HOUR, _summary

    w = job_work(job, cm)
    table = ps.healthy(job.schedule, 1, job.stages, job.m)
    plan = pp.place(table, w["work"], chunk=CHUNK)
    cad = {"end": pp.cadence(plan, BUDGET, bubbles=False), "bubbles": pp.cadence(plan, BUDGET)}
    rows = []
    for k, (where, every) in enumerate(VARIANTS):
        n = every or cad[where].every or 10_000
        if where == "end":  # one step in N pays what the replay of every step measured
            over = plan.end_overhead / n
        else:
            over = (plan if n == 1 else pp.place(table, w["work"], chunk=CHUNK, every=n)).bubble_overhead
        step_s = cm.step_s
        c = cm.replace("derived: protection every N steps (simulate_pipeline_protection)",
                       persistent_interval_s=n * step_s, blocking_s_measured=over * n * step_s,
                       restore_s_measured=cm.restore_in_memory_s)
        led = degraded("reroute", job, rates, trace, horizon, c, rng_for(k))
        deg = led.s.pop("_degraded")
        s = _summary(led, horizon, degraded_hours=deg / HOUR)
        rows.append({"placement": where, "every": n, "overhead": over, "goodput": s["goodput"],
                     "lost_work_hours": s["lost_work_hours"], "fallbacks": s["fallbacks"]})
    return {"bytes_per_chip": w["bytes_per_chip"], "snapshot_s": w["snapshot_s"], "peer_s": w["peer_s"],
            "unit_s": w["unit_s"], "work_units": w["work"], "healthy_ticks": w["healthy_ticks"],
            "work_share_of_step": sum(w["work"].values()) / plan.base_ticks,
            "max_fit_share_of_step": min(plan.capacity.values()) / plan.base_ticks,
            "end_overhead": plan.end_overhead, "bubble_overhead": plan.bubble_overhead,
            "cadence_end": cad["end"].every, "cadence_bubbles": cad["bubbles"].every, "variants": rows}


def format_protection_table(result: dict) -> str:
    lines = ["protection (snapshot + peer copy per stage, reroute strategy restarting from it on a fallback): "
             "added share of the step and goodput",
             f"{'job':<8}{'chips':>8}{'GB/chip':>8}{'work %':>8}{'fits %':>8}{'end/1':>8}{'bub/1':>8}{'end N':>7}{'bub N':>7}"
             f"  {'goodput end/1':>13}{'bub/1':>8}{'end/N':>8}{'bub/N':>8}"]
    for j in result["jobs"]:
        p = j.get("protection")
        if not p:
            continue
        g = [v["goodput"] for v in p["variants"]]
        lines.append(f"{j['replicas']}x{j['stages']:<5}{j['chips']:>8,}{p['bytes_per_chip'] / 1e9:>8.1f}"
                     f"{p['work_share_of_step']:>8.1%}"
                     f"{p['max_fit_share_of_step']:>8.1%}{p['end_overhead']:>8.2%}{p['bubble_overhead']:>8.2%}"
                     f"{p['cadence_end'] or '-':>7}{p['cadence_bubbles'] or '-':>7}  "
                     f"{g[0]:>13.2%}{g[1]:>8.2%}{g[2]:>8.2%}{g[3]:>8.2%}")
    lines.append("columns: GB/chip = stage state per chip; work = one stage's protection per step / step time; fits = what its bubbles hold; "
                 "end/1, bub/1 = added step share every step at the end / in the bubbles; N = cheapest cadence at "
                 f"<= {BUDGET:.0%}; then goodput per variant")
    return "\n".join(lines)


__all__ = ["job_work", "job_protection", "format_protection_table", "VARIANTS"]
