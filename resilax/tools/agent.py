"""`resilax launch --nodes N --node-rank R`: the agent of one host in a job across hosts.

    resilax launch --nodes N --node-rank R --run-dir D -n P --devices-per-process K -- CMD

One agent per host, ``D`` a directory every host sees. The agents find each other and agree
on each generation through the rendezvous in ``D/rendezvous`` (`runtime/rendezvous.py`:
leases, create-once proposals; no server of its own). For a committed generation the agent
of its ``service_node`` runs the coordination service (in its own process, which does no
JAX compute, at the address published in the generation record), and every agent starts
its P workers of CMD with their global process ids from the record, in ``RESILAX_*``
variables as `resilax launch` does on one host. Each agent writes its part,
``D/nodes/g<g>.node<R>.json`` (``{"agent", "workers": {process id: pid}, "status"}``);
the service node's agent merges them into ``D/processes.json`` (atomic, per generation):
``{"generation", "service_node", "coordinator", "nodes": {rank: {"agent", "workers"}},
"status"}``.

A node is *done* when all its workers exited 0; the job is done when every member node is.
Each agent keeps its lease until then (a lease that disappears before its node is done is a
lost host), and the service node's agent keeps the service until then, since the workers of
the last node still need it to shut down.

Not built yet (issue 29, next steps): recovery. A failure here (a worker of this host dies
or hangs, a member's lease expires or another agent takes its rank, another node fails) is
reported, this host's workers are stopped, and the agent exits non-zero; the scheduler may
relaunch the job, which resumes from the newest checkpoint. Agreeing on the next
generation without the lost host (the rendezvous does that already), the host stores and
their mirror on another host, regrowth and whole-job preemption come next.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

from resilax._src.io import write_json
from resilax._src.runtime import rendezvous
from resilax._src.runtime.worker import LaunchEnv
from resilax.tools.processes import (HEARTBEATS, Output, WorkerProcess, exit_reason, heartbeat_file, popen, read_json,
                                     say, signal_running, stop_all)

PROCESSES_JSON = "processes.json"
NODES = "nodes"  # D/nodes/g<g>.node<R>.json: one agent's part of processes.json


class Agent:
    """The agent of node ``node_rank`` of ``nodes``: runs its ``n`` workers of ``cmd`` in the
    generations the agents agree on (only generation 0 for now: see the module docstring).

    Args:
      lease_s: the rendezvous lease (an agent silent for this long is dead).
      address: how the other hosts reach this one (the coordinator address when this node
        runs the service); loopback by default.
      rendezvous_timeout_s: how long to wait for all ``nodes`` agents to agree.
      The rest as `launch.Supervisor`.
    """

    def __init__(self, cmd, *, nodes: int, node_rank: int, n: int, devices_per_process: int, run_dir,
                 lease_s: float = 5.0, address: str = "127.0.0.1", rendezvous_timeout_s: float = 300.0,
                 heartbeat_s: float = 0.5, heartbeat_timeout_s: float = 5.0, collective_timeout_s: int = 15,
                 startup_timeout_s: float = 300.0, jax_heartbeat_timeout_s: int = 60, grace_s: float = 60.0):
        if not cmd:
            raise ValueError("resilax launch: a worker command is required after --")
        if nodes < 1 or not 0 <= node_rank < nodes:
            raise ValueError(f"resilax launch: --nodes must be >= 1 and 0 <= --node-rank < --nodes, got --nodes "
                             f"{nodes} --node-rank {node_rank}")
        if n < 1 or devices_per_process < 1:
            raise ValueError(f"resilax launch: -n and --devices-per-process must be >= 1, got {n} and "
                             f"{devices_per_process}")
        if heartbeat_timeout_s <= heartbeat_s:
            raise ValueError(f"resilax launch: --heartbeat-timeout ({heartbeat_timeout_s} s) must exceed the heartbeat "
                             f"interval --heartbeat ({heartbeat_s} s)")
        self.cmd, self.nodes, self.rank, self.n, self.k = list(cmd), nodes, node_rank, n, devices_per_process
        self.run_dir = pathlib.Path(run_dir).absolute()
        self.lease_s, self.address, self.rendezvous_timeout_s = lease_s, address, rendezvous_timeout_s
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.collective_timeout_s, self.startup_timeout_s = collective_timeout_s, startup_timeout_s
        self.jax_heartbeat_timeout_s, self.grace_s = jax_heartbeat_timeout_s, grace_s
        self.rdv: rendezvous.Rendezvous | None = None
        self.gen: rendezvous.Generation | None = None
        self.workers: list[WorkerProcess] = []
        self._service = None
        self._term: int | None = None

    # ------------------------------------------------------------------ files
    def _node_file(self, g: int, rank: int) -> pathlib.Path:
        return self.run_dir / NODES / f"g{g}.node{rank}.json"

    def _write_node(self, status: str, **extra):
        write_json(self._node_file(self.gen.generation, self.rank), {
            "generation": self.gen.generation, "rank": self.rank, "agent": os.getpid(), "status": status,
            "workers": {str(w.process_id): w.proc.pid for w in self.workers}, **extra})

    def _nodes(self) -> dict[int, dict]:
        """The member nodes' parts of this generation that are readable now."""
        out = {}
        for r in self.gen.members:
            rec = read_json(self._node_file(self.gen.generation, r))
            if rec is not None:
                out[r] = rec
        return out

    def _write_processes(self, parts: dict[int, dict], status: str):
        if self.gen.service_node != self.rank:
            return
        write_json(self.run_dir / PROCESSES_JSON, {
            "generation": self.gen.generation, "service_node": self.gen.service_node,
            "coordinator": self.gen.coordinator, "status": status,
            "nodes": {str(r): {"agent": p["agent"], "workers": p["workers"]} for r, p in sorted(parts.items())}})

    # ------------------------------------------------------------------ a generation
    def _start(self):
        g, gen = self.gen.generation, self.gen
        if gen.service_node == self.rank:
            from resilax._src.runtime import jaxdist

            host, port = gen.coordinator.rsplit(":", 1)
            self._service = jaxdist.start_service(int(port), gen.num_processes, host=host,
                                                  heartbeat_timeout_s=self.jax_heartbeat_timeout_s)
        for pid_ in gen.process_ids[self.rank]:
            env = LaunchEnv(
                coordinator=gen.coordinator, process_id=pid_, num_processes=gen.num_processes, generation=g,
                devices_per_process=self.k, run_dir=str(self.run_dir),
                heartbeat_file=str(heartbeat_file(self.run_dir, g, pid_)), heartbeat_s=self.heartbeat_s,
                jax_heartbeat_timeout_s=self.jax_heartbeat_timeout_s, collective_timeout_s=self.collective_timeout_s,
                init_timeout_s=int(min(self.startup_timeout_s, 600)), host_store="", host_store_every=0)
            proc = popen(self.cmd, {**env.to_env(), "PYTHONUNBUFFERED": "1"})
            out = Output(proc, f"[g{g} n{self.rank} p{pid_}] ", self.run_dir / "logs" / f"g{g}.p{pid_}.log")
            self.workers.append(WorkerProcess(pid_, env, proc, out))
        self._write_node("running")
        say(f"node {self.rank}, generation {g}: nodes {list(gen.members)}, coordination service on node "
            f"{gen.service_node} at {gen.coordinator}; this node's processes "
            f"{[w.process_id for w in self.workers]} (pids {[w.proc.pid for w in self.workers]})")

    def _check(self, w: WorkerProcess, now: float) -> str | None:
        """Why worker ``w`` counts as failed now, or None (running, or exited 0)."""
        rc = w.proc.poll()
        if rc is not None:
            return None if rc == 0 else exit_reason(rc)
        hb = w.heartbeat()
        if hb is None:
            if now - w.started > self.startup_timeout_s:
                return f"wrote no heartbeat within --startup-timeout {self.startup_timeout_s:g} s"
            return None
        if now - hb["t"] > self.heartbeat_timeout_s:
            return f"hung: heartbeat {now - hb['t']:.1f} s old (--heartbeat-timeout {self.heartbeat_timeout_s:g} s)"
        return None

    def _watch(self) -> tuple[int, str]:
        """Polls until the job ends: (0, "") when every member node is done, else (rc, why)."""
        forwarded, written, done = None, None, False
        while True:
            now = time.time()
            if self._term is not None and forwarded is None:
                forwarded = now
                say(f"node {self.rank}: {signal.Signals(self._term).name}: forwarding SIGTERM to the workers")
                signal_running(self.workers, signal.SIGTERM)
            for w in self.workers:
                why = self._check(w, now)
                if why is not None:
                    return (w.proc.returncode if (w.proc.returncode or 0) > 0 else 1), \
                        f"process {w.process_id} (pid {w.proc.pid}) on node {self.rank} {why}"
            mine_done = all(w.proc.poll() == 0 for w in self.workers)
            if mine_done and not done:
                self._write_node("done")
                done = True
            parts = self._nodes()
            if {r: p.get("workers") for r, p in parts.items()} != written:  # another node's part came in
                written = {r: p.get("workers") for r, p in parts.items()}
                self._write_processes(parts, "running")
            failed = [r for r, p in parts.items() if p.get("status") == "failed"]
            if failed:
                return 1, f"node {failed[0]} failed: {parts[failed[0]].get('why')}"
            if mine_done and len(parts) == len(self.gen.members) and all(p["status"] == "done" for p in parts.values()):
                return 0, ""
            why = self.rdv.changed(self.gen)
            if why is not None:
                return 1, why
            if forwarded is not None and now - forwarded > self.grace_s:
                return 128 + signal.SIGTERM, f"workers did not exit within {self.grace_s:g} s of SIGTERM"
            time.sleep(0.05)

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        for d in (self.run_dir, self.run_dir / HEARTBEATS, self.run_dir / "logs", self.run_dir / NODES):
            d.mkdir(parents=True, exist_ok=True)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.rdv = rendezvous.Rendezvous(self.run_dir, self.rank, workers=self.n, lease_s=self.lease_s,
                                         address=self.address)
        try:
            self.rdv.register(wait_s=2 * self.lease_s)  # a relaunch after a kill: the old lease expires first
            say(f"node {self.rank}: waiting for the {self.nodes} agents in {self.rdv.root}")
            self.gen = self.rdv.agree(min_nodes=self.nodes, timeout_s=self.rendezvous_timeout_s)
            self._start()
            rc, why = self._watch()
            if rc == 0:
                self._write_processes(self._nodes(), "done")
                say(f"node {self.rank}: every node's workers exited 0")
                return 0
            say(f"node {self.rank}, generation {self.gen.generation} failed: {why}; stopping this node's workers "
                f"(recovery across hosts is not built yet: relaunch the job to resume from the newest checkpoint)")
            stop_all(self.workers, why)
            self._write_node("failed", why=why)
            self._write_processes(self._nodes(), "failed")
            return rc
        except rendezvous.RendezvousError as e:
            say(f"node {self.rank}: {e}")
            return 1
        finally:
            stop_all(self.workers)
            if self._service is not None:
                self._service.shutdown()
            self.rdv.close()
            for s, h in old.items():
                signal.signal(s, h)

    def _on_signal(self, signum, frame):
        self._term = signum


def add_arguments(p) -> None:
    """The options of `resilax launch` that make it one agent of a job across hosts."""
    g = p.add_argument_group("across hosts (one agent per host; see resilax/tools/agent.py)")
    g.add_argument("--nodes", type=int, default=None, metavar="N", help="hosts in the job (one agent on each)")
    g.add_argument("--node-rank", type=int, default=None, metavar="R", help="this host's rank, 0 <= R < --nodes")
    g.add_argument("--lease", type=float, default=5.0, metavar="S", help="an agent silent for this long is dead (s)")
    g.add_argument("--address", default="127.0.0.1",
                   help="how the other hosts reach this one (the coordination service's address when it runs here)")


def main(cmd, args) -> int:
    """`resilax launch --nodes ...`: builds and runs the `Agent` (exit 2 on bad options)."""
    other = [o for o, v in (("--spares", args.spares), ("--in-place", args.in_place)) if v]
    try:
        if args.node_rank is None or other:
            raise ValueError("--nodes needs --node-rank" if args.node_rank is None
                             else f"{', '.join(other)} cannot be combined with --nodes yet")
        agent = Agent(cmd, nodes=args.nodes, node_rank=args.node_rank, n=args.n,
                      devices_per_process=args.devices_per_process, run_dir=args.run_dir, lease_s=args.lease,
                      address=args.address, heartbeat_s=args.heartbeat, heartbeat_timeout_s=args.heartbeat_timeout,
                      collective_timeout_s=args.collective_timeout or 15, startup_timeout_s=args.startup_timeout)
    except ValueError as e:
        print(f"resilax: error: resilax launch: {e}" if not str(e).startswith("resilax") else f"resilax: error: {e}",
              file=sys.stderr)
        return 2
    return agent.run()
