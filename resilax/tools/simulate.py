"""Goodput simulator: a seeded discrete-event model of a long training run.

Failures are drawn once per seed from a named profile (or given as
``failure_times``) and the *same* trace is replayed against every strategy
(``checkpoint-only``, ``in-memory``, ``resilax``), so strategies differ by
their costs, not by luck. The model steps from event to event (failures,
maintenance, rejoins), never step by step: a 30-day run on 16,384 chips takes
milliseconds. Time is booked in the buckets of :mod:`resilax._src.runtime.goodput`. The
strategies and every assumption are described in docs/goodput.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import os
import sys
from typing import Any, Iterable, Sequence

import numpy as np

from resilax._src.io import write_json
from resilax.tools.costmodel import CostModel, read_topology_bandwidths
from resilax._src.runtime.goodput import BUCKETS

__all__ = [
    "PROFILES", "STRATEGIES", "Profile", "FailureTrace", "young_daly_interval",
    "daly_interval", "expected_goodput_checkpoint_only",
    "expected_goodput_exponential", "draw_failures", "simulate_strategy",
    "simulate", "sweep", "format_table", "register_cli",
]

HOUR = 3600.0
DAY = 86400.0
STRATEGIES = ("checkpoint-only", "in-memory", "resilax")
_KINDS = ("hardware", "software", "sdc", "planned")
_LLAMA3_CHIP_HOURS = 54 * 24 * 16384


@dataclasses.dataclass(frozen=True)
class Profile:
    """Failure rates per chip-hour. ``split``: share of unplanned failures by kind."""
    name: str
    unplanned_per_chip_h: float
    split: tuple[tuple[str, float], ...]
    planned_per_chip_h: float = 0.0
    source: str = ""

    def job_mtbf_s(self, chips: int) -> float:
        """Mean time between unplanned failures of the whole job."""
        return HOUR / (self.unplanned_per_chip_h * chips)


# Llama 3: 419 unexpected interruptions + 47 planned in 54 days on 16,384 H100;
# ~78% hardware (incl. 6 silent data corruptions), the rest software.
_LLAMA3_SPLIT = (("hardware", 0.78 - 6 / 419), ("software", 0.22), ("sdc", 6 / 419))
PROFILES: dict[str, Profile] = {
    "llama3": Profile(
        "llama3", 419 / _LLAMA3_CHIP_HOURS, _LLAMA3_SPLIT, 47 / _LLAMA3_CHIP_HOURS,
        "PRIOR_ART.md: Llama 3 405B, 16,384 H100, 54 days, 419 unexpected "
        "(~78% hardware, 6 SDC) + 47 planned; ~2.0e-5 failures per GPU-hour"),
    "meta-cluster": Profile(
        "meta-cluster", 1 / (8 * 1024), _LLAMA3_SPLIT, 0.0,
        "PRIOR_ART.md: Meta research clusters (HPCA'25), MTBF ~8 h at 1,024 GPUs; "
        "kind split assumed as Llama 3's; no planned events"),
}


def custom_profile(mtbf_hours: float, chips: int) -> Profile:
    """Job MTBF ``mtbf_hours`` at ``chips`` chips, all failures hardware-like."""
    if not mtbf_hours > 0:
        raise ValueError(f"custom profile expects mtbf_hours > 0, but got {mtbf_hours!r}")
    return Profile("custom", 1 / (mtbf_hours * chips), (("hardware", 1.0),), 0.0,
                   f"given: job MTBF {mtbf_hours} h at {chips} chips")


def get_profile(name: str, chips: int, mtbf_hours: float | None = None) -> Profile:
    if name == "custom":
        if mtbf_hours is None:
            raise ValueError("simulate(profile='custom') needs mtbf_hours")
        return custom_profile(mtbf_hours, chips)
    if name not in PROFILES:
        raise ValueError(f"simulate expects a failure profile in "
                         f"{sorted(PROFILES) + ['custom']}, but got {name!r}")
    return PROFILES[name]


# -- closed forms -------------------------------------------------------------
def young_daly_interval(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints: sqrt(2 delta M)."""
    return math.sqrt(2.0 * ckpt_cost_s * mtbf_s)


def daly_interval(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum; M when the checkpoint costs >= 2M."""
    d, m = ckpt_cost_s, mtbf_s
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def expected_goodput_checkpoint_only(interval: float, ckpt_cost: float,
                                     restart_cost: float, mtbf: float) -> float:
    """First-order goodput: tau/(tau+delta) * (1 - (R + (tau+delta)/2) / M)."""
    cyc = interval + ckpt_cost
    return max(0.0, interval / cyc * (1.0 - (restart_cost + cyc / 2.0) / mtbf))


def expected_goodput_exponential(interval: float, ckpt_cost: float,
                                 restart_cost: float, mtbf: float) -> float:
    """Exact expectation for exponential failures (failures may also strike
    during restart, which then starts over): tau / (M e^{R/M} (e^{(tau+delta)/M} - 1))."""
    m = mtbf
    t = m * math.exp(restart_cost / m) * math.expm1((interval + ckpt_cost) / m)
    return interval / t


# -- failure traces -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FailureTrace:
    """Sorted event times (s), kinds and failed domain ids."""
    times: np.ndarray
    kinds: tuple[str, ...]
    domains: np.ndarray

    def count(self, kind: str | None = None) -> int:
        return sum(1 for k in self.kinds if kind is None or k == kind)


def draw_failures(profile: Profile, chips: int, domains: int, horizon_s: float,
                  rng: np.random.Generator) -> FailureTrace:
    """Poisson arrivals over ``horizon_s`` at the profile's rates times ``chips``."""
    hours = horizon_s / HOUR
    n_un = rng.poisson(profile.unplanned_per_chip_h * chips * hours)
    n_pl = rng.poisson(profile.planned_per_chip_h * chips * hours)
    names = [k for k, _ in profile.split]
    probs = np.array([p for _, p in profile.split], dtype=float)
    kinds_un = rng.choice(len(names), size=n_un, p=probs / probs.sum())
    times = np.concatenate([rng.uniform(0, horizon_s, n_un), rng.uniform(0, horizon_s, n_pl)])
    kinds = [names[i] for i in kinds_un] + ["planned"] * n_pl
    doms = rng.integers(0, domains, size=n_un + n_pl)
    order = np.argsort(times, kind="stable")
    return FailureTrace(times[order], tuple(kinds[i] for i in order), doms[order])


def given_failures(times: Sequence[float], kinds: Sequence[str] | None, domains: int,
                   rng: np.random.Generator) -> FailureTrace:
    t = np.asarray(sorted(float(x) for x in times), dtype=float)
    ks = tuple(kinds) if kinds is not None else ("hardware",) * len(t)
    if len(ks) != len(t) or any(k not in _KINDS for k in ks):
        raise ValueError(f"simulate expects failure_kinds of length {len(t)} from "
                         f"{_KINDS}, but got {kinds!r}")
    order = np.argsort(np.asarray(times, dtype=float), kind="stable")
    ks = tuple(ks[i] for i in order)
    return FailureTrace(t, ks, rng.integers(0, domains, size=len(t)))


# -- accounting helpers -------------------------------------------------------
class _Ledger:
    def __init__(self):
        self.s = {b: 0.0 for b in BUCKETS}
        self.failures = 0
        self.planned = 0
        self.fallbacks = 0

    def consume(self, phases: list[tuple[str, float]], duration: float) -> None:
        """Charge phases in order, stopping after ``duration`` seconds."""
        left = duration
        for bucket, sec in phases:
            take = min(sec, left)
            self.s[bucket] += take
            left -= take
            if left <= 0:
                break

    def move(self, src: str, dst: str, sec: float) -> None:
        self.s[src] -= sec
        self.s[dst] += sec


def restart_phases(cm: CostModel, restore_s: float, detect: bool = True) -> list:
    ph = [("detection", cm.detection_s)] if detect else []
    return ph + [("recovery", cm.restart_s), ("checkpoint_restore", restore_s),
                 ("compile", cm.compile_s)]


def _cyclic(trace: FailureTrace, horizon: float, cm: CostModel, tau: float, delta: float,
            persist: float, restore_s: float, extra_save_frac: float) -> _Ledger:
    """Whole-job restart strategies: compute tau, block delta, repeat.

    ``extra_save_frac`` is the share of compute time spent blocking on a second
    (persistent) tier whose copies are never restored from here.
    """
    led = _Ledger()
    cycle = tau + delta
    keep = 1.0 - extra_save_frac
    events = []
    for t, k in zip(trace.times, trace.kinds):
        if k == "sdc":   # found only when the loss misbehaves, later
            events.append((t + cm.sdc_detection_delay_s, "sdc", t))
        else:
            events.append((t, k, None))
    events.sort(key=lambda e: e[0])
    # job start (launch to first step); the job's end is cut off the horizon by the caller
    phases = [("other", cm.launch_s)] if cm.launch_s > 0 else []
    ready, rec_start = sum(s for _, s in phases), 0.0

    def run(length: float, fail: bool, corrupt_at: float | None) -> None:
        n = math.floor(length / cycle)
        rem = length - n * cycle
        compute = n * tau + min(rem, tau)
        led.s["checkpoint_save"] += n * delta + max(0.0, rem - tau) + compute * extra_save_frac
        since = 0.0
        if fail:
            # work since the newest completed save (a save in progress is no save)
            since = min(rem, tau)
            if n >= 1 and rem < persist:
                # that save is not durable yet (tau >= persist): one cycle more
                since += tau
            if corrupt_at is not None:
                if corrupt_at <= 0:
                    since = compute
                else:
                    since = max(since, compute - math.floor(corrupt_at / cycle) * tau)
            since = min(since, compute)
        led.s["productive"] += (compute - since) * keep
        led.s["lost"] += since * keep

    for t, kind, corrupt in events:
        if t >= horizon:
            break
        if t < ready:                       # struck during recovery: start over
            if kind == "sdc":               # found during a restart: ignored (docs)
                continue
            led.consume(phases, t - rec_start)
        else:
            led.consume(phases, ready - rec_start)
            run(t - ready, kind != "planned",
                None if corrupt is None else corrupt - ready)
        if kind == "planned":
            led.planned += 1
            phases = [("checkpoint_save", delta + persist)] + restart_phases(
                cm, restore_s, detect=False)
        else:
            led.failures += 1
            phases = restart_phases(cm, restore_s)
        rec_start = t
        ready = t + sum(s for _, s in phases)
    if horizon < ready:
        led.consume(phases, horizon - rec_start)
    else:
        led.consume(phases, ready - rec_start)
        run(horizon - ready, False, None)
    return led


def _resilax(trace: FailureTrace, horizon: float, cm: CostModel,
             rng: np.random.Generator) -> _Ledger:
    """Peer copies + replay + elastic continuation; checkpoint fallback."""
    led = _Ledger()
    D = cm.domains
    unit_chips = max(cm.chips_per_replica, cm.devices_per_domain)
    n_units = max(1, cm.chips // unit_chips)
    delta = cm.checkpoint_blocking_s
    tau_p = max(cm.persistent_interval_s, cm.persist_s)
    save_frac = delta / (tau_p + delta)
    ratio = cm.overhead_ratio
    down: dict[int, float] = {}            # domain -> rejoin time
    last_fail: dict[int, float] = {}
    rejoins: list[tuple[float, int]] = []
    run_since_restart = 0.0
    now = 0.0                               # accounted up to here
    ready = 0.0

    def unit(d: int) -> int:
        return min(n_units - 1, d * cm.devices_per_domain // unit_chips)

    def alive_frac() -> float:
        return 1.0 - len({unit(d) for d in down}) / n_units

    def run_to(t: float) -> None:
        nonlocal now, run_since_restart
        start = max(now, ready)
        if t > start:
            length = t - start
            led.s["checkpoint_save"] += length * save_frac
            rest = length * (1 - save_frac)
            led.s["protection"] += rest * (ratio - 1) / ratio
            work = rest / ratio
            a = alive_frac()
            led.s["productive"] += work * a
            led.s["idle"] += work * (1 - a)
            run_since_restart += length
        now = max(now, t)

    def pause(t: float, phases: list[tuple[str, float]]) -> None:
        """Stop the job at t for the phases (stacking on a running pause)."""
        nonlocal ready, now
        run_to(t)
        start = max(t, ready)
        total = sum(s for _, s in phases)
        led.consume(phases, min(total, max(0.0, horizon - start)))
        ready = start + total
        now = max(now, min(ready, horizon))

    def progress_rate() -> float:
        return (1 - save_frac) / ratio * alive_frac()

    def fallback(t: float) -> None:
        nonlocal run_since_restart
        led.fallbacks += 1
        run_to(t)
        since = run_since_restart % (tau_p + delta)
        lost = min(since, tau_p) * progress_rate()
        lost = min(lost, led.s["productive"])
        led.move("productive", "lost", lost)
        down.clear()
        rejoins.clear()
        last_fail.clear()
        pause(t, restart_phases(cm, cm.restore_persistent_s))
        run_since_restart = 0.0

    events = [(float(t), k, int(d)) for t, k, d in zip(trace.times, trace.kinds, trace.domains)]
    if cm.launch_s > 0:
        pause(0.0, [("other", cm.launch_s)])
    i = 0
    while True:
        nxt_fail = events[i][0] if i < len(events) else math.inf
        nxt_rejoin = rejoins[0][0] if rejoins else math.inf
        t = min(nxt_fail, nxt_rejoin)
        if t >= horizon:
            break
        if nxt_rejoin <= nxt_fail:
            _, d = heapq.heappop(rejoins)
            if d in down and down[d] == t:
                del down[d]
                run_to(t)
                pause(t, [("recovery", cm.rejoin_s)])
            continue
        _, kind, d = events[i]
        i += 1
        if d in down:                        # already out: hit a live domain instead
            live = [x for x in range(d + 1, d + D) if x % D not in down]
            if not live:
                fallback(t)
                continue
            d = live[0] % D
        if kind == "planned":
            led.planned += 1
        else:
            led.failures += 1
        neighbours = {(d - 1) % D, (d + 1) % D} - {d}
        exposed = any(t - last_fail.get(n, -math.inf) < cm.reprotect_s for n in neighbours)
        down_after = {unit(x) for x in down} | {unit(d)}
        if kind != "planned" and (exposed or len(down_after) >= n_units):
            fallback(t)
            continue
        run_to(t)
        if kind == "planned":                # drained ahead: nothing to replay
            phases = [("recovery", cm.recovery_plan_s), ("recovery", cm.restore_peer_s)]
            back = cm.maintenance_s
        else:
            phases = [("recovery", cm.recovery_plan_s), ("recovery", cm.restore_peer_s),
                      ("compile", cm.recovery_compile_s)]
            if kind == "sdc":
                # found by the next cross-replica checksum; steps since are recomputed
                late = rng.uniform(0, cm.checksum_interval_steps * cm.step_s)
                lost = min(late * progress_rate(), led.s["productive"])
                led.move("productive", "lost", lost)
                back = cm.repair_s
            else:
                phases = [("detection", cm.detection_s)] + phases
                k = int(rng.integers(0, cm.peer_copy_interval_steps))
                phases.append(("replay", k * cm.replay_ratio * cm.step_s))
                back = cm.repair_s if kind == "hardware" else cm.host_restart_s
            last_fail[d] = t
        if len(down_after) < n_units:
            down[d] = t + back
            heapq.heappush(rejoins, (t + back, d))
        pause(t, phases)
    run_to(horizon)
    return led


# -- driver -------------------------------------------------------------------
def _summary(led: _Ledger, horizon: float, **extra: Any) -> dict:
    buckets_h = {b: led.s[b] / HOUR for b in BUCKETS}
    wall_h = horizon / HOUR
    buckets_h["other"] = wall_h - sum(v for b, v in buckets_h.items() if b != "other")
    failure_buckets = ("detection", "recovery", "checkpoint_restore", "compile",
                       "replay", "lost", "idle")
    return {
        "goodput": led.s["productive"] / horizon,
        "lost_hours": sum(buckets_h[b] for b in failure_buckets),
        "lost_work_hours": buckets_h["lost"],
        "overhead_share": (led.s["checkpoint_save"] + led.s["protection"]) / horizon,
        "failures": led.failures,
        "planned": led.planned,
        "fallbacks": led.fallbacks,
        "buckets_hours": buckets_h,
        **extra,
    }


def _rescale(summary: dict, train_s: float, horizon_s: float) -> dict:
    """A summary over ``train_s`` seen over ``horizon_s``: the rest is ``other``."""
    out = dict(summary)
    out["goodput"] = summary["goodput"] * train_s / horizon_s
    out["overhead_share"] = summary["overhead_share"] * train_s / horizon_s
    b = dict(summary["buckets_hours"])
    b["other"] += (horizon_s - train_s) / HOUR
    out["buckets_hours"] = b
    return out


def simulate_strategy(strategy: str, trace: FailureTrace, horizon_s: float, cm: CostModel,
                      *, mtbf_s: float, interval_s: float | None = None,
                      rng: np.random.Generator | None = None) -> dict:
    """One strategy against one trace; returns its summary (see :func:`simulate`).

    The job pays ``cm.launch_s`` at t=0 and ``cm.shutdown_s`` at the horizon's
    end (booked as ``other``); both default to 0, which long runs can ignore.
    """
    train_s = max(0.0, horizon_s - cm.shutdown_s)
    if train_s < horizon_s:
        # the ledger covers the training part; the summary's wall is the whole job
        out = simulate_strategy(strategy, trace, train_s,
                                dataclasses.replace(cm, shutdown_s=0.0), mtbf_s=mtbf_s,
                                interval_s=interval_s, rng=rng)
        return _rescale(out, train_s, horizon_s)
    if strategy == "checkpoint-only":
        delta = cm.checkpoint_blocking_s
        tau = interval_s or daly_interval(delta, mtbf_s)
        tau = max(tau, cm.persist_s)            # one save in flight at a time
        led = _cyclic(trace, horizon_s, cm, tau, delta, cm.persist_s,
                      cm.restore_persistent_s, 0.0)
        return _summary(led, horizon_s, interval_s=tau)
    if strategy == "in-memory":
        delta = cm.checkpoint_blocking_s
        tau = interval_s or daly_interval(delta, mtbf_s)
        tau = max(tau, cm.in_memory_replicate_s)
        tau_p = max(cm.persistent_interval_s, cm.persist_s)
        led = _cyclic(trace, horizon_s, cm, tau, delta, cm.in_memory_replicate_s,
                      cm.restore_in_memory_s, delta / (tau_p + delta))
        return _summary(led, horizon_s, interval_s=tau, persistent_interval_s=tau_p)
    if strategy == "resilax":
        led = _resilax(trace, horizon_s, cm, rng or np.random.default_rng(0))
        return _summary(led, horizon_s,
                        interval_s=cm.peer_copy_interval_steps * cm.step_s,
                        persistent_interval_s=max(cm.persistent_interval_s, cm.persist_s))
    raise ValueError(f"simulate expects strategies from {STRATEGIES}, but got {strategy!r}")


def simulate(*, chips: int | None = None, model_params: float | None = None,
             profile: str = "llama3", mtbf_hours: float | None = None,
             strategies: Iterable[str] = STRATEGIES, days: float = 30.0, seed: int = 0,
             cost: CostModel | None = None, topology: str | os.PathLike | None = None,
             failure_times: Sequence[float] | None = None,
             failure_kinds: Sequence[str] | None = None,
             checkpoint_interval_s: float | None = None,
             checkpoint_interval_steps: int | None = None) -> dict:
    """Simulate ``days`` of training under failures; returns a JSON-able dict.

    ``cost`` (default :class:`CostModel()`) is scaled to ``chips`` /
    ``model_params`` and the topology's bandwidths. ``failure_times`` (seconds
    from start) replace random draws, e.g. to replay a measured run;
    ``failure_kinds`` gives each one's kind (default ``"hardware"``).
    ``checkpoint_interval_s`` / ``_steps`` fix the checkpoint-only and
    in-memory interval instead of Daly's optimum. Same arguments and seed give
    identical output. Cost: O(number of failures) per strategy.
    """
    cm = cost or CostModel()
    topo = read_topology_bandwidths(topology) if topology else None
    cm = cm.scaled(model_params, chips, topo)
    strategies = list(dict.fromkeys(strategies))
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"simulate expects strategies from {STRATEGIES}, but got {s!r}")
    prof = get_profile(profile, cm.chips, mtbf_hours)
    horizon = float(days) * DAY
    rng = np.random.default_rng(seed)
    if failure_times is not None:
        trace = given_failures(failure_times, failure_kinds, cm.domains, rng)
        mtbf_s = horizon / max(1, len(trace.times))
    else:
        trace = draw_failures(prof, cm.chips, cm.domains, horizon, rng)
        mtbf_s = prof.job_mtbf_s(cm.chips)
    interval = checkpoint_interval_s
    if checkpoint_interval_steps is not None:
        interval = checkpoint_interval_steps * cm.step_s
    results = {}
    for k, s in enumerate(strategies):
        srng = np.random.default_rng([seed, k + 1])
        results[s] = simulate_strategy(s, trace, horizon, cm, mtbf_s=mtbf_s,
                                       interval_s=interval, rng=srng)
    return {
        "config": {"chips": cm.chips, "model_params": cm.model_params, "profile": prof.name,
                   "profile_source": prof.source, "days": float(days), "seed": int(seed),
                   "job_mtbf_hours": mtbf_s / HOUR, "strategies": strategies,
                   "given_failure_times": failure_times is not None,
                   "young_daly_interval_s": young_daly_interval(cm.checkpoint_blocking_s, mtbf_s),
                   "daly_interval_s": daly_interval(cm.checkpoint_blocking_s, mtbf_s)},
        "failures": {k: trace.count(k) for k in _KINDS},
        "cost_model": cm.describe(),
        "strategies": results,
    }


SWEEP_CHIPS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)


def sweep(chips_list: Sequence[int] = SWEEP_CHIPS, *, seeds: int = 3,
          progress: bool = True, **kw: Any) -> dict:
    """Mean goodput per strategy for each chip count over ``seeds`` seeds."""
    base_seed = int(kw.pop("seed", 0))
    points = [(c, base_seed + j) for c in chips_list for j in range(seeds)]
    it: Iterable = points
    if progress:
        try:
            from tqdm import tqdm
            it = tqdm(points, desc="simulate sweep", unit="run", file=sys.stderr)
        except ImportError:
            pass
    acc: dict[int, list[dict]] = {}
    for c, s in it:
        acc.setdefault(c, []).append(simulate(chips=c, seed=s, **kw)["strategies"])
    out: dict[str, Any] = {"chips": list(chips_list), "goodput": {}, "seeds": seeds}
    for c in chips_list:
        for strat in acc[c][0]:
            vals = [r[strat]["goodput"] for r in acc[c]]
            out["goodput"].setdefault(strat, []).append(float(np.mean(vals)))
    return out


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"{cfg['chips']:,} chips, {cfg['model_params']:.3g} params, profile "
             f"{cfg['profile']}, {cfg['days']:g} days, seed {cfg['seed']}, job MTBF "
             f"{cfg['job_mtbf_hours']:.2f} h; failures {result['failures']}",
             f"{'strategy':<16}{'goodput':>9}{'lost h':>9}{'lost work h':>12}"
             f"{'ckpt+prot':>10}{'failures':>9}{'fallbacks':>10}{'interval s':>11}"]
    for name, r in result["strategies"].items():
        lines.append(f"{name:<16}{r['goodput']:>9.2%}{r['lost_hours']:>9.1f}"
                     f"{r['lost_work_hours']:>12.1f}{r['overhead_share']:>10.2%}"
                     f"{r['failures']:>9d}{r['fallbacks']:>10d}{r['interval_s']:>11.0f}")
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------
def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``simulate`` to an argparse subparsers object."""
    from resilax.tools.argtypes import int_at_least, output_path, positive_float

    p = subparsers.add_parser("simulate", help="simulate goodput of a long run under failures")
    p.add_argument("--chips", type=int_at_least(1), default=16384)
    p.add_argument("--model-params", type=positive_float, default=405e9)
    p.add_argument("--topology", default=None, help="slices/<spec>.toml with a [bandwidth] table")
    p.add_argument("--failures", default="llama3", choices=sorted(PROFILES) + ["custom"])
    p.add_argument("--mtbf-hours", type=positive_float, default=None, help="job MTBF for --failures custom")
    p.add_argument("--strategy", action="append", default=None,
                   choices=("all",) + STRATEGIES + ("reroute", "drop", "repartition", "checkpoint-restart"),
                   help="repeatable; default all (the last four with --pipeline)")
    p.add_argument("--days", type=positive_float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-json", action="append", default=[], help="bench --json output; repeatable")
    p.add_argument("--json", type=output_path, default=None, help="write results here")
    p.add_argument("--png", type=output_path, default=None, help="write goodput vs chips plot here (runs the sweep)")
    p.add_argument("--sweep", action="store_true", help="goodput vs chips, 1k to 100k")
    p.add_argument("--pipeline", action="store_true",
                   help="data x pipeline jobs: ReCycle reroute vs drop the replica vs Oobleck-style re-partition vs "
                        "checkpoint-restart (resilax.tools.simulate_pipeline; --chips is ignored)")
    p.add_argument("--jobs", default=None, metavar="DxSxN,...",
                   help="--pipeline jobs: replicas x stages x chips per domain (default 16x4x16, 32x8x32, 64x8x64, "
                        "64x16x96: 1,024 to 98,304 chips)")
    p.add_argument("--schedule", default="zb-h1", choices=("gpipe", "1f1b", "zb-h1"), help="--pipeline schedule")
    p.add_argument("--microbatches", type=int_at_least(1), default=None, help="--pipeline micro-batches per replica (default 2S)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (--pipeline)")
    p.set_defaults(func=_cli_main)
    return p


def _cli_main(args: argparse.Namespace) -> int:
    if args.mtbf_hours is not None and args.failures != "custom":
        print(f"resilax simulate: --mtbf-hours applies to --failures custom (the {args.failures} profile has its own "
              f"rates)", file=sys.stderr)
        return 2
    cost = CostModel.from_bench_json(*args.cost_json) if args.cost_json else None  # (read once, here)
    if cost is not None and cost.sources.get("_skipped"):
        print(f"resilax simulate: --cost-json: cannot read {cost.sources['_skipped']}", file=sys.stderr)
        return 2
    try:
        return _run_cli(args, cost)
    except OSError as e:  # a file named on the command line that cannot be read or written
        print(f"resilax simulate: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2


def _run_cli(args: argparse.Namespace, cost: CostModel | None) -> int:
    if args.pipeline:
        from resilax.tools.simulate_pipeline import cli_main

        return cli_main(args, cost)
    strategies = args.strategy or ["all"]
    if set(strategies) - set(STRATEGIES) - {"all"}:
        print(f"resilax simulate: --strategy {sorted(set(strategies) - set(STRATEGIES) - {'all'})} needs --pipeline",
              file=sys.stderr)
        return 2
    strategies = list(STRATEGIES) if "all" in strategies else strategies
    cost = cost or CostModel()
    kw = dict(model_params=args.model_params, profile=args.failures,
              mtbf_hours=args.mtbf_hours, strategies=strategies, days=args.days,
              cost=cost, topology=args.topology)
    if args.failures == "custom" and args.mtbf_hours is None:
        print("resilax simulate: --failures custom needs --mtbf-hours", file=sys.stderr)
        return 2
    result = simulate(chips=args.chips, seed=args.seed, **kw)
    print(format_table(result))
    if args.sweep or args.png:
        if args.failures == "custom":
            # keep the per-chip rate of --chips when other sizes are simulated
            kw["mtbf_hours"] = None
            kw["profile"] = "llama3"
            print("note: the sweep uses the llama3 per-chip rate", file=sys.stderr)
        sw = sweep(seed=args.seed, **kw)
        result["sweep"] = sw
        print("chips      " + "".join(f"{s:>17}" for s in sw["goodput"]))
        for j, c in enumerate(sw["chips"]):
            print(f"{c:<11,}" + "".join(f"{sw['goodput'][s][j]:>17.2%}" for s in sw["goodput"]))
        if args.png:
            from resilax.tools.report import plot_sweep
            plot_sweep(sw, args.png, f"goodput vs chips ({kw['profile']}, "
                       f"{args.model_params:.3g} params)")
            print(f"wrote {args.png}")
    if args.json:
        write_json(args.json, result, indent=1, sort_keys=True)
        print(f"wrote {args.json}")
    return 0
