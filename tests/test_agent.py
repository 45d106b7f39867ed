"""`resilax launch --nodes`: agents of a job across hosts, as separate processes on loopback.

Two agents (each its own process group, as two hosts), 2 workers x 2 CPU devices each, run
`resilax train` on `cpu-4x2` (the bit-exact mode) for a few steps with no failure; the
final state must be bitwise that of a single-process run of the same topology, and
``processes.json`` must name both nodes, the service node and every worker. Recovery across
hosts is not built yet (tools/agent.py): a lost host stops the job (tested with stand-in
workers), and a relaunch in the same run directory agrees on the next generation.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

from helpers import kill_tree

STEPS = 6
TRAIN = ["resilax", "train", "--topology", "cpu-4x2", "--layout", "sharded", "--steps", str(STEPS),
         "--checkpoint-every", "3", "--log-every", "3"]



def test_two_agents_run_a_job_across_hosts_equal_to_one_process(tmp_path, child_env):
    run, out = tmp_path / "run", tmp_path / "final.npz"
    agents, logs = [], []
    try:
        for r in (1, 0):  # the higher rank first: the rendezvous waits for both
            log = open(tmp_path / f"agent{r}.log", "wb")
            logs.append(log)
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "resilax", "launch", "--nodes", "2", "--node-rank", str(r), "--run-dir",
                 str(run), "-n", "2", "--devices-per-process", "2", "--lease", "3", "--heartbeat", "0.2",
                 "--heartbeat-timeout", "5", "--", *TRAIN, "--out", str(out)],
                env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        # the reference while the job runs (its compile overlaps the agents' start-up)
        ref = subprocess.run([sys.executable, "-m", *TRAIN, "--no-log", "--no-peers", "--checkpoint-dir",
                              str(tmp_path / "ref_ck"), "--out", str(tmp_path / "ref.npz"), "--quiet"],
                             env=child_env, capture_output=True, text=True, timeout=240)
        assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
        t0 = time.time()
        rcs = [a.wait(timeout=max(1.0, 240 - (time.time() - t0))) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
        for log in logs:
            log.close()
    texts = {r: (tmp_path / f"agent{r}.log").read_text(errors="replace") for r in (0, 1)}
    assert rcs == [0, 0], texts
    procs = json.loads((run / "processes.json").read_text())
    assert procs["generation"] == 0 and procs["service_node"] == 0 and procs["status"] == "done", procs
    assert sorted(procs["nodes"]) == ["0", "1"]
    assert procs["nodes"]["0"]["agent"] == agents[1].pid and procs["nodes"]["1"]["agent"] == agents[0].pid
    assert sorted(procs["nodes"]["0"]["workers"]) == ["0", "1"] and sorted(procs["nodes"]["1"]["workers"]) == ["2", "3"]
    for r, ids in ((0, (0, 1)), (1, (2, 3))):
        assert f"node {r}, generation 0: nodes [0, 1], coordination service on node 0" in texts[r]
        for i in ids:
            assert f"[g0 n{r} p{i}] done: {STEPS} steps" in texts[r], texts[r][-3000:]
    final, reference = np.load(out, allow_pickle=False), np.load(tmp_path / "ref.npz", allow_pickle=False)
    assert sorted(final.files) == sorted(reference.files)
    assert all(np.array_equal(final[k], reference[k]) for k in final.files)


def test_launch_cli_rejects_bad_node_options(tmp_path, child_env):
    base = [sys.executable, "-m", "resilax", "launch", "-n", "1", "--run-dir", str(tmp_path), "--nodes", "2"]
    for extra, want in ((["--", "true"], "--nodes needs --node-rank"),
                        (["--node-rank", "2", "--", "true"], "0 <= --node-rank < --nodes, got --nodes 2 --node-rank 2"),
                        (["--node-rank", "0", "--spares", "1", "--", "true"],
                         "--spares cannot be combined with --nodes")):
        r = subprocess.run(base + extra, env=child_env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and want in r.stderr, (extra, r.stderr)


def _agent(tmp_path, run, r, worker_code, child_env, tag):
    log = open(tmp_path / f"{tag}{r}.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "resilax", "launch", "--nodes", "2", "--node-rank", str(r),
                          "--run-dir", str(run), "-n", "1", "--lease", "1.5", "--", sys.executable, "-c", worker_code],
                         env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not reaped yet) is dead too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_lost_host_stops_the_job_and_a_relaunch_agrees_on_the_next_generation(tmp_path, child_env):
    """No recovery across hosts yet: SIGKILL of one agent's host (the agent; its workers die
    with it) makes the other agent stop its workers and exit 1, naming the lost node; the
    job relaunched in the same run directory agrees on generation 1 and ends with 0. The
    workers are stand-ins (no JAX), so this tests the agents only."""
    run = tmp_path / "run"
    agents = [_agent(tmp_path, run, r, "import time; time.sleep(120)", child_env, "a") for r in (0, 1)]
    try:
        def running():
            try:
                procs = json.loads((run / "processes.json").read_text())
            except (OSError, ValueError):
                return None
            return procs if len(procs["nodes"]) == 2 else None

        t0 = time.time()
        while (procs := running()) is None:
            assert time.time() - t0 < 60 and all(a.poll() is None for a in agents), "the agents did not start"
            time.sleep(0.05)
        workers = [procs["nodes"][r]["workers"][str(int(r))] for r in ("0", "1")]
        t_kill = time.time()
        kill_tree(agents[1])  # the host of node 1 (not the service node)
        rc0 = agents[0].wait(timeout=30)
        took = time.time() - t_kill
    finally:
        for a in agents:
            kill_tree(a)
    text = (tmp_path / "a0.log").read_text()
    assert rc0 == 1 and "generation 0 failed: node 1's lease expired" in text, text
    assert took < 1.5 + 10, took
    time.sleep(0.5)
    assert not any(_pid_alive(w) for w in workers), workers  # stopped by agent 0 / died with agent 1
    assert json.loads((run / "processes.json").read_text())["status"] == "failed"

    agents = [_agent(tmp_path, run, r, "pass", child_env, "b") for r in (0, 1)]
    try:
        rcs = [a.wait(timeout=60) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
    assert rcs == [0, 0], [(tmp_path / f"b{r}.log").read_text() for r in (0, 1)]
    procs = json.loads((run / "processes.json").read_text())
    assert procs["generation"] == 1 and procs["status"] == "done", procs
