"""`resilax simulate --pipeline`: goodput of a data x pipeline job under failures.

A job is D replicas x S stages; a failure domain is one stage of one replica, ``N`` chips
(tensor/FSDP-parallel inside it, e.g. N/8 hosts of 8 GPUs): a failure of any of its chips
takes the domain out until it is repaired (hardware, SDC: ``repair_s``), restarted
(software: ``host_restart_s``) or back from maintenance (planned: ``maintenance_s``, drained
ahead). Failures are drawn per chip-hour from the goodput simulator's profiles
(:mod:`resilax.tools.simulate`) for D*S*N chips, each on a uniformly drawn domain, and the
same trace is replayed against four strategies:

- ``reroute`` (ReCycle): the lost domain's micro-batches run on the same stage of the other
  replicas; throughput relative to healthy comes from the schedule tables
  (:mod:`resilax._src.pipeline.schedule`) for the set of domains out. Pause per failure:
  detection + plan (switch tables: the per-stage executables are the same, nothing compiles,
  no state is restored: PIPELINE.md §6.3) + the in-flight step redone (uniform in [0, 1)
  steps). Rejoin: plan + the stage's state copied to the new domain over one NIC.
- ``drop``: every replica holding a lost domain sits out; its micro-batches go to the others
  (same global batch). Same pauses as reroute; throughput from the tables.
- ``repartition`` (Oobleck-style, PIPELINE.md §5): the replica with a lost domain is
  re-partitioned over its S-1 live domains (each op S/(S-1) longer) and micro-batches are
  rebalanced over the pipelines ("batch distribution"). Pause per failure and again per
  rejoin (assumed): detection + plan + ``recovery_compile_s`` (Oobleck builds its pipeline
  templates ahead; here their executables are assumed compiled ahead too) + the lost stage's
  state moved over one NIC + the in-flight step redone.
- ``checkpoint-restart``: the goodput simulator's ``checkpoint-only`` model, unchanged.

reroute, drop and repartition keep hourly persistent checkpoints (blocking share charged as
in the ``resilax`` strategy) and fall back to a restart from them when their path cannot
continue (every replica lost the same stage; every replica lost a domain). Not modelled: the
per-domain executor's dispatch overhead (unmeasured, needs accelerators), communication time
in the tables (unit F = B = W = U = 1, BW = 2), memory limits of rerouted activations or
re-partitioned layers.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import sys
from typing import Sequence

import numpy as np

from resilax._src.io import write_json
from resilax._src.pipeline import schedule as ps
from resilax.tools.costmodel import CostModel
from resilax.tools.simulate import (DAY, HOUR, _Ledger, _summary, draw_failures, get_profile, restart_phases,
                                    simulate_strategy)

__all__ = ["PipelineJob", "JOBS", "PIPELINE_STRATEGIES", "Rates", "simulate_pipeline", "format_pipeline_table"]

PIPELINE_STRATEGIES = ("reroute", "drop", "repartition", "checkpoint-restart")


@dataclasses.dataclass(frozen=True)
class PipelineJob:
    """D replicas x S stages, ``chips_per_domain`` chips per (replica, stage) domain, M
    micro-batches per replica per step (default max(8, S): 2S at S=4 as PIPELINE.md §3.3; at
    S=16, 2S would make each reroute table 4x larger to plan)."""
    replicas: int
    stages: int
    chips_per_domain: int
    microbatches: int | None = None
    schedule: str = "zb-h1"

    @property
    def chips(self) -> int:
        return self.replicas * self.stages * self.chips_per_domain

    @property
    def m(self) -> int:
        return self.microbatches or max(8, self.stages)

    @property
    def name(self) -> str:
        return f"{self.replicas}x{self.stages}"


# 1,024 / 8,192 / 16,384 / 32,768 / 98,304 chips
JOBS = (PipelineJob(16, 4, 16), PipelineJob(32, 8, 32), PipelineJob(32, 8, 64), PipelineJob(64, 8, 64),
        PipelineJob(64, 16, 96))


class Rates:
    """Throughput relative to healthy for a set of lost domains, per strategy (None: the
    strategy cannot continue). Cached per canonical failure pattern: replicas are relabelled
    in order, and only the replicas a reroute can touch are planned (``k (M + 1)`` of them for
    k replicas with losses: the others run the healthy schedule and set no maximum; exact
    when every peer absorbs at most one micro-batch per stage, checked against the full mesh
    in the tests)."""

    def __init__(self, job: PipelineJob):
        self.job = job
        self.healthy_step = self._single(job.stages, job.m, 1.0)

    @functools.lru_cache(maxsize=None)
    def _single(self, stages: int, m: int, scale: float) -> float:
        """Step time of one pipeline of ``stages`` stages and ``m`` micro-batches, each op
        ``scale`` times as long (one replica: no peers involved)."""
        costs = {k: v * scale for k, v in ps.DEFAULT_COSTS.items() if k != "U"}
        return ps.simulate(ps.healthy(self.job.schedule, 1, stages, m, costs=costs), costs).step_time

    def reroute(self, lost) -> float | None:
        """Exact for one lost domain or several in one stage; with losses in several stages,
        the least of the per-stage ratios (within 0.01 of the exact tables for every pair at
        16x4 M=8 and 32x8 M=16: the stages' peers do not compete)."""
        per_stage: dict = {}
        for _, s in set(lost):
            per_stage[s] = per_stage.get(s, 0) + 1
        if any(k >= self.job.replicas for k in per_stage.values()):
            return None
        return min((self._reroute(s, k) for s, k in sorted(per_stage.items())), default=1.0)

    @functools.lru_cache(maxsize=None)
    def _reroute(self, stage: int, k: int) -> float:
        j = self.job
        d_eff = min(j.replicas, k * (j.m + 1))
        t = ps.rerouted(j.schedule, d_eff, j.stages, j.m, frozenset((i, stage) for i in range(k)))
        return self.healthy_step / ps.simulate(t).step_time

    def drop(self, lost) -> float | None:
        j = self.job
        k = len({r for r, _ in lost})
        if k == 0:
            return 1.0
        if k >= j.replicas:
            return None
        return self.healthy_step / self._single(j.stages, j.m + math.ceil(k * j.m / (j.replicas - k)), 1.0)

    def repartition(self, lost) -> float | None:
        j = self.job
        left = [j.stages] * j.replicas
        for r, _ in set(lost):
            left[r] -= 1
        return self._repartition(tuple(sorted(left)))

    @functools.lru_cache(maxsize=None)
    def _repartition(self, left: tuple) -> float | None:
        j = self.job
        pipes = [s for s in left if s > 0]
        if not pipes:
            return None
        # batch distribution: each of the D*M micro-batches to the pipeline it slows least
        count = [0] * len(pipes)
        heap = [(self._single(s, 1, j.stages / s), i) for i, s in enumerate(pipes)]
        heapq.heapify(heap)
        for _ in range(j.replicas * j.m):
            _, i = heapq.heappop(heap)
            count[i] += 1
            heapq.heappush(heap, (self._single(pipes[i], count[i] + 1, j.stages / pipes[i]), i))
        step = max(self._single(s, c, j.stages / s) for s, c in zip(pipes, count) if c)
        return self.healthy_step / step


def _degraded(strategy: str, job: PipelineJob, rates: Rates, trace, horizon: float, cm: CostModel,
              rng: np.random.Generator) -> _Ledger:
    """One strategy that keeps running with fewer domains, event by event (failures, rejoins)."""
    led = _Ledger()
    S = job.stages
    ratio = getattr(rates, strategy)
    tau_p = max(cm.persistent_interval_s, cm.persist_s)
    save_frac = cm.checkpoint_blocking_s / (tau_p + cm.checkpoint_blocking_s)
    stage_copy_s = cm.state_bytes / S / cm.dcn_bytes_s  # one stage's state over one NIC
    down: dict = {}
    rejoins: list = []
    now = ready = since_restart = 0.0
    degraded_s = 0.0

    def run_to(t):
        nonlocal now, since_restart, degraded_s
        start = max(now, ready)
        if t > start:
            length = t - start
            led.s["checkpoint_save"] += length * save_frac
            work = length * (1 - save_frac)
            a = ratio(frozenset(down))
            led.s["productive"] += work * a
            led.s["idle"] += work * (1 - a)
            since_restart += length
            if down:
                degraded_s += length
        now = max(now, t)

    def pause(t, phases):
        nonlocal ready, now
        run_to(t)
        start = max(t, ready)
        total = sum(x for _, x in phases)
        led.consume(phases, min(total, max(0.0, horizon - start)))
        ready = start + total
        now = max(now, min(ready, horizon))

    def fallback(t):
        nonlocal since_restart
        led.fallbacks += 1
        run_to(t)
        lost = min(since_restart % (tau_p + cm.checkpoint_blocking_s), tau_p) * (1 - save_frac)
        led.move("productive", "lost", min(lost, led.s["productive"]))
        down.clear()
        rejoins.clear()
        pause(t, restart_phases(cm, cm.restore_persistent_s))
        since_restart = 0.0

    reconfig = strategy == "repartition"
    events = [(float(t), k, divmod(int(d), S)) for t, k, d in zip(trace.times, trace.kinds, trace.domains)]
    i = 0
    while True:
        nxt_fail = events[i][0] if i < len(events) else math.inf
        nxt_rejoin = rejoins[0][0] if rejoins else math.inf
        t = min(nxt_fail, nxt_rejoin)
        if t >= horizon:
            break
        if nxt_rejoin <= nxt_fail:
            _, d = heapq.heappop(rejoins)
            if down.get(d) == t:
                run_to(t)
                del down[d]
                phases = [("recovery", cm.recovery_plan_s + stage_copy_s)]
                if reconfig:  # back to the original partition: reconfigure again
                    phases.append(("compile", cm.recovery_compile_s))
                pause(t, phases)
            continue
        _, kind, d = events[i]
        i += 1
        if d in down:  # already out: the failure hits the next live domain
            n = job.replicas * S
            idx = d[0] * S + d[1]
            live = [divmod((idx + j) % n, S) for j in range(1, n) if divmod((idx + j) % n, S) not in down]
            if not live:
                fallback(t)
                continue
            d = live[0]
        if kind == "planned":
            led.planned += 1
        else:
            led.failures += 1
        if ratio(frozenset(down) | {d}) is None:
            fallback(t)
            continue
        run_to(t)
        phases = [] if kind == "planned" else [("detection", cm.detection_s)]
        phases.append(("recovery", cm.recovery_plan_s + (stage_copy_s if reconfig else 0.0)))
        if reconfig:
            phases.append(("compile", cm.recovery_compile_s))
        if kind != "planned":  # the in-flight step is redone
            phases.append(("lost", float(rng.uniform(0, 1)) * cm.step_s))
        back = {"planned": cm.maintenance_s, "software": cm.host_restart_s}.get(kind, cm.repair_s)
        down[d] = t + back
        heapq.heappush(rejoins, (t + back, d))
        pause(t, phases)
    run_to(horizon)
    led.s["_degraded"] = degraded_s  # read by the caller, not a bucket
    return led


def simulate_pipeline(jobs: Sequence[PipelineJob] = JOBS, *, model_params: float = 405e9, profile: str = "llama3",
                      mtbf_hours: float | None = None, days: float = 30.0, seed: int = 0,
                      cost: CostModel | None = None, strategies: Sequence[str] = PIPELINE_STRATEGIES,
                      progress: bool = False, protection: bool = True) -> dict:
    """Every job under one failure trace per job (seeded), every strategy; a JSON-able dict.
    Same arguments give identical output. Cost: the tables for each failure pattern met
    (cached), then O(failures) per strategy. ``protection``: each job gains ``protection``
    (snapshot + peer copy every step vs every N, at the step's end vs in the bubbles, and
    the reroute strategy's goodput with each: simulate_pipeline_protection)."""
    for s in strategies:
        if s not in PIPELINE_STRATEGIES:
            raise ValueError(f"simulate --pipeline expects strategies from {PIPELINE_STRATEGIES}, but got {s!r}")
    out = []
    it = list(jobs)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="simulate --pipeline", unit="job", file=sys.stderr)
    for job in it:
        cm = (cost or CostModel()).scaled(model_params, job.chips)
        cm = cm.replace("given: the pipeline job's domain", devices_per_domain=job.chips_per_domain,
                        chips_per_replica=job.chips_per_domain * job.stages)
        prof = get_profile(profile, cm.chips, mtbf_hours)
        horizon = float(days) * DAY
        domains = job.replicas * job.stages
        trace = draw_failures(prof, cm.chips, domains, horizon, np.random.default_rng(seed))
        rates = Rates(job)
        per_stage = [rates.reroute({(0, s)}) for s in range(job.stages)]
        single = {"reroute_by_stage": per_stage, "reroute": float(np.mean(per_stage)),
                  "drop": rates.drop({(0, 0)}), "repartition": rates.repartition({(0, 0)})}
        res = {}
        for k, name in enumerate(strategies):
            if name == "checkpoint-restart":
                res[name] = simulate_strategy("checkpoint-only", trace, horizon, cm, mtbf_s=prof.job_mtbf_s(cm.chips))
                continue
            led = _degraded(name, job, rates, trace, horizon, cm, np.random.default_rng([seed, k + 1]))
            degraded = led.s.pop("_degraded")
            res[name] = _summary(led, horizon, degraded_hours=degraded / HOUR)
        out.append({"replicas": job.replicas, "stages": job.stages, "chips_per_domain": job.chips_per_domain,
                    "chips": job.chips, "microbatches": job.m, "schedule": job.schedule,
                    "job_mtbf_hours": prof.job_mtbf_s(cm.chips) / HOUR,
                    "failures": {k: trace.count(k) for k in ("hardware", "software", "sdc", "planned")},
                    "single_loss_ratio": single, "strategies": res})
        if protection:
            from resilax.tools.simulate_pipeline_protection import job_protection

            out[-1]["protection"] = job_protection(job, cm, rates, _degraded, trace, horizon,
                                                   lambda k: np.random.default_rng([seed, 100 + k]))
    return {"config": {"model_params": model_params, "profile": profile, "days": float(days), "seed": int(seed),
                       "strategies": list(strategies),
                       "domain": "one stage of one replica: chips_per_domain chips; any chip failure takes it out"},
            "cost_model": (cost or CostModel()).describe(), "jobs": out}


def format_pipeline_table(result: dict) -> str:
    cfg = result["config"]
    strategies = cfg["strategies"]
    lines = [f"pipeline jobs: {cfg['model_params']:.3g} params, profile {cfg['profile']}, {cfg['days']:g} days, "
             f"seed {cfg['seed']}; domain = one stage of one replica",
             f"{'job':<8}{'N':>4}{'chips':>8}{'M':>4}{'MTBF h':>8}{'fail':>6}{'rr/drop/repart':>20}  "
             + "".join(f"{s:>19}" for s in strategies)]
    for j in result["jobs"]:
        one = j["single_loss_ratio"]
        ratios = f"{one['reroute']:.3f}/{one['drop']:.3f}/{one['repartition']:.3f}"
        lines.append(f"{j['replicas']}x{j['stages']:<5}{j['chips_per_domain']:>4}{j['chips']:>8,}{j['microbatches']:>4}"
                     f"{j['job_mtbf_hours']:>8.2f}{sum(j['failures'].values()):>6}{ratios:>20}  "
                     + "".join(f"{j['strategies'][s]['goodput']:>19.2%}" for s in strategies))
    lines.append("columns: rr/drop/repart = throughput vs healthy with one domain out (reroute: mean over stages); "
                 "then goodput per strategy")
    return "\n".join(lines)


def parse_jobs(text: str, microbatches: int | None, schedule: str) -> list[PipelineJob]:
    jobs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            d, s, n = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"simulate --pipeline expects --jobs items DxSxN like 16x4x16, but got {part!r}")
        jobs.append(PipelineJob(d, s, n, microbatches, schedule))
    return jobs


def _jobs(args) -> list[PipelineJob]:
    if args.jobs:
        jobs = parse_jobs(args.jobs, args.microbatches, args.schedule)
    else:
        jobs = [dataclasses.replace(j, microbatches=args.microbatches, schedule=args.schedule) for j in JOBS]
    for j in jobs:
        ps.healthy(j.schedule, j.replicas, j.stages, j.m)  # a bad shape raises ValueError naming it
        if j.chips_per_domain < 1:
            raise ValueError(f"--jobs expects chips per domain >= 1, but got {j.chips_per_domain}")
    return jobs


def cli_main(args, cost: CostModel | None = None) -> int:
    """``resilax simulate --pipeline`` (options registered by simulate.register_cli); ``cost``:
    the measured costs of ``--cost-json``, read by simulate's CLI (None: the defaults)."""
    try:
        jobs = _jobs(args)
    except ValueError as e:
        print(f"resilax simulate --pipeline: {e}", file=sys.stderr)
        return 2
    wrong = [s for s in (args.strategy or []) if s not in PIPELINE_STRATEGIES + ("all",)]
    if wrong:
        print(f"resilax simulate --pipeline: --strategy expects {PIPELINE_STRATEGIES} or all, but got {wrong}",
              file=sys.stderr)
        return 2
    strategies = [s for s in (args.strategy or []) if s != "all"] or list(PIPELINE_STRATEGIES)
    if "all" in (args.strategy or []):
        strategies = list(PIPELINE_STRATEGIES)
    result = simulate_pipeline(jobs, model_params=args.model_params, profile=args.failures,
                               mtbf_hours=args.mtbf_hours, days=args.days, seed=args.seed,
                               cost=cost,
                               strategies=strategies, progress=not getattr(args, "quiet", False))
    print(format_pipeline_table(result))
    from resilax.tools.simulate_pipeline_protection import format_protection_table

    print(format_protection_table(result))
    if args.json:
        write_json(args.json, result, indent=1, sort_keys=True)
        print(f"wrote {args.json}")
    return 0

