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

``kill_to_resume_s`` is the kill -> the job is back at the step it had reached. The only
recovery path built so far is the new generation restoring the checkpoint (path B), so
``restart_kill_to_resume_s`` and ``restart_lost_steps`` are that same measurement, and
``recovery_path`` says so. ``final_max_rel_diff`` compares the final state with a
failure-free single-process run of the same topology.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from resilax._src.io import write_json


def add_arguments(p) -> None:
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("-n", type=int, default=4, help="worker processes")
    p.add_argument("--devices-per-process", type=int, default=2)
    p.add_argument("--topology", default="cpu-4x2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=12, help="kill once every worker is past this step")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workdir", default=None, help="keep files here (default: a temporary directory)")


def _hb(run: pathlib.Path, gen: int) -> dict:
    out = {}
    for f in (run / "heartbeats").glob(f"g{gen}.p*.json"):
        try:
            hb = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        out[hb["process_id"]] = hb
    return out


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


def bench_multiprocess(*, n=4, devices_per_process=2, topology="cpu-4x2", steps=40, checkpoint_every=5,
                       kill_after=12, seed=None, workdir=None) -> dict:
    import numpy as np

    rng = random.Random(seed)
    own = workdir is None
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="resilax-bench-mp-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run, out, summ = work / "run", work / "final.npz", work / "summary.json"
    train = ["resilax", "train", "--topology", topology, "--layout", "sharded", "--steps", str(steps),
             "--checkpoint-every", str(checkpoint_every), "--log-every", "10"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    print(f"[1/2] failure-free single-process reference: {topology}, {steps} steps", flush=True)
    ref = subprocess.run([sys.executable, "-m", *train, "--no-log", "--no-peers", "--quiet", "--checkpoint-dir",
                          str(work / "ref_ck"), "--out", str(work / "ref.npz")], env=env, timeout=600,
                         capture_output=True, text=True)
    if ref.returncode:
        raise RuntimeError(f"resilax bench multiprocess: the reference run failed:\n{ref.stderr[-3000:]}")
    print(f"[2/2] resilax launch -n {n} --devices-per-process {devices_per_process}: SIGKILL a random worker past "
          f"step {kill_after}", flush=True)
    cmd = [sys.executable, "-m", "resilax", "launch", "-n", str(n), "--devices-per-process", str(devices_per_process),
           "--run-dir", str(run), "--heartbeat", "0.1", "--heartbeat-timeout", "3", "--max-restarts", "2", "--",
           *train, "--out", str(out), "--summary", str(summ)]
    log = open(work / "launch.log", "wb")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: len(h := _hb(run, 0)) == n and all((x.get("step") or 0) >= kill_after for x in h.values()),
              600, f"every worker past step {kill_after}", p)
        time.sleep(rng.uniform(0, 0.5))
        procs = json.loads((run / "processes.json").read_text())
        victim = rng.randrange(n)
        kill_step = max(x.get("step") or 0 for x in _hb(run, 0).values())
        t_kill = time.time()
        os.kill(procs["workers"][str(victim)], signal.SIGKILL)
        print(f"      killed process {victim} (pid {procs['workers'][str(victim)]}) at step {kill_step}", flush=True)
        first = _wait(lambda: (h := _hb(run, 1)) and len(h) == n and all(x.get("first_step_t") for x in h.values())
                      and h, 600, "the new generation's first step", p)
        joined_t = max(x["joined_t"] for x in first.values())
        first_t = max(x["first_step_t"] for x in first.values())
        _wait(lambda: len(h := _hb(run, 1)) == n and all((x.get("step") or 0) >= kill_step for x in h.values()),
              600, f"the new generation back at step {kill_step}", p)
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
    restore = next(e for e in events if e["kind"] == "restore")
    restored_step = restore["step"]
    noticed = hist[0]["ended"]
    restore_s = float(restore["seconds"])
    phases = {"detect": noticed - t_kill, "agree": joined_t - noticed, "restore": restore_s,
              "compile": max(0.0, first_t - joined_t - restore_s), "replay": t_resume - first_t}
    final = np.load(out, allow_pickle=False)
    result = {
        "kill_to_resume_s": t_resume - t_kill,
        "phases": phases,
        "lost_steps": kill_step - restored_step,
        "final_max_rel_diff": _rel_diff(final, np.load(work / "ref.npz", allow_pickle=False)),
        "restart_kill_to_resume_s": t_resume - t_kill,
        "restart_lost_steps": kill_step - restored_step,
        "recovery_path": "new generation restoring the newest Orbax checkpoint (path B): the only path built so far, "
                         "so the restart_* keys are the same measurement; host-store and shrink-in-place recovery "
                         "are not built yet",
        "killed_process": victim, "kill_step": kill_step, "restored_step": restored_step,
        "detected_as": hist[0]["why"], "generations": len(hist),
        "setup": {"processes": n, "devices_per_process": devices_per_process, "topology": topology, "steps": steps,
                  "checkpoint_every": checkpoint_every, "cpu_count": os.cpu_count()},
    }
    if own:
        shutil.rmtree(work, ignore_errors=True)
    return result


def run(args) -> int:
    r = bench_multiprocess(n=args.n, devices_per_process=args.devices_per_process, topology=args.topology,
                           steps=args.steps, checkpoint_every=args.checkpoint_every, kill_after=args.kill_after,
                           seed=args.seed, workdir=args.workdir)
    print(f"\n{'kill -> resume':<28}{r['kill_to_resume_s']:8.2f} s  (process {r['killed_process']} SIGKILLed at "
          f"step {r['kill_step']}, checkpoint {r['restored_step']} restored)")
    for k, v in r["phases"].items():
        print(f"  {k:<26}{v:8.2f} s")
    print(f"{'lost steps (recomputed)':<28}{r['lost_steps']:8d}")
    print(f"{'final max rel diff':<28}{r['final_max_rel_diff']:8.1e}  (vs failure-free single-process run)")
    print(f"recovery path: {r['recovery_path']}")
    if args.json:
        write_json(args.json, r)
        print(f"wrote {args.json}")
    return 0
