"""Fault campaign: random, seeded schedules of 1-3 faults, each run compared with a
failure-free run of the same config, or expected to raise `StateLostError` exactly when
an independent oracle says no copy survives.

``resilax campaign --trials N --seed S [--json PATH]``; the test suite
(tests/test_campaign.py) checks the oracle on hand-written schedules and runs two drawn
trials through the worker processes.

The oracle that judges each trial (`expect`, on a model of the documented semantics, not
resilax's planner) and the trial's description (`Trial`) are in `campaign_oracle`.
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

from resilax.tools.campaign_oracle import MIN_HISTORY, Trial, expect, parse
from resilax.tools.argtypes import int_at_least, output_path

KINDS = ("fail_slice", "nan", "spike", "kill_process")
HEALTH_KINDS = ("rejoin", "bitflip", "hang_slice", "slow_slice", "repair_slice")
WATCHDOG_KINDS = ("hang_slice", "slow_slice", "repair_slice")  # need the liveness watchdog
PHASES = ("before_step", "mid_step", "during_peer_copy", "after_step", "during_save")
TOPOLOGIES = ((2, 4), (4, 2), (8, 1))
MODELS = ("dropout_mlp", "batchnorm_mlp", "token_lm", "transformer_lm")
TOL = 1e-4
OUTCOMES = ("ok", "expected_lost", "expected_sdc", "silent_mismatch", "unexpected_exception", "hang", "wrong_lost",
            "missed_lost", "missed_sdc")
BAD = ("silent_mismatch", "unexpected_exception", "hang", "wrong_lost", "missed_lost", "missed_sdc")


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
            step = parse(faults[-1])[1] + rng.choice((0, 1))  # right after (or with) a previous failure
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
        ks = next(parse(f)[1] for f in faults if f.startswith("kill"))
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
                step = parse(rng.choice(trial.faults))[1] + rng.choice((0, 1, 1, 2))  # around another fault
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
        domain_faults = any(parse(f)[0] not in ("nan", "spike", "kill_process") for f in trial.faults)
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
    c.add_argument("--trials", type=int_at_least(1), default=300)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", type=output_path, default=None, help="write counts and per-trial records here")
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
