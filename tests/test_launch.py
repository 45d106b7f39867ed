"""`resilax launch`: real worker processes under jax.distributed, killed from outside.

The end-to-end test runs 3 processes x 2 CPU devices (3 slices of 2, `resilax train`'s default
bit-exact mode: the state whole in every process, sharded over its 2 devices) under
``--in-place`` with one warm spare, SIGSTOPs a random worker, SIGKILLs process 0, then a
random worker, by the pids in ``processes.json`` (the survivors re-form each time, with the
spare or alone, and grow back), and checks that the job ends on its own with the state of
a failure-free single-process run of the same topology, bitwise (the replicas' results
cross processes by an all-gather, pure data movement). The second test runs the default mode (``--no-deterministic``), whose gloo
sums differ from the in-process all-reduce in the last bits. With failure domains of 4
devices (`cpu-2x4` as 2 x 4) the bit-exact mode's reference is `launch -n 1`, not a plain
run: under `launch` gloo runs a domain's own all-reduces too, in another order than the
in-process all-reduce (2 devices: the same bits either way); a re-form from 2 processes to 1
ends bitwise on it.
Every subprocess has a timeout and is killed in a ``finally``.
"""

import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from helpers import cli, kill_tree
import pytest

from resilax._src.runtime import jaxdist
from resilax._src.runtime.worker import LaunchEnv
from resilax.tools.launch import PROCESSES_JSON, Supervisor, heartbeats, spare_heartbeats

# 120 steps: the in-place test lets its held spare go once the smaller generation is past a
# checkpoint, and the job must still be running when the spare is warm (with 4 processes,
# under the suite's load, 48 steps once ended 0.3 s before the spare was ready: nothing left
# to grow back into; with 3 copies of the test beside a CPU hog, 64 steps once ended 22 s
# after the spare was let go, before it was warm). Its smaller generation has 2 processes,
# whose steps are fast (~0.1 CPU-s a step for both): at the same priority as the spare they ran
# 74-85 steps while it warmed up (cold, and beside a busy loop), so the test lowers theirs
# then. A checkpoint every 10 steps: each costs the job's processes ~0.2 CPU-s apiece.
STEPS, EVERY = 120, 10
# The in-place test's job: 3 processes x 2 devices, 3 slices of 2 CPU devices (no spec of that
# shape ships in slices/: the test writes this one), the global batch divisible by the 3
# domains. 3 processes are what its scenario needs (one lost, the others going on, a spare,
# growing back); with 4 (cpu-4x2) every start, re-form and step had one process more: 99 CPU-s.
CPU_3X2 = """name = "cpu-3x2"
platform = "cpu"
domain = "slice"
emulated = true
domains = 3
devices_per_domain = 2

[mesh]
axes = { data = 3, fsdp = 2 }
elastic_axis = "data"
"""
N = 3


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    """The in-place test's ``resilax train`` command (its topology spec written to a file)."""
    spec = tmp_path_factory.mktemp("topology") / "cpu-3x2.toml"
    spec.write_text(CPU_3X2)
    return ["resilax", "train", "--topology", str(spec), "--layout", "sharded", "--batch", "48", "--steps", str(STEPS),
            "--checkpoint-every", str(EVERY), "--log-every", "10"]



def _wait(pred, timeout, what, proc=None, log=None):
    """``pred()`` once it is true; fails when ``proc`` (the launcher) exits first or after
    ``timeout`` s, with the end of ``log`` (the launcher's output file) in the message."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher exited with {proc.returncode} while waiting for {what}{_tail(log)}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{_tail(log)}")


def _tail(log, n=5000) -> str:
    try:
        return "\n" + pathlib.Path(log).read_text(errors="replace")[-n:] if log is not None else ""
    except OSError:
        return ""


def _processes(run_dir):
    try:
        return json.loads((run_dir / PROCESSES_JSON).read_text())
    except (OSError, ValueError):
        return None


def _steps(run_dir, gen) -> dict:
    return {i: hb.get("step") for i, hb in heartbeats(run_dir, gen).items()}


def _running(run_dir, gen, n=4):
    p = _processes(run_dir)
    return p if p and p["generation"] == gen and p.get("status") == "running" and len(p["workers"]) == n else None


def _ready_spare(run_dir):
    """The pid of a spare that is warm and waiting, or None."""
    procs = _processes(run_dir) or {}
    hbs = spare_heartbeats(run_dir)
    for k, pid in (procs.get("spares") or {}).items():
        if (hbs.get(int(k)) or {}).get("pid") == pid and hbs[int(k)].get("phase") == "spare":
            return pid
    return None


def _rel_diff(a, b) -> float:
    assert sorted(a.files) == sorted(b.files)
    worst = 0.0
    for k in b.files:
        x, y = a[k].astype(np.float64), b[k].astype(np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return worst


@pytest.fixture(scope="module")
def reference(tmp_path_factory, train):
    """A failure-free single-process run of the same topology and program. Without the
    protections that only read the state and write files (record log, peer copies, the
    replica checks, which `launch` turns off too, and the checkpoints: one at the end), that
    a reference does not need (on cpu-4x2: 17.9 -> 11.2 CPU-s, the same bits)."""
    from helpers import child_env

    d = tmp_path_factory.mktemp("ref")
    out = d / "ref.npz"
    cmd = [sys.executable, "-m", *train, "--no-log", "--no-peers", "--no-health", "--checkpoint-every", str(STEPS),
           "--checkpoint-dir", str(d / "ck"), "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return np.load(out, allow_pickle=False)


def _live_past(run_dir, gen, step, n):
    """The ``n`` live workers of generation ``gen`` (processes.json) all completed ``step``."""
    procs = _processes(run_dir)
    if not procs or procs["generation"] != gen or procs.get("status") != "running" or len(procs["workers"]) != n:
        return None
    hbs = heartbeats(run_dir, gen)
    live = [hbs.get(int(i)) or {} for i in procs["workers"]]  # past the step after the newest shrink:
    return procs if all((h.get("step") or -1) >= step and h.get("epoch") == procs["epoch"] for h in live) else None


def _live_steps(run_dir, gen) -> int:
    """The fewest steps a live worker of ``gen`` completed (0 while ``gen`` has none: between
    generations processes.json lists no workers)."""
    procs = _processes(run_dir) or {}
    hbs = heartbeats(run_dir, gen)
    return min(((hbs.get(int(i)) or {}).get("step") or 0 for i in procs.get("workers", ())), default=0)


def _recovering(run_dir, gen):
    """Some live worker of ``gen`` is going on in place (phase ``recover``) after the newest shrink."""
    procs = _processes(run_dir)
    if not procs or procs["generation"] != gen or not procs.get("epoch"):
        return None
    hbs = heartbeats(run_dir, gen)
    return procs if any((hbs.get(int(i)) or {}).get("phase") == "recover" for i in procs["workers"]) else None


def _gen_running(run_dir, gen, n=4):
    """Generation ``gen`` runs with ``n`` workers, each past its first step."""
    procs = _processes(run_dir)
    if not procs or procs["generation"] != gen or procs.get("status") != "running" or len(procs["workers"]) != n:
        return None
    hbs = heartbeats(run_dir, gen)
    return procs if all((hbs.get(int(i)) or {}).get("first_step_t") for i in procs["workers"]) else None


def test_in_place_re_forms_with_a_spare_then_without_one_grows_back_and_re_forms_again(tmp_path, reference, train):
    """``resilax launch --in-place --spares 1``, 3 processes x 2 devices, the bit-exact mode.
    A SIGSTOPped worker is found by its stale heartbeat and killed; the warm spare is ready
    for its place, so the 2 others leave their broken step, detach, drop their JAX backend
    and rejoin as generation 1 in their own processes (same pids) with the spare, restoring
    from their host stores. Right after generation 1's first step, SIGKILL process 0 and
    hold the next spare (SIGSTOP: one slow to start), so the 2 others re-form alone as
    generation 2, 2 of the job's 3 processes (its failure domain 0 dead from the start),
    and checkpoints go on; once the spare is let go, the job grows back to 3 (generation 3)
    at a step boundary. Right after generation 3's first step, SIGKILL a random other worker
    and hold the next spare for good: the others re-form alone again (generation 4). The
    final state is bitwise that of the failure-free single-process run, no step is lost,
    and every process that was not killed ran the whole job."""
    from helpers import child_env

    rng = random.Random(int(os.environ.get("RESILAX_TEST_SEED", "0")) or None)
    run = tmp_path / "run"
    out = tmp_path / "final.npz"
    lg = tmp_path / "launch.log"
    log = open(lg, "wb")
    cmd = [sys.executable, "-m", "resilax", "launch", "-n", str(N), "--devices-per-process", "2", "--run-dir", str(run),
           "--heartbeat", "0.2", "--heartbeat-timeout", "2", "--min-step-deadline", "20", "--max-restarts", "2",
           "--collective-timeout", "5", "--spares", "1", "--in-place", "--", *train, "--out", str(out)]
    p = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    done, reached, pids = [], [], []

    def kill(procs, who, sig, gen):
        reached.append(_live_steps(run, gen))
        pids.append(dict(procs["workers"]))
        os.kill(procs["workers"][str(who)], sig)
        done.append((sig.name, who))

    try:
        _wait(lambda: _ready_spare(run), 180, "a warm spare", p, lg)
        procs = _wait(lambda: _live_past(run, 0, EVERY + 2, N), 180, f"generation 0 past step {EVERY + 2}", p, lg)
        time.sleep(rng.uniform(0, 1.0))
        kill(procs, rng.randrange(1, N), signal.SIGSTOP, 0)
        procs = _wait(lambda: _gen_running(run, 1, n=N), 120, "generation 1 running", p, lg)
        kill(procs, 0, signal.SIGKILL, 1)
        # the spare started now must not be warm before the survivors detach (it could take
        # the dead place, as it should): hold it (a spare slow to start) until the smaller
        # generation has run past a checkpoint
        spare = _wait(lambda: (_processes(run) or {}).get("spares", {}).get("1"), 60, "the next spare", p, lg)
        os.kill(spare, signal.SIGSTOP)
        small = _wait(lambda: _gen_running(run, 2, n=N - 1), 120, f"generation 2 running with {N - 1} workers", p, lg)
        base = _live_steps(run, 2)
        _wait(lambda: _live_steps(run, 2) >= (base // EVERY + 1) * EVERY + 1, 120, "generation 2 past a checkpoint", p, lg)
        # the job must still run when the spare is warm: its workers yield the CPU to the spare
        # (nice 10, every thread: each worker is a process group of its own) while it imports
        # (~3 CPU-s), instead of the job running ~80 more steps of 2 processes meanwhile
        for pid in small["workers"].values():
            os.setpriority(os.PRIO_PGRP, pid, 10)
        os.kill(spare, signal.SIGCONT)
        procs = _wait(lambda: _gen_running(run, 3, n=N), 120, "generation 3 running (grown back)", p, lg)
        third = rng.randrange(1, N)
        kill(procs, third, signal.SIGKILL, 3)
        os.kill(_wait(lambda: (_processes(run) or {}).get("spares", {}).get("2"), 60, "the next spare", p, lg), signal.SIGSTOP)
        rc = p.wait(timeout=300)  # (the supervisor kills the held spare at the end)
    finally:
        kill_tree(p)
        log.close()
    text = (tmp_path / "launch.log").read_text(errors="replace")
    assert rc == 0, f"{done}\n{text[-6000:]}"
    assert "Traceback" not in text, text[-6000:]  # one line per event, no traceback (issue 53)
    hist = json.loads((run / "launch_history.json").read_text())["generations"]
    whys = "\n".join(f"generation {g['generation']} {g['outcome']}: {g['why']}" for g in hist)
    print(f"{done}\n{whys}\n{text[-6000:]}")  # (pytest cuts a long assertion message: the reasons come first)
    every = list(range(N))
    assert [(g["generation"], g["outcome"], g["processes"]) for g in hist] == [
        (0, "reform", every), (1, "reform", every), (2, "regrow", every[1:]), (3, "reform", every),
        (4, "done", sorted(set(every) - {third}))], f"{done}\n{whys}"
    assert f"process {done[0][1]} " in hist[0]["why"] and "hung: heartbeat" in hist[0]["why"]
    assert "--in-place`: the record log is off" in text  # said, not silently dropped
    assert "process 0 " in hist[1]["why"] and "signal SIGKILL" in hist[1]["why"]
    assert f"growing back to {N}" in hist[2]["why"]
    left0 = sorted(int(i) for i in pids[0] if int(i) != done[0][1])
    assert f"processes {left0} re-attached without restarting" in text, text[-3000:]
    line = [ln for ln in text.splitlines() if f"generation 1: {N} workers" in ln][0]
    assert all(str(pids[0][str(i)]) in line for i in left0), (line, pids[0])
    # generation 2: the job's processes 1.. as process ids 0.., in their own pids
    line = [ln for ln in text.splitlines() if f"generation 2: {N - 1} workers" in ln][0]
    assert f"(processes {every[1:]} of the job's {N}" in line and all(str(pids[1][str(i)]) in line for i in every[1:]), \
        line
    assert small["slots"] == {str(i - 1): i for i in every[1:]}, small
    for i in every[1:]:
        assert f"[g2 p{i - 1}] re-attached as process {i - 1} of {N - 1} (generation 2)" in text
        assert f"[g3 p{i}] re-attached as process {i} of {N} (generation 3)" in text
    procs = _processes(run)
    assert procs["status"] == "done" and procs["generation"] == 4
    assert f"process {third} " in hist[3]["why"] and "signal SIGKILL" in hist[3]["why"]
    final = np.load(out, allow_pickle=False)
    import hashlib

    assert hashlib.sha256(out.read_bytes()).hexdigest() == pathlib.Path(f"{out}.sha256").read_text().split()[0]
    assert sorted(final.files) == sorted(reference.files)
    assert all(np.array_equal(final[k], reference[k]) for k in final.files), (_rel_diff(final, reference), done,
                                                                               text[-3000:])
    # no step lost: each generation after a kill resumed (from the host stores) at least at
    # the step every live worker had completed before it
    for g, n, k in ((1, N, 0), (2, N - 1, 1), (4, N - 1, 2)):  # (generation, its processes, the kill before it)
        lines = [ln for ln in text.splitlines() if ln.startswith(f"[g{g} p") and "resumed at step" in ln]
        assert len(lines) == n and all("(host store: " in ln for ln in lines), lines
        assert all(int(ln.split("resumed at step ")[1].split()[0]) >= reached[k] for ln in lines), (lines, reached)
    # the smaller generation saved its checkpoints (Orbax on its 3 processes): generation 3
    # resumed with the newest one that generation 2 was due to save
    def resumed(g):
        ln = [ln for ln in text.splitlines() if ln.startswith(f"[g{g} p0]") and "resumed at step" in ln][0]
        return int(ln.split("resumed at step ")[1].split()[0]), int(ln.split("newest checkpoint: ")[1].split(")")[0])

    (r2, _), (r3, ck3) = resumed(2), resumed(3)
    due = [s for s in range(r2 + 1, r3 + 1) if s % EVERY == 0]
    assert not due or ck3 >= due[-1], (r2, r3, ck3)
    assert max(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit()) == STEPS


# ---------------------------------------------------------------- the supervisor alone (no JAX workers)
def _sup(tmp_path, code: str, **kw):
    return Supervisor([sys.executable, "-c", code], n=2, devices_per_process=1, run_dir=tmp_path / "run",
                      heartbeat_s=0.1, heartbeat_timeout_s=3.0, startup_timeout_s=20, **kw)


def test_supervisor_gives_up_after_max_restarts_with_the_workers_exit_code(tmp_path):
    sup = _sup(tmp_path, "import sys; sys.exit(3)", max_restarts=2)
    assert sup.run() == 3
    hist = json.loads((tmp_path / "run" / "launch_history.json").read_text())["generations"]
    assert len(hist) == 3 and all("exited with code 3" in g["why"] for g in hist)
    procs = _processes(tmp_path / "run")
    assert procs["status"] == "failed" and procs["generation"] == 2 and procs["supervisor"] == os.getpid()


# Each generation's workers report step 10 x generation (``PROGRESS``: 0 in every one), then
# process 1 fails in generations 0-3 and process 0 exits 0.
FAILING_WORKER = """
import json, os, sys, time
g = int(os.environ["RESILAX_GENERATION"])
with open(os.environ["RESILAX_HEARTBEAT_FILE"], "w") as f:
    json.dump({"pid": os.getpid(), "generation": g, "t": time.time(), "phase": "step", "step": PROGRESS * g}, f)
if os.environ["RESILAX_PROCESS_ID"] == "1" and g < 4:
    sys.exit(3)
time.sleep(0.3)
"""


@pytest.mark.parametrize("progress", [10, 0])
def test_supervisor_restarts_a_job_that_gets_further_each_time_but_ends_a_crash_loop(tmp_path, progress):
    """--max-restarts 1 counts failures in a row that get no further than before: a job that
    got 10 steps further before each of its 4 failures is restarted each time and ends; one
    that fails at the same step every time is given up after 1 restart."""
    sup = _sup(tmp_path, FAILING_WORKER.replace("PROGRESS", str(progress)), max_restarts=1)
    rc = sup.run()
    outcomes = [g["outcome"] for g in json.loads((tmp_path / "run" / "launch_history.json").read_text())["generations"]]
    if progress:
        assert rc == 0 and outcomes == ["failed"] * 4 + ["done"], outcomes
    else:
        assert rc == 3 and outcomes == ["failed"] * 2, outcomes


# A worker whose work is done takes 1.5 s to end without a beat, as the interpreter's teardown of
# JAX took over 3 s on a loaded host while its heartbeat thread (a daemon) no longer ran.
SLOW_EXIT_WORKER = """
import atexit, time
atexit.register(time.sleep, 1.5)  # registered first, so it runs after resilax's exit hook: the teardown
from resilax._src.runtime import worker
worker._state["hb"] = hb = worker._Heartbeat(worker.LaunchEnv.from_env())
worker.progress(1, 0.01)
hb.stop()  # (daemon threads do not run during the teardown)
"""


def test_a_worker_silent_while_it_exits_is_not_taken_for_hung(tmp_path):
    """A finished job whose workers are slow to exit ends with 0, not with a restart (one of two
    `resilax bench multiprocess` runs restarted a finished generation: "hung: heartbeat 3.0 s old")."""
    sup = Supervisor([sys.executable, "-c", SLOW_EXIT_WORKER], n=2, devices_per_process=1, run_dir=tmp_path / "run",
                     heartbeat_s=0.1, heartbeat_timeout_s=0.5, startup_timeout_s=20, max_restarts=0)
    assert sup.run() == 0
    hist = json.loads((tmp_path / "run" / "launch_history.json").read_text())["generations"]
    assert [g["outcome"] for g in hist] == ["done"], hist
    assert all(h["exiting"] for h in heartbeats(tmp_path / "run", 0).values())


def test_the_bench_follows_the_generation_that_resumes_not_generation_1(tmp_path):
    """`resilax bench multiprocess` waited for generation 1's first step; when generation 1
    failed before it and generation 2 finished the job, it failed with "the launcher exited with
    0 while waiting for the new generation's first step" (issue 51)."""
    from resilax.tools.bench_multiprocess import _resumed

    run = tmp_path / "run"
    (run / "heartbeats").mkdir(parents=True)

    def now(g, **kw):
        (run / PROCESSES_JSON).write_text(json.dumps({"generation": g}))
        for i in range(2):
            (run / "heartbeats" / f"g{g}.p{i}.json").write_text(json.dumps({"process_id": i, **kw}))

    first = lambda h: h.get("first_step_t")  # noqa: E731
    now(1, step=None)  # generation 1 never completes a step
    assert _resumed(run, 2, first) is None
    now(2, step=13, first_step_t=1.0)
    g, hbs = _resumed(run, 2, first)
    assert g == 2 and sorted(hbs) == [0, 1]
    assert _resumed(run, 2, lambda h: h["step"] >= 14) is None


def test_a_survivor_cuts_its_connections_to_other_processes_only():
    """`peer_links.cut` shuts down the connections to other processes (a survivor's gloo pairs
    with the others), not those within this process (a pair between two of its own devices) nor
    those to a kept port (the coordination service); a wait on a cut one ends at once."""
    import socket

    from resilax._src.runtime import peer_links

    other = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\n"
        "a, b = socket.socket(), socket.socket()\n"
        "for s in (a, b): s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(a.getsockname()[1], b.getsockname()[1], flush=True)\n"
        "x, y = a.accept()[0], b.accept()[0]\n"
        "sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port_a, port_b = map(int, other.stdout.readline().split())
        peer = socket.create_connection(("127.0.0.1", port_a))
        service = socket.create_connection(("127.0.0.1", port_b))
        srv = socket.create_server(("127.0.0.1", 0))
        mine = socket.create_connection(srv.getsockname())
        mine_too = srv.accept()[0]
        assert peer_links.peer_connections(keep=[port_b]) == [peer.fileno()]
        assert peer_links.cut(keep=[port_b]) == 1
        peer.settimeout(5)
        t0 = time.time()
        assert peer.recv(1) == b"" and time.time() - t0 < 1  # the wait ends: no 5 s timeout
        mine.sendall(b"x")
        assert mine_too.recv(1) == b"x"
        assert peer_links.peer_connections() == [service.fileno()]
        assert peer_links.peer_connections(keep=[port_b], within=True) == sorted([mine.fileno(), mine_too.fileno()])
    finally:
        other.kill()
        other.wait()


def test_supervisor_kills_a_worker_that_never_heartbeats(tmp_path):
    # a worker command that is not resilax never writes a heartbeat: the startup deadline ends it
    sup = Supervisor([sys.executable, "-c", "import time; time.sleep(60)"], n=1, devices_per_process=1,
                     run_dir=tmp_path / "run", heartbeat_s=0.1, heartbeat_timeout_s=1.0, startup_timeout_s=1.0,
                     max_restarts=0)
    t0 = time.time()
    assert sup.run() != 0
    assert time.time() - t0 < 15
    hist = json.loads((tmp_path / "run" / "launch_history.json").read_text())["generations"]
    assert "no heartbeat within --startup-timeout" in hist[0]["why"]


def test_supervisor_ends_cleanly_when_workers_exit_0_and_sets_their_env(tmp_path):
    code = ("import os, json; e = {k: v for k, v in os.environ.items() if k.startswith('RESILAX_')}; "
            "open(os.path.join(e['RESILAX_RUN_DIR'], 'env' + e['RESILAX_PROCESS_ID'] + '.json'), 'w').write(json.dumps(e))")
    assert _sup(tmp_path, code).run() == 0
    envs = [LaunchEnv.from_env(json.loads((tmp_path / "run" / f"env{i}.json").read_text())) for i in range(2)]
    assert [e.process_id for e in envs] == [0, 1] and {e.num_processes for e in envs} == {2}
    assert envs[0].coordinator == envs[1].coordinator and envs[0].coordinator.startswith("127.0.0.1:")
    assert _processes(tmp_path / "run")["status"] == "done"


# A worker that is a spare first (or not), then plays a resilax worker: heartbeats with a
# completed step (so the supervisor refills its spares), records what it saw, and:
# generation 0 process 1 fails once both spares are ready; generation 1 exits 0 once both
# spares are ready again (refilled); generation 0 process 0 waits to be stopped.
SPARE_WORKER = r"""
import json, os, sys, time
from resilax._src.runtime import worker
was_spare = worker.is_spare()
if was_spare:
    print("warm and waiting", flush=True)
from resilax._src.runtime import spares
e = spares.wait_for_assignment(prefetch=False)
assert worker.env() == e and os.environ["RESILAX_PROCESS_ID"] == str(e.process_id) and not worker.is_spare()
print(f"assigned: g{e.generation} p{e.process_id}", flush=True)
hb = worker._Heartbeat(e)
hb.first_step_t = time.time()
hb.beat()

def ready_spares():
    try:
        procs = json.load(open(os.path.join(e.run_dir, "processes.json")))
    except (OSError, ValueError):
        return {}
    out = {}
    for k, pid in procs.get("spares", {}).items():
        try:
            h = json.load(open(os.path.join(e.run_dir, "heartbeats", f"spare{k}.json")))
        except (OSError, ValueError):
            continue
        if h.get("pid") == pid and h.get("phase") == "spare":
            out[k] = pid
    return out

if (e.generation, e.process_id) == (0, 0):
    time.sleep(120)
t0 = time.time()
while len(seen := ready_spares()) < 2:
    if time.time() - t0 > 90:
        sys.exit(5)
    time.sleep(0.05)
with open(os.path.join(e.run_dir, f"g{e.generation}.p{e.process_id}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "was_spare": was_spare, "spares_seen": seen}, f)
sys.exit(3 if e.generation == 0 else 0)
"""


def test_supervisor_spares_become_the_next_generations_workers_and_are_refilled(tmp_path, capsys):
    run = tmp_path / "run"
    sup = _sup(tmp_path, SPARE_WORKER, spares=2, max_restarts=1)
    assert sup.run() == 0
    hist = json.loads((run / "launch_history.json").read_text())["generations"]
    assert [g["outcome"] for g in hist] == ["failed", "done"] and "process 1 " in hist[0]["why"], hist
    g0 = json.loads((run / "g0.p1.json").read_text())
    first_spares = g0["spares_seen"]  # started once generation 0 had completed a step
    assert not g0["was_spare"] and sorted(first_spares) == ["0", "1"], g0
    g1 = [json.loads((run / f"g1.p{i}.json").read_text()) for i in range(2)]
    # both workers of generation 1 are the former spares (same pids), and they saw two new
    # spares started after them
    assert all(r["was_spare"] for r in g1) and sorted(r["pid"] for r in g1) == sorted(first_spares.values()), g1
    refilled = g1[0]["spares_seen"]
    assert sorted(refilled) == ["2", "3"] and not set(refilled.values()) & set(first_spares.values()), g1
    procs = _processes(run)
    assert procs["status"] == "done" and procs["spares"] == {} and procs["generation"] == 1
    for pid in refilled.values():  # killed (and reaped) when the job ended
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    out = capsys.readouterr().out
    assert "[spare0] warm and waiting" in out and (run / "logs" / "spare0.log").read_text() == "warm and waiting\n"
    for i in range(2):  # after the assignment the spare's output is the worker's
        assert f"[g1 p{i}] assigned: g1 p{i}" in out and (run / "logs" / f"g1.p{i}.log").read_text() == \
            f"assigned: g1 p{i}\n"


# A worker of the standby test below (no JAX): a standby process parks in the real
# `worker.standby_wait` (its first standby generation's process 0 dies instead: the supervisor
# drops that one and starts another); generation 0's process 1 fails once a standby
# generation is parked, its process 0 waits to be stopped; generation 1 exits 0.
STANDBY_WORKER = r"""
import glob, json, os, sys, time
from resilax._src.runtime import worker
e = worker.LaunchEnv.from_env()
hb = worker._Heartbeat(e)
go = os.environ.get(worker.STANDBY_ENV)
if go:
    if os.path.basename(go).startswith("standby1.") and e.process_id == 0:
        sys.exit(7)
    worker._state.update(env=e, hb=hb, standby=go)
    e = worker.standby_wait()
    assert worker.env() == e and not worker.is_standby() and worker.STANDBY_ENV not in os.environ
print(f"g{e.generation} p{e.process_id} standby={bool(go)}", flush=True)
hb.first_step_t = time.time()
hb.beat()
with open(os.path.join(e.run_dir, f"g{e.generation}.p{e.process_id}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "was_standby": bool(go), "host_store_step": e.host_store_step,
               "heartbeat_file": e.heartbeat_file}, f)
def parked():
    pids = (json.load(open(os.path.join(e.run_dir, "processes.json"))).get("standby") or {}).values()
    phases = {}
    for f in glob.glob(os.path.join(e.run_dir, "heartbeats", "standby*.json")):
        try:
            h = json.load(open(f))
        except (OSError, ValueError):
            continue
        phases[h["pid"]] = h["phase"]
    return len(pids) == 2 and all(phases.get(p) == "standby" for p in pids)
if e.generation == 0:
    if e.process_id == 0:
        time.sleep(120)
    t0 = time.time()
    while not parked():
        if time.time() - t0 > 60:
            sys.exit(5)
        time.sleep(0.05)
    sys.exit(3)
"""


def test_supervisor_drops_a_broken_standby_generation_and_hands_the_next_one_the_failed_generations_places(
        tmp_path, capsys):
    run = tmp_path / "run"
    sup = _sup(tmp_path, STANDBY_WORKER, standby=True, max_restarts=1)
    assert sup.run() == 0
    hist = json.loads((run / "launch_history.json").read_text())["generations"]
    assert [g["outcome"] for g in hist] == ["failed", "done"] and "process 1 " in hist[0]["why"], hist
    out = capsys.readouterr().out
    assert re.search(r"standby generation 1 dropped: process 0 \(pid \d+\) exited with code 7", out), out[-3000:]
    assert "standby generation 2 (set up ahead) told to go" in out, out[-3000:]
    g1 = [json.loads((run / f"g1.p{i}.json").read_text()) for i in range(2)]
    # generation 1 is the standby processes, each now a worker of generation 1 with its heartbeat file
    assert all(r["was_standby"] and r["heartbeat_file"].endswith(f"g1.p{i}.json") for i, r in enumerate(g1)), g1
    assert not any(json.loads((run / f"g0.p{i}.json").read_text())["was_standby"] for i in range(2))
    assert [f"[g1 p{i}] g1 p{i} standby=True" in out for i in range(2)] == [True, True], out[-3000:]
    procs = _processes(run)
    assert procs["status"] == "done" and procs["standby"] == {} and procs["generation"] == 1


def test_a_standby_process_that_fails_before_its_go_leaves_the_runs_goodput_alone(tmp_path, monkeypatch):
    """A standby process shares the job's run directory; one whose set-up fails before it was
    told to go (its `with step:` closes the step) must not overwrite the live generation's
    goodput.json; after its go it writes it like any worker."""
    import resilax
    from resilax._src.runtime import worker
    from resilax.tools import example as ex

    step = resilax.wrap(ex.train_step, topology=resilax.Topology.load("cpu-2x4"),
                        config=resilax.Config(run_dir=str(tmp_path), log=None, peers=None))
    monkeypatch.setitem(worker._state, "standby", str(tmp_path / "go.json"))
    step.close()
    assert not (tmp_path / "goodput.json").exists()
    worker._state.pop("standby")
    from resilax._src.step import saving

    saving.save_goodput(step)
    assert (tmp_path / "goodput.json").exists()


def test_a_relabelled_output_switches_logs_where_the_child_marked_it_not_when_told(tmp_path, capsys):
    # CI once found a spare's first line as a worker in the spare's log: the supervisor
    # switched logs when it wrote the assignment, and its reader thread was behind or ahead
    # of the child. The switch now follows the child's marker in the stream, whatever the
    # reader's lag: here every line is written before the reader may read any of it
    from resilax._src.runtime.worker import LOG_SWITCH
    from resilax.tools.processes import Output

    r, w = os.pipe()

    class Child:  # the reading end of a pipe stands in for the child's stdout
        stdout = os.fdopen(r, "rb")

    old, new = tmp_path / "spare0.log", tmp_path / "g1.p0.log"
    os.write(w, b"warm and waiting\n")
    out = Output(Child, "[spare0] ", old)
    out.relabel("[g1 p0] ", new)  # before the child learns its place, as the supervisor does
    os.write(w, b"half a line" + LOG_SWITCH.encode() + b"assigned: g1 p0\nstep 1\nkilled mid-li")
    os.close(w)
    out.join(timeout=10)
    assert not out.is_alive()
    assert old.read_text() == "warm and waiting\nhalf a line"
    assert new.read_text() == "assigned: g1 p0\nstep 1\nkilled mid-li"
    printed = capsys.readouterr().out
    assert "[spare0] warm and waiting\n" in printed and "[g1 p0] assigned: g1 p0\n[g1 p0] step 1\n" in printed
    # an unterminated line ends its line in the shared output: the supervisor's next line starts its own
    assert "[spare0] half a line\n" in printed and printed.endswith("[g1 p0] killed mid-li\n")
    assert "log-switch" not in printed


def test_supervisor_replaces_a_spare_that_dies_or_hangs_without_failing_the_job(tmp_path, capsys):
    # the worker SIGKILLs the first spare, then SIGSTOPs the second (its heartbeat goes
    # stale), and exits 0 once a third is warm: one generation, no failure
    code = SPARE_WORKER.split("if (e.generation, e.process_id) == (0, 0):")[0] + r"""
import shutil
import signal
def wait_for(pred):
    t0 = time.time()
    while not (v := pred()):
        if time.time() - t0 > 90:
            sys.exit(5)
        time.sleep(0.05)
    return v
os.kill(wait_for(lambda: ready_spares().get("0")), signal.SIGKILL)
os.kill(wait_for(lambda: ready_spares().get("1")), signal.SIGSTOP)
wait_for(lambda: ready_spares().get("2"))
"""
    sup = Supervisor([sys.executable, "-c", code], n=1, devices_per_process=1, run_dir=tmp_path / "run",
                     heartbeat_s=0.1, heartbeat_timeout_s=1.0, startup_timeout_s=20, spares=1, max_restarts=0)
    assert sup.run() == 0
    hist = json.loads((tmp_path / "run" / "launch_history.json").read_text())["generations"]
    assert [g["outcome"] for g in hist] == ["done"], hist
    said = capsys.readouterr().out
    assert "spare 0 (pid " in said and "exited with signal SIGKILL; replacing it" in said, said[-3000:]
    assert "spare 1 (pid " in said and "hung: heartbeat" in said, said[-3000:]
    assert sorted(spare_heartbeats(tmp_path / "run")) == [0, 1, 2]  # one start per loss, no more
    assert _processes(tmp_path / "run")["spares"] == {}


def test_launch_cli_rejects_negative_spares(tmp_path, capsys):
    rc, err = cli(["launch", "-n", "2", "--spares", "-1", "--run-dir", str(tmp_path), "--", sys.executable, "-c", "pass"],
                  capsys)
    assert rc == 2 and "--spares must be an integer >= 0" in err, err
    assert not (tmp_path / PROCESSES_JSON).exists()


def test_launch_cli_rejects_standby_with_in_place_or_nodes(tmp_path, capsys):
    for extra, said in ((["--in-place"], "--standby readies a whole new generation"),
                        (["--nodes", "2", "--node-rank", "0"], "--standby cannot be combined with --nodes")):
        rc, err = cli(["launch", "-n", "2", "--standby", *extra, "--run-dir", str(tmp_path), "--", sys.executable,
                       "-c", "pass"], capsys)
        assert rc == 2 and said in err, err
    assert not (tmp_path / PROCESSES_JSON).exists()


def test_a_worker_that_refuses_its_configuration_ends_the_job_without_restarts(tmp_path, child_env):
    """A configuration every restart would repeat (a topology of 8 devices on a job of 2, a
    malformed option) ends the job after the first generation, exit 78 (EX_CONFIG), with the
    workers' own error and why there is no restart; a worker that fails otherwise is still
    restarted (exit 1 here: the restarts, then the give-up)."""
    cases = {"topology": ["-n", "2", "--", "resilax", "train", "--topology", "cpu-2x4", "--steps", "4"],
             "option": ["-n", "2", "--devices-per-process", "4", "--", "resilax", "train", "--topology", "cpu-2x4",
                        "--no-such-option"],
             "other": ["-n", "1", "--max-restarts", "1", "--", sys.executable, "-c", "raise SystemExit(1)"]}
    for name, args in cases.items():
        run = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "resilax", "launch", "--run-dir", str(run), *args], env=child_env,
                           capture_output=True, text=True, timeout=120)
        gens = json.loads((run / "launch_history.json").read_text())["generations"]
        if name == "other":
            assert r.returncode == 1 and len(gens) == 2 and "giving up: 1 restarts in a row" in r.stdout, r.stdout
            continue
        assert r.returncode == 78, r.stdout + r.stderr[-2000:]
        assert len(gens) == 1, gens
        said = "the topology needs 8 devices" if name == "topology" else "unrecognized arguments: --no-such-option"
        assert said in r.stdout, r.stdout
        assert "refused its configuration before its first step (exit 78" in r.stdout, r.stdout
        assert "Traceback" not in r.stdout + r.stderr


def test_launch_cli_rejects_out_of_range_times_and_counts(tmp_path, capsys):
    """A zero or negative interval, timeout or count is a usage line naming the bound, before
    anything starts (--heartbeat 0 made every worker beat in a busy loop, --collective-timeout 0
    and --startup-timeout 0 were taken, --lease 0 across hosts was a traceback)."""
    for extra, said in ((["--heartbeat", "0"], "argument --heartbeat: must be a finite number > 0, got 0"),
                        (["--collective-timeout", "0"], "argument --collective-timeout: must be >= 1, got 0"),
                        (["--startup-timeout", "-1"], "argument --startup-timeout: must be a finite number > 0"),
                        (["--max-restarts", "-1"], "argument --max-restarts: must be >= 0, got -1"),
                        (["--host-store-every", "-1"], "argument --host-store-every: must be >= 0, got -1"),
                        (["--nodes", "2", "--node-rank", "0", "--lease", "0"], "argument --lease: must be a finite number")):
        rc, err = cli(["launch", "-n", "1", "--run-dir", str(tmp_path / "run"), *extra, "--", "true"], capsys)
        assert rc == 2 and said in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "run").exists()


def test_launch_cli_rejects_a_missing_command(tmp_path, capsys):
    rc, err = cli(["launch", "-n", "2", "--run-dir", str(tmp_path)], capsys)
    assert rc == 2 and "a worker command is required after --" in err, err
    # a command that is not there: one line before any generation starts (it was a traceback)
    for nodes, (cmd, said) in [([], ("no_such_command_xyz", "'no_such_command_xyz' is not found on PATH")),
                               (["--nodes", "2", "--node-rank", "0"], (str(tmp_path / "nope.py"), "is not an executable file"))]:
        rc, err = cli(["launch", *nodes, "-n", "2", "--run-dir", str(tmp_path / "run"), "--", cmd], capsys)
        assert rc == 2 and said in err and "Traceback" not in err, err
        assert not (tmp_path / "run" / "launch_history.json").exists()
    # a run directory that cannot be made or written: one line, exit 2, for the supervisor and an agent
    (tmp_path / "file").write_text("")
    for nodes in ([], ["--nodes", "2", "--node-rank", "0"]):
        rc, err = cli(["launch", *nodes, "-n", "1", "--run-dir", str(tmp_path / "file" / "run"), "--", "true"], capsys)
        assert rc == 2 and "cannot use the run directory" in err and "Not a directory" in err, err


def test_jax_assumptions_hold_and_a_broken_one_is_named(monkeypatch):
    jaxdist.check()  # the installed JAX (0.10.2) satisfies every assumption
    import jax

    # a version number alone refuses nothing: the names are checked, the behaviour probed
    monkeypatch.setattr(jaxdist, "_checked", False)
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    jaxdist.check()
    monkeypatch.setattr(jaxdist, "_checked", False)
    from jax._src import distributed

    monkeypatch.delattr(type(distributed.global_state), "preemption_sync_manager")
    with pytest.raises(jaxdist.JaxAssumptionError, match=r"global_state\.preemption_sync_manager: expected an attribute"):
        jaxdist.check()
    # the service host's own check (a supervisor or agent imports jaxlib's module, not JAX)
    import jaxlib._jax

    monkeypatch.setattr(jaxlib._jax, "get_distributed_runtime_service", lambda address, num_nodes: None)
    with pytest.raises(jaxdist.JaxAssumptionError, match=r"recoverable= and heartbeat_timeout="):
        jaxdist.start_service(1, 1, heartbeat_timeout_s=5)


def test_a_coordination_service_host_does_not_import_jax():
    """A supervisor or an agent only hosts the coordination service: it starts one without
    JAX's Python package (what it saves each of them: ~0.4 CPU-s a start), and the service
    serves a worker's client."""
    code = ("import sys; from resilax._src.runtime import jaxdist, ports; "
            "port = ports.reserve_port('127.0.0.1'); s = jaxdist.start_service(port, 1, heartbeat_timeout_s=5); "
            "print('jax' in sys.modules, flush=True); "
            "from jax._src.lib import _jax; "
            "c = _jax.get_distributed_runtime_client(f'127.0.0.1:{port}', 0, init_timeout=30, heartbeat_timeout=5, "
            "shutdown_timeout=1); c.connect(); c.key_value_set('k', 'v'); print(c.blocking_key_value_get('k', 5000)); "
            "c.shutdown(); s.shutdown()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "v"], r.stdout
    assert "Jax service listening" not in r.stderr  # its INFO lines stay hidden, as under JAX's own import


def test_a_second_job_in_a_run_directory_in_use_is_refused_and_a_relaunch_after_a_kill_is_not(tmp_path):
    """Two jobs in one run directory deleted each other's checkpoints, record-log entries and
    spare assignments (measured: two identical launches both ran to the end, each removing
    the other's old checkpoints). A supervisor holds the directory's lock (flock, exclusive)
    and the agents of a job across hosts share it: a second supervisor, or an agent, in a
    directory a supervisor uses exits 2 with one line naming the directory and the
    supervisor's pid, and changes nothing there; a supervisor refused by an agent's lock
    too. The kernel drops the lock with its process: a relaunch after SIGKILL runs."""
    run = tmp_path / "run"
    worker = ["--", sys.executable, "-c", "import time; time.sleep(120)"]  # (a stand-in worker: no JAX)
    launch = [sys.executable, "-m", "resilax", "launch", "-n", "1", "--devices-per-process", "1", "--run-dir", str(run)]
    agent = [*launch, "--nodes", "2", "--node-rank", "0", "--rendezvous-timeout", "120"]

    def start(cmd, name):
        return subprocess.Popen([*cmd, *worker], stdout=open(tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def refused(cmd):
        r = subprocess.run([*cmd, *worker], capture_output=True, text=True, timeout=60)
        return r.returncode, r.stderr.strip().splitlines()

    def held_by(p, name, old=None):  # (the lock is taken before anything is written to the directory)
        return _wait(lambda: (w := (_processes(run) or {}).get("workers")) and w != old and w, 60, f"{name}'s worker",
                     p, tmp_path / f"{name}.log")

    first = start(launch, "first")
    try:
        workers = held_by(first, "first")
        for cmd in (launch, agent):
            rc, lines = refused(cmd)
            assert rc == 2 and len(lines) == 1, (rc, lines)
            assert f"the run directory {str(run)!r} is in use by another job (resilax launch, pid {first.pid}" in \
                lines[0], lines
            assert _processes(run)["workers"] == workers  # nothing of the first job's was touched
    finally:
        kill_tree(first)
    # the killed supervisor's heartbeats in RAM are removed by the next supervisor on the host
    # (any run directory's): D/heartbeats is left a dangling link, which an agent replaces (a
    # CI run's agent failed on it with a traceback)
    if (run / "heartbeats").is_symlink():
        shutil.rmtree((run / "heartbeats").resolve(), ignore_errors=True)
    node = start(agent, "agent")  # a job across hosts now: its agents share the lock
    try:
        _wait(lambda: (run / "rendezvous" / "leases" / "node0.json").exists(), 60, "the agent's lease", node,
              tmp_path / "agent.log")
        rc, lines = refused(launch)
        assert rc == 2 and "is in use by another job (a resilax launch, or the agents of a job across hosts)" in \
            lines[0], (rc, lines)
    finally:
        kill_tree(node)
    again = start(launch, "again")  # the lock went with its holders (SIGKILL): a relaunch takes it
    try:
        assert "in use" not in (tmp_path / "again.log").read_text() and held_by(again, "again", old=workers)
    finally:
        kill_tree(again)


_PORTS_PROBE = """
import errno, socket, sys
from resilax._src.runtime import jaxdist, ports
from jax._src.lib import _jax

def plain_bind(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return "bound"
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else repr(e)

port = ports.reserve_port()
print("held:", plain_bind(port))  # nothing else can take a held port
a = jaxdist.start_service(port, 1, heartbeat_timeout_s=5)
print("hold released:", ports.take("127.0.0.1", port) is None)
c = _jax.get_distributed_runtime_client(f"127.0.0.1:{port}", 0, init_timeout=30, heartbeat_timeout=5, shutdown_timeout=1)
c.connect(); c.key_value_set("k", "v"); print("served:", c.blocking_key_value_get("k", 5000))
try:  # a second service on the same port: gRPC alone would start it beside the first
    jaxdist.start_service(port, 1, heartbeat_timeout_s=5)
    print("second: started")
except ports.PortInUseError as e:
    print("second:", f"port {port} on 127.0.0.1 is already in use" in str(e))
c.shutdown(); a.shutdown()
old = ports.reserve_port()
ports.HOLD_S = -1.0  # an unused hold is closed at the next reserve once older than HOLD_S
new = ports.reserve_port()
print("stale hold closed:", plain_bind(old), new != old)
"""


def test_a_service_port_is_held_until_the_service_listens_and_never_shared():
    """gRPC binds with SO_REUSEPORT: a second coordination service on a port where one
    listens started beside it, and the kernel spread the workers' connections over both
    (measured). resilax holds a port it picks until its service listens there (nothing else
    can bind it meanwhile), and refuses to start a service on a port another socket is
    bound to, naming the port."""
    r = subprocess.run([sys.executable, "-c", _PORTS_PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == ["held: in use", "hold released: True", "served: v", "second: True",
                                     "stale hold closed: bound True"], r.stdout + r.stderr[-2000:]


# The program of the relaunch and standby tests: 2 workers x 4 devices, the default mode, no checkpoint
# before the end (only the record log, the hosts' stores and a preemption's save bring a
# restart past the start). The SIGTERM of the preemption test goes out once both workers are
# past step 8; under load the test process saw that up to ~0.7 s late (steps take ~0.15 s
# warm), and with 16 steps the sync point once was the last step (nothing left to resume).
# 32 leaves ample room before the end.
RELAUNCH_STEPS = 32
RELAUNCH_TRAIN = ["resilax", "train", "--topology", "cpu-2x4", "--layout", "sharded", "--steps", str(RELAUNCH_STEPS),
                  "--checkpoint-every", "100", "--log-every", "4", "--no-deterministic"]


def _launch_log(tmp_path, attempt) -> str:
    return (tmp_path / f"launch{attempt}.log").read_text(errors="replace")


def test_hang_then_whole_job_kill_then_sigterm_each_resumes_exactly(tmp_path):
    """Three failures of one job, each resumed another way, the end bitwise a failure-free
    run of the same program:

    1. A worker whose main thread hangs after step 5 (its heartbeat thread lives on, the
       others wait in step 6's collective) is found by the step deadline and killed; the next
       generation resumes from the host stores (step 5).
    2. The whole job SIGKILLed past step 10 (supervisor and workers: the hosts' stores die
       with them), with no checkpoint but the start: the relaunch replays the record log that
       process 0 wrote in the run directory (inputs entries: the data position; the
       processes agree on the steps) from step 0, through the host-store resume at 5 (whose
       earlier entries the resume kept), to within ``max_lag`` of the kill.
    3. Preemption: SIGTERM to one worker reaches a sync point on every worker (JAX's
       preemption sync manager over the supervisor's service); they save and exit 0, the
       supervisor ends the job with 0, and launching the same command again resumes at the
       saved step."""
    from helpers import child_env

    steps, log_dir = RELAUNCH_STEPS, tmp_path / "run" / "checkpoints" / "record_log"
    run, out = tmp_path / "run", tmp_path / "final.npz"
    cmd = [sys.executable, "-m", "resilax", "launch", "-n", "2", "--devices-per-process", "4", "--run-dir", str(run),
           "--heartbeat", "0.2", "--heartbeat-timeout", "3", "--min-step-deadline", "10", "--step-deadline-factor", "5",
           "--max-restarts", "1", "--", *RELAUNCH_TRAIN, "--out", str(out), "--fault", "hang@5:after_step/1"]
    for attempt in range(3):
        lg = tmp_path / f"launch{attempt}.log"
        with open(lg, "wb") as log:
            p = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                if attempt == 0:
                    _wait(lambda: _running(run, 1, n=2), 120, "generation 1 (after the hang)", p, lg)
                    _wait(lambda: _past_n(run, 1, 10, 2), 180, "step 10", p, lg)
                    killed_past = min(_steps(run, 1).values())
                    kill_tree(p)
                elif attempt == 1:
                    _wait(lambda: _running(run, 0, n=2), 120, "the relaunch", p, lg)
                    _wait(lambda: _past_n(run, 0, killed_past + 2, 2), 180, f"step {killed_past + 2}", p, lg)
                    os.kill(_processes(run)["workers"][str(random.randrange(2))], signal.SIGTERM)
                rc = p.wait(timeout=180)
            finally:
                kill_tree(p)
        text = _launch_log(tmp_path, attempt)
        assert "Traceback" not in text, text[-5000:]  # one line per event, no traceback (issue 53)
        if attempt == 0:
            failed = [ln for ln in text.splitlines() if "generation 0 failed: process 1 " in ln]
            assert failed and "hung: never started step 6" in failed[0], text[-3000:]
            assert [ln for ln in text.splitlines() if "resumed at step 5 (host store" in ln], text[-3000:]
            entries = sorted(int(f.name.split(".")[0]) for f in log_dir.glob("*.inputs.rxl"))
            assert entries[0] == 0 and entries == list(range(entries[-1] + 1)), entries
            assert not list(log_dir.glob("*.grads.rxl")), "no process holds every shard: inputs entries only"
            continue
        assert rc == 0, text[-5000:]
        got = [ln for ln in text.splitlines() if "resumed at step" in ln]
        if attempt == 1:
            assert len(got) == 2 and "steps replayed from the log" in got[0], text[-3000:]
            resumed = int(got[0].split("resumed at step ")[1].split(" ")[0])
            assert killed_past - 2 <= resumed == entries[-1] + 1, (resumed, killed_past, entries)
            assert _processes(run)["status"] == "preempted" and not out.exists(), text[-3000:]
            stopped = [int(line.split("after step ")[1].split(",")[0]) for line in text.splitlines()
                       if "preempted: every worker stopped after step" in line]
            assert len(stopped) == 2 and stopped[0] == stopped[1] and resumed < stopped[0] < steps, text[-3000:]
        else:
            assert f"resumed at step {stopped[0]} (checkpoint)" in got[0], text[-3000:]
    _launched_ref_bitwise(tmp_path, RELAUNCH_TRAIN)  # the same program without the failures: bitwise


# the program of the 2 x 4 bit-exact tests below (their failure-free reference run is shared):
# one checkpoint, of the last step (the last-save test kills a process during it)
TRAIN_2X4 = ["resilax", "train", "--topology", "cpu-2x4", "--layout", "sharded", "--steps", "8", "--quiet",
             "--checkpoint-every", "8"]


def test_bit_exact_mode_with_4_device_domains_keeps_its_bits_when_processes_go(tmp_path):
    """The bit-exact mode on ``cpu-2x4`` as 2 processes x 4 devices (``--layout sharded``: each
    domain's gradient executable holds all-reduces over its 4 devices). Process 1 hangs after
    step 4; the supervisor kills it and process 0 re-forms alone (``--in-place``) as a job of
    1 process with 1 live domain and trains on to step 8. Its final state is bitwise that of
    a failure-free ``launch -n 1 --devices-per-process 8`` run (1 process, both domains).

    Under ``launch`` every generation, of 2 processes or of 1, runs its collectives through
    gloo, local ones included, so a domain's sums have the same (gloo ring) order whatever
    processes are alive. A run without ``launch`` uses XLA's in-process all-reduce, another
    order for more than 2 participants: it is not the reference here (1.4e-2 off after 8
    steps; ``benchmarks/collective_order_probe.py``). This case was refused before that was
    known."""

    text, _ = _re_form_2x4_alone(tmp_path, TRAIN_2X4, "hang@4:after_step/1")
    assert "[g1 p0] resumed at step 4 (host store" in text, text[-3000:]
    _launched_ref_bitwise(tmp_path, TRAIN_2X4)


def test_a_pipeline_job_loses_a_whole_replica_process_and_keeps_its_bits(tmp_path):
    """Data x pipeline under ``launch``: ``cpu-2x4-pp`` as 2 processes x 4 devices, each process
    one pipeline replica of 4 stages (`resilax.pipeline` inside the loss). Process 1 is
    SIGKILLed after step 4; process 0 re-forms alone in place from its host store and trains
    on to step 8 in the bit-exact mode; its final state is bitwise that of a failure-free
    ``launch -n 1`` run."""
    train = ["resilax", "train", "--topology", "cpu-2x4-pp", "--steps", "8", "--quiet"]
    text, _ = _re_form_2x4_alone(tmp_path, train, "kill_process@4:after_step/1")
    assert re.search(r"\[g1 p0\] resumed at step [34] \(host store", text), text[-3000:]  # its store may trail a step
    _launched_ref_bitwise(tmp_path, train)


def _re_form_2x4_alone(tmp_path, train, fault):
    """``launch -n 2 --devices-per-process 4 --in-place --min-in-place 1`` of ``train`` with
    ``fault``: process 0 re-forms alone (generation 1) and the job ends 0; its output and run dir."""
    from helpers import child_env

    run, out = tmp_path / "run", tmp_path / "final.npz"
    cmd = [sys.executable, "-m", "resilax", "launch", "-n", "2", "--devices-per-process", "4", "--run-dir", str(run),
           "--in-place", "--min-in-place", "1", "--heartbeat", "0.2", "--heartbeat-timeout", "2",
           "--min-step-deadline", "6", "--collective-timeout", "3", "--max-restarts", "0", "--", *train,
           "--out", str(out), "--fault", fault]
    r = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
    text = r.stdout + r.stderr
    assert r.returncode == 0 and out.exists(), text[-5000:]
    hist = json.loads((run / "launch_history.json").read_text())["generations"]
    assert [(g["outcome"], g["processes"]) for g in hist] == [("reform", [0, 1]), ("done", [0])], (hist, text[-3000:])
    # what a user reads (issue 53): one line each from the supervisor and the survivor, no
    # traceback (Orbax's threads the survivor leaves behind fail on the dead process quietly)
    assert "Traceback" not in text, text[-5000:]
    assert "[g0 p0] resilax" in text and "leaving at step " in text and "re-attached as process 0 of 1" in text, \
        text[-3000:]
    return text, run


_LAUNCHED_REFS: dict = {}  # train argv -> the directory of its failure-free `launch -n 1` run (once per session)


def _launched_ref_bitwise(tmp_path, train) -> pathlib.Path:
    """Runs ``train`` failure-free as ``launch -n 1 --devices-per-process 8`` (once per
    session for each ``train``: tests of the same program share it) and checks
    ``tmp_path/final.npz`` is bitwise its final state. Returns that run's directory (its run
    dir is ``ref_run`` in it).

    One process of 8 devices is also the reference of the jobs of 2 processes x 4 devices in
    the default mode (the relaunch and standby tests): under ``launch`` gloo runs every
    collective, and its sums over the 8 devices come out the same in both layouts
    (``docs/multiprocess.md``; these tests passing bitwise prove it for their program). It
    costs one worker process less than a ``launch -n 2`` reference."""
    from helpers import child_env

    d = _LAUNCHED_REFS.get(tuple(train))
    if d is None:
        d = tmp_path
        cmd = [sys.executable, "-m", "resilax", "launch", "-n", "1", "--devices-per-process", "8", "--run-dir",
               str(d / "ref_run"), "--max-restarts", "0", "--", *train, "--out", str(d / "ref.npz")]
        r = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
        _LAUNCHED_REFS[tuple(train)] = d
    a, b = np.load(tmp_path / "final.npz", allow_pickle=False), np.load(d / "ref.npz", allow_pickle=False)
    assert sorted(a.files) == sorted(b.files)
    assert all(np.array_equal(a[k], b[k]) for k in a.files), _rel_diff(a, b)
    return d


def _standby_parked(run_dir, n):
    """The pids of the supervisor's standby generation once all ``n`` are parked, else None."""
    pids = (_processes(run_dir) or {}).get("standby") or {}
    phases = {}
    for f in (run_dir / "heartbeats").glob("standby*.p*.json"):
        try:
            hb = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        phases[hb.get("pid")] = hb.get("phase")
    return pids if len(pids) == n and all(phases.get(pid) == "standby" for pid in pids.values()) else None


def test_a_standby_generation_replaces_a_killed_one_with_its_programs_built_ahead_and_keeps_its_bits(tmp_path):
    """``--standby``: the next generation's 2 processes attach to their own service, build
    their programs and park while generation 0 trains (here: while the main threads of its
    workers hang after step 3, ``--fault hang@3:after_step``, so that the job is still running
    when they are parked, whatever the load: holding them with SIGSTOP once the test saw step
    3 raced the job's end, with 8 steps in a CI run, with 32 faster ones under load here).
    Process 1 of generation 0 is SIGKILLed; the standby processes become generation 1 (same
    pids), resume from the host stores at the step generation 0 had reached, built nothing
    after the go, and the job ends bitwise equal to a failure-free run of the same program
    (the fault's hang only stalls; it fires once). The program is the relaunch test's (the
    default mode, 32 steps), so the two share one failure-free reference run."""
    from helpers import child_env

    run, out, log_file = tmp_path / "run", tmp_path / "final.npz", tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "resilax", "launch", "-n", "2", "--devices-per-process", "4", "--run-dir", str(run),
           "--standby", "--heartbeat", "0.2", "--heartbeat-timeout", "60", "--min-step-deadline", "500",
           "--max-restarts", "1", "--", *RELAUNCH_TRAIN, "--out", str(out), "--fault", "hang@3:after_step"]
    with open(log_file, "wb") as log:
        p = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # (the hang holds the job before its end, and frees the cores for the standby; the
            # supervisor's step deadline, --min-step-deadline 500, leaves it alone meanwhile: a
            # CI run's standby, set up beside generation 0 and another test, was not parked
            # when a deadline of 120 s ended the hang)
            _wait(lambda: _past_n(run, 0, 3, 2), 180, "generation 0 past step 3", p, log_file)
            workers = _processes(run)["workers"]
            reached = max(_steps(run, 0).values())
            standby = _wait(lambda: _standby_parked(run, 2), 400, "the standby generation parked", p, log_file)
            os.kill(workers["1"], signal.SIGKILL)
            rc = p.wait(timeout=180)
        finally:
            kill_tree(p)
    text = (tmp_path / "launch.log").read_text(errors="replace")
    assert rc == 0, text[-5000:]
    assert "standby generation 1 (set up ahead) told to go" in text, text[-3000:]
    resumed = [int(m.group(1)) for m in re.finditer(r"\[g1 p\d\] resumed at step (\d+) \(host store", text)]
    assert len(resumed) == 2 and resumed[0] == resumed[1] >= reached, (resumed, reached, text[-3000:])
    hist = json.loads((run / "launch_history.json").read_text())["generations"]
    assert [g["outcome"] for g in hist] == ["failed", "done"], hist
    g1 = heartbeats(run, 1)
    assert sorted(h["pid"] for h in g1.values()) == sorted(standby.values()), (g1, standby)
    for h in g1.values():  # attached and built before the kill; after the go only the restore and the step
        m = h["marks"]
        assert m["attached"] < m["programs"] <= m["parked"] < m["go"] < h["first_step_t"], m
    assert _processes(run)["standby"] == {}, "the next standby generation is dropped when the job ends"
    _launched_ref_bitwise(tmp_path, RELAUNCH_TRAIN)



def test_a_process_that_dies_during_the_last_save_is_re_formed_around_in_place(tmp_path):
    """``--in-place``: process 1 is SIGKILLed right after the last step's checkpoint was
    dispatched (``kill_process@8:during_save/1``), so process 0 finds the save broken in
    the final wait of ``close`` (its collective times out), not in a step. It waits for the
    supervisor's verdict and re-forms alone (generation 1) instead of failing the job (CI
    saw a job restart from scratch when a kill landed there); generation 1 restores step 8
    from its host store, writes checkpoint 8 again and ends. The final state and checkpoint
    8 are bitwise those of a failure-free run."""
    train = TRAIN_2X4  # (the bit-exact test's program: one failure-free reference for both)
    text, run = _re_form_2x4_alone(tmp_path, train, "kill_process@8:during_save/1")
    assert "the save of step 8 at the end failed" in text and "[g1 p0] resumed at step 8 (host store" in text, \
        text[-3000:]
    ref = _launched_ref_bitwise(tmp_path, train)
    got, want = (_checkpoint_sums(d / "checkpoints" / "8") for d in (run, ref / "ref_run"))
    assert got[1] == want[1] and np.array_equal(got[0], want[0]), (got, want)


def _checkpoint_sums(path):
    """A checkpoint's per-leaf checksums (of the values saved) and its data position. Read as
    a host array: the array's saved sharding names the devices of the process that wrote it
    (ids 2048+ when that was process 1 of the job), which this process does not have (a CI
    run's ValueError: 'Topology mismatch detected')."""
    import orbax.checkpoint as ocp

    sums = np.asarray(ocp.PyTreeCheckpointer().restore(
        path / "checksums", restore_args={"sums": ocp.RestoreArgs(restore_type=np.ndarray)})["sums"])
    meta = json.loads((path / "meta" / "metadata").read_text())
    return sums, (meta["step"], meta["data_state"])


def _past_n(run_dir, gen, step, n):
    s = _steps(run_dir, gen)
    return len(s) == n and all(v is not None and v >= step for v in s.values())


def test_the_public_launched_module_is_the_worker_side():
    """`resilax.launched` (named in resilax's errors and docs) is the runtime's worker API,
    and outside a launch it does nothing: no place, primary, no re-form pending."""
    import resilax
    from resilax._src.runtime import worker as rt

    assert resilax.launched.Reform is rt.Reform and resilax.launched.reattach is rt.reattach
    assert resilax.launched.env() is None and resilax.launched.is_primary()
    assert rt.reform_due(3) is False
    resilax.launched.exit_if_shrunk(0)  # returns: this process never went on in place


def test_a_survivors_wait_for_the_verdict_follows_the_step_deadline(monkeypatch, tmp_path):
    """``--in-place``: the supervisor's step deadline is ``max(--min-step-deadline, factor x
    step time)``, so a survivor's wait for its verdict grows with the measured step time (a
    fixed wait gave up 0.5 s before a 21 s deadline when load made steps take 1 s)."""
    from resilax._src.runtime import worker

    e = LaunchEnv(coordinator="127.0.0.1:1", process_id=0, num_processes=2, generation=0, devices_per_process=4,
                  run_dir=str(tmp_path), heartbeat_file=str(tmp_path / "hb"), heartbeat_s=0.2,
                  jax_heartbeat_timeout_s=10, collective_timeout_s=3, init_timeout_s=60, in_place_wait_s=18.0,
                  step_deadline_factor=20.0)
    hb = worker._Heartbeat(e)
    monkeypatch.setitem(worker._state, "hb", hb)
    assert worker.in_place_wait(e) == 18.0  # no step measured yet: the supervisor's minimum applies
    worker.progress(4, 1.061)  # the step time of that failure
    deadline = max(6.0, 20.0 * 1.061)
    assert worker.in_place_wait(e) >= deadline + 2 + 10  # + heartbeat timeout + margin, as the fixed part has
    assert worker.in_place_wait(LaunchEnv(**{**e.__dict__, "step_deadline_factor": 0.0})) == 18.0


def test_a_wait_for_every_process_ends_when_the_supervisor_names_a_dead_one(tmp_path, caplog, capfd):
    """`membership.wait_unless_a_verdict` (the wait for the previous checkpoint's commit under
    `--in-place`): Orbax's commit barrier waits for a SIGSTOPped process 20 min; once the
    supervisor's verdict names it, the survivor's wait ends with an error (its step fails and
    it re-forms with the others) instead of holding it in its step. What Orbax logs on the
    abandoned wait's thread afterwards (its commit failing on the dead process: an ERROR and
    a long traceback) is not shown; one line says so. Without a verdict the wait is the
    plain one: it returns, its own error is raised as it is, and its logging is kept."""
    import logging
    import threading
    from types import SimpleNamespace

    from resilax._src.runtime import membership

    gate, logged, bg_logged = threading.Event(), threading.Event(), threading.Event()
    absl_log = logging.getLogger("absl")

    def commit():
        gate.wait(60)
        absl_log.error("Save Finalize thread (save_finalize) failed.")
        logged.set()

    def background_commit():  # Orbax's own commit thread of the save in flight
        gate.wait(60)
        absl_log.error("Failed to run 5 Handler Commit operations in background save thread")
        bg_logged.set()

    threading.Thread(target=background_commit, daemon=True).start()

    def dies():  # a thread of the left backend that ends with an uncaught error (not printed either)
        gate.wait(60)
        raise RuntimeError("a barrier with the dead process failed")

    dying = threading.Thread(target=dies, daemon=True)
    dying.start()

    membership.joined(SimpleNamespace(run_dir=str(tmp_path), generation=3, in_place_wait_s=10.0))
    membership._QuietAbandoned.said = False
    try:
        threading.Timer(0.3, lambda: (tmp_path / membership.MEMBERSHIP_JSON).write_text(json.dumps(
            {"generation": 3, "epoch": 1, "alive": [0, 1, 3], "dead": [2]}))).start()
        t0 = time.time()
        with caplog.at_level(logging.ERROR):
            with pytest.raises(RuntimeError, match=r"process\(es\) \[2\] of the job failed while the commit"):
                membership.wait_unless_a_verdict(commit, "the commit")
            assert time.time() - t0 < 5
            membership.leave_behind()  # (as `in_place.leave_for_reform` does: the backend is left)
            gate.set()
            assert logged.wait(5) and bg_logged.wait(5)
            dying.join(5)
            assert not [r for r in caplog.records if "save_finalize" in r.getMessage() or "Handler" in r.getMessage()]
            later = threading.Thread(target=lambda: absl_log.error("the next generation's save failed"))
            later.start()
            later.join()
            assert [r for r in caplog.records if r.getMessage() == "the next generation's save failed"]  # kept
            err = capfd.readouterr().err
            assert "left behind by the supervisor's verdict" in err
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err  # the one line only
            # a thread that was not left behind: its error goes to the hook installed before
            seen = []
            previous, membership._previous_excepthook[0] = membership._previous_excepthook[0], seen.append
            try:
                membership._abandoned_excepthook(SimpleNamespace(thread=later, exc_type=ValueError,
                                                                 exc_value=ValueError("shown"), exc_traceback=None))
            finally:
                membership._previous_excepthook[0] = previous
            assert len(seen) == 1 and str(seen[0].exc_value) == "shown"
            (tmp_path / membership.MEMBERSHIP_JSON).unlink()
            membership.wait_unless_a_verdict(lambda: time.sleep(0.1), "the commit")  # no verdict: returns

            def broken():
                absl_log.error("orbax logged this")
                raise ValueError("orbax said no")

            with pytest.raises(ValueError, match="orbax said no"):
                membership.wait_unless_a_verdict(broken, "the commit")
            assert [r for r in caplog.records if r.getMessage() == "orbax logged this"]  # kept: no verdict
    finally:
        gate.set()
        membership.reset()
        membership._ABANDONED.clear()  # (this test process's threads log as before)
    ran = []
    membership.wait_unless_a_verdict(lambda: ran.append(threading.current_thread()), "x")  # outside a launch:
    assert ran == [threading.main_thread()]  # the plain wait, on the caller's thread


def test_a_stale_heartbeat_of_a_running_worker_blames_the_worker_it_waits_for():
    """The supervisor's choice of whom to kill (`Supervisor._blame`), on real processes: a
    worker whose heartbeat is stale but which is not stopped, and which has started a step
    another worker never started, is waiting for that one (a suite run under load named the
    waiting process 0 while process 1 hung); a SIGSTOPped worker is itself the cause, ahead
    or not; with no worker behind, the stale one stays named."""
    from resilax.tools import processes

    class W:
        def __init__(self, pid_proc, process_id, started):
            self.proc, self.process_id, self._started, self.rc = pid_proc, process_id, started, None

        def heartbeat(self):
            return {"started": self._started}

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        ahead, behind = W(procs[0], 0, 6), W(procs[1], 1, 4)
        sup = Supervisor.__new__(Supervisor)
        sup.workers = [ahead, behind]
        stale = "hung: heartbeat 2.0 s old (--heartbeat-timeout 2 s; SIGSTOP?)"
        assert processes.stopped(procs[0].pid) is False
        w, why = sup._blame(ahead, stale)
        assert w is behind and "never started step 5" in why and "process 0 hung: heartbeat" in why, why
        assert sup._blame(behind, stale)[0] is behind  # no one behind it
        os.kill(procs[0].pid, signal.SIGSTOP)
        for _ in range(100):
            if processes.stopped(procs[0].pid):
                break
            time.sleep(0.01)
        assert processes.stopped(procs[0].pid) is True
        assert sup._blame(ahead, stale) == (ahead, stale)
        assert processes.stopped(2 ** 22 + 12345) is None  # no such process
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_detaching_waits_for_a_running_worker_with_a_stale_heartbeat_but_not_for_a_stopped_one(tmp_path, monkeypatch):
    """`Supervisor._detach_live_workers` on real processes: a worker whose heartbeat goes
    stale while it leaves its broken step, but which runs, is waited for and re-forms (the
    silence is reported); a SIGSTOPped one, or one that exited, ends the re-form at once
    (the caller restarts the job); one that never detaches ends it at the time limit."""
    from resilax.tools import processes

    class W:
        def __init__(self, proc, process_id, beat):
            self.proc, self.process_id, self._beat = proc, process_id, beat

        def heartbeat(self):
            return self._beat()

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        t0 = time.time()
        # silent 3 s (heartbeat timeout 1 s), then detached
        slow = W(procs[0], 0, lambda: {"t": t0 - 1.0, "phase": "detaching"} if time.time() < t0 + 3.0
                 else {"t": time.time(), "phase": "detached"})
        fine = W(procs[1], 1, lambda: {"t": time.time(), "phase": "detached"})
        sup = Supervisor.__new__(Supervisor)
        sup.run_dir, sup.generation, sup.epoch = tmp_path, 2, 1
        sup.collective_timeout_s, sup.min_deadline, sup.heartbeat_timeout_s = 5.0, 5.0, 1.0
        sup.workers = [slow, fine]
        lines = []
        monkeypatch.setattr("resilax.tools.launch.say", lines.append)
        assert sup._detach_live_workers() == [slow, fine]
        assert time.time() - t0 >= 3.0
        assert any("process 0 up to" in ln for ln in lines), lines
        assert json.loads((tmp_path / "membership.json").read_text())["reform"] == 3
        lines.clear()
        stuck = W(procs[0], 0, lambda: {"t": time.time() - 5.0, "phase": "detaching"})
        sup.workers = [stuck, fine]
        os.kill(procs[0].pid, signal.SIGSTOP)
        for _ in range(100):
            if processes.stopped(procs[0].pid):
                break
            time.sleep(0.01)
        t1 = time.time()
        assert sup._detach_live_workers() is None and time.time() - t1 < 2.0
        assert any("process 0 did not re-form (stopped" in ln for ln in lines), lines
        procs[2].kill()
        procs[2].wait()
        sup.workers = [fine, W(procs[2], 2, lambda: {"t": time.time(), "phase": "detached"})]
        assert sup._detach_live_workers() is None
        assert any("process 2 did not re-form (exited with signal SIGKILL)" in ln for ln in lines), lines
        never = W(procs[1], 1, lambda: {"t": time.time(), "phase": "recover"})
        sup.min_deadline, sup.collective_timeout_s = 0.5, 0.5
        sup.workers = [never]
        t2 = time.time()
        assert sup._detach_live_workers() is None and 1.0 <= time.time() - t2 < 3.0
        assert any("did not all detach within 1 s" in ln for ln in lines), lines
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_heartbeats_live_in_ram_during_the_job_and_on_disk_after_it(tmp_path):
    """`resilax launch` keeps ``D/heartbeats`` in RAM (/dev/shm) while the job runs: a
    heartbeat's rename on a disk busy with checkpoint writes can wait for the journal, and
    a stale heartbeat reads as a hung worker. A former launch's heartbeats are gone at the
    start; at the end the last ones are back on disk in ``D/heartbeats`` and the RAM
    directory is removed."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here: the heartbeats stay in the run directory")
    code = ("import os, json, time; from resilax._src.runtime import worker; e = worker.LaunchEnv.from_env(os.environ); "
            "hb = worker._Heartbeat(e); hb.beat(); hb.stop(); "
            "open(os.path.join(e.run_dir, f'where{e.process_id}'), 'w').write(os.path.realpath(e.heartbeat_file))")
    old = tmp_path / "run" / "heartbeats"
    old.mkdir(parents=True)
    (old / "g0.p7.json").write_text("{}")  # a former launch's
    assert _sup(tmp_path, code).run() == 0
    run = tmp_path / "run"
    where = [(run / f"where{i}").read_text() for i in range(2)]
    assert all(w.startswith(f"/dev/shm/resilax-hb-{os.getpid()}-") for w in where), where
    hb = run / "heartbeats"
    assert hb.is_dir() and not hb.is_symlink()
    assert sorted(p.name for p in hb.iterdir()) == ["g0.p0.json", "g0.p1.json"]
    assert json.loads((hb / "g0.p1.json").read_text())["process_id"] == 1
    assert not any(n.startswith(f"resilax-hb-{os.getpid()}-") for n in os.listdir("/dev/shm"))


def test_heartbeats_stay_on_disk_when_ram_cannot_hold_them(tmp_path, monkeypatch):
    """Where the link into RAM cannot be made (a run dir on a file system without links, a
    read-only /dev/shm), the heartbeats stay in ``D/heartbeats`` and the job runs as before."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here: the heartbeats stay in the run directory anyway")

    def refuse(self, *a, **k):
        raise OSError(1, "Operation not permitted (test)")

    monkeypatch.setattr(pathlib.Path, "symlink_to", refuse)
    code = ("import os; from resilax._src.runtime import worker; e = worker.LaunchEnv.from_env(os.environ); "
            "hb = worker._Heartbeat(e); hb.beat(); hb.stop()")
    assert _sup(tmp_path, code).run() == 0
    hb = tmp_path / "run" / "heartbeats"
    assert hb.is_dir() and not hb.is_symlink() and (hb / "g0.p1.json").exists()
    assert not any(n.startswith(f"resilax-hb-{os.getpid()}-") for n in os.listdir("/dev/shm"))


def test_a_workers_broken_collective_is_one_line_and_its_traceback_a_file(tmp_path, monkeypatch, capsys):
    """Under `resilax launch`, a worker whose collective broke because another process died or
    hung (the survivor of a hang: 'Gloo AllGather failed: Timed out waiting 5000ms') exits 1
    with one line that says so, and its traceback goes to the run directory's logs, not to
    the job's output (it printed 40 lines there, above the supervisor's line naming the hung
    process). Any other error, and any error outside `launch`, is printed as Python prints it."""
    from types import SimpleNamespace

    import jax

    from resilax._src.runtime import worker
    from resilax.tools import cli, report

    gloo = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [unbound_buffer.cc:81] Timed out waiting "
                                      "5000ms for recv operation to complete")

    def step_failed(args):
        try:
            raise gloo
        except jax.errors.JaxRuntimeError as e:  # (as the step's error unwinds through close())
            raise RuntimeError("the final wait failed too") from e

    exits = []  # (the worker exits with os._exit: Orbax's commit thread waits on the others; not in pytest)
    monkeypatch.setattr(worker, "exit_after_broken_collective", exits.append)
    monkeypatch.setattr(worker, "env", lambda: SimpleNamespace(run_dir=str(tmp_path), generation=2, process_id=1))
    monkeypatch.setattr(report, "_cli_main", step_failed)
    assert cli.main(["report", str(tmp_path)]) == 1
    assert exits == [1]
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "collective with another process broke" in err and "Timed out waiting 5000ms" in err, err
    saved = tmp_path / "logs" / "g2.p1.error.txt"
    assert str(saved) in err and "Traceback" in saved.read_text() and "the final wait failed too" in saved.read_text()
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")
    monkeypatch.setattr(report, "_cli_main", lambda args: (_ for _ in ()).throw(oom))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Out of memory"):  # the user's to act on: as it is
        cli.main(["report", str(tmp_path)])
    monkeypatch.setattr(worker, "env", lambda: None)
    monkeypatch.setattr(report, "_cli_main", step_failed)
    with pytest.raises(RuntimeError, match="the final wait failed too"):  # no supervisor to act: as it is
        cli.main(["report", str(tmp_path)])
    assert exits == [1]
