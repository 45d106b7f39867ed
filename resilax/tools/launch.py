"""`resilax launch`: a supervisor for N JAX worker processes on 127.0.0.1.

    resilax launch -n 4 --devices-per-process 2 --run-dir D [--spares S] -- resilax train --topology cpu-4x2 ...

The supervisor does no JAX compute. Per *generation* it starts a coordination service on
a fresh loopback port (in this process, so no worker's death takes it down), starts N
workers of CMD with their place in the job in ``RESILAX_*`` variables (resilax attaches
them inside `Topology`/`wrap`), keeps ``D/processes.json`` current and watches them:

- a worker that exits non-zero or by a signal is dead;
- a worker whose heartbeat file is older than ``--heartbeat-timeout`` (SIGSTOPped, or the
  whole process wedged) is hung: it is SIGKILLed, so a hang becomes a death (the
  heartbeats, ``D/heartbeats``, are kept in RAM while the job runs: a busy disk's journal
  does not delay them; they are copied back at the end);
- a worker in its step loop that completes no step within the step deadline
  (``max(--min-step-deadline, --step-deadline-factor x measured step time)``; stuck in a
  collective whose peer is gone) is hung too.

On a death, with ``--in-place`` and when every other worker can (each says so in its
heartbeat: the bit-exact mode, one failure domain per process, host store on) and at least
``--min-in-place`` of them are left, the others **go on in place** (path A): the supervisor
deletes the dead host's store and writes ``D/membership.json``
(``{"generation", "epoch", "alive", "dead"}``); each survivor's broken collective fails
(XLA's collective timeout), it reads the verdict, the survivors agree on the newest step
they all hold, restore it from their own host store onto the mesh of the live processes'
devices (its executables were compiled ahead, in the background) and continue, with the
same global batch and the same maths. A job that shrank **grows back** once enough warm
spares are ready for the dead places: the supervisor adds ``"reform"`` to the membership
file, the live workers leave at a step boundary they agree on, detach from the service and
drop their JAX backend (their state is in their host stores), and the next generation
starts on a new service with them in their own processes (same pids, same process ids) and
the spares in the dead places; the worker command runs its set-up again
(`resilax.launched.Reform`, `reattach`; `resilax train` does) and resumes at that boundary
from the host stores. Otherwise (path B) every other worker of the
generation is SIGKILLed (their collectives are broken) and a new generation starts with N
workers on a new service; they resume from durable state (the host state stores, else the
newest Orbax checkpoint). At most
``--max-restarts`` new generations in a row that get no further than the step reached before
(a crash loop); then the supervisor exits with the last failure's code.
SIGTERM/SIGINT to the supervisor are forwarded to the workers (each saves at the next
preemption sync point and exits); a generation whose workers all exit 0 ends the job with 0.

``--spares S`` keeps S *spares* warm: processes of CMD started with ``RESILAX_SPARE`` (the
path of their assignment file, ``D/spares/spare<k>.json``) instead of a place in the job.
A spare imports JAX and resilax without starting a backend, writes ``phase: spare`` to
``D/heartbeats/spare<k>.json`` and waits. A new generation takes its workers from the ready
spares first (the supervisor writes each its `LaunchEnv` as JSON, atomically; the spare
then joins like a fresh worker, minus Python start-up and imports) and starts fresh
processes for the rest. The first S spares start with the first generation (whose workers
are all fresh); after a recovery, new spares are started to get back to S once every worker
of the new generation has completed a step (or after ``--startup-timeout``), so they do not
compete for CPU with a recovering generation. A spare that dies, is not ready within
``--startup-timeout``, or whose heartbeat goes stale once ready is replaced (not a job
failure); spares are killed on SIGTERM and when the job ends. Their output goes to
``D/logs/spare<k>.log`` (prefix ``[spare<k>]``), then, once assigned, to the worker's log
with its ``[g<g> p<i>]`` prefix.

``--standby`` keeps the next generation set up ahead (`resilax.tools.standby`): N processes
of CMD attached to generation g+1's own service, with their backends up and their programs
built, parked in `ResilientStep.init` before anything reads or writes the job's state. A
generation that fails (path B) is replaced by it: the supervisor writes each process its
place (the same process id, the host-store step to restore) and only the restore and the
first step remain. One that cannot serve (a process died, hung or was not parked in time)
is dropped and another started; a failure that finds none parked starts the new generation
the usual way. Not with ``--in-place`` (the survivors re-form there) or ``--nodes``.

Why a new generation and not a rejoin: a replacement joining the same service under the
same process id connects, but gloo then fails (``ALREADY_EXISTS: key cpu:gloo/...``);
measured on jax 0.10.2 (docs/multiprocess.md).
"""

from __future__ import annotations

import os
import pathlib
import signal
import shutil
import time

from resilax._src.io import write_json
from resilax._src.protect import hoststore_files
from resilax._src.runtime import membership, ports, worker
from resilax._src.runtime.worker import LaunchEnv
from resilax.tools import processes, standby
from resilax.tools.processes import (HEARTBEATS, Output, SparePool, WorkerProcess, exit_reason, heartbeat_file,
                                     popen, read_json, say, stop_all)

# imported from here by tests and benchmarks
reserve_port, heartbeats, spare_heartbeats, _read_json = (ports.reserve_port, processes.heartbeats,
                                                          processes.spare_heartbeats, read_json)

PROCESSES_JSON = "processes.json"
SPARES = processes.SPARES  # D/spares/spare<k>.json: a spare's assignment
_STOPPED = "another worker of its generation died"
# --in-place, a death with no warm spare for every dead place: "reform": the survivors re-form
# as a smaller generation on a new backend (checkpoints and preemption go on); "backend":
# they go on in the same processes on the backend the failure broke (faster here, but XLA's
# CPU runtime keeps broken communicators cached: docs/multiprocess.md)
SHRINK_MODES = ("reform", "backend")


# a supervisor's host stores and heartbeat directory in RAM (its pid first): `hoststore_files.remove_orphans`
ORPHAN_STORES = r"resilax-store-(?P<pid>\d+)-\d+"
ORPHAN_HEARTBEATS = r"resilax-hb-(?P<pid>\d+)-\d+"


class Supervisor:
    """Runs generations of workers until one ends cleanly or the restart budget is spent.

    Args:
      cmd: the worker command (argv).
      n: workers per generation; ``devices_per_process``: CPU devices each asks JAX for.
      run_dir: ``processes.json``, heartbeats and per-worker logs live here.
      heartbeat_s / heartbeat_timeout_s: how often workers write their heartbeat; how old it
        may get before the worker is declared hung and killed.
      step_deadline_factor / min_step_deadline_s: the step deadline is
        ``max(min_step_deadline_s, factor x measured step time)``.
      collective_timeout_s: XLA's CPU collective timeout in the workers (default: below the
        step deadline, so a collective on a dead peer errors instead of waiting 30 minutes).
      startup_timeout_s: a generation whose workers have not all written a heartbeat by
        then is a failure.
      spares: processes kept warm (imported, waiting) to become the next generation's
        workers (see the module docstring); 0: every worker is started fresh.
    """

    def __init__(self, cmd, *, n: int, devices_per_process: int, run_dir, max_restarts: int = 3,
                 heartbeat_s: float = 0.5, heartbeat_timeout_s: float = 5.0, step_deadline_factor: float = 20.0,
                 min_step_deadline_s: float = 30.0, collective_timeout_s: int | None = None,
                 startup_timeout_s: float = 300.0, jax_heartbeat_timeout_s: int | None = None, grace_s: float = 60.0,
                 host_store_every: int = 1, spares: int = 0, in_place: bool = False, min_in_place: int | None = None,
                 shrink: str = "reform", standby: bool = False):
        processes.check_command(cmd)
        if n < 1 or devices_per_process < 1:
            raise ValueError(f"resilax launch: -n and --devices-per-process must be >= 1, got {n} and "
                             f"{devices_per_process}")
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"resilax launch: --spares must be an integer >= 0 (0: no warm spares), got {spares!r}")
        if heartbeat_timeout_s <= heartbeat_s:
            raise ValueError(f"resilax launch: --heartbeat-timeout ({heartbeat_timeout_s} s) must exceed the heartbeat "
                             f"interval --heartbeat ({heartbeat_s} s)")
        self.cmd = list(cmd)
        self.n = n
        self.k = devices_per_process
        self.run_dir = pathlib.Path(run_dir).absolute()
        self.max_restarts = max_restarts
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.factor = step_deadline_factor
        self.min_deadline = min_step_deadline_s
        self.collective_timeout_s = collective_timeout_s or max(1, int(min_step_deadline_s * 0.5))
        self.startup_timeout_s = startup_timeout_s
        # The coordination service's own liveness check must not fire while survivors of a
        # death still need it: a survivor's broken collective ends after the collective
        # timeout, and only then does it detach to re-form. When the service declared the dead
        # task gone first, a survivor's detach (ShutdownTask) failed and JAX aborted the process
        # (a soak run: service timeout 10 s == collective timeout 10 s). The supervisor finds
        # deaths itself (heartbeat files), so the service's timeout only has to be long.
        need = int(self.collective_timeout_s + self.min_deadline + 10)
        self.jax_heartbeat_timeout_s = max(int(jax_heartbeat_timeout_s or 0), need)
        self.grace_s = grace_s
        self.host_store_every = host_store_every
        self.store_root: pathlib.Path | None = None
        self._hb_ram: pathlib.Path | None = None  # D/heartbeats' directory in RAM (`_heartbeats_in_ram`)
        self.store_step: int | None = None
        self.generation = -1
        self.workers: list[WorkerProcess] = []
        self.history: list[dict] = []
        self._term: int | None = None
        self._dead_process: int | None = None
        self._service = None
        self.in_place = bool(in_place)
        self.min_in_place = max(1, -(-n // 2)) if min_in_place is None else int(min_in_place)
        if self.in_place and not host_store_every:
            raise ValueError("resilax launch: --in-place needs the host state store (--host-store-every >= 1): the "
                             "survivors restore the step they agree on from it")
        if self.min_in_place < 1:
            raise ValueError(f"resilax launch: --min-in-place must be >= 1, got {min_in_place}")
        if shrink not in SHRINK_MODES:
            raise ValueError(f"resilax launch: --shrink must be one of {SHRINK_MODES}, got {shrink!r}")
        self.shrink = shrink
        if standby and in_place:
            raise ValueError("resilax launch: --standby readies a whole new generation (path B); with --in-place the "
                             "survivors re-form instead: use --spares for the dead places")
        self.standby_on = bool(standby)
        processes.make_run_dir(self.run_dir)  # (options checked: a usage error leaves nothing behind)
        self._standby = None  # the standby generation (`tools/standby.py`), or None
        self._standby_count = 0
        self._standby_backoff = (0.0, 0)  # (not before, failures in a row)
        self.slots = list(range(n))  # the job's process index of each process id of this generation
        self.epoch = 0  # in-place shrinks within this generation
        # generations started after a failure since the job last got further than before (a
        # job re-formed or grown back is not one): a crash loop ends, a long job with
        # occasional failures does not
        self._restarts = 0
        self._best_step = -1  # the newest step any worker had completed at the last failure
        self._reform_now: str | None = None  # why the job re-forms now (`_shrink_in_place`)
        self.departed: list[WorkerProcess] = []  # workers of this generation that died while the others went on
        self.num_spares = spares
        self.pool = SparePool(self.run_dir, spares, popen_fn=self._popen, heartbeat_s=heartbeat_s,
                              heartbeat_timeout_s=heartbeat_timeout_s, startup_timeout_s=startup_timeout_s)
        self.spares = self.pool.spares  # (the same list: the pool changes it in place)
        self._t_gen = time.time()

    # ------------------------------------------------------------------ files
    def _write_processes(self, status: str):
        write_json(self.run_dir / PROCESSES_JSON, {
            "generation": self.generation, "supervisor": os.getpid(),
            "workers": {str(w.process_id): w.proc.pid for w in self.workers if w.proc.poll() is None},
            "status": status, "coordinator": self.workers[0].env.coordinator if self.workers else None,
            "epoch": self.epoch,
            "slots": {str(w.process_id): w.slot for w in self.workers},
            "spares": self.pool.pids(),
            "standby": self._standby.pids() if self._standby is not None else {},
        })

    # ------------------------------------------------------------------ one generation
    def _start_generation(self, carry: list | None = None, slots: list | None = None):
        """Starts the next generation: a new service, and for each of the job's process
        indices in ``slots`` (default: all ``-n``; fewer when survivors re-form without
        replacements for every dead one) a carried-over worker that re-forms in its own
        process (``carry``: the live workers of the generation that re-formed), else a ready
        warm spare, else a new process. Process ids are numbered 0.. in slot order."""
        from resilax._src.runtime import jaxdist

        self.generation += 1
        g = self.generation
        self.slots = list(range(self.n)) if slots is None else sorted(slots)
        m = len(self.slots)
        if self._take_standby(carry, m):
            return
        port = reserve_port()  # held until the service listens there (`ports`)
        self._service = jaxdist.start_service(port, m, heartbeat_timeout_s=self.jax_heartbeat_timeout_s)
        (self.run_dir / HEARTBEATS).mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.workers, self.departed, self.epoch = [], [], 0
        (self.run_dir / membership.MEMBERSHIP_JSON).unlink(missing_ok=True)
        ready = self._ready_spares()
        carried = {w.slot: w for w in carry or ()}
        smaller = m < self.n
        for i, slot in enumerate(self.slots):
            env = self._env(g, i, port, self.slots)
            prefix, log = f"[g{g} p{i}] ", self.run_dir / "logs" / f"g{g}.p{i}.log"
            if slot in carried:  # a live worker of the generation that re-formed: it re-attaches without restarting
                w = carried[slot]  # (its assignment is named by its process id in that generation)
                self.workers.append(processes.hand_place(w.proc, w.out, env, prefix, log,
                                                         membership.reform_assignment(self.run_dir, g, w.process_id)))
                continue
            if ready:  # a warm spare: tell it its place (it then joins like a fresh worker)
                self.workers.append(self.pool.assign(ready.pop(0), env, prefix, log))
                continue
            proc = self._popen({**env.to_env(), "PYTHONUNBUFFERED": "1"})
            self.workers.append(WorkerProcess(i, env, proc, Output(proc, prefix, log)))
        self._t_gen = time.time()
        self._write_processes("running")
        from_spares = [w.process_id for w in self.workers if w.spare is not None]
        say(f"generation {g}: {m} workers x {self.k} devices"
             + (f" (processes {self.slots} of the job's {self.n}: no replacement for the others yet)" if smaller else "")
             + f", coordinator 127.0.0.1:{port}, pids "
             f"{[w.proc.pid for w in self.workers]}"
             + (f"; processes {from_spares} from warm spares "
                f"{[w.spare for w in self.workers if w.spare is not None]}" if from_spares else "")
             + (f"; processes {sorted(carried)} re-attached without restarting" if carried else ""))

    def _env(self, g: int, i: int, port: int, slots: list, heartbeat: str | None = None) -> LaunchEnv:
        """Process ``i``'s place in generation ``g`` (service on ``port``; ``slots``: the job's
        process index of each process id)."""
        smaller = len(slots) < self.n
        return LaunchEnv(
            coordinator=f"127.0.0.1:{port}", process_id=i, num_processes=len(slots), generation=g,
            devices_per_process=self.k, run_dir=str(self.run_dir),
            heartbeat_file=heartbeat or str(heartbeat_file(self.run_dir, g, i)), heartbeat_s=self.heartbeat_s,
            jax_heartbeat_timeout_s=self.jax_heartbeat_timeout_s, collective_timeout_s=self.collective_timeout_s,
            init_timeout_s=int(min(self.startup_timeout_s, 600)),
            host_store=str(self.store_root or ""), host_store_every=self.host_store_every,
            host_store_step=-1 if self.store_step is None else self.store_step,
            in_place_wait_s=(self.min_deadline + self.heartbeat_timeout_s + 10.0) if self.in_place else 0.0,
            step_deadline_factor=self.factor,
            slots=",".join(map(str, slots)) if smaller else "", num_slots=self.n if smaller else 0)

    # ------------------------------------------------------------------ the standby generation
    # ------------------------------------------------------------------ a standby generation (`standby`)
    def _tend_standby(self, now: float):
        standby.tend(self, now)

    def _drop_standby(self, why: str, failed: bool = False):
        standby.drop(self, why, failed)

    def _take_standby(self, carry, m: int) -> bool:
        return standby.take(self, carry, m)

    def _popen(self, env: dict):
        return popen(self.cmd, env)  # (`processes.popen`: from the main thread only)

    # ------------------------------------------------------------------ warm spares
    def _tend_spares(self, now: float):
        if self.pool.tend(now, lambda: self._term is None and processes.generation_settled(
                self.workers, self.generation == 0, self._t_gen, self.startup_timeout_s, now)):
            self._write_processes("running")

    def _ready_spares(self) -> list:
        return self.pool.ready()

    def _kill_spares(self):
        self.pool.kill_all()

    def _join_departed(self):
        """Lets the output threads of the workers that died in this generation finish."""
        for w in self.departed:
            w.out.join(timeout=2)

    def _stop_generation(self, why: str):
        self._join_departed()
        stop_all(self.workers, why)
        if self._service is not None:
            self._service.shutdown()
            self._service = None

    def _check(self, w: WorkerProcess, now: float) -> str | None:
        """Why ``w`` counts as dead now, or None."""
        rc = w.proc.poll()
        if rc is not None:
            w.rc = rc
            if rc == 0:
                return None
            return exit_reason(rc)
        hb = w.heartbeat()
        if hb is None:
            if now - w.started > self.startup_timeout_s:
                return f"wrote no heartbeat within --startup-timeout {self.startup_timeout_s:g} s"
            return None
        hung = processes.heartbeat_hung(hb, now, self.heartbeat_timeout_s, self.grace_s)
        if hung is not None:
            return hung
        if hb.get("phase") == "step" and hb.get("step_t") and hb.get("step_s"):
            deadline = max(self.min_deadline, self.factor * hb["step_s"])
            late = now - hb["step_t"]
            if late > deadline:
                return (f"hung: no step completed for {late:.1f} s after step {hb['step']} (step deadline "
                        f"{deadline:.1f} s: max(--min-step-deadline, {self.factor:g} x {hb['step_s'] * 1e3:.1f} ms))")
        return None

    def _blame(self, w: "WorkerProcess", why: str) -> tuple["WorkerProcess", str]:
        """The worker to act on when ``w`` looks dead for ``why``: past the step deadline the
        workers waiting in a collective look hung too, and with the collective timeout below
        the deadline they fail first (exit 1), so the one the others wait for is the cause
        (`_culprit`). Likewise for a stale heartbeat from a process that is not stopped (a
        suite run under load: the worker waiting for a hung one had a heartbeat 2 s old and
        was named instead of it). A stopped process (SIGSTOP) is itself the cause."""
        if (why.startswith("hung: no step") or (w.rc or 0) > 0
                or (why.startswith("hung: heartbeat") and processes.stopped(w.proc.pid) is False)):
            return self._culprit(w, why)
        return w, why

    def _culprit(self, w: "WorkerProcess", why: str) -> tuple["WorkerProcess", str]:
        """Past the step deadline every worker waiting in a collective looks hung; the one
        that never started the step the others are in is the cause (ties: ``w``)."""
        started = {x.process_id: (x.heartbeat() or {}).get("started") for x in self.workers}
        known = [s for s in started.values() if s is not None]
        if len(known) == len(self.workers) and min(known) < max(known):
            lag = min(self.workers, key=lambda x: started[x.process_id])
            if lag.proc.poll() is None:
                # (the others' hosts may have dispatched more than one step ahead, as plain jit's do)
                at = started[lag.process_id]
                return lag, (f"hung: never started step {at + 1} (it is at step {at}; the other workers have "
                             f"started up to step {max(known)} and wait for it; process {w.process_id} {why})")
        return w, why

    def _watch(self) -> tuple[str, int, str]:
        """Polls the generation until it ends: ("done", 0, ""), ("failed", rc, why) or ("term", rc, "")."""
        forwarded = None
        self._dead_process = None
        while True:
            now = time.time()
            if self._reform_now is not None:  # a death with warm spares for every dead place
                why, self._reform_now = self._reform_now, None
                return "reform", 0, why
            if self._term is not None and forwarded is None:
                forwarded = now
                say(f"{signal.Signals(self._term).name}: forwarding SIGTERM to the workers (they save at the next "
                     f"preemption sync point and exit)")
                processes.signal_running(self.workers, signal.SIGTERM)
                if self.spares:
                    self._kill_spares()  # nothing to save; none are started from now on
                    self._write_processes("running")
                self._drop_standby("SIGTERM")
            if self.num_spares:
                self._tend_spares(now)
            if self.standby_on:
                self._tend_standby(now)
            for w in self.workers:
                why = self._check(w, now)
                if why is not None:
                    w, why = self._blame(w, why)
                if why is not None and self._shrink_in_place(w, why, now):
                    break  # the survivors go on: watch them
                if why is not None:
                    why = w.reap(why)
                    self._dead_process = w.slot
                    return "failed", (w.rc if w.rc and w.rc > 0 else 1), f"process {w.process_id} (pid {w.proc.pid}) {why}"
            if all(w.proc.poll() == 0 for w in self.workers):
                return ("term" if forwarded else "done"), 0, ""
            grow = self._grow_ready()
            if grow is not None:
                return "regrow", 0, grow
            if forwarded is not None and now - forwarded > self.grace_s:
                return "failed", 128 + signal.SIGTERM, f"workers did not exit within {self.grace_s:g} s of SIGTERM"
            time.sleep(0.05)

    def _in_place_refused(self, w: WorkerProcess) -> str | None:
        """Why the workers other than ``w`` cannot go on in place (None: they can)."""
        if not self.in_place:
            return "--in-place is off"
        if self._term is not None:
            return "the job is being stopped"
        hb = w.heartbeat() or {}
        if (w.rc or 0) > 0 and (hb.get("phase") == "recover" or (hb.get("epoch") or 0) != self.epoch):
            # an error (not a death) while going on in place, or before a step under the new
            # membership: going on without it again could repeat it; a new generation starts clean
            return f"process {w.process_id} failed (exit code {w.rc}) while or right after going on in place"
        others = [x for x in self.workers if x is not w]
        if any(x.proc.poll() is not None for x in others):
            return "another worker has exited too"
        if len(others) < self.min_in_place:
            return f"{len(others)} worker(s) would be left (--min-in-place {self.min_in_place})"
        return next((why for x in others if (why := processes.not_ready_in_place(x)) is not None), None)

    def _shrink_in_place(self, w: WorkerProcess, why: str, now: float) -> bool:
        """Path A: ``w`` is dead (or killed here as hung); the others go on in place when they
        can, or re-form at once when warm spares are ready for every dead place (`_watch`
        then returns "reform"). Returns False when they cannot (the caller starts a new
        generation)."""
        refused = self._in_place_refused(w)
        if refused is not None:
            if self.in_place:
                say(f"process {w.process_id} {why}; not going on in place: {refused}")
            return False
        why = w.reap(why)
        self._lose_host_store(w.slot)
        self.workers = [x for x in self.workers if x is not w]
        self.departed.append(w)
        self.epoch += 1
        alive = [x.process_id for x in self.workers]
        ready = self._ready_spares()
        missing = self.n - len(alive)
        # warm spares for every dead place, or --shrink reform: re-form at once
        reform = self.shrink == "reform" or len(ready) >= missing
        write_json(self.run_dir / membership.MEMBERSHIP_JSON, {
            "generation": self.generation, "epoch": self.epoch, "alive": alive,
            "dead": sorted(x.process_id for x in self.departed), **({"reform": self.generation + 1} if reform else {})})
        died = f"process {w.process_id} (pid {w.proc.pid}) {why}"
        self._write_processes("running")
        if reform:  # the survivors leave their broken step, detach and rejoin (`_watch` returns)
            how = ("with warm spare(s) for every dead place" if len(ready) >= missing else
                   f"as {len(alive) + len(ready)} of the job's {self.n} processes ({len(ready)} warm spare(s) ready; "
                   f"it grows back when more are)")
            self._reform_now = f"{died}; re-forming {how}"
            say(f"generation {self.generation}: {died}; processes {alive} re-form {how} as generation "
                 f"{self.generation + 1} without restarting")
            return True
        self.history.append({"generation": self.generation, "outcome": "shrunk", "epoch": self.epoch,
                             "why": died, "alive": alive, "started": self._t_gen, "ended": now})
        say(f"generation {self.generation}: {died}; processes {alive} go on in place (epoch {self.epoch})")
        return True

    def _grow_ready(self) -> str | None:
        """Why the job, smaller than ``-n`` (re-formed without replacements for every dead
        process, or shrunk on its backend), grows back to ``-n`` now (None: not now): enough
        warm spares are ready for the missing places and every live worker has completed a
        step of this generation since its newest shrink (none is recovering)."""
        if not self.in_place or self._term is not None or len(self.workers) >= self.n:
            return None  # (fewer than -n: shrunk in place, or a generation re-formed without replacements)
        missing = self.n - len(self.workers)
        ready = self._ready_spares()
        if len(ready) < missing:
            return None
        for w in self.workers:
            hb = w.heartbeat() or {}
            if w.proc.poll() is not None or hb.get("phase") != "step" or hb.get("epoch") != self.epoch:
                return None
        gone = sorted(set(range(self.n)) - {w.slot for w in self.workers})
        return (f"{len(ready)} warm spare(s) ready for the {missing} place(s) of the job's process(es) {gone}: "
                f"growing back to {self.n}")

    def _detach_live_workers(self) -> list | None:
        """The job re-forms: ``"reform"`` in the membership file tells the live workers to
        leave (after a death, from their failed step; to grow back, at a step boundary they
        agree on, `membership.reform_due`). Waits until each has detached from the service;
        returns them, or None if one exited, was stopped (SIGSTOP) or did not detach in time.
        A stale heartbeat of a worker that runs (not stopped) is waited for up to that time:
        under load, a worker leaving a broken step went 2 s without a beat (cause not found;
        a probe of JAX's teardown held the GIL for at most 66 ms), and one hung for good is
        caught by the time limit. The longest silence is reported."""
        current = read_json(self.run_dir / membership.MEMBERSHIP_JSON) or {}
        write_json(self.run_dir / membership.MEMBERSHIP_JSON, {
            "generation": self.generation, "epoch": self.epoch, **current, "reform": self.generation + 1})
        limit = time.time() + self.collective_timeout_s + self.min_deadline
        stale: dict[int, float] = {}  # process id -> the oldest heartbeat age seen while it ran
        while True:
            now = time.time()
            states = []
            for w in self.workers:
                hb = w.heartbeat() or {}
                age = now - hb.get("t", 0)
                if w.proc.poll() is not None or processes.stale_and_stopped(w.proc.pid, age, self.heartbeat_timeout_s):
                    how = (exit_reason(w.proc.returncode) if w.proc.poll() is not None
                           else f"stopped (SIGSTOP?) or unknown, heartbeat {age:.1f} s old in phase {hb.get('phase')}")
                    say(f"process {w.process_id} did not re-form ({how})")
                    return None
                if age > self.heartbeat_timeout_s:
                    stale[w.process_id] = max(age, stale.get(w.process_id, 0.0))
                states.append(hb.get("phase"))
            if all(p == "detached" for p in states):
                if stale:
                    say("re-forming: heartbeats went stale while the workers detached (not stopped: waited); "
                         + ", ".join(f"process {i} up to {a:.1f} s" for i, a in sorted(stale.items())))
                return list(self.workers)
            if now > limit:
                say(f"the workers did not all detach within {self.collective_timeout_s + self.min_deadline:g} s "
                     f"(phases {states}" + (f"; heartbeats stale: {stale}" if stale else "") + ")")
                return None
            time.sleep(0.05)

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        """Runs the job to its end; its exit code (2: another job holds the run directory)."""
        return processes.run_locked(self.run_dir, self._run)

    def _run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._heartbeats_in_ram()
        if self.num_spares or self.in_place or self.standby_on:  # (re-forming workers and standbys read theirs there too)
            shutil.rmtree(self.run_dir / SPARES, ignore_errors=True)  # a former launch's assignments
            (self.run_dir / SPARES).mkdir(parents=True)
            (self.run_dir / HEARTBEATS).mkdir(parents=True, exist_ok=True)
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.host_store_every:
            self._make_store()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        rc = 1
        carry = slots = None
        try:
            while True:
                t_gen = time.time()
                self._start_generation(carry, slots)
                carry = slots = None
                outcome, rc, why = self._watch()
                t_end = time.time()
                self.history.append({"generation": self.generation, "outcome": outcome, "why": why,
                                     "processes": list(self.slots), "started": t_gen, "ended": t_end})
                if outcome in ("regrow", "reform"):
                    if outcome == "regrow":
                        say(f"generation {self.generation}: {why}; the live workers leave at the next step boundary")
                    carry = self._detach_live_workers()
                    if carry is not None:
                        self._join_departed()
                        self._service.shutdown()
                        self._service = None
                        # the dead places a warm spare can take now; the others wait for a grow-back
                        gone = sorted(set(range(self.n)) - {w.slot for w in carry})
                        slots = sorted({w.slot for w in carry} | set(gone[:len(self._ready_spares())]))
                        if self.store_root is not None:
                            self.store_step = hoststore_files.restorable_step(self.store_root, self.n, slots)
                        self.history[-1]["ended"] = time.time()
                        continue
                    outcome, rc, why = "failed", 1, f"{outcome} failed: {why}"
                    self.history[-1].update(outcome=outcome, why=why)
                if outcome == "done" and any((w.heartbeat() or {}).get("phase") == "preempted" for w in self.workers):
                    outcome = "term"  # SIGTERM reached a worker directly (not through this supervisor)
                    self.history[-1]["outcome"] = outcome
                if outcome in ("done", "term"):
                    self._kill_spares()
                    self._drop_standby("the job ended")
                    self._stop_generation("generation ended")
                    self._write_processes("done" if outcome == "done" else "preempted")
                    say(f"generation {self.generation}: all {len(self.workers)} workers exited 0"
                         + (" after SIGTERM (preempted; relaunch to resume)" if outcome == "term" else ""))
                    return 0
                say(f"generation {self.generation} failed: {why}; stopping the other workers")
                reached = max([(w.heartbeat() or {}).get("step") or -1 for w in self.workers + self.departed] + [-1])
                self._stop_generation(_STOPPED)
                # a worker killed by a signal it did not get from this supervisor (two killed
                # at once: both), or killed as hung, lost its host; one that exited with an
                # error (a collective timed out) or that this supervisor stopped did not
                for w in self.workers:
                    if w.slot == self._dead_process or ((w.proc.returncode or 0) < 0 and w.killed_for is None):
                        self._lose_host_store(w.slot)
                if self.store_root is not None:
                    self.store_step = hoststore_files.restorable_step(self.store_root, self.n)
                    say(f"host stores hold every process's shards up to step {self.store_step}"
                         if self.store_step is not None else "host stores hold no complete step")
                refused = processes.refused_config(self.workers)
                if self._term is not None or refused is not None:
                    self._kill_spares()
                    self._write_processes("failed")
                    if refused is not None:
                        say(f"giving up: {refused}")
                        return worker.EXIT_CONFIG
                    return rc
                if reached > self._best_step:  # the job got further than at the last failure: not a crash loop
                    self._restarts, self._best_step = 0, reached
                self._restarts += 1
                if self._restarts > self.max_restarts:
                    self._kill_spares()
                    self._write_processes("failed")
                    say(f"giving up: {self.max_restarts} restarts in a row without getting past step "
                         f"{self._best_step} (--max-restarts {self.max_restarts}); exit {rc}")
                    return rc
                self._write_processes("restarting")
        finally:
            for w in self.workers:
                w.kill()
            self._kill_spares()
            if self._standby is not None:
                self._standby.drop()
                self._standby = None
            if self._service is not None:
                self._service.shutdown()
                self._service = None
            for s, h in old.items():
                signal.signal(s, h)
            if self.store_root is not None:
                shutil.rmtree(self.store_root, ignore_errors=True)
            self._heartbeats_to_disk()
            write_json(self.run_dir / "launch_history.json", {"generations": self.history})

    # ------------------------------------------------------------------ heartbeats
    def _heartbeats_in_ram(self):
        """``D/heartbeats`` becomes a link to a directory in RAM (/dev/shm) where there is one,
        for this launch (a former launch's heartbeats are removed). A heartbeat is a small file
        written and renamed every ``--heartbeat`` s; on a disk busy with checkpoint writes a
        rename waits for the file system's journal (measured here: up to 0.5 s under two
        writers), and a stale heartbeat makes a healthy worker look hung. At the end the
        files are copied back into ``D/heartbeats`` (`_heartbeats_to_disk`)."""
        link = self.run_dir / HEARTBEATS
        self._hb_ram = None
        root = pathlib.Path("/dev/shm")
        if not root.is_dir():
            return  # (the heartbeats stay in the run directory)
        gone = hoststore_files.remove_orphans(root, ORPHAN_HEARTBEATS)
        if gone:
            say(f"removed the heartbeat directories of killed supervisor(s): {gone}")
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        ram = root / f"resilax-hb-{os.getpid()}-{time.time_ns()}"
        try:
            ram.mkdir()
            link.symlink_to(ram, target_is_directory=True)
        except OSError as e:  # /dev/shm not writable (or the run dir cannot hold a link): on disk
            say(f"heartbeats stay in {link} (could not keep them in RAM at {ram}: {e})")
            shutil.rmtree(ram, ignore_errors=True)
            return
        self._hb_ram = ram

    def _heartbeats_to_disk(self):
        """The last heartbeats, from RAM back into ``D/heartbeats`` (for reading after the job)."""
        ram, self._hb_ram = self._hb_ram, None
        if ram is None:
            return
        link = self.run_dir / HEARTBEATS
        tmp = self.run_dir / f".{HEARTBEATS}.{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(ram, tmp)
            if link.is_symlink():
                link.unlink()
            os.replace(tmp, link)
        except OSError as e:
            say(f"could not copy the heartbeats back into {link}: {e}")
        finally:
            shutil.rmtree(ram, ignore_errors=True)

    # ------------------------------------------------------------------ host state store
    def _make_store(self):
        """One directory per host, in RAM (/dev/shm) where there is one; the supervisor owns them."""
        root = hoststore_files.ram_root(self.run_dir)
        gone = hoststore_files.remove_orphans(root, ORPHAN_STORES)
        if gone:
            say(f"removed the host stores of killed supervisor(s): {gone}")
        self.store_root = root / f"resilax-store-{os.getpid()}-{time.time_ns()}"
        for i in range(self.n):
            (self.store_root / f"host{i}").mkdir(parents=True)

    def _lose_host_store(self, process_id):
        """Honest emulation: the host of a dead worker lost its memory, so its store is gone."""
        if self.store_root is None or process_id is None:
            return
        shutil.rmtree(self.store_root / f"host{process_id}", ignore_errors=True)
        (self.store_root / f"host{process_id}").mkdir(parents=True, exist_ok=True)
        say(f"host {process_id}'s state store deleted with its worker")

    def _on_signal(self, signum, frame):
        self._term = signum
