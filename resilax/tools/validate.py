"""Validation: the goodput simulator against a real CPU job with injected failures.

Three parts, each usable alone:

* :func:`measure_costs` -- short real runs of ``resilax train`` (a fresh run, then a
  restarted one resuming from its checkpoints) measure every cost the simulator's
  checkpoint-only path charges; :func:`cost_model` turns them into a
  :class:`~resilax.tools.costmodel.CostModel` whose every field says how it was measured.
* :func:`run_measured_job` -- the real job: ``resilax train`` killed by SIGKILL after
  each planned step (``--fault kill_process@N:after_step``) and started again at once,
  until it finishes. Measures the wall time from first launch to final exit and when
  each failure happened.
* :func:`validate` -- both, then :func:`resilax.tools.simulate.simulate` replays the measured
  failure times against the measured costs over the measured wall time.

Goodput, measured and simulated alike: ``steps * step_s / wall``, where ``step_s`` is
the failure-free seconds per step (mean, from :func:`measure_costs`) -- the share of
the wall time a failure-free, checkpoint-free run would need. The simulator's
``productive`` seconds are that same quantity for the simulated job. See
docs/goodput.md, "Validation".

The parent only drives and times: each training process is a ``python -m resilax
train`` child with this checkout on ``PYTHONPATH``, with checkpoints only
(``--no-log --no-peers --no-anomaly``: the strategy the simulator's path models).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from resilax._src.io import write_json
from resilax.tools.costmodel import CostModel
from resilax._src.runtime.goodput import BUCKETS, GoodputFileError, load_goodput
from resilax.tools.argtypes import int_at_least, output_path

__all__ = ["measure_costs", "cost_model", "run_measured_job", "validate", "format_table",
           "register_cli"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STEP = re.compile(r"^step\s+(\d+)/(\d+)")
_RESUMED = re.compile(r"^resumed at step (\d+)")
Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _domains(topology: str) -> tuple[int, int]:
    """(devices, devices per domain) of an emulated ``cpu-DxN`` topology."""
    m = re.fullmatch(r"cpu-(\d+)x(\d+)", topology)
    if not m:
        raise ValueError(f"resilax validate expects an emulated topology 'cpu-DxN' such as "
                         f"'cpu-2x4', but got {topology!r}")
    d, n = int(m[1]), int(m[2])
    return d * n, n


# -- one training process -----------------------------------------------------
def _committed(ckpt: str) -> set[int]:
    try:
        return {int(p) for p in os.listdir(ckpt) if p.isdigit()}
    except FileNotFoundError:
        return set()


def _run_process(args: Sequence[str], ckpt: str, t0: float,
                 on_step: Callable[[int, float], None] | None = None) -> dict:
    """Runs ``resilax train ARGS`` to its exit; times (s since ``t0``) of each step line
    (printed once the step and any save it triggered returned) and of each checkpoint
    first seen committed (a directory named by its step; polled every 5 ms)."""
    before = _committed(ckpt)
    commits: dict[int, float] = {}
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            now = time.perf_counter() - t0
            for s in _committed(ckpt) - before - set(commits):
                commits[s] = now
            stop.wait(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    launch = time.perf_counter() - t0
    p = subprocess.Popen([sys.executable, "-m", "resilax", "train", *args], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    drain.start()
    steps: dict[int, float] = {}
    resumed = 0
    for line in p.stdout:
        now = time.perf_counter() - t0
        if m := _STEP.match(line):
            steps[int(m[1])] = now
            if on_step:
                on_step(int(m[1]), now)
        elif m := _RESUMED.match(line):
            resumed = int(m[1])
    rc = p.wait()
    exit_t = time.perf_counter() - t0
    drain.join(5)
    stop.set()
    poller.join(1)
    for s in _committed(ckpt) - before - set(commits):
        commits[s] = exit_t
    try:
        gp = load_goodput(ckpt).to_json()
        gp = {"wall_s": gp["wall_s"], "totals": gp["totals"], "segments": gp["segments"]}
    except GoodputFileError:
        gp = None
    return {"launch_s": launch, "exit_s": exit_t, "returncode": rc, "resumed_from": resumed,
            "step_s": steps, "commit_s": commits, "goodput": gp, "stderr_tail": "".join(err)[-2000:]}


# The validated strategy is the simulator's checkpoint-only path, so the job keeps
# checkpoints and turns the other protections off: with the record log on (the default) a
# kill would resume near the step it died at instead of the newest checkpoint.
CHECKPOINT_ONLY = ("--no-log", "--no-peers", "--no-anomaly")


def _train_args(steps: int, every: int, ckpt: str, topology: str, *extra: str) -> list[str]:
    return ["--steps", str(steps), "--checkpoint-every", str(every), "--checkpoint-dir", ckpt,
            "--topology", topology, "--log-every", "1", *CHECKPOINT_ONLY, *extra]


def _check_rc(run: dict, want: int, what: str) -> None:
    if run["returncode"] != want:
        raise RuntimeError(f"resilax validate: {what} exited with {run['returncode']}, expected "
                           f"{want}; stderr tail:\n{run['stderr_tail']}")


# -- costs --------------------------------------------------------------------
def _intervals(run: dict, every: int) -> tuple[list[float], list[float]]:
    """(plain step intervals, save step intervals) between consecutive step lines of one
    process; the first step (compile) has no interval. A save step's interval is the step
    plus its save (blocking part, goodput.json write)."""
    t = run["step_s"]
    plain, saves = [], []
    for k in sorted(t):
        if k - 1 in t:
            (saves if k % every == 0 else plain).append(t[k] - t[k - 1])
    return plain, saves


def measure_costs(workdir: str, *, steps: int = 300, resume_steps: int = 200,
                  checkpoint_every: int = 100, topology: str = "cpu-2x4",
                  log: Log = _print) -> dict:
    """Measures the checkpoint-only costs from two real runs of ``resilax train``.

    Run A: fresh, ``steps`` steps (step time, save cost, persist time, shutdown). Run B:
    started again on A's checkpoints to ``steps + resume_steps``: the restart (launch to
    first step after the restore, and the restore and compile seconds from its
    goodput.json). Run C: fresh again, ``2 * checkpoint_every`` steps: the job's start
    on a warm compilation cache. Both step counts must be multiples of ``checkpoint_every`` so every
    run ends on a save, as the validated job does. Returns a JSON-able dict of raw
    times and the derived costs (``costs``: name -> {value, source}); build the
    CostModel with :func:`cost_model`. Costs three process launches (~5 s each on 2
    loaded cores) plus the steps. Raises RuntimeError if a run fails.
    """
    E = checkpoint_every
    if steps % E or resume_steps % E or steps < 2 * E or resume_steps < 2 * E:
        raise ValueError(f"measure_costs expects steps and resume_steps that are multiples of "
                         f"checkpoint_every >= 2 saves each, but got {steps}, {resume_steps}, {E}")
    ckpt = os.path.join(workdir, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    t0 = time.perf_counter()
    log(f"[measure] run A: fresh, {steps} steps, checkpoint every {E}")
    a = _run_process(_train_args(steps, E, ckpt, topology), ckpt, t0)
    _check_rc(a, 0, "measure run A")
    total = steps + resume_steps
    log(f"[measure] run B: restarted on A's checkpoints, to step {total}  (A: {a['exit_s']:.1f} s)")
    b = _run_process(_train_args(total, E, ckpt, topology), ckpt, t0)
    _check_rc(b, 0, "measure run B")
    if b["resumed_from"] != steps:
        raise RuntimeError(f"measure run B resumed from {b['resumed_from']}, expected {steps}")

    # Run C: a fresh start again, now on the compilation cache A warmed, as the job's
    # first launch will be (A may have been the first run on a cold cache).
    ckpt_c = os.path.join(workdir, "ckpt_fresh")
    shutil.rmtree(ckpt_c, ignore_errors=True)
    log(f"[measure] run C: fresh again, {2 * E} steps  (B: {b['exit_s'] - b['launch_s']:.1f} s)")
    c = _run_process(_train_args(2 * E, E, ckpt_c, topology), ckpt_c, t0)
    _check_rc(c, 0, "measure run C")

    out = _derive_costs({"A": a, "B": b, "C": c}, E, fresh="C", restarted=["B"])
    r = out["raw"]
    log(f"[measure] done in {time.perf_counter() - t0:.1f} s: step "
        f"{out['costs']['step_s']['value'] * 1e3:.1f} ms, save "
        f"{out['costs']['blocking_s_measured']['value'] * 1e3:.0f} ms, persist "
        f"{out['costs']['persist_s_measured']['value'] * 1e3:.0f} ms, restart "
        f"{statistics.fmean(r['restart_total_s']):.2f} s, launch "
        f"{out['costs']['launch_s']['value']:.2f} s (run A: {r['launch_total_s']['A']:.2f} s, "
        "maybe a cold cache)")
    return {"topology": topology, "checkpoint_every": E, "steps": [steps, total], **out}


def _derive_costs(runs: dict[str, dict], E: int, *, fresh: str, restarted: Sequence[str],
                  where: str = "run") -> dict:
    """Costs from processes timed by :func:`_run_process` (name -> run).

    Every run gives step intervals, save intervals and persist times; ``fresh`` (a run
    that started without checkpoints) gives the job's launch; ``restarted`` (runs that
    resumed from one) give restart, restore and compile; runs that exited normally give
    the shutdown. Returns ``{"costs": name -> {value, source}, "raw": ...}``.
    """
    plain, saves = [], {}
    for n, r in runs.items():
        p_, s_ = _intervals(r, E)
        plain += p_
        saves[n] = s_
    step_s = statistics.fmean(plain)
    # a process's first save also sets up Orbax and the checksum program: paid once per
    # process, so it is a launch/restart cost, not a per-save one
    later = [x for s_ in saves.values() for x in s_[1:]]
    delta = statistics.fmean(later) - step_s
    first_extra = {n: (s_[0] - step_s - delta if s_ else 0.0) for n, s_ in saves.items()}
    persist = [t - r["step_s"][k] for r in runs.values() for k, t in r["commit_s"].items()
               if k in r["step_s"]]
    persist_s = statistics.median(persist)
    to_first = {n: r["step_s"][min(r["step_s"])] - r["launch_s"] for n, r in runs.items()}
    # launch -> first step done, less that step, plus the first save's set-up
    total = {n: to_first[n] - step_s + first_extra[n] for n in runs}
    gp = {n: (runs[n]["goodput"] or {}).get("totals", {}) for n in runs}
    restore = [gp[n].get("checkpoint_restore", 0.0) for n in restarted]
    comp = [gp[n].get("compile", 0.0) for n in restarted]
    restore_s, compile_s = statistics.fmean(restore), statistics.fmean(comp)
    restart_total = [total[n] for n in restarted]
    restart_s = statistics.fmean(restart_total) - restore_s - compile_s
    launch_s = total[fresh]
    tails = [r["exit_s"] - r["step_s"][max(r["step_s"])] for r in runs.values()
             if r["returncode"] == 0]
    shutdown_s = statistics.fmean(tails)
    rs = ", ".join(restarted)
    src = "measured: "
    costs = {
        "step_s": (step_s, src + f"mean of {len(plain)} step-line intervals without a save, "
                   f"processes {', '.join(runs)} (median {statistics.median(plain):.4f} s; "
                   "the simulator advances compute linearly, so the rate is the mean)"),
        "blocking_s_measured": (delta, src + f"mean step-line interval of {len(later)} save "
                                "steps (each process's first excluded) minus step_s: the "
                                "blocking save and the goodput.json write"),
        "persist_s_measured": (persist_s, src + f"median over {len(persist)} saves of save "
                               "returned -> step directory committed (polled every 5 ms)"),
        "detection_s": (0.0, "measured: 0; the driver's wait() returns when SIGKILL ends the "
                        "child and it relaunches at once (in the job's wall time)"),
        "restore_s_measured": (restore_s, src + f"goodput.json checkpoint_restore, {where} {rs}"),
        "compile_s": (compile_s, src + f"goodput.json compile (persistent XLA cache), {where} {rs}"),
        "restart_s": (restart_s, src + f"{where} {rs}: launch -> first step line "
                      f"({', '.join(f'{to_first[n]:.3f}' for n in restarted)} s) - step_s + "
                      "first-save set-up - restore - compile: python + jax import, mesh, "
                      "state init, first dispatch"),
        "launch_s": (launch_s, src + f"{where} {fresh} (fresh): launch -> first step line "
                     f"({to_first[fresh]:.3f} s) - step_s + first-save set-up "
                     f"({first_extra[fresh]:.3f} s)"),
        "shutdown_s": (shutdown_s, src + f"mean over {len(tails)} normal exits of last step "
                       "line -> process exit: final checkpoint wait, summary, interpreter exit"),
    }
    return {"costs": {k: {"value": v, "source": s_} for k, (v, s_) in costs.items()},
            "raw": {"plain_intervals_s": plain, "save_intervals_s": saves, "persist_s": persist,
                    "first_save_extra_s": first_extra, "launch_to_first_step_s": to_first,
                    "launch_total_s": total, "restart_total_s": restart_total,
                    "shutdown_s": tails, "goodput_totals": gp}}


def _example_params() -> int:
    """Parameters of the example MLP (resilax.tools.example.ExampleSpec defaults)."""
    from resilax.tools.example import ExampleSpec

    s = ExampleSpec()
    dims = [s.features] + [s.hidden] * s.depth + [s.classes]
    return sum(a * b + b for a, b in zip(dims, dims[1:]))


def _model_failure_times(job: dict, cm: CostModel) -> list[float]:
    """The job's failures on the simulator's clock, each where it struck in its life.

    The schedule is given in steps ("kill after step N"), so that is how it goes in: life i
    resumed at step r_i (a save) and ran to its kill at step k_i, i.e. ``(k_i - r_i)`` steps
    and ``(k_i - r_i) // checkpoint_every`` blocking saves at the model's rates, starting
    when the model's own launch or restart is done. Placing failures by raw wall time
    instead would let one life's start-up or step-rate noise move a failure across a save
    in the model, so the lost work would follow the noise rather than the schedule; this
    way what is validated is the accounting of launch, restarts, restores, compiles, saves,
    the persist window and lost work, against the measured wall time.
    """
    from resilax.tools.simulate import restart_phases

    every = job["checkpoint_every"]
    restart = sum(sec for _, sec in restart_phases(cm, cm.restore_persistent_s))
    ready, times = cm.launch_s, []
    for p in job["processes"]:
        if not p["killed"]:
            break
        steps = p["last_step"] - p["resumed_from"]
        times.append(ready + steps * cm.step_s + (steps // every) * cm.checkpoint_blocking_s)
        ready = times[-1] + restart
    return times


def cost_model(measured: dict) -> CostModel:
    """The CostModel of :func:`measure_costs` output.

    Sizes describe the real job (8 devices, 4 per domain, the example MLP) so that
    ``CostModel.scaled`` -- called by ``simulate`` without ``chips`` or
    ``model_params`` -- changes nothing; the byte-derived times it would otherwise use
    are replaced by measured ones (blocking, persist, restore).
    """
    chips, per = _domains(measured["topology"])
    fields = {k: v["value"] for k, v in measured["costs"].items()}
    sources = {k: v["source"] for k, v in measured["costs"].items()}
    fields["restart_s"] = max(0.0, fields["restart_s"])
    # a save step minus a plain one: on a loaded machine with few saves it can come out < 0
    fields["blocking_s_measured"] = max(0.0, fields["blocking_s_measured"])
    size = {"chips": chips, "devices_per_domain": per, "chips_per_replica": per,
            "model_params": float(_example_params())}
    for k in size:
        sources[k] = f"set: the validated job ({measured['topology']}, example MLP)"
    return CostModel(**fields, **size, sources=sources)


# -- the job ------------------------------------------------------------------
def run_measured_job(steps: int, checkpoint_every: int, kill_steps: Sequence[int],
                     workdir: str, *, topology: str = "cpu-2x4", log: Log = _print,
                     progress_s: float = 5.0) -> dict:
    """Runs the real job to ``steps``: one ``resilax train`` process per life, SIGKILLed
    after each step of ``kill_steps`` (ascending, in (0, steps)) and started again at
    once from the newest committed checkpoint.

    Returns wall time from the first launch to the final exit (``wall_s``), the failure
    times (each killed process's exit, seconds from the start), and per process:
    launch/exit times, the step it resumed from, its last step and its goodput.json
    totals (a killed process's file stops at its last save); and ``measured_costs``,
    the checkpoint-only costs measured on the job's own lives (as :func:`measure_costs`
    measures them on separate runs; needs at least one kill). Prints a line at each
    launch and exit and every ``progress_s`` seconds. Raises RuntimeError if a process
    exits otherwise than planned.
    """
    kills = [int(k) for k in kill_steps]
    if kills != sorted(set(kills)) or any(not 0 < k < steps for k in kills):
        raise ValueError(f"run_measured_job expects distinct ascending kill steps in (0, {steps}), "
                         f"but got {list(kill_steps)!r}")
    ckpt = os.path.join(workdir, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    t0 = time.perf_counter()
    last = [0.0]
    procs, raw = [], {}
    lives = kills + [None]

    for i, k in enumerate(lives):
        def on_step(s: int, now: float, i=i) -> None:
            if now - last[0] >= progress_s:
                last[0] = now
                log(f"[job] {now:7.1f} s  life {i + 1}/{len(lives)}  step {s}/{steps}")

        extra = ("--fault", f"kill_process@{k}:after_step") if k is not None else ()
        log(f"[job] {time.perf_counter() - t0:7.1f} s  launch {i + 1}/{len(lives)}"
            + (f" (SIGKILL planned after step {k})" if k is not None else ""))
        r = _run_process(_train_args(steps, checkpoint_every, ckpt, topology, *extra), ckpt,
                         t0, on_step)
        _check_rc(r, -signal.SIGKILL if k is not None else 0, f"job life {i + 1}")
        last_step = k if k is not None else max(r["step_s"])
        log(f"[job] {r['exit_s']:7.1f} s  life {i + 1} ended "
            + (f"by SIGKILL after step {k}" if k is not None else "normally")
            + f" (resumed from {r['resumed_from']})")
        raw[f"life{i + 1}"] = r
        first = min(r["step_s"]) if r["step_s"] else None
        procs.append({"launch_s": r["launch_s"], "exit_s": r["exit_s"],
                      "first_step": first,
                      "launch_to_first_step_s": r["step_s"][first] - r["launch_s"] if first else None,
                      "resumed_from": r["resumed_from"], "last_step": last_step,
                      "killed": k is not None,
                      "goodput_totals": r["goodput"]["totals"] if r["goodput"] else None,
                      "goodput_wall_s": r["goodput"]["wall_s"] if r["goodput"] else None})
    wall = procs[-1]["exit_s"]
    lost = [p["last_step"] - n["resumed_from"] for p, n in zip(procs, procs[1:])]
    own = _derive_costs(raw, checkpoint_every, fresh="life1", restarted=list(raw)[1:],
                        where="job life") if len(raw) > 1 else None
    return {"steps": steps, "checkpoint_every": checkpoint_every, "kill_steps": kills,
            "topology": topology, "wall_s": wall,
            "failure_times_s": [p["exit_s"] for p in procs if p["killed"]],
            "lost_steps": lost, "processes": procs,
            "measured_costs": dict(own, topology=topology) if own else None}


# -- both ---------------------------------------------------------------------
def measured_buckets(job: dict) -> dict[str, float]:
    """Seconds per bucket summed over the job's goodput.json files; ``outside`` is wall
    time no recorder saw (interpreter start and exit, and a killed process's time after
    its last save)."""
    out = {b: 0.0 for b in BUCKETS}
    for p in job["processes"]:
        for b, s in (p["goodput_totals"] or {}).items():
            out[b] += s
    out["outside"] = job["wall_s"] - sum(out.values())
    return out


def _simulate_job(measured: dict, job: dict, seed: int) -> dict:
    """The job replayed in the simulator on ``measured`` costs; goodput as defined above."""
    from resilax.tools.simulate import simulate

    cm = cost_model(measured)
    wall = job["wall_s"]
    sim = simulate(strategies=["checkpoint-only"], cost=cm, failure_times=_model_failure_times(job, cm),
                   checkpoint_interval_steps=job["checkpoint_every"], days=wall / 86400.0, seed=seed)
    s = sim["strategies"]["checkpoint-only"]
    g_meas = job["steps"] * cm.step_s / wall
    return {"measured_goodput": g_meas, "simulated_goodput": s["goodput"],
            "relative_error": abs(s["goodput"] - g_meas) / g_meas,
            "lost_steps_simulated": s["lost_work_hours"] * 3600.0 / cm.step_s,
            "costs": measured["costs"], "cost_model": cm.describe(),
            "buckets_s": {b: h * 3600.0 for b, h in s["buckets_hours"].items()},
            "simulation": sim}


def _check(steps: int, checkpoint_every: int, kills: Sequence[int]) -> None:
    """Raises ValueError for a job `validate` cannot run, before anything runs."""
    if steps % checkpoint_every:
        raise ValueError(f"validate expects steps to be a multiple of checkpoint_every (the job "
                         f"ends on a save, as the measured runs do), but got {steps}, {checkpoint_every}")
    if not kills:
        raise ValueError("validate expects at least one kill (restart costs are measured on the job)")
    if list(kills) != sorted(set(kills)) or not 0 < kills[0] <= kills[-1] < steps:
        raise ValueError(f"validate expects distinct ascending kill steps in (0, {steps}), but got {list(kills)}")


def validate(*, steps: int = 2000, checkpoint_every: int = 200,
             kills: Sequence[int] = (700, 1500), measure_steps: int | None = None,
             predict: bool = True, topology: str = "cpu-2x4", workdir: str | None = None,
             seed: int = 0, json_path: str | None = None, png_path: str | None = None,
             log: Log = _print) -> dict:
    """Runs the job (and, with ``predict``, the cost-measuring runs first), simulates it,
    returns and prints the comparison.

    Each simulation is ``simulate(strategies=["checkpoint-only"], cost=cost_model(...),
    failure_times=<measured>, checkpoint_interval_steps=checkpoint_every,
    days=wall/86400)``, run twice:

    * ``validation`` -- on the costs measured on the job's own lives: does the
      simulator's accounting (launch, restarts, saves, persist, lost work placed by
      time) reproduce the job's goodput given what each thing really cost?
    * ``prediction`` -- on the costs of :func:`measure_costs` (separate runs just
      before): the same question when the costs come from elsewhere, which on a shared
      machine also carries its load changing between the runs and the job.

    Top-level ``measured_goodput``, ``simulated_goodput``, ``relative_error``, ``costs``
    are the validation's. Also returned: ``failure_times_s``, lost steps measured and
    simulated, bucket seconds, the raw runs. Writes JSON and a PNG when asked. Costs
    one launch per life plus ``steps`` steps, and with ``predict`` three more launches
    and ``2 * measure_steps + 2 * checkpoint_every`` steps.
    """
    _check(steps, checkpoint_every, kills)
    own = workdir is None
    work = workdir or tempfile.mkdtemp(prefix="resilax-validate-")
    os.makedirs(work, exist_ok=True)
    ms = measure_steps or 3 * checkpoint_every
    try:
        separate = (measure_costs(os.path.join(work, "measure"), steps=ms, resume_steps=ms,
                                  checkpoint_every=checkpoint_every, topology=topology, log=log)
                    if predict else None)
        job = run_measured_job(steps, checkpoint_every, kills, os.path.join(work, "job"),
                               topology=topology, log=log)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    val = _simulate_job(job["measured_costs"], job, seed)
    pred = _simulate_job(separate, job, seed) if separate else None
    result = {
        "measured_goodput": val["measured_goodput"],
        "simulated_goodput": val["simulated_goodput"],
        "relative_error": val["relative_error"],
        "definition": "goodput = steps * step_s / wall (step_s: failure-free mean step seconds); "
                      "simulated: productive seconds / wall",
        "wall_s": job["wall_s"], "steps": steps, "checkpoint_every": checkpoint_every,
        "kill_steps": list(kills), "failure_times_s": job["failure_times_s"],
        "lost_steps_measured": sum(job["lost_steps"]),
        "lost_steps_simulated": val["lost_steps_simulated"],
        "costs": val["costs"],
        "buckets_s": {"measured": measured_buckets(job), "simulated": val["buckets_s"]},
        "validation": val, "prediction": pred, "measure": separate, "job": job,
        "command": (f"resilax validate --steps {steps} --checkpoint-every {checkpoint_every} "
                    f"--kills {','.join(map(str, kills))}"
                    + (f" --measure-steps {ms}" if predict else " --no-predict")
                    + f" --topology {topology}"),
    }
    log(format_table(result))
    if json_path:
        write_json(json_path, result, indent=1, sort_keys=True, default=float)
        log(f"wrote {json_path}")
    if png_path:
        plot_validation(result, png_path)
        log(f"wrote {png_path}")
    return result


def format_table(r: dict) -> str:
    pred = r.get("prediction")
    rows = [f"{'cost (checkpoint-only path)':<24}{'job':>10}{'separate':>10}  source (job)"]
    for k, v in r["costs"].items():
        sep = f"{pred['costs'][k]['value']:>10.4f}" if pred else f"{'-':>10}"
        rows.append(f"  {k:<22}{v['value']:>10.4f}{sep}  {v['source'][:80]}")
    rows += [
        f"job: {r['steps']} steps, checkpoint every {r['checkpoint_every']}, SIGKILL after steps "
        f"{r['kill_steps']} at {', '.join(f'{t:.1f}' for t in r['failure_times_s'])} s; "
        f"wall {r['wall_s']:.1f} s",
        f"{'':<34}{'measured':>10}{'simulated':>11}{'rel err':>9}{'lost steps':>11}",
        f"{'validation (job costs)':<34}{r['measured_goodput']:>10.2%}"
        f"{r['simulated_goodput']:>11.2%}{r['relative_error']:>9.2%}"
        f"{r['lost_steps_simulated']:>11.1f}",
    ]
    if pred:
        rows.append(f"{'prediction (separate-run costs)':<34}{pred['measured_goodput']:>10.2%}"
                    f"{pred['simulated_goodput']:>11.2%}{pred['relative_error']:>9.2%}"
                    f"{pred['lost_steps_simulated']:>11.1f}")
    rows.append(f"{'lost steps measured':<34}{r['lost_steps_measured']:>10.0f}")
    return "\n".join(rows)


def plot_validation(r: dict, path: str) -> str:
    """Measured vs simulated goodput, and seconds per bucket of both, to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from resilax.tools.report import COLORS

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 2.4]})
    vals = [100 * r["measured_goodput"], 100 * r["simulated_goodput"]]
    ax1.bar(["measured", "simulated"], vals, color=["#1f77b4", "#ff7f0e"])
    for i, v in enumerate(vals):
        ax1.annotate(f"{v:.1f}%", (i, v), ha="center", va="bottom")
    ax1.set_ylabel("goodput (%)")
    ax1.set_ylim(0, 100)
    ax1.set_title(f"relative error {r['relative_error']:.1%}")
    names = list(BUCKETS) + ["outside"]
    colors = dict(COLORS, outside="#e0e0e0")
    for row, key in enumerate(("simulated", "measured")):
        left = 0.0
        for b in names:
            sec = r["buckets_s"][key].get(b, 0.0)
            if sec > 1e-3:
                ax2.barh(row, sec, left=left, color=colors[b], label=b if row == 0 or b not in
                         r["buckets_s"]["simulated"] else None)
                left += sec
    ax2.set_yticks([0, 1])
    ax2.set_yticklabels(["simulated", "measured\n(goodput.json)"])
    ax2.set_xlabel("seconds")
    h, l = ax2.get_legend_handles_labels()
    uniq = dict(zip(l, h))
    ax2.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax2.set_title(f"{r['steps']} steps, kills after {r['kill_steps']}, wall {r['wall_s']:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- CLI ----------------------------------------------------------------------
def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``validate`` to an argparse subparsers object."""
    p = subparsers.add_parser("validate", help="real CPU job with SIGKILLs vs the goodput simulator")
    p.add_argument("--steps", type=int_at_least(1), default=2000)
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=200)
    p.add_argument("--kills", default="700,1500", help="steps after which the job is SIGKILLed")
    p.add_argument("--measure-steps", type=int_at_least(1), default=None,
                   help="steps of each cost-measuring run (default 3 x checkpoint-every)")
    p.add_argument("--no-predict", dest="predict", action="store_false",
                   help="skip the separate cost-measuring runs (job costs only)")
    p.add_argument("--topology", default="cpu-2x4")
    p.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=output_path, default=None, help="write results here")
    p.add_argument("--png", type=output_path, default=None, help="write a measured-vs-simulated chart here")
    p.set_defaults(func=_cli_main)
    return p


def _cli_main(args: argparse.Namespace) -> int:
    try:
        try:
            kills = [int(x) for x in args.kills.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--kills expects step numbers separated by commas (e.g. 700,1500), but got "
                             f"{args.kills!r}") from None
        _check(args.steps, args.checkpoint_every, kills)
    except ValueError as e:
        print(f"resilax validate: {e}", file=sys.stderr)
        return 2
    validate(steps=args.steps, checkpoint_every=args.checkpoint_every, kills=kills,
             measure_steps=args.measure_steps, predict=args.predict, topology=args.topology,
             workdir=args.workdir,
             seed=args.seed, json_path=args.json, png_path=args.png)
    return 0
