"""`resilax bench multihost`: a host SIGKILLed under `resilax launch --nodes`, death to back-at-the-step by phase.

Runs, on loopback, ``--nodes`` agents (default 3; each its own process group, as a host) x
1 worker x 2 CPU devices: ``resilax launch --nodes N --node-rank R -n 1 --devices-per-process
2 -- resilax train`` on an N-slice topology (``--batch 48``) in the bit-exact mode, or with
``--no-deterministic`` the default mode (state sharded over every device: the leaves divide
over 2, 4 or 8 devices, e.g. ``--nodes 4``; each worker's shards mirrored to the next host),
checkpoints every ``--checkpoint-every`` steps (tests/test_bench_multihost.py: the
``service`` case, a replacement, 2 workers per host). ``--workers-per-host P`` (with
``--devices-per-process K``, default 2 for one worker per host, else 1) runs P workers of K
devices per agent, one failure domain per process (``N P`` domains of K devices), as a
generation missing hosts needs. Once every worker of generation 0 is
past ``--kill-after``, one case:

- ``service``: SIGKILL the host that runs the coordination service (its agent's process
  group and its worker's session): the other two re-form without it, the service moves;
- ``other``: the same for a host that does not run the service;
- ``relaunch`` (the baseline): SIGKILL every host, then start the three agents again at
  once in the same run directory (what a scheduler's restart of the whole job does);
- ``double``: SIGKILL the service host, then, during the recovery, the re-forming
  generation's service host (the service moves twice) at ``--second-kill-at``: ``proposed``,
  ``committed`` or ``attached`` (the default: every one of its workers attached, none
  resumed); the last host goes on alone (``--min-nodes 1`` unless given). The JSON's
  ``second_kill`` says where it landed. Phases: ``detect``, ``recovering`` (-> the second
  kill), ``detect2`` (-> the last host stopped its workers; 0 if none), then ``agree`` to
  ``redo`` as below; ``--replace`` replaces both killed ranks at once.

Each is timed from the kill to *back at the step* (every worker of the new generation has
completed the step the job had reached at the kill), by phase, from the files the agents and
workers write (no extra instrumentation):

- ``detect``: the kill -> the first surviving agent has stopped its workers and marked its
  node's part of generation 0 ended (``nodes/g0.node<R>.json``; 0 for ``relaunch``);
- ``agree``: -> the next generation is committed (``rendezvous/generations/g<k>.outcome.json``;
  for ``relaunch`` this includes the new agents' start and the old leases expiring);
- ``start``: -> every worker of it has attached to the new coordination service (its
  heartbeat's ``joined_t``: process start, imports, ``jax.distributed``);
- ``restore``: the state read back: the newest step from the hosts' stores (host stores on,
  the default), else the newest checkpoint (the ``restore`` events of ``--summary``);
- ``setup``: -> each worker's first step done (state, executables from the cache, the step);
- ``redo``: redoing the steps between the step restored and the step reached at the kill.

``lost_steps`` is that difference (the kill's step minus the step restored). A killed
host's store (its agent's directory, ``nodes/g0.node<R>.json``) is deleted with it: its
memory is gone (what it held survives only as whole copies or mirrors on other hosts). Each
case's final state is compared with a failure-free single-process run of the same topology
(``distance``: the largest relative norm of a leaf's difference); a case that is not bitwise
(the default mode: within 1e-4) makes the bench exit 1. ``--repeat N`` runs each case
N times (median/min/max). ``--replace`` starts a replacement agent for the killed rank once
the job is back at the step (the live nodes' workers stall, SIGSTOP, until its lease is
live, so that a short job on a busy machine cannot end first), and records the growing back (the agents stop their workers
at a step boundary, the new generation resumes at that step: 0 redone, else it fell back
to the checkpoint).

``--soak N`` repeats the case (``--cases``, one or more; default ``service``) with
replacements N times and reports per run the outcome (``bitwise``, ``within 1e-4``, ``off by``,
``hang``: a wait timed out, ``failed``: an agent exited non-zero), every generation end and
why, and the *fallbacks*: a generation beyond the expected ends (the kill, for ``double``
the generation the second kill ended, the growing back) or a growing back whose drain did
not end with every worker saving its step (both redo steps from the newest checkpoint).

Every agent runs in a session of its own with a time limit; in a ``finally`` each agent's
process group and its workers' sessions (from ``nodes/*.json``) get SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from resilax._src.io import write_json
from resilax._src.runtime import rendezvous
from resilax.tools.bench_multihost_table import DOUBLE_PHASES, PHASES, print_table
from resilax.tools.processes import heartbeats
from resilax.tools.argtypes import int_at_least, output_path

NODES = 3
CASES = ("service", "other", "relaunch", "double")
SECOND_KILL_AT = ("proposed", "committed", "attached")


class BenchError(RuntimeError):
    pass


class Hang(BenchError):
    """A wait timed out."""


def add_arguments(p) -> None:
    p.add_argument("--json", type=output_path, default=None, help="write results here")
    p.add_argument("--steps", type=int_at_least(1), default=24)
    p.add_argument("--nodes", type=int_at_least(1), default=NODES, metavar="N", help="agents (hosts) in the job")
    p.add_argument("--no-deterministic", action="store_true",
                   help="the default mode (state sharded over the hosts, each worker's shards mirrored to the next "
                        "host): within 1e-4 of the reference instead of bitwise")
    p.add_argument("--checkpoint-every", type=int_at_least(1), default=5)
    p.add_argument("--kill-after", type=int_at_least(1), default=12, help="kill once every worker is past this step")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated, of {', '.join(CASES)} (default: service, other, relaunch; --soak: service)")
    p.add_argument("--workers-per-host", type=int_at_least(1), default=1, metavar="P",
                   help="workers per agent (the topology gets one failure domain per process: 3 P domains)")
    p.add_argument("--devices-per-process", type=int_at_least(1), default=None, metavar="K",
                   help="CPU devices per worker (default: 2 with one worker per host, else 1)")
    p.add_argument("--second-kill-at", default="attached", choices=SECOND_KILL_AT,
                   help="double: when in the recovery the second host is killed: the re-forming generation proposed, "
                        "committed, or every one of its workers attached to its service (default)")
    p.add_argument("--min-nodes", type=int_at_least(1), default=None, metavar="M",
                   help="the agents' --min-nodes (default: theirs; 1 for double, so the last host goes on alone)")
    p.add_argument("--repeat", type=int_at_least(1), default=1, metavar="N", help="run each case N times (median/min/max)")
    p.add_argument("--replace", action="store_true",
                   help="after a host kill, start a replacement agent once the job is back and time the growing back")
    p.add_argument("--soak", type=int_at_least(0), default=0, metavar="N",
                   help="instead: N runs of the case(s) (default service), each with replacements; outcome and "
                        "fallbacks per run")
    p.add_argument("--lease", type=float, default=2.0, metavar="S", help="the agents' --lease")
    p.add_argument("--spares", type=int_at_least(0), default=0, metavar="S",
                   help="the agents' --spares: S warm worker processes on each host (the start phase's imports)")
    p.add_argument("--in-place", action="store_true",
                   help="the agents' --in-place: the live hosts' workers re-form in their processes (bit-exact mode)")
    p.add_argument("--host-store-every", type=int_at_least(0), default=1, metavar="K", help="the agents' (0: host stores off)")
    p.add_argument("--host-store-mirrors", type=int_at_least(1), default=1, metavar="K", help="the agents' (default 1)")
    p.add_argument("--timeout", type=float, default=240.0, metavar="S",
                   help="the most one case may take (start to every agent's exit); past it: a hang")
    p.add_argument("--workdir", default=None, help="keep files here (default: a temporary directory, removed "
                                                   "unless something failed)")
    p.add_argument("--netns", action="store_true",
                   help="hosts that are really apart (root): each host a network namespace with its own /dev/shm and "
                        "/tmp; cases partition, partition-service, cut, lossy, delay, flap-short, flap-long, skew, full, "
                        "readonly, readonly-host; faults joined by '+' are one job, one after the other "
                        "(resilax/tools/bench_netns.py); --soak N: N runs of the partition cases")
    p.add_argument("--hold", type=float, default=8.0, metavar="S", help="--netns: how long a partition lasts")


# ------------------------------------------------------------------ files the agents and workers write
def _topology_name(workers: int = 1, devices: int = 2, nodes: int = NODES) -> str:
    return f"cpu-{nodes * workers}x{devices}"


def _topology(work: pathlib.Path, workers: int = 1, devices: int = 2, nodes: int = NODES) -> str:
    """One failure domain per process (``nodes * workers`` of ``devices`` each)."""
    name, domains = _topology_name(workers, devices, nodes), nodes * workers
    path = work / f"{name}.toml"
    path.write_text(f'name = "{name}"\nplatform = "cpu"\ndomain = "slice"\nemulated = true\n'
                    f'domains = {domains}\ndevices_per_domain = {devices}\n\n[mesh]\n'
                    f'axes = {{ data = {domains}, fsdp = {devices} }}\n'
                    'elastic_axis = "data"\n\n'
                    '[bandwidth]\nici = 10.0\ndcn = 10.0\nhost = 10.0\nstorage = 1.0\n'
                    'sources = { ici = "emulated", dcn = "emulated", host = "emulated", storage = "emulated" }\n')
    return str(path)


def _json(path):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


def _gen_file(run, g, what) -> pathlib.Path:
    return run / rendezvous.RENDEZVOUS / "generations" / f"g{g}.{what}.json"


def _committed(run, g) -> rendezvous.Generation | None:
    out = _json(_gen_file(run, g, "outcome"))
    if not out or out.get("outcome") != rendezvous.COMMITTED:
        return None
    rec = _json(_gen_file(run, g, "proposal"))
    return rendezvous.Generation.from_record(rec) if rec else None


def _latest(run) -> int:
    gens = [int(p.name[1:].split(".")[0]) for p in (run / rendezvous.RENDEZVOUS / "generations").glob("g*.proposal.json")]
    return max(gens, default=-1)


def _mtime(path) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _back(run, after: int, step: int, members=None):
    """The first committed generation newer than ``after`` (with ``members``, if given) whose
    every worker completed ``step``: ``(generation, heartbeats)``, or None."""
    for g in range(after + 1, _latest(run) + 1):
        gen = _committed(run, g)
        if gen is None or (members is not None and sorted(gen.members) != sorted(members)):
            continue
        hbs = heartbeats(run, g)
        if len(hbs) == gen.num_processes and all((h.get("step") or 0) >= step for h in hbs.values()):
            return g, hbs
    return None


# ------------------------------------------------------------------ processes
class Hosts:
    """The agents of one case: start, SIGKILL a host (its agent's group and its workers'
    sessions), and kill everything left in ``close``."""

    def __init__(self, work: pathlib.Path, run: pathlib.Path, cmd: list, opts: list, deadline: float,
                 nodes: int = NODES):
        self.work, self.run, self.cmd, self.opts, self.deadline, self.nodes = work, run, cmd, opts, deadline, nodes
        self.agents: dict[int, subprocess.Popen] = {}
        self.all: list[subprocess.Popen] = []
        self.logs: list[pathlib.Path] = []

    def start(self, r: int, tag: str = "") -> None:
        log_path = self.work / f"agent{r}{tag}.log"
        self.logs.append(log_path)
        with open(log_path, "wb") as log:
            p = subprocess.Popen([sys.executable, "-m", "resilax", "launch", "--nodes", str(self.nodes), "--node-rank",
                                  str(r), "--run-dir", str(self.run), *self.opts, "--", *self.cmd],
                                 env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.agents[r] = p
        self.all.append(p)

    def _workers_of(self, agent_pid: int) -> list[int]:
        pids = []
        for f in (self.run / "nodes").glob("g*.node*.json"):
            rec = _json(f) or {}
            if rec.get("agent") == agent_pid:
                pids += [int(x) for x in (rec.get("workers") or {}).values()]
        return pids

    def _lose_store(self, agent_pid: int) -> None:
        """A killed host's memory is gone: its agent's host store (which it cannot remove)."""
        for f in (self.run / "nodes").glob("g*.node*.json"):
            rec = _json(f) or {}
            if rec.get("agent") == agent_pid and rec.get("host_store"):
                shutil.rmtree(rec["host_store"], ignore_errors=True)

    def kill(self, r: int) -> None:
        p = self.agents[r]
        for pid in [p.pid, *self._workers_of(p.pid)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        p.wait(timeout=10)
        self._lose_store(p.pid)
        del self.agents[r]  # (still in ``all``, for `close`)

    def wait(self, pred, what: str, live=None):
        """Polls ``pred`` until it returns something true; `Hang` past the case's deadline,
        `BenchError` when an agent of ``live`` (default: every current one) exited non-zero."""
        while time.time() < self.deadline:
            v = pred()
            if v:
                return v
            for r, p in self.agents.items():
                if (live is None or r in live) and p.poll() not in (None, 0):
                    raise BenchError(f"agent {r} exited with {p.returncode} while waiting for {what}")
            time.sleep(0.02)
        raise Hang(f"timed out waiting for {what}")

    def finish(self) -> list[int]:
        rcs = []
        for r, p in sorted(self.agents.items()):
            try:
                rcs.append(p.wait(timeout=max(1.0, self.deadline - time.time())))
            except subprocess.TimeoutExpired:
                raise Hang(f"timed out waiting for agent {r} to exit") from None
        return rcs

    def signal_workers(self, g: int, nodes, sig) -> None:
        """Sends ``sig`` to the workers of generation ``g`` on ``nodes`` (SIGSTOP: a stalled host)."""
        for r in nodes:
            for pid in ((_json(self.run / "nodes" / f"g{g}.node{r}.json") or {}).get("workers") or {}).values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), sig)

    def leased(self, ranks) -> bool:
        """Whether an agent holds a live lease for each of ``ranks``."""
        with contextlib.suppress(rendezvous.CorruptRecordError):
            recs = [rendezvous.read_record(self.run / rendezvous.RENDEZVOUS / "leases" / f"node{r}.json") for r in ranks]
            return all(rec is not None and rec["expires"] > time.time() for rec in recs)
        return False

    def draining(self, g: int, ranks) -> bool:
        """Whether the agents of ``ranks`` said they grow back from generation ``g`` (`Agent._drain`)."""
        lines = self.text().splitlines()
        return all(any(f"node {r}, generation {g}: " in ln and "growing back at a step boundary" in ln for ln in lines)
                   for r in ranks)

    def close(self) -> None:
        for p in self.all:
            for pid in [p.pid, *self._workers_of(p.pid)]:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._lose_store(p.pid)

    def text(self) -> str:
        return "\n".join(f.read_text(errors="replace") for f in self.logs if f.exists())


def _resumed(text: str, g: int) -> int | None:
    for ln in text.splitlines():
        if ln.startswith(f"[g{g} ") and "resumed at step " in ln:
            return int(ln.split("resumed at step ")[1].split()[0])
    return None


def _resumed_from(text: str, g: int) -> str | None:
    """Where generation ``g``'s workers resumed from: host store, checkpoint (+ record log), or None."""
    for ln in text.splitlines():
        if ln.startswith(f"[g{g} ") and "resumed at step " in ln:
            return "host store" if "(host store" in ln else "checkpoint + record log" if "replayed" in ln else "checkpoint"
    return None


def _ends(text: str) -> list[dict]:
    """Every ``node R, generation G ended: WHY; ...`` line of the agents, in generation order."""
    out = []
    for ln in text.splitlines():
        if ", generation " in ln and " ended: " in ln and "] node " in ln:
            head, why = ln.split(" ended: ", 1)
            node, gen = head.split("] node ", 1)[1].split(", generation ")
            out.append({"node": int(node), "generation": int(gen.split()[0]),
                        "why": why.split("; this node's workers stopped")[0]})
    return sorted(out, key=lambda e: (e["generation"], e["node"]))


def _distance(out: pathlib.Path, ref) -> float:
    """The largest relative norm of a leaf's difference from ``ref`` (0.0: bitwise; inf: other leaves)."""
    import numpy as np

    a = np.load(out, allow_pickle=False)
    if sorted(a.files) != sorted(ref.files):
        return float("inf")
    return max((0.0 if np.array_equal(a[k], ref[k]) else
                float(np.linalg.norm(a[k].astype(np.float64) - ref[k]) / max(np.linalg.norm(ref[k].astype(np.float64)),
                                                                             1e-30))) for k in ref.files)


# ------------------------------------------------------------------ one case
def _reforming(run, dead, at: str):
    """For ``double``: the first generation after 0 without a ``dead`` rank that has reached
    ``at`` (``proposed``, ``committed``, ``attached``: every one of its workers attached to
    its service): ``(generation, its record, its outcome or None, its heartbeats)``, or None."""
    for g in range(1, _latest(run) + 1):
        rec = _json(_gen_file(run, g, "proposal"))
        if not rec:
            continue
        gen = rendezvous.Generation.from_record(rec)
        outcome = (_json(_gen_file(run, g, "outcome")) or {}).get("outcome")
        if set(gen.members) & set(dead) or outcome == rendezvous.ABANDONED:
            continue
        hbs = heartbeats(run, g)
        if at == "proposed" or (outcome == rendezvous.COMMITTED and (
                at == "committed" or (len(hbs) == gen.num_processes and all(h.get("joined_t") for h in hbs.values())))):
            return g, gen, outcome, hbs
    return None


def run_case(work: pathlib.Path, case: str, *, train: list, ref, kill_after: int, lease: float, timeout: float,
             replace: bool = False, host_store_every: int = 1, workers: int = 1, devices: int = 2, mirrors: int = 1,
             min_nodes: int | None = None, second_kill_at: str = "attached", nodes: int = NODES, spares: int = 0,
             in_place: bool = False, log=print) -> dict:
    """One job of ``nodes`` agents; ``case`` as in the module docstring. Raises `Hang` or `BenchError`;
    returns the measurements (``bitwise``: the final state is ``ref``'s; ``distance``: how far from it)."""
    run, out, summ = work / "run", work / "final.npz", work / "summary.json"
    cmd = [*train, "--out", str(out), "--summary", str(summ)]
    opts = ["-n", str(workers), "--devices-per-process", str(devices), "--lease", str(lease), "--heartbeat", "0.2",
            "--heartbeat-timeout", "10", "--rendezvous-timeout", "120", "--host-store-every", str(host_store_every),
            "--host-store-mirrors", str(mirrors)]
    if min_nodes is not None:
        opts += ["--min-nodes", str(min_nodes)]
    if spares:
        opts += ["--spares", str(spares)]
    opts += ["--in-place", "--collective-timeout", "5"] if in_place else []
    nproc = nodes * workers
    hosts = Hosts(work, run, cmd, opts, time.time() + timeout, nodes)
    second = None  # double: where the second kill landed
    try:
        for r in range(nodes):
            hosts.start(r)
        hosts.wait(lambda: _committed(run, 0), "generation 0")
        hosts.wait(lambda: len(h := heartbeats(run, 0)) == nproc and all((x.get("step") or 0) >= kill_after
                                                                        for x in h.values()),
                   f"every worker of generation 0 past step {kill_after}")
        procs = hosts.wait(lambda: (p := _json(run / "processes.json")) and len(p.get("nodes", {})) == nodes and p,
                           "processes.json naming every node")
        service = procs["service_node"]
        victims = {"service": [service], "other": [max(r for r in range(nodes) if r != service)],
                   "relaunch": list(range(nodes)), "double": [service]}[case]
        kill_step = max(x.get("step") or 0 for x in heartbeats(run, 0).values())
        t_kill = time.time()
        for r in victims:
            hosts.kill(r)
        # what a restart can resume from (a save still committing shows as Orbax's tmp directory)
        ckpts = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name[0].isdigit()) \
            if (run / "checkpoints").is_dir() else []
        log(f"      SIGKILL host(s) {victims} (service on {service}) at step {kill_step}")
        survivors = [r for r in range(nodes) if r not in victims]
        first_survivors = list(survivors)
        after, back_step = 0, kill_step
        if case == "relaunch":
            for r in range(nodes):
                hosts.start(r, ".relaunch")
            survivors = list(range(nodes))
        elif case == "double":
            g1, gen1, outcome1, hbs1 = hosts.wait(lambda: _reforming(run, victims, second_kill_at),
                                                  f"the re-forming generation {second_kill_at}")
            victim2 = gen1.service_node
            text1 = hosts.text()  # (read before the kill: what had resumed by then)
            second = {"at": second_kill_at, "generation": g1, "members": list(gen1.members),
                      "service_node": victim2, "outcome": outcome1,
                      "workers_attached": sum(bool(h.get("joined_t")) for h in hbs1.values()),
                      "workers_resumed": sum(ln.startswith(f"[g{g1} ") and "resumed at step " in ln
                                             for ln in text1.splitlines()),
                      "workers": gen1.num_processes,
                      "step": max([kill_step] + [h.get("step") or 0 for h in hbs1.values()])}
            t_kill2 = time.time()
            hosts.kill(victim2)
            second["after_first_kill_s"] = t_kill2 - t_kill
            victims.append(victim2)
            survivors.remove(victim2)
            after, back_step = g1, second["step"]
            log(f"      SIGKILL host {victim2} (the service of generation {g1}, {second_kill_at}: "
                f"{second['workers_attached']}/{second['workers']} workers attached, {second['workers_resumed']} "
                f"resumed) {second['after_first_kill_s']:.2f} s after the first kill")
        g, hbs = hosts.wait(lambda: _back(run, after, back_step, survivors), f"the job back at step {back_step}")
        t_back = time.time()
        gen = _committed(run, g)
        log(f"      back at step {back_step} in {t_back - t_kill:.1f} s (generation {g}, nodes {list(gen.members)}, "
            f"service on {gen.service_node})")
        grow = None
        if replace and case != "relaunch":
            t_join = time.time()
            # the live nodes' workers stall (SIGSTOP) until the replacements hold their leases and
            # the live nodes' agents told them to stop (SIGTERM, pending while they stall), so that
            # they join a running job however loaded the machine is: on 2 busy cores the steps
            # left could end it first, JAX's preemption sync seeing a SIGTERM only at its next 1 s
            # poll (a CI run: 1 worker at 20 steps/s ended 32 steps before the sync). A stall of a
            # few seconds is far below the heartbeat timeout (10 s); past 5 s they go on anyway
            hosts.signal_workers(g, survivors, signal.SIGSTOP)
            try:
                for v in victims:
                    hosts.start(v, ".replacement")
                hosts.wait(lambda: hosts.leased(victims), "the replacement agents' leases")
                told = time.time() + 5.0
                hosts.wait(lambda: time.time() > told or hosts.draining(g, survivors), "the survivors' drain")
            finally:
                hosts.signal_workers(g, survivors, signal.SIGCONT)
            others = [p for r, p in hosts.agents.items() if r not in victims]
            got = hosts.wait(lambda: _back(run, g, 1, range(nodes)) or all(p.poll() == 0 for p in others),
                             "a generation with the replacement(s) stepping")
            if got is True:  # (a replacement for a job that already ended waits for --rendezvous-timeout)
                raise BenchError(f"the job ended before the replacement(s) for node(s) {victims} joined: give it more "
                                 f"--steps")
            grow = {"generation": got[0], "join_to_stepping_s": time.time() - t_join}
            log(f"      replacement(s) for node(s) {victims} in generation {got[0]} after "
                f"{grow['join_to_stepping_s']:.1f} s")
        rcs = hosts.finish()
    finally:
        hosts.close()
    text = hosts.text()
    if any(rcs):
        raise BenchError(f"the live agents exited with {rcs}")
    ends = _ends(text)

    def _stopped(g_, r):  # when node r had stopped its workers and marked generation g_ ended
        f = run / "nodes" / f"g{g_}.node{r}.json"
        return _mtime(f) if (_json(f) or {}).get("status") in ("stopped", "failed", "reforming") else None

    if case == "relaunch":
        detected = t_kill
    else:
        detected = min((m for r in first_survivors if (m := _stopped(0, r)) is not None), default=t_kill)
    committed = _mtime(_gen_file(run, g, "outcome"))
    joined = max(h["joined_t"] for h in hbs.values())
    first = max(h["first_step_t"] for h in hbs.values())
    summary = _json(summ) or {}
    final_gen = (_json(run / "processes.json") or {}).get("generation")
    restore = [e for e in summary.get("events", []) if e.get("kind") == "restore"] if final_gen == g else []
    restore_s = sum(float(e["seconds"]) for e in restore) if restore else None
    restored = _resumed(text, g) or 0  # (no "resumed at step" line: no checkpoint yet, it started over)
    tail = {"start": joined - committed, "restore": restore_s, "setup": first - joined - (restore_s or 0.0),
            "redo": t_back - first}
    if case == "double":
        detected2 = min((m for r in survivors if (m := _stopped(second["generation"], r)) is not None),
                        default=t_kill2)
        phases = {"detect": detected - t_kill, "recovering": t_kill2 - detected, "detect2": detected2 - t_kill2,
                  "agree": committed - detected2, **tail}
        second["death_to_back_s"] = t_back - t_kill2
    else:
        phases = {"detect": detected - t_kill, "agree": committed - detected, **tail}
    res = {
        "case": case, "killed": victims, "service_node_before": service, "service_node_after": gen.service_node,
        "kill_step": kill_step, "restored_step": restored, "restored_from": _resumed_from(text, g),
        "lost_steps": None if restored is None else max(0, back_step - restored),
        "checkpoints_at_kill": ckpts, "death_to_back_s": t_back - t_kill, "phases": phases, "generation_back": g,
        "nodes_back": list(gen.members), "min_nodes": min_nodes,
        "abandoned_generations": [k for k in range(1, _latest(run) + 1)
                                  if ((_json(_gen_file(run, k, "outcome")) or {}).get("outcome")) == rendezvous.ABANDONED],
        "generation_ends": ends, "distance": _distance(out, ref),
    }
    res["bitwise"] = res["distance"] == 0.0
    if second is not None:
        res["second_kill"] = second
    if grow is not None:
        g2 = grow["generation"]
        stopped = [int(ln.split("(newest step ")[1].split(")")[0]) for ln in text.splitlines()
                   if f"generation {g2 - 1} ended: " in ln and "(newest step " in ln]
        r2 = _resumed(text, g2)
        drain = [e["why"] for e in ends if e["generation"] == g2 - 1]
        grow.update(resumed_step=r2, stopped_step=max(stopped) if stopped else None,
                    redone_steps=None if r2 is None or not stopped else max(0, max(stopped) - r2),
                    drained=bool(drain) and all("the workers saved their step and exited" in w for w in drain))
        res["grow_back"] = grow
    return res


def soak_fallbacks(res: dict) -> list[str]:
    """Why a soak run redid steps from the checkpoint beyond the one restart a host death costs:
    a generation that ran and ended other than the kill's and the growing back's, or a drain
    that did not end with every worker saving its step."""
    # (an abandoned generation, one that a member never acked, started no worker: no restart)
    g_back = res["generation_back"]
    g_second = (res.get("second_kill") or {}).get("generation")  # (double: the second kill ended it)
    why = [f"generation {e['generation']} ended: {e['why']}" for e in res["generation_ends"]
           if 1 <= e["generation"] < g_back and e["generation"] != g_second]
    grow = res.get("grow_back")
    if grow is not None:
        if grow["generation"] != g_back + 1:
            why += [f"generation {e['generation']} ended: {e['why']}" for e in res["generation_ends"]
                    if g_back < e["generation"] < grow["generation"]]
        if not grow["drained"]:
            why += [f"growing back did not drain: {e['why']}" for e in res["generation_ends"]
                    if e["generation"] == grow["generation"] - 1]
    return why


# ------------------------------------------------------------------ the bench
def _stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def bench_multihost(*, steps=24, checkpoint_every=5, kill_after=12, cases=None, repeat=1, replace=False, soak=0,
                    lease=2.0, timeout=240.0, workdir=None, host_store_every=1, workers_per_host=1, mirrors=1,
                    devices_per_process=None, min_nodes=None, second_kill_at="attached", nodes=NODES,
                    deterministic=True, spares=0, in_place=False, log=print) -> dict:
    import numpy as np

    if cases is None:
        cases = ("service",) if soak else CASES[:3]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise ValueError(f"resilax bench multihost: --cases must name some of {', '.join(CASES)}, got {bad or cases}")
    if kill_after + 2 >= steps or kill_after < checkpoint_every:
        raise ValueError(f"resilax bench multihost: need --checkpoint-every <= --kill-after < --steps - 2, got "
                         f"{checkpoint_every}, {kill_after}, {steps}")
    workers = workers_per_host
    devices = devices_per_process or (2 if workers == 1 else 1)
    if workers < 1 or devices < 1:
        raise ValueError(f"resilax bench multihost: --workers-per-host and --devices-per-process must be >= 1, got "
                         f"{workers} and {devices}")
    if nodes < 2 or 48 % (nodes * workers):
        raise ValueError(f"resilax bench multihost: need --nodes >= 2 and the batch of 48 split over the {nodes} x "
                         f"{workers} processes")
    tol, mode = (0.0, "bit-exact") if deterministic else (1e-4, "default")  # the default mode: within 1e-4
    if second_kill_at not in SECOND_KILL_AT:
        raise ValueError(f"resilax bench multihost: --second-kill-at must be one of {', '.join(SECOND_KILL_AT)}, got "
                         f"{second_kill_at!r}")
    own = workdir is None
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="resilax-bench-mh-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    train = ["resilax", "train", "--topology", _topology(work, workers, devices, nodes), "--layout", "sharded",
             "--batch", "48", "--steps", str(steps), "--checkpoint-every", str(checkpoint_every),
             "--log-every", "10"] + ([] if deterministic else ["--no-deterministic"])
    jobs = [(c, True, f"soak{i}" if len(cases) == 1 else f"{c}.soak{i}") for i in range(soak) for c in cases] \
        if soak else [(c, replace, f"{c}{i}") for i in range(repeat) for c in cases]
    total = len(jobs) + 1
    t0 = time.time()
    log(f"[1/{total}] failure-free single-process reference: {nodes * workers} slices x {devices} CPU device(s), "
        f"{mode}, {steps} steps")
    r = subprocess.run([sys.executable, "-m", *train, "--no-log", "--no-peers", "--quiet", "--checkpoint-dir",
                        str(work / "ref_ck"), "--out", str(work / "ref.npz")], env=dict(os.environ), timeout=timeout,
                       capture_output=True, text=True, check=False)
    if r.returncode:
        raise BenchError(f"resilax bench multihost: the reference run failed:\n{r.stderr[-3000:]}")
    ref = np.load(work / "ref.npz", allow_pickle=False)
    runs, failed = [], False
    for i, (case, rep, name) in enumerate(jobs):
        what = {"service": "SIGKILL the coordination service's host", "other": "SIGKILL a host without the service",
                "relaunch": "SIGKILL every host, relaunch the job",
                "double": f"SIGKILL the service's host, then the next service's host ({second_kill_at})"}[case]
        log(f"[{i + 2}/{total}] {name}: {what}" + (" (+ a replacement agent)" if rep else ""))
        (work / name).mkdir()
        t = time.time()
        try:
            res = run_case(work / name, case, train=train, ref=ref, kill_after=kill_after, lease=lease,
                           timeout=timeout, replace=rep, host_store_every=host_store_every, workers=workers,
                           mirrors=mirrors, devices=devices, min_nodes=min_nodes if min_nodes or case != "double" else 1,
                           second_kill_at=second_kill_at, nodes=nodes, spares=spares, in_place=in_place, log=log)
            res["outcome"] = "bitwise" if res["bitwise"] else (f"within {tol:g}" if res["distance"] <= tol else
                                                               f"off by {res['distance']:.2e}")
        except Hang as e:
            res = {"case": case, "outcome": "hang", "error": str(e), "bitwise": False}
        except BenchError as e:
            res = {"case": case, "outcome": "failed", "error": str(e), "bitwise": False}
        res["wall_s"] = time.time() - t
        if "phases" in res:
            res["fallbacks"] = soak_fallbacks(res)
        res["dir"] = name
        res["ok"] = res["outcome"] in ("bitwise", f"within {tol:g}")
        failed |= not res["ok"]
        log(f"      {res['outcome']}" + (f": {res['error']}" if "error" in res else "")
            + (f"; fallbacks: {res['fallbacks']}" if res.get("fallbacks") else "") + f" ({res['wall_s']:.0f} s)")
        runs.append(res)
    result = {
        "benchmark": "multihost",
        "setup": {"nodes": nodes, "workers_per_node": workers, "devices_per_process": devices,
                  "topology": _topology_name(workers, devices, nodes), "cases": list(cases), "min_nodes": min_nodes,
                  "spares": spares, "in_place": in_place,
                  "second_kill_at": second_kill_at if "double" in cases else None,
                  "mode": mode, "tolerance": tol, "batch": 48, "steps": steps, "checkpoint_every": checkpoint_every,
                  "kill_after": kill_after, "lease_s": lease, "heartbeat_s": 0.2, "host_store_every": host_store_every,
                  "host_store_mirrors": mirrors, "repeat": repeat, "soak": soak,
                  "replace": bool(replace or soak), "cpu_count": os.cpu_count(), "loopback": True},
        "runs": runs, "wall_s": time.time() - t0, "ok": not failed,
    }
    if soak:
        result["soak"] = {
            "runs": len(runs), "bitwise": sum(r["outcome"] == "bitwise" for r in runs),
            "ok": sum(r["ok"] for r in runs), "not_bitwise": sum(r["outcome"].startswith("off by") for r in runs),
            "hang": sum(r["outcome"] == "hang" for r in runs), "failed": sum(r["outcome"] == "failed" for r in runs),
            "fell_back_to_checkpoint": sum(bool(r.get("fallbacks")) for r in runs),
            "fallback_reasons": [w for r in runs for w in r.get("fallbacks", [])],
            "death_to_back_s": _stats([r.get("death_to_back_s") for r in runs]),
            "grow_back_redone_steps": [(r.get("grow_back") or {}).get("redone_steps") for r in runs],
            "lost_steps": [r.get("lost_steps") for r in runs],
        }
    else:
        result["cases"] = {}
        for c in cases:
            ok = [r for r in runs if r["case"] == c and "phases" in r]
            result["cases"][c] = {
                "runs": sum(r["case"] == c for r in runs), "bitwise": all(r["bitwise"] for r in runs if r["case"] == c),
                "ok": all(r["ok"] for r in runs if r["case"] == c),
                "distance": max((r.get("distance", float("inf")) for r in runs if r["case"] == c), default=None),
                "death_to_back_s": _stats([r["death_to_back_s"] for r in ok]),
                "phases": {k: _stats([r["phases"][k] for r in ok])
                           for k in (DOUBLE_PHASES if c == "double" else PHASES)},
                "lost_steps": _stats([r["lost_steps"] for r in ok]),
            }
    if own and not failed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        result["workdir"] = str(work)
    return result


def run(args) -> int:
    if args.netns:
        from resilax.tools import bench_netns

        return bench_netns.run(args)
    cases = None if args.cases is None else tuple(c.strip() for c in args.cases.split(",") if c.strip())
    r = bench_multihost(steps=args.steps, checkpoint_every=args.checkpoint_every, kill_after=args.kill_after,
                        cases=cases, repeat=args.repeat, replace=args.replace, soak=args.soak, lease=args.lease,
                        timeout=args.timeout, workdir=args.workdir, host_store_every=args.host_store_every,
                        mirrors=args.host_store_mirrors,
                        workers_per_host=args.workers_per_host, devices_per_process=args.devices_per_process,
                        min_nodes=args.min_nodes, second_kill_at=args.second_kill_at, nodes=args.nodes,
                        deterministic=not args.no_deterministic, spares=args.spares, in_place=args.in_place,
                        log=lambda m: print(m, flush=True))
    print_table(r)
    if args.json:
        write_json(args.json, r)
        print(f"wrote {args.json}")
    if not r["ok"]:
        print(f"resilax bench multihost: a case did not end bitwise (the default mode: within 1e-4), or hung, or "
              f"failed; files kept in "
              f"{r.get('workdir')}", file=sys.stderr)
        return 1
    return 0
