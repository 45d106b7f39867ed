"""A standby generation (``resilax launch --standby``): the next generation, started ahead.

Without it a new generation (path B) starts N processes (or takes warm spares), and each
attaches to the new coordination service, starts its JAX backend, traces, lowers and loads
its programs before the first step: seconds of Python per process, most of a recovery on a
few shared cores. A standby generation does all of that while the current generation
trains: N processes of the worker command, attached to generation g+1's own service (on a
port of its own) as process ids 0..N-1, with their backends up and their programs built;
each stops in `ResilientStep.init` before it touches the job's checkpoints or host stores
(`worker.standby_wait`) and says ``standby`` in its heartbeat. When generation g fails,
the supervisor stops g as always and writes each standby process its place, the same
process id with the step to restore from the host stores (its "go" file); what is left is
the restore and the first step.

The standby generation is all or nothing: a process of it that exits, whose heartbeat goes
stale, or that is not parked within the startup timeout makes the supervisor drop the
whole standby generation (kill it, shut its service down) and start another later; a
failure that finds it not parked drops it too, and the new generation starts the usual
way (spares, fresh processes). It is started once every worker of the current generation
has completed a step (it must not take CPU from a recovering generation).
"""

from __future__ import annotations

import pathlib
import time

from resilax._src.runtime import membership, worker
from resilax._src.runtime.ports import reserve_port
from resilax._src.runtime.worker import LaunchEnv
from resilax.tools import processes
from resilax.tools.processes import HEARTBEATS, SPARES, Output, WorkerProcess, exit_reason, hand_place, read_json, say, \
    stop_all


class StandbyGeneration:
    """N processes attached to the service of generation ``generation`` (not started yet as
    the job's), waiting in `worker.standby_wait`.

    Args:
      index: this standby generation's number within the job (file names; never reused).
      generation: the generation it will become.
      service: its coordination service (owned: shut down by `drop`); ``port`` its port.
      envs: the `LaunchEnv` each process attaches with (heartbeat file: its standby one).
      popen_fn: starts one process with extra environment variables (the supervisor's).
      run_dir: where its heartbeats, go files and logs live.
    """

    def __init__(self, index: int, generation: int, service, port: int, envs: list[LaunchEnv], popen_fn, run_dir):
        self.index, self.generation, self.service, self.port = index, generation, service, port
        self.run_dir = pathlib.Path(run_dir)
        self.started = time.time()
        self.procs: list[tuple] = []  # (proc, out, env, go file)
        for e in envs:
            name = f"standby{index}.p{e.process_id}"
            go = self.run_dir / SPARES / f"{name}.json"
            go.unlink(missing_ok=True)
            pathlib.Path(e.heartbeat_file).unlink(missing_ok=True)
            proc = popen_fn({**e.to_env(), worker.STANDBY_ENV: str(go), "PYTHONUNBUFFERED": "1"})
            self.procs.append((proc, Output(proc, f"[{name}] ", self.run_dir / "logs" / f"{name}.log"), e, go))

    @staticmethod
    def heartbeat_file(run_dir, index: int, process_id: int) -> pathlib.Path:
        return pathlib.Path(run_dir) / HEARTBEATS / f"standby{index}.p{process_id}.json"

    def _heartbeat(self, proc, e) -> dict | None:
        hb = read_json(e.heartbeat_file)
        return hb if hb is not None and hb.get("pid") == proc.pid else None

    def pids(self) -> dict[str, int]:
        return {str(e.process_id): proc.pid for proc, _, e, _ in self.procs if proc.poll() is None}

    def ready(self, max_age_s: float) -> bool:
        """Every process alive, parked (``standby``) and beating."""
        now = time.time()
        for proc, _, e, _ in self.procs:
            hb = self._heartbeat(proc, e) or {}
            if proc.poll() is not None or hb.get("phase") != "standby" or now - hb["t"] > max_age_s:
                return False
        return True

    def broken(self, now: float, heartbeat_timeout_s: float, startup_timeout_s: float) -> str | None:
        """Why the standby generation cannot serve (None: it can, or may once set up)."""
        for proc, _, e, _ in self.procs:
            rc = proc.poll()
            if rc is not None:
                return f"process {e.process_id} (pid {proc.pid}) {exit_reason(rc)}"
            hb = self._heartbeat(proc, e)
            if hb is None or hb.get("phase") != "standby":
                if now - self.started > startup_timeout_s:
                    return (f"process {e.process_id} not parked within --startup-timeout {startup_timeout_s:g} s "
                            f"(phase {(hb or {}).get('phase')})")
            elif now - hb["t"] > heartbeat_timeout_s:
                return f"process {e.process_id} hung: heartbeat {now - hb['t']:.1f} s old"
        return None

    def take(self, envs: list[LaunchEnv], prefix, log) -> list[WorkerProcess]:
        """Tells every process to go as the worker of ``envs[i]`` (same coordinator, process id
        and generation it attached as); its output goes on under ``prefix(i)`` / ``log(i)``.
        The service is the generation's from now on (the caller owns it)."""
        out = []
        for (proc, o, e, go), new in zip(self.procs, envs):
            assert (new.process_id, new.coordinator, new.generation) == (e.process_id, e.coordinator, e.generation)
            w = hand_place(proc, o, new, prefix(new.process_id), log(new.process_id), go)
            w.standby = self.index
            out.append(w)
        self.procs, self.service = [], None
        return out

    def drop(self) -> None:
        """Kills every process and shuts the service down."""
        stop_all([_Proc(proc, o) for proc, o, _, _ in self.procs])
        self.procs = []
        if self.service is not None:
            self.service.shutdown()
            self.service = None


class _Proc:  # what `stop_all` needs of a process
    def __init__(self, proc, out: Output):
        self.proc, self.out = proc, out

    def kill(self, why=None):
        from resilax.tools.processes import kill_group

        kill_group(self.proc)


# ---------------------------------------------------------------- the supervisor's side (`launch.Supervisor`)
def tend(sup, now: float):
    """Drops a standby generation that cannot serve; starts one (generation g+1, all -n
    processes) with generation 0, and after a recovery once every worker of generation g
    has completed a step (it must not take CPU from a recovering generation), none is
    dead, and no SIGTERM is being handled."""
    from resilax._src.runtime import jaxdist

    sb = sup._standby
    if sb is not None:
        why = sb.broken(now, sup.heartbeat_timeout_s, sup.startup_timeout_s)
        if why is None and sb.generation == sup.generation + 1:
            return
        drop(sup, why or f"it was readied for generation {sb.generation}, the next is "
                                  f"{sup.generation + 1}", failed=why is not None)
        return
    not_before, _ = sup._standby_backoff
    if sup._term is not None or now < not_before or len(sup.workers) != sup.n or any(
            w.proc.poll() is not None for w in sup.workers) or not processes.generation_settled(
            sup.workers, sup.generation == 0, sup._t_gen, sup.startup_timeout_s, now):
        return  # (with generation 0 at once, as spares: no progress to win back yet)
    sup._standby_count += 1
    k, g = sup._standby_count, sup.generation + 1
    port = reserve_port()
    service = jaxdist.start_service(port, sup.n, heartbeat_timeout_s=sup.jax_heartbeat_timeout_s)
    envs = [sup._env(g, i, port, list(range(sup.n)),
                      heartbeat=str(StandbyGeneration.heartbeat_file(sup.run_dir, k, i))) for i in range(sup.n)]
    sup._standby = StandbyGeneration(k, g, service, port, envs, sup._popen, sup.run_dir)
    sup._write_processes("running")
    say(f"standby generation {k} for generation {g}: {sup.n} processes set up ahead on 127.0.0.1:{port}, pids "
        f"{[p.pid for p, *_ in sup._standby.procs]}")

def drop(sup, why: str, failed: bool = False):
    sb, sup._standby = sup._standby, None
    if sb is None:
        return
    sb.drop()
    if failed:  # back off: 2, 4, ... up to 60 s before the next one
        n = sup._standby_backoff[1] + 1
        sup._standby_backoff = (time.time() + min(60.0, 2.0 ** n), n)
    say(f"standby generation {sb.index} dropped: {why}")
    sup._write_processes("running")

def take(sup, carry, m: int) -> bool:
    """Makes the parked standby generation generation ``sup.generation`` (path B with all
    -n processes, and it is parked); else drops it (it would take CPU from the new
    generation's set-up). Returns whether it was taken."""
    sb = sup._standby
    if sb is None:
        return False
    if carry or m != sup.n or sb.generation != sup.generation or not sb.ready(sup.heartbeat_timeout_s):
        drop(sup, "not parked when generation " f"{sup.generation} was needed" if carry is None and
                           m == sup.n else f"generation {sup.generation} re-forms instead")
        return False
    g = sup.generation
    sup._standby, sup._service = None, sb.service
    sup._standby_backoff = (0.0, 0)
    sup.workers, sup.departed, sup.epoch = [], [], 0
    (sup.run_dir / membership.MEMBERSHIP_JSON).unlink(missing_ok=True)
    envs = [sup._env(g, i, sb.port, sup.slots) for i in range(m)]
    sup.workers = sb.take(envs, lambda i: f"[g{g} p{i}] ", lambda i: sup.run_dir / "logs" / f"g{g}.p{i}.log")
    sup._t_gen = time.time()
    sup._write_processes("running")
    say(f"generation {g}: {m} workers x {sup.k} devices, coordinator 127.0.0.1:{sb.port}, pids "
        f"{[w.proc.pid for w in sup.workers]}: standby generation {sb.index} (set up ahead) told to go"
        + (f" from host-store step {sup.store_step}" if sup.store_step is not None else ""))
    return True
