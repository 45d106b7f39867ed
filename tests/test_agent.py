"""`resilax launch --nodes`: agents of a job across hosts, as separate processes on loopback.

What a host's store offers a new generation (no JAX); with stand-in workers (no JAX), a hung host (SIGSTOP) found by its lease; and a
whole-job SIGTERM (preemption) that a relaunch resumes from, bitwise, both launches by the
Slurm recipe's command with Slurm's variables (processes.json names both nodes, the service
node and every worker). Recovery across hosts with real workers (three agents x 2 workers,
the service host SIGKILLed, resumed from the survivors' host stores, grown back, bitwise) is
tests/test_bench_multihost.py: `resilax bench multihost` runs that very job.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

import recipes
from helpers import agree_together, cli, flat_equal, kill_tree, load_npz, reference_run, shared_topology

STEPS = 6
TRAIN = ["resilax", "train", "--topology", "cpu-4x2", "--layout", "sharded", "--steps", str(STEPS),
         "--checkpoint-every", "3", "--log-every", "3"]



def _slurm_agents(tmp_path, run, cmd, child_env, tag, *, nodes=2, procs_per_node=1, devices=2):
    """The Slurm recipe's command (examples/slurm/resilax.sbatch: its `srun` line's `resilax
    launch ...`, run with bash as srun would on each node) as ``nodes`` agents on loopback,
    each its own process group, with Slurm's variables instead of --nodes/--node-rank/--address:
    SLURM_NNODES, SLURM_NODEID, SLURMD_NODENAME=localhost (resolved to 127.0.0.1: the address
    the service binds and is advertised at), the script's RUN_DIR/PROCS_PER_NODE/
    DEVICES_PER_PROCESS and its arguments (``cmd``). The agents, by rank; logs ``{tag}{rank}.log``."""
    launch = recipes.sbatch_launch()
    path = recipes.resilax_shim(tmp_path / "bin") + os.pathsep + child_env.get("PATH", "")
    agents = {}
    for r in reversed(range(nodes)):  # the higher ranks first: the rendezvous waits for all
        env = dict(child_env, PATH=path, SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes), SLURM_NODEID=str(r),
                   SLURM_LOCALID="0", SLURMD_NODENAME="localhost", RUN_DIR=str(run),
                   PROCS_PER_NODE=str(procs_per_node), DEVICES_PER_PROCESS=str(devices))
        with open(tmp_path / f"{tag}{r}.log", "wb") as log:
            agents[r] = subprocess.Popen(["bash", "-c", f"exec {launch}", "resilax.sbatch", *cmd], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
    return [agents[r] for r in range(nodes)]


def test_launch_cli_rejects_bad_node_options(tmp_path, capsys):
    base = ["launch", "-n", "1", "--run-dir", str(tmp_path), "--nodes", "2"]
    for extra, want in ((["--", "true"], "--nodes needs --node-rank"),
                        (["--node-rank", "2", "--", "true"], "0 <= --node-rank < --nodes, got --nodes 2 --node-rank 2"),
                        (["--node-rank", "0", "--in-place", "--shrink", "backend", "--", "true"],
                         "--shrink backend cannot be combined with --nodes"),
                        (["--node-rank", "0", "--in-place", "--min-in-place", "1", "--", "true"],
                         "--min-in-place (across hosts: --min-nodes) cannot be combined with --nodes"),
                        (["--node-rank", "0", "--in-place", "--host-store-every", "0", "--", "true"],
                         "--in-place re-forms from the host stores: it needs --host-store-every > 0"),
                        (["--node-rank", "0", "--spares", "-1", "--", "true"],
                         "--spares must be an integer >= 0"),
                        (["--node-rank", "0", "--host-store-mirrors", "2", "--", "true"],
                         "--host-store-mirrors must be in [1, 1] (--nodes - 1"),
                        (["--node-rank", "0", "--host-store-mirrors", "0", "--", "true"],
                         "--host-store-mirrors must be in [1, 1] (--nodes - 1")):
        rc, err = cli(base + extra, capsys)
        assert rc == 2 and want in err, (extra, err)
    assert not (tmp_path / "processes.json").exists()


def _commit(root, slot, step, whole, kind="own", writers=None):
    """A host-store commit record of ``step`` for process ``slot`` (no arrays: the agent reads records only)."""
    d = root / f"host{slot}" / kind
    d.mkdir(parents=True, exist_ok=True)
    (d / f"step{step}.json").write_text(json.dumps({"step": step, "sha256": "x", "process": slot, "whole": whole,
                                                    "writers": writers}))


def test_the_agent_offers_its_host_store_steps_and_only_whole_copies_after_the_nodes_changed(tmp_path, capsys):
    """The agent's choice of what its host store offers a new generation (no JAX, no workers):
    everything its processes can restore when the nodes are the same; after a host was lost,
    only whole copies (the bit-exact mode), the default mode's shards fall back to the
    checkpoint, saying so; a new agent's store is empty; a host with the store off offers
    none. The workers then take the newest step in every host's offer (`agree_newest`)."""
    from types import SimpleNamespace

    from resilax._src.runtime import membership
    from resilax.tools.agent import Agent

    def agent(rank, members_before, members, whole, every=1):
        a = Agent(["true"], nodes=3, node_rank=rank, n=2, devices_per_process=1, run_dir=tmp_path / "run",
                  host_store_every=every, host_store_dir=tmp_path / f"shm{rank}{whole}")
        assert a.store_root is None if not every else a.store_root == tmp_path / f"shm{rank}{whole}"
        for step in (7, 8, 9):
            for slot in (2 * rank, 2 * rank + 1):
                if step < 9 or slot % 2:  # process 2 * rank was killed while writing step 9
                    _commit(tmp_path / f"shm{rank}{whole}", slot, step, whole)
        a._members = members_before
        a.gen = SimpleNamespace(generation=1, members=members)
        return a._store_steps([2 * rank, 2 * rank + 1])

    # a whole copy serves every process of its host: process 3's step 9 serves process 2 too
    assert agent(1, None, (0, 1, 2), True) == "7,8,9"  # the first generation (a relaunch on the same host)
    assert agent(1, (0, 1, 2), (0, 1, 2), False) == "7,8"  # a worker failed, no host lost: its own shards fit
    assert agent(1, (0, 1, 2), (1, 2), True) == "7,8,9"  # host 0 lost: whole copies still fit
    capsys.readouterr()
    assert agent(1, (0, 1, 2), (1, 2), False) == "none"  # the default mode: no mirror of host 0's shards anywhere
    said = capsys.readouterr().out
    assert "own shards up to step 8 (the default mode); the nodes changed ([0, 1, 2] -> [1, 2])" in said
    assert "no step has every process's shards in a live host's store" in said
    assert "resuming from the newest checkpoint" in said
    # with mirrors: host 0's processes mirrored to node 1, node 2's own copies served by its
    # agent's store server: the steps of which all 6 writers' shards are on a live host
    from resilax._src.protect import hoststore_net

    six = list(range(6))
    mine, theirs = tmp_path / "shm-m1", tmp_path / "shm-m2"
    for step in (7, 8, 9):
        for slot in (2, 3):
            _commit(mine, slot, step, False, writers=six)
        for slot in (0, 1):
            if step < 9 or slot:  # process 0's mirror of step 9 never arrived
                _commit(mine, slot, step, False, "mirror", six)
        for slot in (4, 5):
            _commit(theirs, slot, step, False, writers=six)
    server = hoststore_net.StoreServer(theirs)
    try:
        a = Agent(["true"], nodes=3, node_rank=1, n=2, devices_per_process=1, run_dir=tmp_path / "run",
                  host_store_dir=mine)
        a._members, a.gen = (0, 1, 2), SimpleNamespace(generation=1, members=(1, 2))
        a._stores = {1: "unused", 2: server.address}
        assert a._store_steps([2, 3]) == "7,8"
        said = capsys.readouterr().out
        assert "the live hosts' stores hold every process's shards of steps [7, 8] (node(s) [0]'s from their " \
               "mirrors)" in said, said
        server.close()  # node 2 gone too: not every writer's shards are reachable
        a._members, a.gen = (0, 1, 2), SimpleNamespace(generation=2, members=(1, 2))
        a._newest = None
        assert a._store_steps([2, 3]) == "none"
        assert f"unreachable: node 2 ({server.address}" in capsys.readouterr().out
    finally:
        server.close()
    # a generation that failed before storing a step leaves generation 0's shards the newest:
    # the next one, on the same nodes as the failed one, must not take them (it offered them,
    # "the nodes did not change", and each of its workers' reads failed its shard keys)
    a = Agent(["true"], nodes=3, node_rank=1, n=2, devices_per_process=1, run_dir=tmp_path / "run",
              host_store_every=1, host_store_dir=tmp_path / "shm1False")
    a._members = (0, 1, 2)
    for g in (1, 2):
        a.gen = SimpleNamespace(generation=g, members=(1, 2))
        assert a._store_steps([2, 3]) == "none", g
    for slot in (2, 3):  # generation 2 stores step 10 on its own nodes: those shards fit generation 3
        _commit(tmp_path / "shm1False", slot, 10, False)
    a.gen = SimpleNamespace(generation=3, members=(1, 2))
    assert a._store_steps([2, 3]).split(",")[-1] == "10"
    assert agent(1, (0, 1, 2), (0, 1, 2), True, every=0) == "none"
    fresh = Agent(["true"], nodes=3, node_rank=0, n=2, devices_per_process=1, run_dir=tmp_path / "run")
    assert fresh.store_root.name.startswith("resilax-store-") and "-node0-" in fresh.store_root.name
    assert not str(fresh.store_root).startswith(str(tmp_path / "run"))  # never on the shared run dir
    fresh.gen = SimpleNamespace(generation=2, members=(0, 1, 2))
    assert fresh._store_steps([0, 1]) == "none"  # a replacement host: empty store
    # the workers' vote: the newest step in every host's offer; one host with none: all checkpoint
    votes = {}
    old_votes, old_env = membership._votes, membership._state.get("env")
    membership._votes, membership._state["env"] = (lambda v, what: votes[what]), object()
    try:
        votes["a"] = ["7,8", "7,8,9", "8"]
        votes["b"] = ["7,8", "none", "7,8"]
        votes["c"] = ["9", "7,8"]
        assert membership.agree_newest([7, 8], "a") == 8
        assert membership.agree_newest([7, 8], "b") is None
        assert membership.agree_newest([9], "c") is None
    finally:
        membership._votes, membership._state["env"] = old_votes, old_env
    assert membership.agree_newest([3, 5], "alone") == 5  # not under launch: its own newest


def _wait(pred, timeout, what, procs=()):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead and not pred():  # (it may have come true just before the exit)
            raise AssertionError(f"an agent exited ({dead}) while waiting for {what}\n{_log_tails(procs)}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{_log_tails(procs)}")


def _exit_codes(procs, timeout, what, also=()) -> list[int]:
    """The exit codes of ``procs`` once all exited; past ``timeout`` an AssertionError with
    the logs of ``procs`` and ``also`` and the rendezvous records (what a hang needs to be read)."""
    t0 = time.time()
    while any(p.poll() is None for p in procs):
        if time.time() - t0 > timeout:
            run = next((pathlib.Path(a[a.index("--run-dir") + 1]) for p in procs
                        if "--run-dir" in (a := [str(x) for x in p.args])), None)
            records = "" if run is None else "\n".join(
                f"{f.relative_to(run)}: {f.read_text(errors='replace')[:400]}"
                for f in sorted((run / "rendezvous").rglob("*.json")))
            raise AssertionError(f"timed out after {timeout} s waiting for {what}: exit codes "
                                 f"{[p.poll() for p in procs]}\n{_log_tails([*procs, *also])}\n{records}")
        time.sleep(0.05)
    return [p.returncode for p in procs]


def _log_tails(procs, n=2500) -> str:
    """The end of every agent log next to the agents' run directory (what a failure needs to be read)."""
    dirs = {pathlib.Path(a[a.index("--run-dir") + 1]).parent for p in procs
            if "--run-dir" in (a := [str(x) for x in p.args])}
    return "\n".join(f"--- {f.name}:\n{f.read_text(errors='replace')[-n:]}" for d in dirs for f in sorted(d.glob("*.log")))


def _processes(run, gen=None, nodes=None):
    """processes.json once it names generation ``gen`` running with every node of ``nodes`` in it."""
    try:
        procs = json.loads((run / "processes.json").read_text())
    except (OSError, ValueError):
        return None
    if gen is not None and (procs["generation"] != gen or procs["status"] != "running"):
        return None
    return procs if nodes is None or sorted(procs["nodes"]) == sorted(map(str, nodes)) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not reaped yet) is dead too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _signal_host(procs, r, sig):
    """``sig`` to host ``r``: its agent's process group and each of its workers' (own sessions)."""
    node = procs["nodes"][str(r)]
    for pid in [node["agent"], *node["workers"].values()]:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def _launch(tmp_path, run, r, nodes, cmd, child_env, tag, *extra):
    log = open(tmp_path / f"{tag}{r}.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "resilax", "launch", "--nodes", str(nodes), "--node-rank", str(r),
                          "--run-dir", str(run), *extra, "--", *cmd],
                         env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return p


# a stand-in worker: prints its place in the job, sleeps through generations 0 and 1, ends in 2
STAND_IN = ("import os, time; e = os.environ; print('slots', repr(e['RESILAX_SLOTS']), 'of', e['RESILAX_NUM_SLOTS'], "
            "'process', e['RESILAX_PROCESS_ID'], 'of', e['RESILAX_NUM_PROCESSES'], flush=True); "
            "time.sleep(120 if int(e['RESILAX_GENERATION']) < 2 else 0)")


def test_a_host_store_directory_in_use_by_another_agent_is_refused_and_left_alone(tmp_path, child_env):
    """An agent empties its --host-store-dir when it starts: a second agent given the same
    directory (another job's here, in another run directory) emptied the first one's store
    under its workers. Now the first holds it: the second exits 2 with one line naming the
    directory and the first agent's pid, and the first one's store is still there."""
    store = tmp_path / "store"
    opts = ("-n", "1", "--devices-per-process", "1", "--rendezvous-timeout", "120", "--host-store-dir", str(store))
    first = _launch(tmp_path, tmp_path / "run_a", 0, 2, [sys.executable, "-c", STAND_IN], child_env, "a", *opts)
    try:
        _wait(lambda: (tmp_path / "run_a" / "rendezvous" / "leases" / "node0.json").exists(), 60, "the first lease",
              [first])
        assert (store / "host0").is_dir()
        r = subprocess.run([sys.executable, "-m", "resilax", "launch", "--nodes", "2", "--node-rank", "0", "--run-dir",
                            str(tmp_path / "run_b"), *opts, "--", sys.executable, "-c", STAND_IN], env=child_env,
                           capture_output=True, text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
        assert f"the host store directory {str(store)!r} is in use by another agent (pid {first.pid}," in lines[0], \
            lines
        assert first.poll() is None and (store / "host0").is_dir()
        assert not (tmp_path / "run_b" / "rendezvous").exists()  # refused before it registered anywhere
    finally:
        kill_tree(first)


def test_an_agent_after_the_job_completed_says_so_when_it_gives_up(tmp_path, child_env):
    """Two agents run a job whose workers exit 0 at once (the job completes); an agent started
    afterwards with node 1's rank finds no generation to join: after --rendezvous-timeout it
    exits 1 and says the job had already completed, not only that it waited."""
    run = tmp_path / "run"

    def agent(rank, timeout):
        return subprocess.Popen([sys.executable, "-m", "resilax", "launch", "--nodes", "2", "--node-rank", str(rank),
                                 "--run-dir", str(run), "-n", "1", "--devices-per-process", "1", "--lease", "1",
                                 "--rendezvous-timeout", str(timeout), "--", sys.executable, "-c", "pass"],
                                env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    first = [agent(r, 60) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in first]
    finally:
        for p in first:
            kill_tree(p)
    assert [p.returncode for p in first] == [0, 0], outs
    assert json.loads((run / "processes.json").read_text())["status"] == "done"
    late = agent(1, 2)
    try:
        out = late.communicate(timeout=60)[0]
    finally:
        kill_tree(late)
    assert late.returncode == 1, out
    assert "got no committed generation" in out and "already completed in generation 0" in out, out


def test_the_agents_end_a_job_whose_workers_refuse_their_configuration_without_restarts(tmp_path, child_env):
    """Both hosts' workers refuse a topology of 8 devices on a job of 2 x 1: every agent
    gives up after the first generation with exit 78 (EX_CONFIG) and says why, instead of
    agreeing on generation after generation that would fail the same way."""
    run = tmp_path / "run"
    train = ["resilax", "train", "--topology", "cpu-2x4", "--steps", "4"]
    agents = [_launch(tmp_path, run, r, 2, train, child_env, "cfg", "-n", "1", "--devices-per-process", "1",
                      "--lease", "2") for r in (0, 1)]
    try:
        for p in agents:
            p.wait(timeout=120)
    finally:
        for p in agents:
            kill_tree(p)
    outs = [(tmp_path / f"cfg{r}.log").read_text(errors="replace") for r in (0, 1)]
    assert [p.returncode for p in agents] == [78, 78], outs
    for out in outs:
        assert "the topology needs 8 devices" in out and "refused its configuration before its first step" in out, out
        assert "generation 1" not in out, out


def test_a_hung_service_host_is_found_by_its_lease_and_the_job_grows_back_when_it_wakes(tmp_path, child_env):
    """SIGSTOP of node 0's agent and worker (the service host hangs): node 1 sees node 0's
    lease expire, stops its worker and re-forms alone as generation 1 (--min-nodes 1), its
    worker keeping its place in the job (process 1 of 2); SIGCONT: the woken agent finds a
    newer generation, stops its stale worker and asks back in, and generation 2 has both
    nodes again (the job grew back). Stand-in workers (no JAX): this tests the agents."""
    run = tmp_path / "run"
    opts = ("-n", "1", "--lease", "1.5", "--min-nodes", "1", "--rendezvous-timeout", "60")
    cmd = [sys.executable, "-c", STAND_IN]
    agents = [_launch(tmp_path, run, r, 2, cmd, child_env, "a", *opts) for r in (0, 1)]
    try:
        procs = _wait(lambda: _processes(run, 0, (0, 1)), 60, "generation 0 on both nodes", agents)
        old = procs["nodes"]["0"]["workers"]["0"]
        t_stop = time.time()
        _signal_host(procs, 0, signal.SIGSTOP)
        procs1 = _wait(lambda: _processes(run, 1, (1,)), 30, "generation 1 on node 1 alone", agents[1:])
        took = time.time() - t_stop
        _wait(lambda: "[g1 n1 p0] slots" in (tmp_path / "a1.log").read_text(), 30, "generation 1's worker",
              agents[1:])  # (it prints its place in the job; growing back stops it)
        _signal_host(procs, 0, signal.SIGCONT)
        rcs = [a.wait(timeout=60) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
    texts = [(tmp_path / f"a{r}.log").read_text() for r in (0, 1)]
    assert rcs == [0, 0], texts
    assert took < 1.5 + 10, took
    assert procs1["service_node"] == 1
    assert "generation 0 ended: node 0's lease expired" in texts[1], texts[1]
    assert "[g1 n1 p0] slots '1' of 2 process 0 of 1" in texts[1], texts[1]
    # the woken agent ends generation 0 on the newer generation, or, when the SIGSTOP froze it
    # mid-check after it had read the newest generation (0), on what it reads next: its own
    # lease, expired while it was stopped (seen once, 2026-11-27), or node 1's request (seen
    # once in CI); either way it does not join 1
    assert ("generation 0 ended: generation 1 was proposed" in texts[0] or
            "generation 0 ended: node 0's lease expired" in texts[0] or
            "generation 0 ended: node 1 asked for a new generation" in texts[0]), texts[0]
    assert "node 0, generation 1:" not in texts[0], texts[0]
    assert "generation 1 ended: node(s) [0] joined" in texts[1] or "generation 1 ended: generation 2 was proposed" \
        in texts[1], texts[1]
    assert "[g2 n0 p0] slots '' of 0 process 0 of 2" in texts[0] and "[g2 n1 p1] slots '' of 0 process 1 of 2" \
        in texts[1], texts
    assert not _pid_alive(old)
    procs = json.loads((run / "processes.json").read_text())
    assert procs["generation"] == 2 and procs["service_node"] == 0 and procs["status"] == "done", procs


# a stand-in worker that ends once the job is back at its full size after a recovery
BACK_TO_FULL = ("import os, time; e = os.environ; print('process', e['RESILAX_PROCESS_ID'], 'of', "
                "e['RESILAX_NUM_PROCESSES'], flush=True); "
                "time.sleep(0 if int(e['RESILAX_GENERATION']) >= 1 and e['RESILAX_NUM_PROCESSES'] == '2' else 120)")


def test_a_spare_host_stands_in_for_a_killed_one_and_the_job_grows_back_to_full_size(tmp_path, child_env):
    """Two agents and two spare agents (``--spare``: a standby host, no rank). SIGKILL of node
    1's agent and worker (its host dies): exactly one spare claims node 1's rank once its
    lease expired, runs as node 1, and the job is back at both nodes with no replacement of
    its own (stand-in workers that end once the job runs at full size again after the
    recovery). The other spare exits 0 when the job ends, saying it stood in for no host.
    Stand-in workers (no JAX): this tests the agents; a spare is then an agent like the
    replacement with the dead rank that tests/test_bench_multihost.py runs with real ones."""
    run = tmp_path / "run"
    opts = ("-n", "1", "--lease", "1.5", "--min-nodes", "1", "--rendezvous-timeout", "60")
    cmd = [sys.executable, "-c", BACK_TO_FULL]
    agents = [_launch(tmp_path, run, r, 2, cmd, child_env, "a", *opts) for r in (0, 1)]
    spares = []
    for k in range(2):
        with open(tmp_path / f"s{k}.log", "wb") as log:
            spares.append(subprocess.Popen([sys.executable, "-m", "resilax", "launch", "--nodes", "2", "--spare",
                                            "--run-dir", str(run), *opts, "--", *cmd], env=child_env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
    try:
        procs = _wait(lambda: _processes(run, 0, (0, 1)), 60, "generation 0 on both nodes", agents)
        _signal_host(procs, 1, signal.SIGKILL)
        rcs = [p.wait(timeout=90) for p in (agents[0], *spares)]
    finally:
        for p in (*agents, *spares):
            kill_tree(p)
    texts = [(tmp_path / f"s{k}.log").read_text() for k in range(2)]
    a0 = (tmp_path / "a0.log").read_text()
    assert rcs == [0, 0, 0], (rcs, a0[-2000:], texts)
    stood = [k for k in range(2) if "standing in as node 1" in texts[k]]
    assert len(stood) == 1, texts
    other = texts[1 - stood[0]]
    assert "with no host to stand in for" in other and "standing in" not in other, other
    final = json.loads((run / "processes.json").read_text())
    assert final["status"] == "done" and sorted(final["nodes"]) == ["0", "1"], final
    assert final["nodes"]["1"]["agent"] == spares[stood[0]].pid, (final, [s.pid for s in spares])
    assert "process 1 of 2" in texts[stood[0]] and final["generation"] >= 1, texts[stood[0]]
    assert len(list((run / "rendezvous" / "claims").glob("node1.*.json"))) == 1


def test_warm_spare_processes_on_each_host_become_the_next_generations_workers_bitwise(tmp_path, child_env,
                                                                                      tmp_path_factory):
    """``--spares 1`` across hosts: each agent keeps a warm spare process of the worker
    command (imported, waiting; processes.json lists it under its node). SIGKILL of node 1's
    worker ends the generation on both hosts; the next generation's workers are the hosts'
    warm spares (no process start, no imports), new spares are started once it steps, and
    the job ends bitwise equal to a failure-free single-process run (2 agents x 1 worker x
    2 CPU devices, the bit-exact mode, checkpoints every 10, host stores). The program and its
    failure-free reference are the preemption test's (`_train_2x2`, `_reference_2x2`)."""
    train = _train_2x2(tmp_path_factory)
    run, out = tmp_path / "run", tmp_path / "final.npz"
    cmd = [sys.executable, "-m", *train, "--out", str(out)]
    opts = ("-n", "1", "--devices-per-process", "2", "--spares", "1", "--rendezvous-timeout", "120")
    agents = [_launch(tmp_path, run, r, 2, cmd, child_env, "w", *opts) for r in (0, 1)]
    try:
        procs = _wait(lambda: (p := _processes(run, 0, (0, 1))) and all(p["nodes"][str(r)].get("spares")
                                                                        for r in (0, 1)) and p,
                      180, "generation 0 with a warm spare on each node", agents)
        _wait(lambda: all((_json_file(run / "heartbeats" / f"node{r}.spare0.json") or {}).get("phase") == "spare"
                          for r in (0, 1)), 120, "both spares warm (imported, waiting)", agents)
        _wait(lambda: len(s := _steps(run, 0)) == 2 and min(s.values()) >= 3, 120, "generation 0 stepping", agents)
        os.kill(int(procs["nodes"]["1"]["workers"]["1"]), signal.SIGKILL)
        ref = _reference_2x2(tmp_path_factory)  # (made while the job recovers, unless another test made it)
        rcs = [a.wait(timeout=240) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
    texts = [(tmp_path / f"w{r}.log").read_text(errors="replace") for r in (0, 1)]
    assert rcs == [0, 0], [t[-3000:] for t in texts]
    for r, spare in ((0, procs["nodes"]["0"]["spares"]), (1, procs["nodes"]["1"]["spares"])):
        line = next(ln for ln in texts[r].splitlines() if f"node {r}, generation 1: nodes" in ln)
        assert "from warm spares [0]" in line and f"(pids [{spare['0']}])" in line, line  # generation 0's spare
        assert f"node {r}: started 1 warm spare(s)" in texts[r].split(line)[1], texts[r][-3000:]  # and a new one
    assert flat_equal(load_npz(out), ref)


def test_a_spare_stands_in_for_a_hung_host_which_is_fenced_when_it_wakes(tmp_path, child_env):
    """SIGSTOP of node 1's agent and worker (its host hangs): the spare takes node 1's rank once
    the lease expired and the job is back at both nodes; SIGCONT: the woken agent finds
    another incarnation in its lease (fenced), stops its stale worker and exits 1 saying so,
    without touching the spare's lease; the job then completes with the spare as node 1.
    Stand-in workers that end, once the job is back at full size, when the test says so."""
    run, go = tmp_path / "run", tmp_path / "go"
    worker = ("import os, time; e = os.environ; print('process', e['RESILAX_PROCESS_ID'], 'of', "
              "e['RESILAX_NUM_PROCESSES'], flush=True)\n"
              "full = int(e['RESILAX_GENERATION']) >= 1 and e['RESILAX_NUM_PROCESSES'] == '2'\n"
              f"while not (full and os.path.exists({str(go)!r})): time.sleep(0.05)")
    opts = ("-n", "1", "--lease", "1.5", "--min-nodes", "1", "--rendezvous-timeout", "60")
    cmd = [sys.executable, "-c", worker]
    agents = [_launch(tmp_path, run, r, 2, cmd, child_env, "h", *opts) for r in (0, 1)]
    with open(tmp_path / "spare.log", "wb") as log:
        spare = subprocess.Popen([sys.executable, "-m", "resilax", "launch", "--nodes", "2", "--spare", "--run-dir",
                                  str(run), *opts, "--", *cmd], env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        procs = _wait(lambda: _processes(run, 0, (0, 1)), 60, "generation 0 on both nodes", agents)
        old_worker = int(procs["nodes"]["1"]["workers"]["1"])
        _signal_host(procs, 1, signal.SIGSTOP)
        back = _wait(lambda: (p := _json_file(run / "processes.json")) and p.get("status") == "running" and
                     (p.get("nodes", {}).get("1") or {}).get("agent") == spare.pid and p, 60,
                     "the spare running as node 1", [agents[0], spare])
        _signal_host(procs, 1, signal.SIGCONT)
        woken_rc, = _exit_codes([agents[1]], 60, "the woken agent", also=[agents[0], spare])
        go.write_text("")
        rcs = _exit_codes([agents[0], spare], 60, "the job's end", also=[agents[1]])
    finally:
        for p in (*agents, spare):
            kill_tree(p)
    woken = (tmp_path / "h1.log").read_text()
    assert woken_rc == 1 and "lost its lease" in woken, woken[-2000:]
    assert rcs == [0, 0], ((tmp_path / "h0.log").read_text()[-2000:], (tmp_path / "spare.log").read_text()[-2000:])
    assert back["generation"] >= 1 and not _pid_alive(old_worker)
    final = json.loads((run / "processes.json").read_text())
    assert final["status"] == "done" and final["nodes"]["1"]["agent"] == spare.pid, final


def test_a_node_that_ends_and_leaves_between_two_reads_is_the_jobs_end(tmp_path):
    """The end of a job across hosts: node 1's agent saw every node done, exited and released
    its lease between node 0's read of the nodes' parts (node 1 still running) and its look
    at the rendezvous (node 1 left). That is the job's end, not a lost node: node 0 ends
    with 0 (CI, 1 run in 24 beside three others: node 0 formed a generation alone after
    the job had ended, and its worker waited for a peer for good). The agents' own
    rendezvous and part files; the interleaving is made at node 0's look."""
    from resilax._src.runtime.rendezvous import Rendezvous
    from resilax.tools.agent import NODES, Agent

    agents = [Agent([sys.executable, "-c", "pass"], nodes=2, node_rank=r, n=1, devices_per_process=1,
                    run_dir=tmp_path, lease_s=30.0, host_store_every=0) for r in (0, 1)]
    (tmp_path / NODES).mkdir()
    for a in agents:
        a.rdv = Rendezvous(tmp_path, a.rank, workers=1, lease_s=30.0, poll_s=0.01)
        a.rdv.register(renew=False)
    gen = agree_together([a.rdv for a in agents], min_nodes=2)
    for a in agents:
        a.gen = gen  # (no workers: both nodes' workers exited 0)
    agents[1]._write_node("running")
    look = agents[0].rdv.changed

    def node_1_ends_then_look(gen):
        agents[1]._write_node("done")  # node 1 saw both parts done ...
        agents[1].rdv.close()  # ... and its agent exited, releasing its lease
        return look(gen)

    agents[0].rdv.changed = node_1_ends_then_look
    assert look(agents[0].gen) is None
    assert agents[0]._watch() == ("done", 0, "")
    assert agents[0].rdv.changed(agents[0].gen) == "node 1 left"  # what node 0 saw, after the parts


def _json_file(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_spare_refuses_a_rank_and_needs_nodes(tmp_path, capsys):
    """``--spare`` takes a lost host's rank: with ``--node-rank`` or without ``--nodes`` it is
    a usage error naming the option, and nothing is started."""
    base = ["launch", "--run-dir", str(tmp_path / "run"), "-n", "1", "--spare"]
    rc, err = cli([*base, "--nodes", "2", "--node-rank", "1", "--", "true"], capsys)
    assert rc == 2 and "--spare takes the rank of a lost host: leave out --node-rank" in err, err
    rc, err = cli([*base, "--", "true"], capsys)
    assert rc == 2 and "--spare is a standby agent of a job across hosts: it needs --nodes" in err, err
    assert not (tmp_path / "run").exists()


def _topology(tmp_path, domains=3):
    """A spec of ``domains`` emulated CPU slices x 2 devices (one per worker process), as the bench writes it."""
    from resilax.tools.bench_multihost import _topology as bench_topology

    return bench_topology(tmp_path, workers=1, devices=2, nodes=domains)


def _train_2x2(tmp_path_factory):
    """The program of the warm-spare and preemption tests (2 slices x 2 devices, 30 steps)."""
    return ["resilax", "train", "--topology", shared_topology(tmp_path_factory, 2), "--layout", "sharded",
            "--steps", "30", "--checkpoint-every", "10", "--log-every", "10"]


def _reference_2x2(tmp_path_factory):
    """`_train_2x2`'s failure-free single-process run, made once per session (helpers.reference_run);
    it saves per leaf (``RESILAX_PACK_CHECKPOINTS=0``), the launched jobs packed."""
    return reference_run(tmp_path_factory, *_train_2x2(tmp_path_factory)[2:], "--no-log", "--no-peers", "--quiet",
                         env={"RESILAX_PACK_CHECKPOINTS": "0"})


def _steps(run, gen):
    out = {}
    for f in (run / "heartbeats").glob(f"g{gen}.p*.json"):
        try:
            out[f.name] = json.loads(f.read_text()).get("step") or 0
        except (OSError, ValueError):
            pass
    return out


def _resumed(log, prefix):
    """The step the worker with ``prefix`` in ``log`` resumed at, or None (not yet)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    got = [int(ln.split("resumed at step ")[1].split()[0]) for ln in lines if ln.startswith(prefix) and
           "resumed at step " in ln]
    return got[0] if got else None


def test_whole_job_sigterm_preempts_every_host_and_a_relaunch_resumes_bitwise(tmp_path, child_env, tmp_path_factory):
    """Whole-job preemption across hosts, through the Slurm recipe's command (`_slurm_agents`:
    what its ``--signal=TERM@60`` and ``--requeue`` do, done by hand): SIGTERM to both agents
    (each its own process group; the workers are in sessions of their own, so only the agents
    get it) mid-run. Each forwards it to its worker; the workers stop after the step they
    agree on (JAX's preemption sync), save it and exit 0; both agents exit 0 and
    processes.json says ``preempted`` (what the script's requeue looks for). The job
    relaunched in the same run directory resumes at that step and ends bitwise equal to a
    failure-free single-process run (2 agents x 1 worker x 2 CPU devices, 2 slices x 2
    devices, the bit-exact mode). While it runs, processes.json names both nodes, their agents
    and workers, and the coordinator at the node name resolved. The launched job saves packed
    checkpoints (the default: a multi-process packed save and restore); the reference saves
    per leaf (``RESILAX_PACK_CHECKPOINTS=0``)."""
    train = _train_2x2(tmp_path_factory)
    steps = int(train[train.index("--steps") + 1])
    run, out = tmp_path / "run", tmp_path / "final.npz"
    cmd = [*train, "--out", str(out)]
    packed_env = dict(child_env, RESILAX_PACK_CHECKPOINTS="1")
    agents = _slurm_agents(tmp_path, run, cmd, packed_env, "p")
    try:
        procs = _wait(lambda: _processes(run, 0, (0, 1)), 120, "generation 0 on both nodes", agents)
        assert procs["service_node"] == 0 and procs["coordinator"].startswith("127.0.0.1:"), procs  # SLURMD_NODENAME
        assert [procs["nodes"][str(r)]["agent"] for r in (0, 1)] == [a.pid for a in agents], procs
        assert [sorted(procs["nodes"][str(r)]["workers"]) for r in (0, 1)] == [["0"], ["1"]], procs
        _wait(lambda: len(s := _steps(run, 0)) == 2 and min(s.values()) >= 3, 120, "generation 0 stepping", agents)
        for a in agents:
            os.killpg(a.pid, signal.SIGTERM)
        rcs = [a.wait(timeout=60) for a in agents]
        assert rcs == [0, 0], [(tmp_path / f"p{r}.log").read_text()[-3000:] for r in (0, 1)]
        assert json.loads((run / "processes.json").read_text())["status"] == "preempted"
        assert not out.exists()
        metas = [json.loads(m.read_text()) for m in (run / "checkpoints").glob("*/meta/metadata")]
        assert metas and {m["format"] for m in metas} == {2}, [(m["format"], m["step"]) for m in metas]  # packed
        agents = _slurm_agents(tmp_path, run, cmd, packed_env, "q")  # the requeued job
        ref = _reference_2x2(tmp_path_factory)
        rcs = [a.wait(timeout=180) for a in agents]
    finally:
        for a in agents:
            kill_tree(a)
    first = (tmp_path / "p0.log").read_text(errors="replace")
    again = (tmp_path / "q0.log").read_text(errors="replace")
    assert rcs == [0, 0], again[-3000:]
    assert "after SIGTERM (preempted; relaunch to resume)" in first, first[-3000:]
    assert "node 0, generation 0: nodes [0, 1], coordination service on node 0" in first, first[-3000:]
    stopped = [int(ln.split("stopped after step ")[1].split(",")[0]) for ln in first.splitlines()
               if ln.startswith("[g0 n0 p0] preempted: every worker stopped after step ")]
    assert stopped and 3 <= stopped[0] < steps, first[-3000:]
    assert _resumed(tmp_path / "q0.log", "[g1 n0 p0]") == stopped[0], again[-3000:]
    assert stopped[0] in {m["step"] for m in metas}, [m["step"] for m in metas]  # it resumed from a packed save
    assert json.loads((run / "processes.json").read_text())["status"] == "done"
    assert flat_equal(load_npz(out), ref)


def test_in_place_the_live_hosts_workers_re_form_in_their_processes_bitwise(tmp_path, child_env, tmp_path_factory):
    """``--in-place`` across hosts: 3 agents x 1 worker x 2 CPU devices (the bit-exact mode,
    host stores), two losses in one job. Past step 13, a worker: SIGKILL of node 1's worker
    only (its agent starts a new one); then, past step 23, a host: SIGKILL of node 2, agent
    and worker (not the service host). Each time the other hosts keep their workers: the
    agents agree on the next generation (generation 1 with all three; generation 2 without
    node 2) while the workers wait in their broken step, and the workers re-form in their own
    processes (the same pids: node 1's new worker among them the second time), resuming from
    their host stores at the step reached, not at the checkpoint (10; 20). The final state is
    bitwise that of a failure-free single-process run. (Until 2026-11-29 the two losses were
    two jobs, a test parametrized by the loss: the same assertions, each on its generation,
    at 58 -> ~35 CPU-s.)"""
    steps = 40
    train = ["resilax", "train", "--topology", shared_topology(tmp_path_factory, 3), "--layout", "sharded", "--steps",
             str(steps), "--checkpoint-every", "10", "--log-every", "10", "--batch", "48"]
    run, out = tmp_path / "run", tmp_path / "final.npz"
    cmd = [sys.executable, "-m", *train, "--out", str(out)]
    opts = ("-n", "1", "--devices-per-process", "2", "--in-place", "--lease", "4", "--collective-timeout", "5",
            "--rendezvous-timeout", "120")  # (lease 4 s: 2 s expired under a starved renewal thread, 1 run in 20)
    agents = [_launch(tmp_path, run, r, 3, cmd, child_env, "i", *opts) for r in (0, 1, 2)]
    try:
        procs = _wait(lambda: _processes(run, 0, (0, 1, 2)), 180, "generation 0 on the three nodes", agents)
        kill_step = min(_wait(lambda: (s := _steps(run, 0)) and len(s) == 3 and min(s.values()) >= 13 and s,
                              180, "generation 0 past step 13", agents).values())
        os.kill(int(procs["nodes"]["1"]["workers"]["1"]), signal.SIGKILL)  # the worker
        procs1 = _wait(lambda: _processes(run, 1, (0, 1, 2)), 180, "generation 1 on the three nodes", agents)
        kill_step2 = min(_wait(lambda: (s := _steps(run, 1)) and len(s) == 3 and min(s.values()) >= 23 and s,
                               180, "generation 1 past step 23", agents).values())
        _signal_host(procs1, 2, signal.SIGKILL)  # the host
        ref = reference_run(tmp_path_factory, *train[2:], "--no-log", "--no-peers", "--quiet")
        rcs = _exit_codes(agents[:2], 240, "the job's end", also=agents[2:])
    finally:
        for a in agents:
            kill_tree(a)
    texts = [(tmp_path / f"i{r}.log").read_text(errors="replace") for r in (0, 1, 2)]
    assert rcs == [0, 0], [t[-3000:] for t in texts]
    for lost, g, kept, members, was, step, ckpt in (("worker", 1, (0, 2), "[0, 1, 2]", procs, kill_step, 10),
                                                    ("host", 2, (0, 1), "[0, 1]", procs1, kill_step2, 20)):
        for r in kept:
            ended = next((ln for ln in texts[r].splitlines() if f"node {r}, generation {g - 1} ended: " in ln), "")
            assert "this node's workers stay (--in-place)" in ended, (lost, texts[r][-3000:])
            pid = was["nodes"][str(r)]["workers"][str(r)]
            line = next(ln for ln in texts[r].splitlines() if f"node {r}, generation {g}: nodes {members}" in ln)
            assert f"(pids [{pid}])" in line and "] re-attached without restarting" in line, (lost, line)
            resumed = _resumed(tmp_path / f"i{r}.log", f"[g{g} n{r} p")
            assert resumed is not None and resumed >= step - 1 and resumed > ckpt, (lost, step, texts[r][-3000:])
    # the lost worker: node 1 started a new one; the verdict called its old one dead
    line = next(ln for ln in texts[1].splitlines() if "node 1, generation 1: nodes [0, 1, 2]" in ln)
    assert "re-attached" not in line and f"[{procs['nodes']['1']['workers']['1']}]" not in line, line
    assert flat_equal(load_npz(out), ref)


def test_the_agents_write_the_same_verdict_at_once_none_trips_on_another(tmp_path):
    """Every agent re-forming in place writes ``D/membership.json`` (the same record): three
    writers at once, 200 times each, never fail (a temporary file shared by name made one
    agent's rename fail and the agent exit) and leave the whole record, no temporary file."""
    import types

    from resilax.tools import agent_reform

    old = types.SimpleNamespace(generation=4, members=(0, 1, 2), process_ids={0: (0, 1), 1: (2, 3), 2: (4, 5)})
    new = types.SimpleNamespace(generation=6, members=(0, 1), process_ids={0: (0, 1), 1: (2, 3)})
    errors = []

    def write():
        try:
            for _ in range(200):
                agent_reform.write_verdict(tmp_path, old, new, [])
        except Exception as e:  # noqa: BLE001  (the test's outcome)
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert json.loads((tmp_path / "membership.json").read_text()) == {
        "generation": 4, "epoch": 1, "dead": [4, 5], "alive": [0, 1, 2, 3], "reform": 6}
    assert os.listdir(tmp_path) == ["membership.json"]


def test_default_mode_a_lost_host_resumes_from_its_mirror_on_the_next_host_within_1e_4(tmp_path, child_env):
    """The default mode across hosts (state sharded over both hosts' devices: each process
    holds half of every leaf): each worker stores its shards on its own host and mirrors them
    to the next host's store server. Node 0 (the service host) is SIGKILLed past a
    checkpoint, its store deleted with it (its RAM is gone). Node 1 re-forms alone: its
    agent finds every process's shards of the newest steps in its store (its own, node 0's
    mirror) and offers them; its worker assembles the smaller mesh's shards from both copies
    and resumes at the step reached, not at the checkpoint. The run ends within 1e-4
    (relative norm, every leaf) of a failure-free single-process run. 2 agents x 1 worker x
    2 CPU devices, 2 slices x 2 devices."""
    steps = 30
    train = ["resilax", "train", "--topology", _topology(tmp_path, 2), "--layout", "sharded", "--no-deterministic",
             "--steps", str(steps), "--checkpoint-every", "10", "--log-every", "10"]
    run, out = tmp_path / "run", tmp_path / "final.npz"
    stores = [tmp_path / f"store{r}" for r in (0, 1)]
    agents = [_launch(tmp_path, run, r, 2, [*train, "--out", str(out)], child_env, "d", "-n", "1",
                      "--devices-per-process", "2", "--lease", "2", "--host-store-dir", str(stores[r]))
              for r in (0, 1)]
    try:
        procs = _wait(lambda: _processes(run, 0, (0, 1)), 120, "generation 0 on both nodes", agents)
        assert procs["service_node"] == 0
        kill_step = min(_wait(lambda: (s := _steps(run, 0)) and len(s) == 2 and min(s.values()) >= 13 and s,
                              120, "generation 0 past step 13", agents).values())
        # node 1's store holds node 0's mirror of a step past the checkpoint before the kill
        _wait(lambda: any(int(f.stem[4:]) > 10 for f in (stores[1] / "host0" / "mirror").glob("step*.json")), 30,
              "node 0's mirror on node 1", agents)
        _signal_host(procs, 0, signal.SIGKILL)
        shutil.rmtree(stores[0], ignore_errors=True)
        ref = subprocess.run([sys.executable, "-m", *train, "--no-log", "--no-peers", "--checkpoint-dir",
                              str(tmp_path / "ref_ck"), "--out", str(tmp_path / "ref.npz"), "--quiet"],
                             env=dict(child_env, RESILAX_PACK_CHECKPOINTS="0"), capture_output=True, text=True,
                             timeout=240)
        assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
        rc = agents[1].wait(timeout=240)
    finally:
        for a in agents:
            kill_tree(a)
    log = (tmp_path / "d1.log").read_text(errors="replace")
    assert rc == 0, log[-4000:]
    assert "node 1, generation 1: nodes [1], coordination service on node 1" in log, log[-4000:]
    assert "the live hosts' stores hold every process's shards of steps [" in log and \
        "(node(s) [0]'s from their mirrors)" in log, log[-4000:]
    resumed = _resumed(tmp_path / "d1.log", "[g1 n1 p0]")
    # at most the step being mirrored at the kill is redone; never back to the checkpoint (10)
    assert resumed is not None and resumed >= kill_step - 1 and resumed > 10, (kill_step, log[-4000:])
    assert f"[g1 n1 p0] resumed at step {resumed} (host store: assembled from " in log, log[-4000:]
    # the mirror crossed with the job's key, made by the first agent, readable by its owner only
    assert (run / "store.key").stat().st_mode & 0o777 == 0o600 and "not authenticated" not in log
    a, b = np.load(out, allow_pickle=False), np.load(tmp_path / "ref.npz", allow_pickle=False)
    assert sorted(a.files) == sorted(b.files)
    rel = {k: float(np.linalg.norm(a[k].astype(np.float64) - b[k]) / max(np.linalg.norm(b[k].astype(np.float64)),
                                                                         1e-30)) for k in a.files}
    assert max(rel.values()) <= 1e-4, rel
