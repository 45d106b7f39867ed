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

Recovery (issue 29). A generation ends early when a worker of
this host dies or hangs (stale heartbeat), another node reports a failure or asks for a new
generation, a member's lease expires (a dead host, or a hung one: a SIGSTOPped agent stops
renewing), another agent takes a member's rank, or a live agent that is not a member joins.
Then every agent stops its own workers (their JAX runtime cannot outlive a lost peer:
/work/shared/MULTIPROCESS.md; with ``--in-place`` the live hosts' workers re-form in their
processes instead where they can: `agent_reform`), the old service node's agent shuts its service down, and the
agents agree on the next generation with the live nodes (`Rendezvous.agree`): the lowest
live rank proposes and becomes the service node (so the service moves off a dead host),
each agent starts its workers with the new global process ids, and they resume from the
newest step every member's host store holds, else from the newest checkpoint in
``D/checkpoints``. Host stores (``--host-store-every``, default every step; 0: off): each
agent owns its host's store (``--host-store-dir``, default a new directory on /dev/shm;
never under ``D``, a network file system on a cluster; emptied when the agent starts,
removed when it ends), its workers write their shards there, and the agent serves it on
its ``--address`` (`hoststore_net.StoreServer`; the address is in its lease): the workers
of the previous live host (of the previous K, ``--host-store-mirrors K``) put their mirror
copies of the default mode's shards there (a whole copy needs none). At each generation
the agent offers the steps its store holds for all its processes
(`LaunchEnv.host_store_steps`) and the workers take the newest step in every host's offer
by a key-value vote (all or none of them take the host store). After a host loss whole
copies fit as they are (the bit-exact mode: each survivor holds the whole state, so no
step is lost); the default mode's re-formed mesh needs other shards, so the
agents offer the steps of which every process's shards are in a live host's store (the
lost host's as the next host's mirror), and each worker assembles its new shards from
them, reading other hosts' copies through their servers; else the checkpoint (the agent
says why). A replacement agent's
store is empty, so the generation it joins resumes from the checkpoint (growing back
saves one at the step it drains at). A generation with fewer nodes than ``--nodes`` runs the job's
processes of its members only: each worker keeps its place in the job (``RESILAX_SLOTS``:
node r's worker j is the job's process ``r * P + j``; ``RESILAX_NUM_SLOTS = N * P``), as the
single-host supervisor does when survivors re-form without replacements, so the topology
must have one failure domain per process (the dead nodes' domains are empty). At least
``--min-nodes`` (default: half of ``--nodes``, rounded up) live nodes are needed: with fewer,
the lowest live agent waits for replacements up to ``--rendezvous-timeout``, then every
waiting agent exits 1. A replacement agent (a new process with a dead node's rank, once that
lease expired) or a hung agent that wakes up is a live non-member: the running generation
ends and the next one has it back (the job grows back at a restart boundary). When nothing
else is wrong (every member holds its lease, none failed), the agents first send SIGTERM to
their workers, which stop after a step they all agree on (JAX's preemption sync), save it
and exit 0, so growing back redoes no step; up to ``grace_s``, else they are killed. After
``--max-restarts`` generations in a row that end without this node's workers getting past
the step they reached before, the agent gives up (exit 1). SIGTERM is forwarded to the
workers (whole-job preemption: each saves and exits 0) and ends the agent, not a recovery.

Spares. ``--spares S``: each agent keeps S warm processes of CMD on its host
(`processes.SparePool`, as the single-host supervisor does: JAX imported, waiting, files
``D/spares/node<R>.spare<k>.json``, heartbeats ``D/heartbeats/node<R>.spare<k>.json``;
processes.json lists them under their node); a generation's workers on this host come from
the ready ones first, and new ones start once the generation has stepped. ``--spare`` (no
rank) makes this process a standby *host*: it waits for a host of the running job to lose
its lease, claims that rank once (`rendezvous.standby`) and runs as its agent.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import shutil
import signal
import sys
import time

from resilax._src.io import write_json
from resilax._src.protect import hoststore_files, hoststore_net
from resilax._src.runtime import membership, rendezvous, worker
from resilax._src.runtime.worker import LaunchEnv
from resilax.tools import agent_reform
from resilax.tools.processes import (HEARTBEATS, SPARES, Output, SparePool, WorkerProcess, check_command, exit_reason,
                                     generation_settled, hand_place, heartbeat_file, heartbeat_hung, make_run_dir, popen,
                                     read_json, refused_config, run_locked, say, signal_running, stop_all)

PROCESSES_JSON = "processes.json"
NODES = "nodes"  # D/nodes/g<g>.node<R>.json: one agent's part of processes.json


# the default host stores of agents (the pid last), of any job and rank: `hoststore_files.remove_orphans`
ORPHAN_STORES = r"resilax-store-[0-9a-f]{12}-node\d+-(?P<pid>\d+)"


class Agent:
    """The agent of node ``node_rank`` of ``nodes``: runs its ``n`` workers of ``cmd`` in the
    generations the agents agree on (see the module docstring for recovery).

    Args:
      lease_s: the rendezvous lease (an agent silent for this long is dead).
      address: how the other hosts reach this one (the coordinator address when this node
        runs the service); loopback by default.
      rendezvous_timeout_s: how long to wait for the agents to agree on a generation (all
        ``nodes`` for the first one, ``min_nodes`` after a failure).
      min_nodes: the fewest live nodes a generation after a failure may run on (default:
        half of ``nodes``, rounded up).
      max_restarts: give up after this many generations in a row that end without this
        node's workers getting past the step they had reached before.
      The rest as `launch.Supervisor`.
    """

    def __init__(self, cmd, *, nodes: int, node_rank: int, n: int, devices_per_process: int, run_dir,
                 lease_s: float = 5.0, address: str = "127.0.0.1", rendezvous_timeout_s: float = 300.0,
                 heartbeat_s: float = 0.5, heartbeat_timeout_s: float = 5.0, collective_timeout_s: int = 15,
                 startup_timeout_s: float = 300.0, jax_heartbeat_timeout_s: int = 60, grace_s: float = 60.0,
                 min_nodes: int | None = None, max_restarts: int = 3, host_store_every: int = 1,
                 host_store_dir=None, host_store_mirrors: int = 1, spares: int = 0, in_place: bool = False,
                 clock_skew_s=0.0):
        check_command(cmd)
        if nodes < 1 or not 0 <= node_rank < nodes:
            raise ValueError(f"resilax launch: --nodes must be >= 1 and 0 <= --node-rank < --nodes, got --nodes "
                             f"{nodes} --node-rank {node_rank}")
        if n < 1 or devices_per_process < 1:
            raise ValueError(f"resilax launch: -n and --devices-per-process must be >= 1, got {n} and "
                             f"{devices_per_process}")
        min_nodes = -(-nodes // 2) if min_nodes is None else min_nodes
        if not 1 <= min_nodes <= nodes:
            raise ValueError(f"resilax launch: --min-nodes must be in [1, --nodes={nodes}], got {min_nodes}")
        if host_store_every < 0:
            raise ValueError(f"resilax launch: --host-store-every must be >= 0, got {host_store_every}")
        if not 1 <= host_store_mirrors < max(nodes, 2):
            raise ValueError(f"resilax launch: --host-store-mirrors must be in [1, {max(nodes - 1, 1)}] (--nodes - 1: "
                             f"each host's shards are mirrored on that many other hosts), got {host_store_mirrors}")
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"resilax launch: --spares must be an integer >= 0 (0: no warm spares), got {spares!r}")
        if heartbeat_timeout_s <= heartbeat_s:
            raise ValueError(f"resilax launch: --heartbeat-timeout ({heartbeat_timeout_s} s) must exceed the heartbeat "
                             f"interval --heartbeat ({heartbeat_s} s)")
        self.cmd, self.nodes, self.rank, self.n, self.k = list(cmd), nodes, node_rank, n, devices_per_process
        self.run_dir = pathlib.Path(run_dir).absolute()
        self.lease_s, self.address, self.rendezvous_timeout_s = lease_s, address, rendezvous_timeout_s
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.collective_timeout_s, self.startup_timeout_s = collective_timeout_s, startup_timeout_s
        self.jax_heartbeat_timeout_s, self.grace_s = jax_heartbeat_timeout_s, grace_s
        self.min_nodes, self.max_restarts = min_nodes, max_restarts
        # the rendezvous' wall clock; tests set it off (``RESILAX_TEST_CLOCK_SKEW_S``) as a host's bad clock
        self.clock = ((lambda: time.time() + clock_skew_s()) if callable(clock_skew_s) else
                      (lambda: time.time() + clock_skew_s) if clock_skew_s else time.time)
        self.host_store_every, self.host_store_mirrors = host_store_every, host_store_mirrors
        if in_place and not host_store_every:
            raise ValueError("resilax launch: --in-place re-forms from the host stores: it needs --host-store-every > 0")
        make_run_dir(self.run_dir)  # (options checked: a usage error leaves nothing behind)
        self.in_place = bool(in_place)  # a lost host: the others' workers re-form in their processes (`agent_reform`)
        # this host's store (RAM where there is /dev/shm; never under the shared run dir, which
        # is a network file system on a cluster): made by `run`, removed when the agent ends
        tag = hashlib.sha256(str(self.run_dir).encode()).hexdigest()[:12]
        # the default stores of agents (the pid last) of any job and rank on this host: a killed
        # one's is removed (`run`; a live agent's is kept), else its RAM stays taken until the
        # host restarts (a suite run here had left 48 of another run dir's tests)
        self._orphans = None if host_store_dir else ORPHAN_STORES
        self.store_root = (pathlib.Path(host_store_dir).absolute() if host_store_dir else
                           hoststore_files.ram_root() / f"resilax-store-{tag}-node{node_rank}-{os.getpid()}"
                           ) if host_store_every else None
        self._members: tuple[int, ...] | None = None  # the generation before this one
        self._writers: tuple[int, ...] | None = None  # the nodes of the generation that stored the newest step
        self._newest: int | None = None  # the store's newest step when the generation before this one began
        self.rdv: rendezvous.Rendezvous | None = None
        self.gen: rendezvous.Generation | None = None
        self.workers: list[WorkerProcess] = []
        self._service = None
        self._server: hoststore_net.StoreServer | None = None
        self._stores: dict[int, str] = {}  # the members' store servers, from their leases
        self._term: int | None = None
        # warm spare processes on this host (--spares): each generation's workers come from them first
        self.pool = SparePool(self.run_dir, spares, popen_fn=lambda env: popen(self.cmd, env), heartbeat_s=heartbeat_s,
                              heartbeat_timeout_s=heartbeat_timeout_s, startup_timeout_s=startup_timeout_s,
                              tag=f"node{node_rank}.", who=f"node {node_rank}: ")
        self._t_gen = 0.0
        self._cut_said = False  # said that the run directory cannot be written (`_cut_off_ok`)

    # ------------------------------------------------------------------ files
    def _node_file(self, g: int, rank: int) -> pathlib.Path:
        return self.run_dir / NODES / f"g{g}.node{rank}.json"

    def _write_node(self, status: str, **extra):
        with self._cut_off_ok():
            self._write_node_now(status, **extra)

    @contextlib.contextmanager
    def _cut_off_ok(self):
        """Status records a host cut off its run directory cannot write: said once, not fatal (the
        rendezvous decides whether this host is still a member, `_watch`)."""
        try:
            yield
        except OSError as e:
            if not self._cut_said:
                say(f"node {self.rank}: cannot write to the run directory {self.run_dir} ({e})")
                self._cut_said = True

    def _write_node_now(self, status: str, **extra):
        write_json(self._node_file(self.gen.generation, self.rank), {
            "generation": self.gen.generation, "rank": self.rank, "agent": os.getpid(), "status": status,
            "workers": {str(w.process_id): w.proc.pid for w in self.workers},
            "host_store": str(self.store_root or ""), **extra})

    def _nodes(self, gen=None) -> dict[int, dict]:
        """The member nodes' parts of this generation (or ``gen``) that are readable now."""
        out, gen = {}, gen or self.gen
        for r in gen.members:
            rec = read_json(self._node_file(gen.generation, r))
            if rec is not None:
                out[r] = rec
        return out

    def _write_processes(self, parts: dict[int, dict], status: str):
        with self._cut_off_ok():
            self._write_processes_now(parts, status)

    def _write_processes_now(self, parts: dict[int, dict], status: str):
        # only the service node's agent, and only while its generation is the newest and the
        # rendezvous' own (an agent that was hung, or cut off from the run directory and formed
        # a generation in a view of its own, wakes up after the others moved on: it must not
        # overwrite their file; a reader checks ``generation_id`` against the rendezvous too)
        if self.gen.service_node != self.rank or (self.rdv.latest() or 0) > self.gen.generation or \
                (self.rdv.proposal(self.gen.generation) or self.gen).sha256 != self.gen.sha256:
            return
        write_json(self.run_dir / PROCESSES_JSON, {
            "generation": self.gen.generation, "generation_id": self.gen.sha256, "service_node": self.gen.service_node,
            "coordinator": self.gen.coordinator, "status": status,
            "nodes": {str(r): {"agent": p["agent"], "workers": p["workers"], **({"spares": p["spares"]} if p.get("spares")
                                                                                else {})}
                      for r, p in sorted(parts.items())}})

    # ------------------------------------------------------------------ a generation
    def _start(self, carry: dict | None = None):
        """Starts this host's workers of the committed generation: ``carry`` (the live workers of
        the one before, by their place in the job) re-form in their own processes, a ready warm
        spare or a new process takes each other place."""
        g, gen, carry = self.gen.generation, self.gen, carry or {}
        short = [r for r in gen.members if len(gen.process_ids[r]) != self.n]
        if short:
            raise rendezvous.RendezvousError(
                f"resilax launch: every agent of a job runs -n {self.n} workers (node r's worker j is the job's process "
                f"r * {self.n} + j), but node(s) {short} run {[len(gen.process_ids[r]) for r in short]}")
        # each process keeps its place in the job (its failure domain) when nodes are missing
        slots = [r * self.n + j for r in sorted(gen.members) for j in range(self.n)]
        whole = slots == list(range(self.nodes * self.n))
        self.workers = []
        leases = self.rdv.leases()
        self._stores = {r: leases[r]["store"] for r in gen.members if (leases.get(r) or {}).get("store")}
        # the mirror: the next --host-store-mirrors live hosts in rank order (fewer when fewer are left)
        ring = sorted(gen.members)
        i = ring.index(self.rank)
        after = [ring[(i + d) % len(ring)] for d in range(1, min(self.host_store_mirrors, len(ring) - 1) + 1)]
        remote = ",".join(self._stores[r] for r in after if r in self._stores)
        peers = ",".join(a for r, a in sorted(self._stores.items()) if r != self.rank)
        steps = self._store_steps([self.rank * self.n + j for j in range(self.n)])
        if self._server is not None:  # no mirror from a fenced generation from now on
            self._server.fence(g, gen.sha256)
        if gen.service_node == self.rank:
            from resilax._src.runtime import jaxdist

            host, port = gen.coordinator.rsplit(":", 1)
            self._service = jaxdist.start_service(int(port), gen.num_processes, host=host,
                                                  heartbeat_timeout_s=self.jax_heartbeat_timeout_s)
        for j, pid_ in enumerate(gen.process_ids[self.rank]):
            env = LaunchEnv(
                coordinator=gen.coordinator, process_id=pid_, num_processes=gen.num_processes, generation=g,
                devices_per_process=self.k, run_dir=str(self.run_dir),
                heartbeat_file=str(heartbeat_file(self.run_dir, g, pid_)), heartbeat_s=self.heartbeat_s,
                jax_heartbeat_timeout_s=self.jax_heartbeat_timeout_s, collective_timeout_s=self.collective_timeout_s,
                init_timeout_s=int(min(self.startup_timeout_s, 600)), host_store=str(self.store_root or ""),
                host_store_every=self.host_store_every, host_store_mirror=0, host_store_steps=steps,
                host_store_remote=remote, host_store_peers=peers,
                slots="" if whole else ",".join(map(str, slots)), num_slots=0 if whole else self.nodes * self.n,
                generation_id=gen.sha256,
                in_place_wait_s=self.lease_s + self.heartbeat_timeout_s + 10.0 if self.in_place else 0.0)
            prefix, log = f"[g{g} n{self.rank} p{pid_}] ", self.run_dir / "logs" / f"g{g}.p{pid_}.log"
            w = carry.get(self.rank * self.n + j)
            if w is not None:  # re-forms in its own process (its assignment is named by its id in its generation)
                self.workers.append(hand_place(w.proc, w.out, env, prefix, log, membership.reform_assignment(
                    self.run_dir, w.env.generation + 1, w.process_id)))
                continue
            ready = self.pool.ready()
            if ready:  # a warm spare of this host: its place (it then joins like a fresh worker)
                self.workers.append(self.pool.assign(ready[0], env, prefix, log))
                continue
            proc = popen(self.cmd, {**env.to_env(), "PYTHONUNBUFFERED": "1"})
            self.workers.append(WorkerProcess(pid_, env, proc, Output(proc, prefix, log)))
        self._t_gen = time.time()
        self._write_node("running", spares=self.pool.pids())
        say(f"node {self.rank}, generation {g}: nodes {list(gen.members)}, coordination service on node "
            f"{gen.service_node} at {gen.coordinator}; this node's processes "
            f"{[w.process_id for w in self.workers]} (pids {[w.proc.pid for w in self.workers]})"
            + (f", from warm spares {[w.spare for w in self.workers if w.spare is not None]}"
               if any(w.spare is not None for w in self.workers) else "")
            + (f"; processes {[w.process_id for w in self.workers if w.proc in kept]} re-attached without restarting"
               if (kept := {w.proc for w in carry.values()}) else "")
            + ("" if whole else f" as the job's processes {[w.slot for w in self.workers]} of {self.nodes * self.n} "
               f"(nodes {sorted(set(range(self.nodes)) - set(gen.members))} missing)"))

    def _store_steps(self, mine: list[int]) -> str:
        """What this host's store offers the new generation (`LaunchEnv.host_store_steps`): the
        steps it holds for every one of its processes (``mine``: their places in the job); the
        workers resume from the newest step every host offers, else from the checkpoint. When
        the nodes changed since the copies were written, whole copies (the bit-exact mode)
        still fit as they are; the default mode's shards fit only as pieces of the re-formed
        mesh's shards: the steps of which every process's shards are in some live host's
        store, a lost host's on the next host as its mirror (`_covered`)."""
        if self.store_root is None:
            return "none"  # (the workers vote all the same: a host without a store sends every one to the checkpoint)
        r, g, members = self.rank, self.gen.generation, self.gen.members
        n_job = self.nodes * self.n
        steps = hoststore_files.restorable_steps(self.store_root, n_job, mine)
        newest = steps[-1] if steps else None
        # new steps since the generation before this one began: its nodes wrote them; one that
        # failed before storing any leaves the copies (and their writers) of an older one
        if newest != self._newest:
            self._writers = self._members
        if steps and self._writers is not None and self._writers != members:
            whole = hoststore_files.restorable_steps(self.store_root, n_job, mine, whole=True)
            if whole != steps:
                whole = self._covered(steps, members)
            steps = whole
        self._members, self._newest = members, newest
        if steps:
            say(f"node {r}, generation {g}: this host's store holds steps {steps} for its processes {mine}; the "
                f"workers resume from the newest step every node's store holds, else from the newest checkpoint")
        return ",".join(map(str, steps)) or "none"

    def _covered(self, steps: list[int], members) -> list[int]:
        """After the nodes changed, in the default mode (each process holds its own shards):
        the steps every process that stored them has a copy of in some live host's store
        (its own host's, or the mirror on the next host), which a re-formed mesh assembles
        (`HostStore.restore`). Asks the other members' store servers."""
        r, g = self.rank, self.gen.generation
        listings, unreachable = [hoststore_files.records(self.store_root)], []
        for rank, addr in sorted(self._stores.items()):
            if rank != r:
                try:
                    listings.append(hoststore_net.listing(addr, timeout_s=min(hoststore_net.TIMEOUT_S, self.lease_s)))
                except OSError as e:
                    unreachable.append(f"node {rank} ({addr}: {e})")
        covered = [s for s in hoststore_files.covered_steps(listings) if s <= steps[-1]]
        lost = sorted(set(self._writers) - set(members))
        say(f"node {r}, generation {g}: this host's store holds its processes' own shards up to step {steps[-1]} "
            f"(the default mode); the nodes changed ({list(self._writers)} -> {list(members)}), so the re-formed "
            f"mesh needs other shards: "
            + (f"the live hosts' stores hold every process's shards of steps {covered}"
               + (f" (node(s) {lost}'s from their mirrors)" if lost else "") if covered else
               f"no step has every process's shards in a live host's store (a lost host's mirrors were lost too: "
               f"{self.host_store_mirrors} mirror(s), --host-store-mirrors; or the store is off); resuming from the "
               f"newest checkpoint")
            + (f"; unreachable: {', '.join(unreachable)}" if unreachable else ""))
        return covered

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
        return heartbeat_hung(hb, now, self.heartbeat_timeout_s, self.grace_s)

    def _watch(self) -> tuple[str, int, str]:
        """Polls until this generation ends: ``("done", 0, "")`` when every member node is done;
        ``("failed", rc, why)``: a worker of this node failed; ``("ended", 1, why)``: the
        generation must end for another reason (`Rendezvous.changed`, another node failed);
        ``("term", rc, why)``: the workers did not exit within the grace period after SIGTERM."""
        forwarded, written, done, cut = None, None, False, None
        while True:
            now = time.time()
            if self._term is not None and forwarded is None:
                forwarded = now
                say(f"node {self.rank}: {signal.Signals(self._term).name}: forwarding SIGTERM to the workers")
                signal_running(self.workers, signal.SIGTERM)
                self.pool.kill_all()  # nothing to save; none are started from now on
            if self.pool.num and self._term is None and self.pool.tend(now, lambda: generation_settled(
                    self.workers, self.gen.generation == 0, self._t_gen, self.startup_timeout_s, now)):
                self._write_node("done" if done else "running", spares=self.pool.pids())
            for w in self.workers:
                why = self._check(w, now)
                if why is not None:
                    return "failed", (w.proc.returncode if (w.proc.returncode or 0) > 0 else 1), \
                        f"process {w.process_id} (pid {w.proc.pid}) on node {self.rank} {why}"
            mine_done = all(w.proc.poll() == 0 for w in self.workers)
            if mine_done and not done:
                self._write_node("done")
                done = True
            parts = self._nodes()
            now_written = {r: (p.get("workers"), p.get("spares")) for r, p in parts.items()}
            if now_written != written:  # another node's part came in, or its warm spares changed
                written = now_written
                self._write_processes(parts, "running")
            failed = [r for r, p in parts.items() if p.get("status") == "failed"]
            if failed:
                return "ended", 1, f"node {failed[0]} failed: {parts[failed[0]].get('why')}"
            if mine_done and self._all_done(parts):
                return "done", 0, ""
            try:
                why, cut = self.rdv.changed(self.gen), None
            except OSError as e:  # the run directory (the rendezvous) cannot be read: cut off from it?
                cut, why = cut or now, None
                if now - cut > self.lease_s:  # this host's lease cannot have been renewed: the others go on
                    how = "unable to write to" if e.errno in (errno.EROFS, errno.ENOSPC) else "cut off from"
                    return "ended", 1, (f"{how} the run directory {self.run_dir} for more than the lease "
                                        f"({self.lease_s:g} s; {e}): this host's lease was not renewed, so the other "
                                        f"hosts may go on without it: its workers stop (fenced) and it rejoins once "
                                        f"the run directory is back")
            if why is not None:
                # a node that was done when it read the parts may have ended and left (its lease
                # released) since this agent read them: that is the job's end, not a lost node
                return ("done", 0, "") if mine_done and self._all_done(self._nodes()) else ("ended", 1, why)
            if forwarded is not None and now - forwarded > self.grace_s:
                return "term", 128 + signal.SIGTERM, f"workers did not exit within {self.grace_s:g} s of SIGTERM"
            time.sleep(0.05)

    def _failed_nodes(self, gen) -> list[int]:
        return [r for r, p in self._nodes(gen).items() if p.get("status") == "failed"]

    def _reform_wait_s(self) -> float:
        """How long re-forming in place waits for workers to leave a broken step and detach."""
        return self.collective_timeout_s + self.lease_s + self.heartbeat_timeout_s + 10.0

    def _all_done(self, parts: dict[int, dict]) -> bool:
        return len(parts) == len(self.gen.members) and all(p["status"] == "done" for p in parts.values())

    def _growing(self) -> bool:
        """The generation ends only because agents joined: every member still holds its lease
        (same incarnation), no member node failed, and a live agent is not a member."""
        try:
            leases = self.rdv.leases()
        except OSError:  # cut off the run directory: not a growing back
            return False
        live = self.rdv.live(leases)
        if any(r not in live or live[r]["incarnation"] != self.gen.incarnations[r] for r in self.gen.members):
            return False
        if any(p.get("status") == "failed" for p in self._nodes().values()):
            return False
        return bool(set(live) - set(self.gen.members))

    def _drain(self, why: str) -> str:
        """Grows back at a step boundary instead of killing the workers mid-interval: SIGTERM
        to this node's workers (JAX's preemption sync stops every worker of the generation
        after the same step, which they save), then waits until they exited, up to
        ``grace_s`` or until a member is lost. Returns ``why`` with how the drain ended."""
        say(f"node {self.rank}, generation {self.gen.generation}: {why}: growing back at a step boundary (SIGTERM "
            f"to this node's workers: they stop after the step every worker agrees on, save it and exit)")
        signal_running(self.workers, signal.SIGTERM)
        deadline = time.time() + self.grace_s
        while time.time() < deadline and any(w.proc.poll() is None for w in self.workers):
            if any(r not in self.rdv.live() for r in self.gen.members):
                break
            time.sleep(0.05)
        codes = [w.proc.poll() for w in self.workers]
        return why + ("; the workers saved their step and exited" if all(c == 0 for c in codes)
                      else f"; the drain ended with exit codes {codes}")

    def _end_generation(self, outcome: str, why: str, keep_service: bool = False) -> int:
        """Stops this node's workers and (unless ``keep_service``) the service it ran; returns
        the newest step they had completed (-1: none)."""
        reached = max([(w.heartbeat() or {}).get("step") or -1 for w in self.workers] + [-1])
        stop_all(self.workers, why)
        self._write_node("failed" if outcome == "failed" else "stopped", why=why, refused=refused_config(self.workers))
        self._write_processes(self._nodes(), "failed" if self._term is not None else "restarting")
        if self._service is not None and not keep_service:
            self._service.shutdown()
            self._service = None
        return reached

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        """This host's part of the job to its end; its exit code (2: a single-host `resilax
        launch` holds the run directory, or another agent this one's --host-store-dir)."""
        try:
            self._hold_store()
        except ValueError as e:
            print(f"resilax: error: {e}", file=sys.stderr, flush=True)
            return 2
        return run_locked(self.run_dir, self._run, shared=True)

    def _hold_store(self) -> None:
        """An explicit --host-store-dir is emptied when the agent starts and removed when it
        ends: this agent holds it (`dirlock`: a lock file beside it, for the process's life)
        so that no second agent, of this job or another, empties it under this one's workers
        or puts its shards among theirs. (The default store is a new directory of its own.)"""
        if self.store_root is None or self._orphans:
            return
        from resilax._src import dirlock

        where = f"the host store directory {str(self.store_root)!r}"
        try:
            self.store_root.parent.mkdir(parents=True, exist_ok=True)
            dirlock.hold(self.store_root.parent, name=f".{self.store_root.name}.resilax.lock", what="resilax launch")
        except dirlock.DirectoryInUse as e:
            raise ValueError(f"resilax launch: {where} is in use by another agent ({e.holder}); each agent needs a "
                             f"--host-store-dir of its own (it is emptied when an agent starts)") from None
        except OSError as e:
            raise ValueError(f"resilax launch: cannot use {where}: {e.strerror or e}") from None

    def _run(self) -> int:
        link = self.run_dir / HEARTBEATS
        if link.is_symlink():  # a killed single-host launch's link to its heartbeats in RAM (gone, or going)
            link.unlink()
        for d in (self.run_dir, self.run_dir / HEARTBEATS, self.run_dir / "logs", self.run_dir / NODES,
                  self.run_dir / SPARES):
            d.mkdir(parents=True, exist_ok=True)
        if self.store_root is not None:  # a new agent starts with an empty store (a new host's memory)
            gone = hoststore_files.remove_orphans(self.store_root.parent, self._orphans) if self._orphans else []
            if gone:
                say(f"node {self.rank}: removed the host store(s) of killed agent(s) on this host: {gone}")
            shutil.rmtree(self.store_root, ignore_errors=True)
            for j in range(self.n):
                (self.store_root / f"host{self.rank * self.n + j}").mkdir(parents=True)
            # the store's server: the previous host's workers put their mirrors here, a re-formed
            # generation reads this host's copies through it; only with the job's key (this
            # agent, its workers and its client calls share it through the environment)
            hoststore_net.job_key(self.run_dir)
            self._server = hoststore_net.StoreServer(self.store_root, host=self.address)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.rdv = rendezvous.Rendezvous(self.run_dir, self.rank, workers=self.n, lease_s=self.lease_s,
                                         address=self.address, store=self._server.address if self._server else "",
                                         clock=self.clock)
        restarts, best = 0, -1
        try:
            self.rdv.register(wait_s=2 * self.lease_s)  # a relaunch after a kill: the old lease expires first
            say(f"node {self.rank}: waiting for the {self.nodes} agents in {self.rdv.root}")
            self.gen = self.rdv.agree(min_nodes=self.nodes, timeout_s=self.rendezvous_timeout_s)
            carry = None
            while True:
                self._start(carry)
                outcome, rc, why = self._watch()
                old_gen, g, carry = self.gen, self.gen.generation, None
                if outcome == "done":
                    # SIGTERM to this agent, or to the workers directly (a scheduler's preemption)
                    preempted = self._term is not None or any(
                        (w.heartbeat() or {}).get("phase") == "preempted" for w in self.workers)
                    self._write_processes(self._nodes(), "preempted" if preempted else "done")
                    say(f"node {self.rank}: every node's workers exited 0"
                        + (" after SIGTERM (preempted; relaunch to resume)" if preempted else ""))
                    return 0
                if outcome == "ended" and self._term is None and self._growing():
                    why = self._drain(why)
                refused = agent_reform.refused(self.workers, outcome, self._term) if self.in_place else "off"
                verdict = None
                if refused is None:  # --in-place: the workers wait in their broken step while the agents agree
                    say(f"node {self.rank}, generation {g} ended: {why}; this node's workers stay (--in-place): "
                        f"agreeing on the next generation with the live nodes (at least {self.min_nodes}), then they "
                        f"re-form in their processes")
                    self._write_node("reforming", why=why)
                    self.gen = self.rdv.agree(after=g, min_nodes=self.min_nodes, timeout_s=self.rendezvous_timeout_s)
                    verdict = agent_reform.write_verdict(self.run_dir, old_gen, self.gen, self._failed_nodes(old_gen))
                    carry = agent_reform.await_detached(self.workers, self._reform_wait_s(), self.heartbeat_timeout_s)
                    self.workers = []
                else:
                    if self.in_place:
                        say(f"node {self.rank}, generation {g}: not re-forming in place: {refused}")
                    # (--in-place: the service stays until the other hosts' workers left it, below)
                    reached = self._end_generation(outcome, why, keep_service=self.in_place and self._term is None)
                    if self._term is not None:
                        say(f"node {self.rank}, generation {g} ended after SIGTERM: {why}; this node's workers stopped")
                        return rc
                    # this node's workers, or another node's (its part says so), refused their configuration
                    refused = refused_config(self.workers) or next(
                        (p["refused"] for p in self._nodes().values() if p.get("refused")), None)
                    if refused is not None:
                        with self._cut_off_ok():
                            self.rdv.request(g, why)  # the other nodes end this generation too
                        say(f"node {self.rank}: giving up: {refused}")
                        return worker.EXIT_CONFIG
                    grows = []
                    with self._cut_off_ok():
                        if outcome == "failed":
                            self.rdv.request(g, why)  # the other nodes end this generation too
                        grows = sorted(set(self.rdv.live()) - set(self.gen.members))
                    if reached > best:  # this node got further than at the last failure: not a crash loop
                        restarts, best = 0, reached
                    restarts += 0 if grows and outcome != "failed" else 1
                    if restarts > self.max_restarts:
                        say(f"node {self.rank}: giving up: {self.max_restarts} restarts in a row without getting past "
                            f"step {best} (--max-restarts {self.max_restarts}); last: {why}")
                        return rc
                    say(f"node {self.rank}, generation {g} ended: {why}; this node's workers stopped (newest step "
                        f"{reached}); agreeing on generation {g + 1} with the live nodes (at least {self.min_nodes})")
                    self.gen = self.rdv.agree(after=g, min_nodes=self.min_nodes, timeout_s=self.rendezvous_timeout_s)
                if self._service is not None:  # (--in-place) detaching talks to the old service: it goes last
                    verdict = verdict or agent_reform.write_verdict(self.run_dir, old_gen, self.gen,
                                                                    self._failed_nodes(old_gen))
                    left = agent_reform.await_survivors(self.run_dir, verdict, self._reform_wait_s(),
                                                        self.heartbeat_timeout_s)
                    if left:
                        say(f"node {self.rank}: processes {left} did not leave generation {g}'s service in time")
                    self._service.shutdown()
                    self._service = None
        except rendezvous.RendezvousError as e:
            fenced = (f" (fenced: another agent, a replacement or a spare, took node {self.rank}'s rank while this one "
                      f"did not renew its lease, stopped or cut off; this agent and its workers stop)"
                      if self.rdv.lost and not self.rdv.skew else "")
            say(f"node {self.rank}: {e}{fenced}{self._ended_note()}")
            return 1
        finally:
            stop_all(self.workers)
            self.pool.kill_all()
            if self._service is not None:
                self._service.shutdown()
            self.rdv.close()
            if self._server is not None:
                self._server.close()
            if self.store_root is not None:
                shutil.rmtree(self.store_root, ignore_errors=True)
            for s, h in old.items():
                signal.signal(s, h)

    def _ended_note(self) -> str:
        """Why an agent that found no generation to join may have come too late: the job in the
        run directory already ended (an agent cannot tell a lone late replacement from the first
        agent of a relaunch, so it waits the rendezvous timeout either way; then it says this)."""
        try:
            with open(self.run_dir / PROCESSES_JSON) as f:
                procs = json.load(f)
        except (OSError, ValueError):
            return ""
        status, g = procs.get("status"), procs.get("generation")
        if status == "done":
            return (f" (the job in {self.run_dir} already completed in generation {g}: every node's workers exited "
                    f"0; a replacement for a finished job has nothing to join, and a relaunch needs every node's "
                    f"agent)")
        if status == "preempted":
            return (f" (the job in {self.run_dir} was preempted in generation {g}: a relaunch resumes it and needs "
                    f"at least --min-nodes agents)")
        return ""

    def _on_signal(self, signum, frame):
        self._term = signum
