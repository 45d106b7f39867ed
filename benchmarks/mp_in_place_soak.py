"""Soak test of `resilax launch --in-place`: the same failure schedule, many times.

Not a test in the suite (each run is about a minute of 5 real processes on 2 cores): it
counts how often the in-place paths fall back to a restart, which one run cannot show. Each
run starts `resilax launch -n 4 --devices-per-process 2 --in-place --spares 1` on
`resilax train --topology cpu-4x2 --layout sharded` (the bit-exact mode) and, at random
moments chosen by the run's seed, in whatever generation runs then with 4 workers:

1. once every worker is past step 7 and the spare is warm, SIGKILLs a random worker: the
   spare is ready for its place, so the others **re-form** with it (they leave their broken
   step and rejoin the next generation in their own processes);
2. as soon as that generation has completed a step (the new spare is still importing),
   SIGKILLs a random worker: no spare is ready, so the others **re-form alone** as a
   smaller job (``--shrink reform``, the default; the spare takes the place if it is warm
   by the time they have detached) or **go on in place** on their backend (``--shrink
   backend``), and **grow back** once the new spare is warm (``--hold-spare S``: the spare
   started then is SIGSTOPped for S seconds, a spare slow to start, so that the survivors
   surely find none ready);
3. 3 steps into the newest generation of 4, SIGSTOPs a random worker: found by its stale
   heartbeat and killed; re-form or shrink, depending on the spare.

Each run is one of: ``clean`` (the job ended by itself, no generation failed, and the final
state is bitwise the failure-free single-process run's), ``fell back`` (an in-place path
failed and a new generation restarted every worker; still bitwise), ``hung`` (the launch
did not end: the workers' Python stacks are dumped with py-spy) or ``wrong`` (the final state
differs, or none). Logs of the runs that are not clean are kept.

    python benchmarks/mp_in_place_soak.py --runs 10 --seed 301 [--shrink backend] --json benchmarks/results/mp_in_place_soak.json
"""

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from resilax.tools.launch import _read_json  # noqa: E402

STEPS, EVERY = 40, 5
TRAIN = ["resilax", "train", "--topology", "cpu-4x2", "--layout", "sharded", "--steps", str(STEPS),
         "--checkpoint-every", str(EVERY), "--log-every", "10"]


def _env():
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("XLA_FLAGS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _live_past(run, gen, step, n):
    from resilax.tools.launch import PROCESSES_JSON, heartbeats

    procs = _read_json(os.path.join(run, PROCESSES_JSON))
    if not procs or procs["generation"] != gen or procs.get("status") != "running" or len(procs["workers"]) != n:
        return None
    hbs = heartbeats(run, gen)
    live = [hbs.get(int(i)) or {} for i in procs["workers"]]
    return procs if all((h.get("step") or -1) >= step and h.get("epoch") == procs.get("epoch", 0)
                        for h in live) else None


def _handled(run, gen: int) -> bool:
    """The supervisor acted on the kill: a newer generation, or fewer than 4 live workers."""
    from resilax.tools.launch import PROCESSES_JSON

    procs = _read_json(os.path.join(run, PROCESSES_JSON)) or {}
    return procs.get("generation") != gen or len(procs.get("workers", {})) < 4


def _running(run, at_least: int = 0, spare: bool = False):
    """processes.json when the newest generation runs 4 workers that each completed a step
    (at least step ``at_least``), with a warm spare if ``spare``; else None."""
    from resilax.tools.launch import PROCESSES_JSON, heartbeats, spare_heartbeats

    procs = _read_json(os.path.join(run, PROCESSES_JSON))
    if not procs or procs.get("status") != "running" or len(procs["workers"]) != 4:
        return None
    hbs = heartbeats(run, procs["generation"])
    live = [hbs.get(int(i)) or {} for i in procs["workers"]]
    if not all(h.get("first_step_t") and h.get("epoch") == procs.get("epoch", 0)
               and (h.get("step") or 0) >= at_least for h in live):
        return None
    if spare and not any((h or {}).get("phase") == "spare" for h in spare_heartbeats(run).values()):
        return None
    return procs


def _wait(pred, timeout, proc):
    """``pred()``'s first true value within ``timeout`` s; None if the launch ended or the time ran out."""
    from resilax.tools.bench_multiprocess import _wait as wait

    try:
        return wait(pred, timeout, "the soak's next step", proc)
    except RuntimeError:
        return None


def _dump_stacks(run, path):
    """The Python stacks of a launch that did not end (py-spy, when installed), for the log."""
    from resilax.tools.launch import PROCESSES_JSON

    procs = _read_json(os.path.join(run, PROCESSES_JSON)) or {}
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spy = here if os.path.exists(here) else "py-spy"
    with open(path, "w") as f:
        for k, pid in sorted((procs.get("workers") or {}).items()):
            r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            f.write(f"== process {k} (pid {pid})\n{r.stdout}{r.stderr}\n")


def _cont(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # replaced meanwhile (a held spare that was warm looks hung)
        pass


def one_run(seed: int, where: str, reference, shrink: str = "reform", hold_spare: float = 0.0) -> dict:
    rng = random.Random(seed)
    run, out = os.path.join(where, "run"), os.path.join(where, "final.npz")
    cmd = [sys.executable, "-m", "resilax", "launch", "-n", "4", "--devices-per-process", "2", "--run-dir", run,
           "--heartbeat", "0.2", "--heartbeat-timeout", "2", "--min-step-deadline", "20", "--max-restarts", "3",
           "--spares", "1", "--in-place", "--shrink", shrink, "--", *TRAIN, "--out", out]
    os.makedirs(where, exist_ok=True)
    log_path = os.path.join(where, "launch.log")
    t0 = time.time()
    done = []
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # (signal, steps past the newest generation's first step, wait for a warm spare)
            plan = [(signal.SIGKILL, EVERY + 2, True), (signal.SIGKILL, 0, False), (signal.SIGSTOP, 3, False)]
            for sig, past, spare in plan:
                procs = _wait(lambda: _running(run, 0, spare), 240, p)
                if procs is not None and past:
                    from resilax.tools.launch import heartbeats

                    base = min(h.get("step") or 0 for h in heartbeats(run, procs["generation"]).values())
                    procs = _wait(lambda: _running(run, base + past), 240, p)
                if procs is None:
                    break
                time.sleep(rng.uniform(0, 1.0) if past else 0.0)
                k = rng.choice(sorted(int(i) for i in procs["workers"]))
                os.kill(procs["workers"][str(k)], sig)
                done.append((procs["generation"], sig.name, k))
                if hold_spare and not spare and sig == signal.SIGKILL:  # the spare(s) starting now: held
                    held = _wait(lambda: set((_read_json(os.path.join(run, "processes.json")) or {}).get("spares", {})
                                             .values()), 60, p)
                    for pid in held or ():
                        os.kill(pid, signal.SIGSTOP)
                        threading.Timer(hold_spare, _cont, (pid,)).start()
                _wait(lambda: _handled(run, procs["generation"]), 60, p)
            try:
                rc = p.wait(timeout=150)
            except subprocess.TimeoutExpired:
                rc = None
                _dump_stacks(run, os.path.join(where, "stacks.txt"))
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = open(log_path, errors="replace").read()
    hist = (_read_json(os.path.join(run, "launch_history.json")) or {}).get("generations", [])
    outcomes = [(g["generation"], g["outcome"]) for g in hist]
    smaller = sum(len(g.get("processes") or [0] * 4) < 4 for g in hist)  # generations re-formed without a spare
    whys = [g.get("why", "")[:160] for g in hist]
    bitwise = None
    if os.path.exists(out):
        final = np.load(out, allow_pickle=False)
        bitwise = sorted(final.files) == sorted(reference.files) and all(
            np.array_equal(final[k], reference[k]) for k in final.files)
    fails = [ln.split("] ", 1)[1][:200] for ln in text.splitlines()
             if "Gloo" in ln and "jax.errors.JaxRuntimeError" in ln]
    clean = rc == 0 and bitwise is True and outcomes and outcomes[-1][1] == "done" and \
        not any(o == "failed" for _, o in outcomes)
    kind = "clean" if clean else "hung" if rc is None else "fell back" if rc == 0 and bitwise else "wrong"
    return {"seed": seed, "rc": rc, "kills": done, "history": outcomes, "smaller_generations": smaller, "bitwise": bitwise, "clean": clean, "kind": kind,
            "errors": fails[:6], "whys": whys, "wall_s": time.time() - t0, "log": log_path,
            "hung": rc is None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shrink", choices=("reform", "backend"), default="reform", help="resilax launch --shrink")
    ap.add_argument("--hold-spare", type=float, default=0.0, metavar="S",
                    help="SIGSTOP the spare started at the second kill for S seconds (0: not held)")
    a = ap.parse_args()
    from resilax.tools.bench import write_result

    root = tempfile.mkdtemp(prefix="resilax-soak-")
    ref = os.path.join(root, "ref.npz")
    r = subprocess.run([sys.executable, "-m", *TRAIN, "--no-log", "--no-peers", "--checkpoint-dir",
                        os.path.join(root, "ck"), "--out", ref, "--quiet"], env=_env(), capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"the reference run failed:\n{r.stderr[-3000:]}")
    reference = np.load(ref, allow_pickle=False)
    rows = []
    for i in range(a.runs):
        row = one_run(a.seed + i, os.path.join(root, f"run{i}"), reference, a.shrink, a.hold_spare)
        rows.append(row)
        print(f"run {i + 1}/{a.runs} seed {row['seed']}: {row['kind']}; kills "
              f"{row['kills']}; history {row['history']}; bitwise {row['bitwise']}; "
              f"{row['wall_s']:.0f} s" + (f"; why {row['whys']}; errors {row['errors'][:2]}; log {row['log']}" if not row['clean']
                                         else ""), flush=True)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("clean", "fell back", "hung", "wrong")}
    paths = {k: sum(o == k for r in rows for _, o in r["history"]) for k in ("reform", "shrunk", "regrow", "failed")}
    paths["smaller_generations"] = sum(r["smaller_generations"] for r in rows)
    print(f"\n{len(rows)} runs: {kinds}; transitions over all runs: {paths}")
    write_result(a.json, {"benchmark": "mp_in_place_soak", "shrink": a.shrink, "hold_spare_s": a.hold_spare,
                          "runs": len(rows), "kinds": kinds,
                          "clean": kinds["clean"], "transitions": paths, "rows": rows})


if __name__ == "__main__":
    main()
