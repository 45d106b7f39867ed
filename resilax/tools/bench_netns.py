"""`resilax bench multihost --netns`: hosts that are really apart, and the faults that separate them.

Each host is a network namespace with a mount namespace of its own (`netns.NetHosts`: its
own address in a private subnet, its own ``/dev/shm`` and ``/tmp``, its host name resolving
to its address), sharing only the run directory (and the code and compilation cache); one
agent per host, started with ``--address`` its own IP, so the coordination service, gloo's
collectives and the host stores' mirrors all go over the veths. ``--nodes`` agents (default
3) x 1 worker x 2 CPU devices run ``resilax train`` on an N-slice topology in the bit-exact
mode (``--no-deterministic``: the default mode, within 1e-4), checkpoints every
``--checkpoint-every``. Once every worker is past ``--kill-after``, one fault:

- ``none``: no fault (the failure-free run in namespaces: the time the others are slower than);
- ``partition``: a host without the service loses its link for ``--hold`` s (its processes
  keep running), then it comes back;
- ``partition-service``: the same for the host that runs the coordination service;
- ``cut``: a host without the service loses its link *and* its view of the run directory
  (replaced by an empty file system: its lease cannot be renewed, the others go on without
  it) for at least 3 leases and until the others are back at the step without it (at most
  120 s), then both come back;
- ``lossy``: from the start, one host's link drops 5% of packets each way and is slowed
  (``tc netem`` delay 50 ms where the kernel has it; else a rate limit): no fault time;
- ``delay``: from the start, every packet one host sends arrives 50 ms late (`NetHosts.delay`:
  netem, or an NFQUEUE rule at the receivers; no loss): no fault time;
- ``flap-short`` / ``flap-long``: a host's link and its run-directory view go for half a
  lease / 1.5 leases (at least 2 s / 5 s), then come back;
- ``skew``: a host's clock (the rendezvous' clock, ``RESILAX_TEST_CLOCK_SKEW_S``) jumps 2.5
  leases ahead: it must withdraw, not be a second owner of its rank;
- ``full``: the shared run directory is a file system of its own (a 64 MiB tmpfs, mounted
  before the hosts start, so each host's mount namespace holds it): it is filled up (one
  file takes every free byte) until a write fails on it (a save, the record log, a lease),
  then freed two leases later (no
  lease can be renewed meanwhile; every agent must wait, none exit). The newest checkpoint
  committed before the failure is copied aside (``kept_checkpoint``: the caller can restore
  it) and ``committed_at_fault`` lists the committed ones then;
- ``readonly``: the run directory turns read-only for every host (`NetHosts.read_only_run_dir`:
  a read-only bind mount of it in each host's mount namespace; files already open, such as
  logs, keep working, as on an NFS export turned read-only) until a write fails on it, then
  writable again two leases later; as ``full`` otherwise; ``readonly-host``: the same for one
  host's view only (a host without the service).

Per case (JSON ``cases``: ``name``, ``detect_s``, ``back_s``, ``lost_steps``,
``generations``, ``ok``, and more): ``detect_s`` the fault -> the first agent ended
generation 0 (null: none did); ``back_s`` -> every worker of a later generation completed the
step reached at the fault (null: no new generation was needed); ``lost_steps`` that step minus
the step the later generation resumed at; ``generations`` how many were committed;
``split_brain`` what the run directory shows of two sides (a checkpoint the fence rule
rejects left outside quarantine, a processes.json of another generation's identity than the
rendezvous', a rank with two incarnations in one generation); ``ok``: every agent that should
finish did (exit 0), the final state is the reference's (bitwise; within 1e-4), no split brain.
``--soak N`` runs the partition cases (``partition``, ``partition-service``, ``cut``) N
times in turn: JSON ``soak`` = ``{runs, hangs, wrong, split_brains}``.

Faults joined by ``+`` (``--cases partition+partition-service``) are one job: the first
fault once every worker is past ``--kill-after``, each next one once every node is back in
a generation whose every worker is 10 steps past the previous fault's step (`run_case`).
JSON ``cases`` has one entry per fault (``name`` the fault, ``run`` the job), each with its
own ``detect_s``, ``back_s``, ``lost_steps`` and ``generations`` (those from the generation
at the fault to the one at the next fault) and the job's ``ok``, ``distance``,
``exit_codes``, ``split_brain``. A job costs a few processes' start-ups (imports, tracing,
the first step) however many faults it holds.

Needs root (`netns.unavailable` says why not). Every host's processes are SIGKILLed and the
namespaces removed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from resilax._src.runtime import fence, rendezvous
from resilax.tools import netns
from resilax.tools.bench_multihost import (BenchError, Hang, _back, _committed, _distance, _latest, _resumed,
                                           _topology)
from resilax.tools.processes import heartbeats

CASES = ("none", "partition", "partition-service", "cut", "lossy", "delay", "flap-short", "flap-long", "skew", "full",
         "readonly", "readonly-host")
SOAK_CASES = ("partition", "partition-service", "cut")


def _json(path):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


def split_brain(run: pathlib.Path) -> list[str]:
    """What the run directory shows of two sides (empty: nothing)."""
    bad = []
    ck = run / "checkpoints"
    for d in sorted(ck.iterdir()) if ck.is_dir() else ():
        if d.name.isdigit():
            meta = _json(d / "meta" / "metadata")
            why = fence.rejected(run, meta or {}, int(d.name))
            if why:
                bad.append(f"checkpoint {d.name} is a fenced side's and was not moved aside: {why}")
    procs = _json(run / "processes.json") or {}
    if procs.get("generation_id"):
        prop = _json(run / rendezvous.RENDEZVOUS / "generations" / f"g{procs['generation']}.proposal.json") or {}
        if prop.get("sha256") != procs["generation_id"]:
            bad.append(f"processes.json names generation {procs['generation']} {procs['generation_id'][:12]}, not the "
                       f"rendezvous' {str(prop.get('sha256'))[:12]}")
    for g in range(_latest(run) + 1):
        gen = _committed(run, g)
        if gen is not None and len(set(gen.incarnations.values())) != len(gen.members):
            bad.append(f"generation {g} has a rank twice")
    return bad


class Job:
    """The agents of one case, one per host of ``hosts``."""

    def __init__(self, hosts: netns.NetHosts, work: pathlib.Path, cmd: list, opts: list, deadline: float):
        self.hosts, self.work, self.run, self.cmd, self.opts, self.deadline = hosts, work, work / "run", cmd, opts, \
            deadline
        self.agents: dict[int, subprocess.Popen] = {}
        self.logs: list[pathlib.Path] = []

    def start(self, r: int, env: dict | None = None) -> None:
        log = self.work / f"agent{r}.log"
        self.logs.append(log)
        argv = [sys.executable, "-m", "resilax", "launch", "--nodes", str(self.hosts.n), "--node-rank", str(r),
                "--address", self.hosts.address(r), "--run-dir", str(self.run), *self.opts, "--", *self.cmd]
        with open(log, "wb") as f:
            self.agents[r] = subprocess.Popen(self.hosts.wrap(r, argv, shared=[self.work]),
                                              env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), stdout=f,
                                              stderr=subprocess.STDOUT, start_new_session=True)

    def agent_pid(self, r: int) -> int:
        """The agent's own pid (under ``ip netns exec``/``unshare``/``sh``, which exec it)."""
        return self.agents[r].pid

    def wait(self, pred, what: str):
        while time.time() < self.deadline:
            v = pred()
            if v:
                return v
            for r, p in self.agents.items():
                if p.poll() not in (None, 0):
                    raise BenchError(f"agent {r} exited with {p.returncode} while waiting for {what}")
            time.sleep(0.05)
        raise Hang(f"timed out waiting for {what}")

    def text(self) -> str:
        return "\n".join(f.read_text(errors="replace") for f in self.logs if f.exists())

    def close(self) -> None:
        for r in range(self.hosts.n):
            self.hosts.kill(r)
        for p in self.agents.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _first_end(run: pathlib.Path, t_fault: float, g: int = 0) -> float | None:
    """The fault -> the first agent that marked generation ``g`` ended (its node file's mtime)."""
    ts = []
    for f in (run / "nodes").glob(f"g{g}.node*.json"):
        rec = _json(f) or {}
        if rec.get("status") in ("stopped", "failed"):
            ts.append(f.stat().st_mtime)
    return min(ts) - t_fault if ts else None


def faults_of(case: str) -> list[str]:
    """The faults of ``case``, one job: ``a+b`` is fault ``a``, then, once every node is back in
    a generation past ``fault_gap`` more steps, fault ``b`` (`run_case`). ``none``, ``lossy`` and
    ``delay`` (no fault time) stand alone; ``skew`` (its host withdraws) comes last."""
    faults = case.split("+")
    bad = [f for f in faults if f not in CASES]
    if bad or (len(faults) > 1 and (any(f in ("none", "lossy", "delay") for f in faults) or "skew" in faults[:-1])):
        raise ValueError(f"resilax bench multihost --netns: a case is one of {', '.join(CASES)}, or faults joined by "
                         f"'+' (not none, lossy or delay; skew last), got {case!r}")
    return faults


def run_case(work: pathlib.Path, case: str, *, train: list, ref, tol: float, kill_after: int, lease: float,
             timeout: float, nodes: int = 3, hold: float = 8.0, lossy_also: int | None = None,
             lossy_rate_mbit: float = 20.0, collective_timeout: float = 5.0, fault_gap: int = 10, log=print) -> dict:
    """One job of ``nodes`` hosts in namespaces; ``case`` as in the module docstring, or faults
    joined by ``+`` (`faults_of`): one job, the first fault once every worker is past
    ``kill_after``, each next one once every node is back in a generation whose every worker
    is ``fault_gap`` steps past the previous fault's step. ``faults``: per fault ``name``,
    ``detect_s``, ``back_s``, ``lost_steps``, ``generations`` (those committed from the one
    at the fault to the one at the next fault, or the last) and the rest; with one fault they
    are also the result's own keys, as they always were. ``lossy_also``: that host's link is
    lossy too, from the start (two faults in one job); ``lossy_rate_mbit``: a lossy link's
    rate limit where the kernel has no netem (`NetHosts.lossy`); ``collective_timeout``:
    `resilax launch --collective-timeout` (a flap is survived when it is longer than the gap
    plus TCP's retransmission back-off)."""
    faults = faults_of(case)
    run, out = work / "run", work / "final.npz"
    cmd = [*train, "--out", str(out)]
    opts = ["-n", "1", "--devices-per-process", "2", "--lease", str(lease), "--heartbeat", "0.2",
            "--heartbeat-timeout", "10", "--rendezvous-timeout", "120", "--collective-timeout", f"{collective_timeout:g}",
            "--startup-timeout", "120"]
    res: dict = {"name": case, "detect_s": None, "back_s": None, "lost_steps": 0, "generations": 0, "ok": False}
    tmpfs = "full" in faults
    if tmpfs:  # (before the hosts start: each host's mount namespace is a copy holding it)
        run.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(run)], check=True, capture_output=True)
    try:
        return _run_case(run, out, cmd, opts, res, faults, nodes=nodes, work=work, kill_after=kill_after, lease=lease,
                         timeout=timeout, hold=hold, lossy_also=lossy_also, lossy_rate_mbit=lossy_rate_mbit, ref=ref,
                         tol=tol, fault_gap=fault_gap, log=log)
    finally:
        if tmpfs:
            (run / "filler").unlink(missing_ok=True)
            subprocess.run(["umount", "-l", str(run)], capture_output=True)  # (the files go with it)


def _settled(run, nodes: int, step: int, g: int | None):
    """``(generation, processes.json)`` once the newest proposed generation (``g``, if given) is
    committed with all ``nodes``, every one of its workers past ``step``, and processes.json is
    its own and names every node; else None."""
    g = _latest(run) if g is None else g
    gen = _committed(run, g)
    if gen is None or len(gen.members) != nodes:
        return None
    h = heartbeats(run, g)
    if len(h) != gen.num_processes or not all((x.get("step") or 0) >= step for x in h.values()):
        return None
    p = _json(run / "processes.json")
    return (g, p) if p and p.get("generation") == g and len(p.get("nodes", {})) == nodes else None


def _run_case(run, out, cmd, opts, res, faults, *, nodes, work, kill_after, lease, timeout, hold, lossy_also,
              lossy_rate_mbit, ref, tol, fault_gap, log) -> dict:
    victim = nodes - 1  # never the service host (node 0, the lowest rank, proposes generation 0)
    skew_file = work / "skew"
    first = faults[0]
    with netns.NetHosts(nodes) as hosts:
        job = Job(hosts, work, cmd, opts, time.time() + timeout)
        try:
            applied = None
            if first == "lossy":
                applied = hosts.lossy(victim, loss=0.05, delay_ms=50, rate_mbit=lossy_rate_mbit)
            elif first == "delay":
                applied = hosts.delay(victim, 50)
            if lossy_also is not None:
                res["lossy_also"] = f"host {lossy_also}: " + hosts.lossy(lossy_also, loss=0.05, delay_ms=50,
                                                                             rate_mbit=lossy_rate_mbit)
            for r in range(nodes):
                job.start(r, {"RESILAX_TEST_CLOCK_SKEW_S": f"@{skew_file}"} if "skew" in faults and r == victim
                          else None)
            t_start = time.time()
            job.wait(lambda: _committed(run, 0), "generation 0")
            per: list[dict] = []
            for i, case in enumerate(faults):
                at = kill_after if i == 0 else per[-1]["fault_step"] + fault_gap
                prev = per[-1] if per else None

                def ready(prev=prev, at=at, i=i):
                    if prev is not None:
                        _watch_back(run, prev)
                    return _settled(run, nodes, at, 0 if i == 0 else None)

                g_at, procs = job.wait(ready, f"every worker of {'generation 0' if i == 0 else 'a generation of every node'}"
                                       f" past step {at}")
                service = procs["service_node"]
                target = service if case == "partition-service" else victim
                fault_step = max(x.get("step") or 0 for x in heartbeats(run, g_at).values())
                t_fault = time.time()
                f = {"name": case, "generation_at_fault": g_at, "fault_step": fault_step, "t_fault": t_fault,
                     "target": target, "service_node": service}
                per.append(f)
                applied = _fault(case, f, run=run, work=work, hosts=hosts, job=job, nodes=nodes, victim=victim,
                                 lease=lease, hold=hold, skew_file=skew_file, kept=i, applied=applied, log=log)
            # until every agent exits: when the job was back at the step
            last = per[-1]
            expect_exit = {r: (1 if faults[-1] == "skew" and r == last["target"] else 0) for r in range(nodes)}
            while any(p.poll() is None for p in job.agents.values()):
                if time.time() > job.deadline:
                    raise Hang(f"timed out waiting for the agents to exit ({[p.poll() for p in job.agents.values()]})")
                _watch_back(run, last)
                time.sleep(0.05)
            rcs = {r: p.returncode for r, p in job.agents.items()}
            text = job.text()
            for k, f in enumerate(per):
                _outcome(f, run, text, end=per[k + 1]["generation_at_fault"] if k + 1 < len(per) else _latest(run))
            res["faults"] = per
            if len(per) == 1:
                res.update(per[0], name=faults[0])
            res["exit_codes"] = rcs
            res["total_s"] = time.time() - t_start
            res["link"] = applied
            res["split_brain"] = split_brain(run)
            res["distance"] = _distance(out, ref) if out.exists() else float("inf")
            res["ok"] = (rcs == expect_exit and res["distance"] <= tol and not res["split_brain"]
                         and all(f.get("refused", True) for f in per))
            return res
        finally:
            job.close()


def _watch_back(run, f: dict) -> None:
    """Sets fault ``f``'s ``back_s`` (the fault -> every worker of a later generation past the
    fault's step) once that is so, if it was not found already (while the fault lasted)."""
    if f["back_s"] is None and _latest(run) > f["generation_at_fault"] and \
            _back(run, f["generation_at_fault"], f["fault_step"]):
        f["back_s"] = time.time() - f["t_fault"]


def _outcome(f: dict, run, text: str, *, end: int) -> None:
    """Fault ``f``'s results from the run directory and the agents' logs, read after the job:
    generations ``f["generation_at_fault"]`` .. ``end`` are its."""
    g_f, fault_step, t_fault = f["generation_at_fault"], f["fault_step"], f["t_fault"]
    gens = [g for g in range(g_f, end + 1) if _committed(run, g) is not None]
    f["generations"] = len(gens)
    f["detect_s"] = _first_end(run, t_fault, g_f) if len(gens) > 1 else None
    b = _back(run, g_f, fault_step) if len(gens) > 1 else None
    if b is not None and b[0] > end:
        b = None
    if f["back_s"] is None and b is not None:
        f["back_s"] = max((pathlib.Path(p).stat().st_mtime for p in (run / "heartbeats").glob(f"g{b[0]}.p*.json")),
                          default=t_fault) - t_fault
    g_back = b[0] if b is not None else None  # the generation that was back at the step
    resumed = _resumed(text, g_back) if g_back is not None else None
    f["generation_back"] = g_back
    f["lost_steps"] = max(0, fault_step - resumed) if resumed is not None else 0
    f["resumed_step"] = resumed
    f["why_ended"] = [ln.split(" ended: ", 1)[1].split(";")[0] for ln in text.splitlines()
                      if f" generation {g_f} ended: " in ln][:3]
    if f["name"] == "skew":
        f["refused"] = "clock is " in text and "off the run directory's file system" in text


def _fault(case, f, *, run, work, hosts, job, nodes, victim, lease, hold, skew_file, kept, applied, log):
    """Fault ``case`` now, on ``f["target"]``, and what it needs until it is over (its results
    into ``f``); returns the link setting (``lossy``, ``delay``: from the start)."""
    target, service, fault_step, t_fault = f["target"], f["service_node"], f["fault_step"], f["t_fault"]
    f["back_s"] = None
    down = {"partition": hold, "partition-service": hold, "cut": 3 * lease,
            "flap-short": max(2.0, lease / 2), "flap-long": max(5.0, 1.5 * lease)}.get(case)
    cut = case in ("cut", "flap-short", "flap-long")
    ro_hosts = {"readonly": range(nodes), "readonly-host": [victim]}.get(case, ())
    if case == "skew":
        skew_file.write_text(str(2.5 * lease))
        log(f"      host {target}'s clock jumps {2.5 * lease:g} s ahead at step {fault_step}")
    elif case in ("full", "readonly", "readonly-host"):
        said = ("the disk is full", "No space left on device") if case == "full" else ("Read-only file system",)
        before = sum(job.text().count(x) for x in said)  # (an earlier fault's say so too)
        if case == "full":
            st = os.statvfs(run)
            log(f"      the run directory fills up at step {fault_step} ({st.f_bavail * st.f_frsize / 2**20:.1f}"
                f" MiB free before: " + subprocess.run(["du", "-sh", *map(str, run.iterdir())],
                                                       capture_output=True, text=True).stdout.replace("\n", "; ")
                + ")")
            _fill(run / "filler")
        else:  # every host's view (an NFS export turned read-only: every client sees it), or one's
            for r in ro_hosts:
                hosts.read_only_run_dir(r, run, job.agent_pid(r))
            log(f"      the run directory turns read-only for host(s) {list(ro_hosts)} at step {fault_step}")
        # a worker's write (a save, the record log) or an agent's (its lease) fails first
        job.wait(lambda: sum(job.text().count(x) for x in said) > before, f"a write to fail ({said[-1]})")
        t_full = time.time()
        while time.time() < t_full + 2 * lease:  # two leases: none can be renewed meanwhile
            for r, p in job.agents.items():
                if p.poll() is not None:
                    raise BenchError(f"agent {r} exited with {p.returncode} while the run directory was {case}")
            time.sleep(0.1)
        done = _checkpoints(run)
        f["committed_at_fault"] = done
        if done:  # copied aside while the job waits: the caller restores it
            aside = work / ("kept_checkpoint" if kept == 0 else f"kept_checkpoint{kept}")
            shutil.copytree(run / "checkpoints" / str(done[-1]), aside / str(done[-1]))
            f["kept_checkpoint"] = str(aside)
        if case == "full":
            (run / "filler").unlink()
        for r in ro_hosts:
            hosts.writable_run_dir(r, run, job.agent_pid(r))
        f["healed_s"] = time.time() - t_fault
        log(f"      a write failed, the job waits; {f['healed_s']:.1f} s after: "
            f"{'freed' if case == 'full' else 'writable again'} (committed: {done})")
    elif down is not None:
        hosts.partition(target)
        if cut:
            hosts.cut_run_dir(target, run, job.agent_pid(target))
        log(f"      host {target} (service on {service}): link down{' and run directory cut' if cut else ''} "
            f"for {down:g} s at step {fault_step}")
        t_heal = t_fault + down
        others = [r for r in range(nodes) if r != target]
        g_f = f["generation_at_fault"]
        while time.time() < t_heal or (case == "cut" and time.time() < t_fault + 120 and f["back_s"] is None):
            if f["back_s"] is None and _back(run, g_f, fault_step, others if case == "cut" else None):
                f["back_s"] = time.time() - t_fault
            time.sleep(0.05)  # (cut: until the others are back at the step without it)
        f["healed_s"] = time.time() - t_fault
        if cut:
            hosts.restore_run_dir(target, run, job.agent_pid(target))
        hosts.heal(target)
    else:
        log(f"      host {target}'s link: {applied}; nothing else happens" if applied else "      no fault")
    return applied


def _fill(path: pathlib.Path) -> None:
    """One file takes every free byte of ``path``'s file system (ENOSPC ends it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    except OSError:  # (full already)
        return
    try:
        for size in (1 << 20, 4096):  # then the last partial megabyte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


def _checkpoints(run: pathlib.Path) -> list[int]:
    """The committed checkpoints' steps (Orbax commits by renaming ``<step>.orbax-checkpoint-tmp``)."""
    d = run / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def bench_netns(*, steps=40, checkpoint_every=5, kill_after=10, cases=None, soak=0, lease=4.0, timeout=300.0,
                workdir=None, nodes=3, deterministic=True, hold=8.0, log=print) -> dict:
    import numpy as np

    why = netns.unavailable()
    if why:
        raise BenchError(f"resilax bench multihost --netns: cannot make hosts in namespaces here: {why}")
    cases = tuple(cases or (SOAK_CASES if soak else CASES))
    for c in cases:
        faults_of(c)  # (ValueError: not a case)
    own = workdir is None
    # not under /tmp: each host has a /tmp of its own (the run directory is bound back, but the
    # reference run and the topology file are read by every host)
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="resilax-bench-netns-", dir="/var/tmp"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tol = 0.0 if deterministic else 1e-4
    train = ["resilax", "train", "--topology", _topology(work, 1, 2, nodes), "--layout", "sharded", "--batch", "48",
             "--steps", str(steps), "--checkpoint-every", str(checkpoint_every), "--log-every", "10"] + \
        ([] if deterministic else ["--no-deterministic"])
    jobs = [(c, f"{c}.soak{i}") for i in range(soak) for c in cases] if soak else [(c, c) for c in cases]
    log(f"[1/{len(jobs) + 1}] failure-free single-process reference: {nodes} slices x 2 CPU devices, {steps} steps")
    r = subprocess.run([sys.executable, "-m", *train, "--no-log", "--no-peers", "--quiet", "--checkpoint-dir",
                        str(work / "ref_ck"), "--out", str(work / "ref.npz")], env=dict(os.environ), timeout=timeout,
                       capture_output=True, text=True, check=False)
    if r.returncode:
        raise BenchError(f"resilax bench multihost --netns: the reference run failed:\n{r.stderr[-3000:]}")
    ref = np.load(work / "ref.npz", allow_pickle=False)
    out, soak_runs = [], {"runs": 0, "hangs": 0, "wrong": 0, "split_brains": 0, "failed": 0}
    for i, (case, name) in enumerate(jobs):
        log(f"[{i + 2}/{len(jobs) + 1}] {name}")
        (work / name).mkdir()
        try:
            res = run_case(work / name, case, train=train, ref=ref, tol=tol, kill_after=kill_after, lease=lease,
                           timeout=timeout, nodes=nodes, hold=hold, log=log)
        except Hang as e:
            res = {"name": case, "detect_s": None, "back_s": None, "lost_steps": None, "generations": None,
                   "ok": False, "hang": str(e)}
        except BenchError as e:
            res = {"name": case, "detect_s": None, "back_s": None, "lost_steps": None, "generations": None,
                   "ok": False, "error": str(e)}
        res["run"] = name
        faults = res.pop("faults", [])
        # a job of several faults: one entry per fault, each with the job's own results
        rows = [{**res, **f, "run": name} for f in faults] if len(faults) > 1 else [res]
        out.extend(rows)
        for row in rows:
            log(f"      {'ok' if row['ok'] else 'NOT OK'}{' ' + row['name'] if len(rows) > 1 else ''}: detect "
                f"{row['detect_s']}, back {row['back_s']}, lost {row['lost_steps']}, generations {row['generations']}, "
                f"distance {row.get('distance')}" + (f", split brain {row['split_brain']}" if row.get("split_brain")
                                                     else "")
                + (f", {row.get('hang') or row.get('error')}" if not row["ok"] and (row.get("hang") or row.get("error"))
                   else ""))
        if soak:
            soak_runs["runs"] += 1
            soak_runs["hangs"] += "hang" in res
            soak_runs["wrong"] += res.get("distance", 0.0) > tol
            soak_runs["split_brains"] += bool(res.get("split_brain"))
            soak_runs["failed"] += not res["ok"]
    result = {"benchmark": "multihost-netns", "setup": {"nodes": nodes, "steps": steps, "kill_after": kill_after,
                                                         "checkpoint_every": checkpoint_every, "lease_s": lease,
                                                         "hold_s": hold, "mode": "bit-exact" if deterministic else
                                                         "default", "netem": netns.netem_available()},
              "cases": out, "ok": all(r["ok"] for r in out)}
    if soak:
        result["soak"] = soak_runs
    if own and result["ok"]:
        shutil.rmtree(work, ignore_errors=True)
    else:
        result["workdir"] = str(work)
    return result


def print_table(r: dict) -> None:
    # a fault of a job of several: "fault (in job)"
    labels = [c.get("run", c["name"]) if "+" not in c.get("run", "") else f"{c['name']} (in {c['run']})"
              for c in r["cases"]]
    w = max([22, *(len(x) + 2 for x in labels)])
    print(f"{'case':<{w}}{'detect (s)':>11}{'back (s)':>10}{'lost':>6}{'gens':>6}{'total (s)':>11}  ok")
    for c, label in zip(r["cases"], labels):
        f = (lambda v: "-" if v is None else f"{v:.2f}")
        print(f"{label:<{w}}{f(c['detect_s']):>11}{f(c['back_s']):>10}"
              f"{'-' if c['lost_steps'] is None else c['lost_steps']:>6}{'-' if c['generations'] is None else c['generations']:>6}"
              f"{f(c.get('total_s')):>11}  {'yes' if c['ok'] else 'NO'}")
    if "soak" in r:
        print("soak: " + ", ".join(f"{k} {v}" for k, v in r["soak"].items()))


def run(args) -> int:
    from resilax._src.io import write_json

    cases = None if args.cases is None else tuple(c.strip() for c in args.cases.split(",") if c.strip())
    r = bench_netns(steps=args.steps if args.steps != 24 else 40, checkpoint_every=args.checkpoint_every,
                    kill_after=args.kill_after if args.kill_after != 12 else 10, cases=cases, soak=args.soak,
                    lease=args.lease if args.lease != 2.0 else 4.0, timeout=max(args.timeout, 300.0),
                    workdir=args.workdir, nodes=args.nodes, deterministic=not args.no_deterministic, hold=args.hold,
                    log=lambda m: print(m, flush=True))
    print_table(r)
    if args.json:
        write_json(args.json, r)
        print(f"wrote {args.json}")
    if not r["ok"]:
        print(f"resilax bench multihost --netns: a case hung, failed, ended off the reference or left a split brain; "
              f"files kept in {r.get('workdir')}", file=sys.stderr)
        return 1
    return 0
