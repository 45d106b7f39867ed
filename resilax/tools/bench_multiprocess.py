"""`resilax bench multiprocess`: a worker SIGKILLed under `resilax launch`, kill to resume by phase.

Runs ``resilax launch -n N --devices-per-process K -- resilax train --layout sharded``,
kills a random worker by its pid in ``processes.json`` once generation 0 is past its first
checkpoint, and times the way back from the heartbeats, the supervisor's history and the
restored worker's events:

- ``detect``: the kill -> the supervisor sees the death;
- ``agree``: -> every worker of the new generation has joined the new coordination
  service (stop the survivors, new service, start N processes, import, attach);
- ``restore``: the newest Orbax checkpoint read back and verified (process 0's event);
- ``compile``: the rest until the new generation's first step is done (state set-up,
  loading executables from the persistent cache, the step itself);
- ``replay``: redoing the steps between the checkpoint and the step reached at the kill.

``kill_to_resume_s`` is the kill -> the job is back at the step it had reached. The run
is done twice in one invocation: with the host state store (the new generation restores
every shard from the hosts' stores, the dead host's from its neighbour's mirror) and with
``--host-store-every 0`` (relaunch + the newest Orbax checkpoint: ``restart_*``); with
``--spares S`` a third time with the host state store and S warm spares (``spares_*``: the
new generation's first S workers are processes that already imported JAX and resilax; the
kill waits until they are warm); with ``--standby`` once more with the host state store
and a standby generation (``standby_*``: the next generation's processes attached to their
own service, built their programs and parked before the kill; ``agree`` is then the death
noticed -> the go, and ``marks_after_noticed_s`` splits the rest by the workers' set-up
marks); with ``--in-place --shrink backend`` (``in_place_*``: the survivors go
on in place on their own devices, no new generation; kill -> every live worker back at the
step it had reached, phases from the survivors' ``recovery`` event: ``agree`` is from the
kill to the agreement on the step: the survivors leave their broken collective, those not
connected to the dead one once the others cut their connections after the verdict); with ``--in-place`` and no spare (``shrink_reform_*``:
the survivors leave their broken step, detach and re-form alone, as a generation of N - 1
processes in their own processes, the dead one's failure domain empty; phases as for a new
generation); and with ``--in-place`` and one warm spare
(``reform_*``: the survivors leave their broken step, detach and rejoin the next generation
in their own processes with the spare in the dead place; phases as for a new generation).
``final_max_rel_diff`` compares the final state with a failure-free single-process run
of the same topology.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from resilax._src.io import write_json
from resilax.tools.launch import heartbeats, spare_heartbeats
from resilax.tools.argtypes import int_at_least, output_path


PHASES = ("detect", "agree", "restore", "compile", "replay")


def add_arguments(p) -> None:
    p.add_argument("--json", type=output_path, default=None, help="write results here")
    p.add_argument("-n", type=int_at_least(1), default=4, help="worker processes")
    p.add_argument("--devices-per-process", type=int_at_least(1), default=2)
    p.add_argument("--topology", default="cpu-4x2")
    p.add_argument("--steps", type=int_at_least(1), default=40)
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=5)
    p.add_argument("--kill-after", type=int_at_least(1), default=12, help="kill once every worker is past this step")
    p.add_argument("--spares", type=int_at_least(0), default=0, metavar="S",
                   help="also measure the host-store run with `resilax launch --spares S` (0: not measured)")
    p.add_argument("--standby", action="store_true",
                   help="also measure the host-store run with `resilax launch --standby` (the next generation set up "
                        "ahead and parked; the kill waits until it is)")
    p.add_argument("--collective-timeout", type=int_at_least(1), default=5, metavar="S",
                   help="resilax launch --collective-timeout for every run: in place, the survivors that were not "
                        "connected to the dead worker notice it only when their collective times out")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workdir", default=None, help="keep files here (default: a temporary directory)")


def _wait(pred, timeout, what, proc):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        if proc.poll() is not None:
            raise RuntimeError(f"resilax bench multiprocess: the launcher exited with {proc.returncode} while "
                               f"waiting for {what}")
        time.sleep(0.02)
    raise RuntimeError(f"resilax bench multiprocess: timed out after {timeout} s waiting for {what}")


def _rel_diff(a, b) -> float:
    import numpy as np

    if sorted(a.files) != sorted(b.files):
        raise RuntimeError(f"resilax bench multiprocess: final states differ in leaves: {sorted(a.files)} vs "
                           f"{sorted(b.files)}")
    worst = 0.0
    for k in b.files:
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return worst


def _warm_spares(run: pathlib.Path) -> int:
    try:
        procs = json.loads((run / "processes.json").read_text())
    except (OSError, ValueError):
        return 0
    hbs = spare_heartbeats(run)
    return sum((hbs.get(int(k)) or {}).get("pid") == pid and hbs[int(k)].get("phase") == "spare"
               for k, pid in (procs.get("spares") or {}).items())


def _standby_parked(run: pathlib.Path, n: int) -> bool:
    """The supervisor's standby generation has all ``n`` processes parked (``standby``)."""
    try:
        pids = json.loads((run / "processes.json").read_text()).get("standby") or {}
    except (OSError, ValueError):
        return False
    if len(pids) != n:
        return False
    got = {}
    for f in (run / "heartbeats").glob("standby*.p*.json"):
        try:
            hb = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        got[hb.get("pid")] = hb.get("phase")
    return all(got.get(pid) == "standby" for pid in pids.values())


def _live(run: pathlib.Path, epoch: int, step: int) -> bool:
    """Every live worker of generation 0 completed ``step`` under membership ``epoch``."""
    try:
        procs = json.loads((run / "processes.json").read_text())
    except (OSError, ValueError):
        return False
    hbs = heartbeats(run, 0)
    live = [hbs.get(int(i)) or {} for i in procs["workers"]]
    return bool(live) and procs.get("epoch") == epoch and all(
        h.get("epoch") == epoch and (h.get("step") or 0) >= step for h in live)


def _resumed(run: pathlib.Path, n1: int, cond):
    """``(g, heartbeats)`` once the current generation g >= 1 has ``n1`` workers that all meet
    ``cond``; else None."""
    try:
        g = json.loads((run / "processes.json").read_text())["generation"]
    except (OSError, ValueError, KeyError):
        return None
    h = heartbeats(run, g) if g >= 1 else {}
    return (g, h) if len(h) == n1 and all(cond(x) for x in h.values()) else None


def _kill_and_time(work: pathlib.Path, train: list, *, n, devices_per_process, kill_after, rng, store_every,
                   ref, collective_timeout, spares=0, in_place=False, shrink=None, standby=False) -> dict:
    """One launch; SIGKILL one random worker once every worker is past ``kill_after`` (and
    ``spares`` spares are warm)."""
    run, out, summ = work / "run", work / "final.npz", work / "summary.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "resilax", "launch", "-n", str(n), "--devices-per-process", str(devices_per_process),
           "--run-dir", str(run), "--heartbeat", "0.1", "--heartbeat-timeout", "3", "--max-restarts", "2",
           "--collective-timeout", str(collective_timeout),
           "--host-store-every", str(store_every), "--spares", str(spares), *(["--in-place"] if in_place else []),
           *(["--shrink", shrink] if shrink else []), *(["--standby"] if standby else []),
           "--", *train, "--out", str(out),
           "--summary", str(summ)]
    log = open(work / "launch.log", "wb")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: len(h := heartbeats(run, 0)) == n and all((x.get("step") or 0) >= kill_after for x in h.values()),
              600, f"every worker past step {kill_after}", p)
        if spares:
            _wait(lambda: _warm_spares(run) >= spares, 600, f"{spares} warm spares", p)
        if standby:
            _wait(lambda: _standby_parked(run, n), 600, "the standby generation parked", p)
        time.sleep(rng.uniform(0, 0.5))
        procs = json.loads((run / "processes.json").read_text())
        victim = rng.randrange(n)
        kill_step = max(x.get("step") or 0 for x in heartbeats(run, 0).values())
        t_kill = time.time()
        os.kill(procs["workers"][str(victim)], signal.SIGKILL)
        print(f"      killed process {victim} (pid {procs['workers'][str(victim)]}) at step {kill_step}", flush=True)
        if in_place and not spares and shrink == "backend":
            _wait(lambda: _live(run, 1, kill_step), 600, f"the survivors back at step {kill_step} in place", p)
            t_resume = time.time()
            rc = p.wait(timeout=600)
            return _in_place_result(work, rc, t_kill, t_resume, kill_step, victim, ref)
        n1 = n - 1 if in_place and not spares else n  # re-formed without a spare: the survivors alone
        # The generation that resumes is the newest one, not always generation 1: one that fails
        # on the way (a worker taken for hung under load) is part of the way back. Waiting for
        # generation 1 alone was the race of issue 51: once it failed and the next one finished
        # the job, the launcher exited with 0 while the bench still waited for generation 1.
        g, first = _wait(lambda: _resumed(run, n1, lambda h: h.get("first_step_t")), 600,
                         "the new generation's first step", p)
        joined_t = max(x["joined_t"] for x in first.values())
        first_t = max(x["first_step_t"] for x in first.values())
        marks = {}  # each set-up mark of the new generation: its slowest worker's
        for x in first.values():
            for k, t in (x.get("marks") or {}).items():
                marks[k] = max(marks.get(k, t), t)
        g, _ = _wait(lambda: _resumed(run, n1, lambda h: (h.get("step") or 0) >= kill_step), 600,
                     f"the new generation back at step {kill_step}", p)
        t_resume = time.time()
        rc = p.wait(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        log.close()
    if rc:
        raise RuntimeError(f"resilax bench multiprocess: the launcher exited with {rc}; see {work / 'launch.log'}")
    hist = json.loads((run / "launch_history.json").read_text())["generations"]
    events = json.loads(summ.read_text())["events"]
    restore = [e for e in events if e["kind"] == "restore"]
    log = (work / "launch.log").read_text(errors="replace").splitlines()
    # the step generation g resumed at, from its process 0 (the summary is the last generation's)
    said = [m for line in log if (m := re.match(rf"\[g{g} p0\] resumed at step (\d+)", line))]
    restored_step = int(said[0].group(1)) if said else restore[-1]["step"]
    # (the restore's seconds are in the last generation's summary only: not known when a later
    # generation ran after the one that resumed; the compile phase then includes it)
    restore_s = sum(float(e["seconds"]) for e in restore) if hist[-1]["generation"] == g else 0.0
    noticed = hist[0]["ended"]
    import numpy as np

    gen1 = [line for line in log if f"] generation {g}: " in line]
    return {
        # since the death was noticed: attached (to the service) / go (a standby told to go) / programs
        # (built ahead) / compiled (the first step's programs ready, every worker past the barrier)
        "marks_after_noticed_s": {k: t - noticed for k, t in sorted(marks.items(), key=lambda kv: kv[1])},
        "kill_to_resume_s": t_resume - t_kill,
        "phases": {"detect": noticed - t_kill, "agree": joined_t - noticed, "restore": restore_s,
                   "compile": max(0.0, first_t - joined_t - restore_s), "replay": t_resume - first_t},
        "lost_steps": max(0, kill_step - restored_step),  # a step may complete between reading it and the kill
        "final_max_rel_diff": _rel_diff(np.load(out, allow_pickle=False), ref),
        "killed_process": victim, "kill_step": kill_step, "restored_step": restored_step,
        "restored_from": [e["source"] for e in restore], "detected_as": hist[0]["why"],
        "spares": spares, "standby": standby, "generation_1": gen1[0].split("] ", 1)[1] if gen1 else None,
        "resumed_in_generation": g, "generations": [[h["outcome"], h["why"]] for h in hist],
    }


def _in_place_result(work, rc, t_kill, t_resume, kill_step, victim, ref) -> dict:
    import numpy as np

    if rc:
        raise RuntimeError(f"resilax bench multiprocess: the launcher exited with {rc}; see {work / 'launch.log'}")
    hist = json.loads((work / "run" / "launch_history.json").read_text())["generations"]
    if [h["outcome"] for h in hist] != ["shrunk", "done"]:
        raise RuntimeError(f"resilax bench multiprocess: --in-place did not go on in place: {hist}")
    ev = [e for e in json.loads((work / "summary.json").read_text())["events"]
          if e["kind"] == "recovery" and e.get("in_place")][-1]
    sec = ev["seconds"]
    detect = hist[0]["ended"] - t_kill
    total = t_resume - t_kill
    agree = max(0.0, total - detect - sec["compile"] - sec["restore"])
    replay_etc = total - detect - agree - sec["compile"] - sec["restore"]
    return {
        "kill_to_resume_s": total,
        "phases": {"detect": detect, "agree": agree, "restore": sec["restore"], "compile": sec["compile"],
                   "replay": max(0.0, replay_etc)},
        "lost_steps": max(0, kill_step - ev["restored_step"]),
        "final_max_rel_diff": _rel_diff(np.load(work / "final.npz", allow_pickle=False), ref),
        "killed_process": victim, "kill_step": kill_step, "restored_step": ev["restored_step"],
        "restored_from": ["host_store (own, in place)"], "detected_as": hist[0]["why"], "spares": 0,
        "survivor_event_seconds": sec, "compiled_ahead": ev["compiled_ahead"], "mesh_after": ev["mesh"],
        "generations": [[h["outcome"], h["why"]] for h in hist],
    }


def bench_multiprocess(*, n=4, devices_per_process=2, topology="cpu-4x2", steps=40, checkpoint_every=5,
                       kill_after=12, seed=None, workdir=None, spares=0, collective_timeout=5, standby=False) -> dict:
    import numpy as np

    if spares < 0:
        raise ValueError(f"resilax bench multiprocess: --spares must be >= 0, got {spares}")
    rng = random.Random(seed)
    runs = 6 + bool(spares) + bool(standby)
    own = workdir is None
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="resilax-bench-mp-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    train = ["resilax", "train", "--topology", topology, "--layout", "sharded", "--steps", str(steps),
             "--checkpoint-every", str(checkpoint_every), "--log-every", "10"]
    print(f"[1/{runs}] failure-free single-process reference: {topology}, {steps} steps", flush=True)
    r = subprocess.run([sys.executable, "-m", *train, "--no-log", "--no-peers", "--quiet", "--checkpoint-dir",
                        str(work / "ref_ck"), "--out", str(work / "ref.npz")], env=dict(os.environ), timeout=600,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"resilax bench multiprocess: the reference run failed:\n{r.stderr[-3000:]}")
    ref = np.load(work / "ref.npz", allow_pickle=False)
    common = dict(n=n, devices_per_process=devices_per_process, kill_after=kill_after, ref=ref,
                  collective_timeout=collective_timeout)
    done = [1]

    def measure(name, what, **kw):  # one launch with one kill, in work/<name>, its own random stream
        done[0] += 1
        print(f"[{done[0]}/{runs}] {what}", flush=True)
        (work / name).mkdir()
        try:
            return _kill_and_time(work / name, train, rng=random.Random(rng.random()), **common, **kw)
        except RuntimeError as err:  # one launch that did not come back the measured way loses its column only
            print(f"      failed: {err}", flush=True)
            nan = float("nan")
            return {"error": str(err), "kill_to_resume_s": nan, "phases": dict.fromkeys(PHASES, nan),
                    "lost_steps": -1, "final_max_rel_diff": nan, "kill_step": -1, "restored_step": -1,
                    "generations": None}

    a = measure("store", f"resilax launch -n {n} --devices-per-process {devices_per_process} (host state store every "
                         f"step): SIGKILL a random worker past step {kill_after}", store_every=1)
    b = measure("restart", "the same kill with --host-store-every 0: relaunch + Orbax checkpoint restore",
                store_every=0)
    c = measure("spares", f"the host-store run with --spares {spares}: the new generation's workers come from warm "
                          f"spares", store_every=1, spares=spares) if spares else None
    sb = measure("standby", "the host-store run with --standby: the next generation's processes attached, built their "
                            "programs and parked ahead; the kill waits until they are", store_every=1,
                 standby=True) if standby else None
    d = measure("in_place", "the host-store run with --in-place --shrink backend: the survivors go on without the "
                            "dead worker on their backend", store_every=1, in_place=True, shrink="backend")
    f = measure("shrink", "--in-place, no spare: the survivors re-form alone as a smaller job without restarting",
                store_every=1, in_place=True)
    e = measure("reform", "--in-place with 1 warm spare: the survivors re-form with it as the next generation "
                          "without restarting", store_every=1, in_place=True, spares=1)

    def keys(prefix, x):  # a run's headline numbers under ``<prefix>_*`` and the whole run as ``<prefix>_run``
        return {f"{prefix}_{k}": x[k] for k in ("kill_to_resume_s", "phases", "lost_steps", "final_max_rel_diff")} | \
            {f"{prefix}_run": x}

    result = {
        "kill_to_resume_s": a["kill_to_resume_s"], "phases": a["phases"], "lost_steps": a["lost_steps"],
        "final_max_rel_diff": a["final_max_rel_diff"],
        "restart_kill_to_resume_s": b["kill_to_resume_s"], "restart_lost_steps": b["lost_steps"],
        "restart_phases": b["phases"], "restart_final_max_rel_diff": b["final_max_rel_diff"],
        "recovery_path": "new generation on a fresh coordination service restoring from the host state stores "
                         "(dead host's shards from its ring neighbour's mirror); restart_*: the same with the "
                         "stores off (newest Orbax checkpoint)",
        "host_store_run": a, "restart_run": b,
        "setup": {"processes": n, "devices_per_process": devices_per_process, "topology": topology, "steps": steps,
                  "checkpoint_every": checkpoint_every, "cpu_count": os.cpu_count(), "spares": spares,
                  "collective_timeout_s": collective_timeout, "standby": standby},
        **keys("in_place", d), **keys("reform", e), **keys("shrink_reform", f),
        **(keys("spares", c) if c is not None else {}),
        **(keys("standby", sb) if sb is not None else {}),
    }
    if own:
        shutil.rmtree(work, ignore_errors=True)
    return result


def run(args) -> int:
    r = bench_multiprocess(n=args.n, devices_per_process=args.devices_per_process, topology=args.topology,
                           steps=args.steps, checkpoint_every=args.checkpoint_every, kill_after=args.kill_after,
                           seed=args.seed, workdir=args.workdir, spares=args.spares,
                           collective_timeout=args.collective_timeout, standby=args.standby)
    runs = [r["host_store_run"], r["restart_run"]] + ([r["spares_run"]] if "spares_run" in r else []) + \
        ([r["standby_run"]] if "standby_run" in r else []) + [r["in_place_run"], r["shrink_reform_run"], r["reform_run"]]
    heads = ["host store", "restart"] + ([f"+{args.spares} spares"] if "spares_run" in r else []) + \
        (["+standby"] if "standby_run" in r else []) + ["in place", "re-form -1", "re-form"]

    def row(label, vals, fmt):
        print(f"{label:<28}" + "".join(format(v, fmt) for v in vals))

    print(f"\n{'':<28}" + "".join(f"{h:>14}" for h in heads))
    row("kill -> resume (s)", [x["kill_to_resume_s"] for x in runs], "14.2f")
    for k in runs[0]["phases"]:
        row(f"  {k}", [x["phases"][k] for x in runs], "14.2f")
    row("killed at step", [x["kill_step"] for x in runs], "14d")
    row("restored step", [x["restored_step"] for x in runs], "14d")
    row("lost steps", [x["lost_steps"] for x in runs], "14d")
    row("generations after kill", [len(x["generations"]) - 1 if x.get("generations") else -1 for x in runs], "14d")
    row("final max rel diff", [x["final_max_rel_diff"] for x in runs], "14.1e")
    print("(final max rel diff: vs a failure-free single-process run; nan / -1: that launch failed, see its error)")
    if args.json:
        write_json(args.json, r)
        print(f"wrote {args.json}")
    return 0
