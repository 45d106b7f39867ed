"""The child processes of `resilax launch`'s supervisor: spawn, output, heartbeats, kill.

Starting them tied to its life, copying their output, reading their heartbeat files, and the
handles of its workers and warm spares.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

from resilax._src.io import write_json
from resilax._src.runtime import worker, xlaflags
from resilax._src.runtime.worker import LaunchEnv

HEARTBEATS = "heartbeats"  # D/heartbeats/g<generation>.p<process id>.json; spares: spare<k>.json
SPARES = "spares"  # D/spares/<tag>spare<k>.json: a warm spare's assignment (`SparePool`)


def die_with_parent():  # runs in the child between fork and exec
    """Linux: the worker gets SIGKILL when the supervisor dies (even by SIGKILL), so no
    worker outlives the process that owns its coordination service."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def check_command(cmd) -> None:
    """Raises ValueError unless ``cmd`` is a command to start: a worker command that is not
    there would fail every generation's start with a traceback."""
    if not cmd:
        raise ValueError("resilax launch: a worker command is required after --")
    if shutil.which(cmd[0]) is None:
        where = "is not an executable file" if os.sep in cmd[0] else "is not found on PATH"
        raise ValueError(f"resilax launch: the worker command {cmd[0]!r} {where}")


def make_run_dir(path) -> None:
    """Creates the job's run directory once its options are checked (every record of the job
    goes there); raises ValueError naming it when it cannot be made or written."""
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as e:
        raise ValueError(f"resilax launch: cannot use the run directory {str(path)!r}: {e.strerror or e}") from None


RUN_LOCK = "launch.lock"  # D/launch.lock: held (flock) by the job using D, released when its process ends


def lock_run_dir(path, shared: bool = False) -> int | None:
    """Takes the run directory's lock (`dirlock`, ``D/launch.lock``) for this process's life:
    exclusive for `resilax launch`'s supervisor, shared for the agents of a job across hosts
    (one per host, all in the same directory). Raises ValueError naming the directory (and
    the supervisor's pid, when one holds it) when another job is there: two jobs in one
    directory delete each other's checkpoints, host stores and assignments. Returns the
    lock's file descriptor (keep it open), or None where there is no lock (a file system
    without locks; an agent also goes on without one when the file cannot be opened)."""
    from resilax._src import dirlock

    try:
        return dirlock.acquire(pathlib.Path(path) / RUN_LOCK, shared=shared, what="resilax launch")
    except dirlock.DirectoryInUse as e:
        holder = (f"resilax launch, {e.holder}" if e.pid is not None else
                  "a resilax launch, or the agents of a job across hosts")
        raise ValueError(f"resilax launch: the run directory {str(path)!r} is in use by another job ({holder}); two "
                         f"jobs in one directory delete each other's checkpoints. Wait for it to end, stop it, or "
                         f"use another --run-dir") from None
    except OSError as e:
        if shared:
            return None
        raise ValueError(f"resilax launch: cannot use the run directory {str(path)!r}: {e.strerror or e}") from None


def run_locked(run_dir, run, shared: bool = False) -> int:
    """``run()``'s exit code, with the run directory's lock held (`lock_run_dir`); 2, with
    one line, when another job holds it."""
    try:
        fd = lock_run_dir(run_dir, shared)
    except ValueError as e:
        print(f"resilax: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        return run()
    finally:
        if fd is not None:
            os.close(fd)


def popen(cmd, env: dict) -> subprocess.Popen:
    """Starts ``cmd`` with ``env`` added, in a session of its own, its output piped, killed
    when the supervisor dies. From the main thread only: PR_SET_PDEATHSIG fires when the
    *thread* that forked the child exits, so a child started from a short-lived thread would
    die with it."""
    env = {**os.environ, **env}
    # bitwise on GPU needs deterministic XLA (runtime/xlaflags.py); the user's flags are kept
    env["XLA_FLAGS"] = xlaflags.with_deterministic(env.get("XLA_FLAGS"))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent if sys.platform == "linux" else None)


def read_json(path) -> dict | None:
    """A heartbeat or similar record, or None when it cannot be read or parsed right now
    (missing, or replaced while read)."""
    try:
        with open(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's session (it has its own: grain workers and the like go too)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stopped(pid: int) -> bool | None:
    """Whether process ``pid`` is stopped (SIGSTOP: state ``T`` in ``/proc/PID/stat``); None
    where that cannot be read (no ``/proc``, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] in "Tt"
    except (OSError, ValueError, IndexError):
        return None


def stale_and_stopped(pid: int, age_s: float, timeout_s: float) -> bool:
    """A heartbeat ``age_s`` old, past ``timeout_s``, from a process that is stopped (SIGSTOP)
    or whose state cannot be read: it is not coming back. A running process's stale heartbeat
    is not enough (re-forming waits for it: `launch.Supervisor._detach_live_workers`,
    `agent_reform.await_detached`)."""
    return age_s > timeout_s and stopped(pid) is not False


def heartbeat_hung(hb: dict, now: float, timeout_s: float, grace_s: float) -> str | None:
    """Why a running worker whose newest heartbeat is ``hb`` counts as hung now, or None. A
    worker that said it is exiting (`worker.exiting`: its work is done, the interpreter tears
    down and its heartbeat thread no longer runs) may be silent for ``grace_s``, not only
    ``timeout_s``: a teardown took over 3 s on a loaded host, and a job whose workers had all
    finished was restarted."""
    age = now - hb["t"]
    if hb.get("exiting"):
        return None if age <= grace_s else f"hung while exiting: heartbeat {age:.1f} s old (grace {grace_s:g} s)"
    if age > timeout_s:
        return f"hung: heartbeat {age:.1f} s old (--heartbeat-timeout {timeout_s:g} s; SIGSTOP?)"
    return None


def exit_reason(rc: int) -> str:
    return f"exited with {'signal ' + signal.Signals(-rc).name if rc < 0 else 'code ' + str(rc)}"


def heartbeat_file(run_dir, generation: int, process_id: int) -> pathlib.Path:
    """Where worker ``process_id`` of ``generation`` writes its heartbeat."""
    return pathlib.Path(run_dir) / HEARTBEATS / f"g{generation}.p{process_id}.json"


def heartbeats(run_dir, generation: int) -> dict[int, dict]:
    """``{process id: heartbeat record}`` of the workers of ``generation`` that wrote one (see
    `worker._Heartbeat`: pid, phase, step, step_t, step_s, joined_t, first_step_t,
    started). A file that cannot be read or parsed right now is left out."""
    out = {}
    for f in (pathlib.Path(run_dir) / HEARTBEATS).glob(f"g{int(generation)}.p*.json"):
        hb = read_json(f)
        if hb is None:
            continue
        out[hb["process_id"]] = hb
    return out


def spare_heartbeats(run_dir) -> dict[int, dict]:
    """``{spare index: heartbeat record}`` (pid, t, phase ``warming``/``spare``/``assigned``)
    of the spares that wrote one; unreadable files are left out."""
    out = {}
    for f in (pathlib.Path(run_dir) / HEARTBEATS).glob("spare*.json"):
        hb = read_json(f)
        if hb is not None:
            out[int(f.stem[len("spare"):])] = hb
    return out


def say(msg: str) -> None:
    print(f"[resilax launch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Output(threading.Thread):
    """Copies a child's output to its log file and, prefixed, to the supervisor's stdout. The
    prefix and the log change when a spare becomes a worker (or a worker re-attaches to a new
    generation): `relabel` names the new ones before the child is told its place, and the
    switch happens where the child wrote `worker.LOG_SWITCH` into its output, so that every
    line lands in the log of the process the child was when it wrote it (switching at
    `relabel` itself put a line written after the assignment into the spare's log when this
    thread lagged, and one written before into the worker's when the child lagged)."""

    def __init__(self, proc: subprocess.Popen, prefix: str, log_path: pathlib.Path):
        super().__init__(daemon=True)
        self.proc = proc
        self._lock = threading.Lock()
        self._label = (prefix, log_path)
        self._next: list[tuple[str, pathlib.Path]] = []  # labels named by relabel, not yet switched to
        self.start()

    def relabel(self, prefix: str, log_path: pathlib.Path):
        """Call before the child can read its new place (it then writes the switch marker)."""
        open(log_path, "ab").close()  # every worker has its log, output or not
        with self._lock:
            self._next.append((prefix, log_path))

    def run(self):
        from resilax._src.runtime.worker import LOG_SWITCH

        marker = LOG_SWITCH.encode()
        prefix, path = self._label
        log = self._open(path)
        try:
            for line in iter(self.proc.stdout.readline, b""):
                if line.endswith(marker):
                    line = line[:-len(marker)]  # the child's output before it, unterminated
                    self._write(log, prefix, line)
                    with self._lock:
                        if self._next:
                            self._label = self._next.pop(0)
                    prefix, new = self._label
                    if new != path:
                        self._close(log)
                        log, path = self._open(new), new
                    continue
                self._write(log, prefix, line)
        finally:
            self._close(log)

    _log_failed = False  # said once per forwarder that the log file cannot be written

    def _open(self, path):
        try:
            return open(path, "ab")
        except OSError as e:
            self._cannot_log(path, e)
            return None

    def _close(self, log):
        if log is not None:
            try:
                log.close()
            except OSError:  # (the unflushed tail was already reported by _write)
                pass

    def _cannot_log(self, path, e: OSError):
        # A full, read-only or cut-off run directory: the output still goes to this agent's
        # output, and the child's pipe is still drained (a forwarder that died of the error
        # left the child blocked writing to a full pipe).
        if not self._log_failed:
            self._log_failed = True
            try:
                sys.stdout.write(f"{self._label[0]}resilax launch: cannot write this process's log {path} ({e}); its "
                                 f"output goes on here only\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass

    def _write(self, log, prefix: str, line: bytes):
        if not line:
            return
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError as e:
                self._cannot_log(getattr(log, "name", "?"), e)
        text = line.decode(errors="replace")
        try:  # an unterminated line (a child killed mid-line) must not swallow the next one written here
            sys.stdout.write(prefix + text + ("" if text.endswith("\n") else "\n"))
            sys.stdout.flush()
        except (OSError, ValueError):
            pass


class SpareProcess:
    """A warm process of the worker command waiting for its assignment."""

    def __init__(self, index: int, proc: subprocess.Popen, out: Output, heartbeat_file: pathlib.Path,
                 assignment: pathlib.Path):
        self.index = index
        self.proc = proc
        self.out = out
        self.heartbeat_file = heartbeat_file
        self.assignment = assignment
        self.started = time.time()

    def heartbeat(self) -> dict | None:
        hb = read_json(self.heartbeat_file)
        return hb if hb is not None and hb.get("pid") == self.proc.pid else None

    def ready(self, max_age_s: float) -> bool:
        """Alive, imported and waiting, with a fresh heartbeat (a SIGSTOPped spare is not)."""
        hb = self.heartbeat() or {}
        return self.proc.poll() is None and hb.get("phase") == "spare" and time.time() - hb["t"] <= max_age_s

    def kill(self, why: str | None = None):
        kill_group(self.proc)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class SparePool:
    """Warm spares of a worker command (``--spares``): processes started ahead of need with
    ``RESILAX_SPARE`` (their assignment file, ``D/spares/<tag>spare<k>.json``) instead of a
    place in the job; each imports JAX and resilax without starting a backend, writes
    ``phase: spare`` to ``D/heartbeats/<tag>spare<k>.json`` and waits for an assignment
    (`runtime/worker.py`). Used by the single-host supervisor and by each agent of a job
    across hosts (``tag``: ``node<R>.``, so that the hosts' spares do not share names in the
    shared run directory)."""

    def __init__(self, run_dir, num: int, *, popen_fn, heartbeat_s: float, heartbeat_timeout_s: float,
                 startup_timeout_s: float, tag: str = "", who: str = ""):
        self.run_dir, self.num, self.tag, self.who = pathlib.Path(run_dir), num, tag, who  # who: its messages' prefix
        self.popen_fn, self.heartbeat_s = popen_fn, heartbeat_s
        self.heartbeat_timeout_s, self.startup_timeout_s = heartbeat_timeout_s, startup_timeout_s
        self.spares: list[SpareProcess] = []
        self._count = 0  # spare indices are never reused within a job
        self._backoff_until = 0.0
        self._failures = 0

    def start_one(self) -> int:
        k = self._count
        self._count += 1
        name = f"{self.tag}spare{k}"
        assignment = self.run_dir / SPARES / f"{name}.json"
        hb = self.run_dir / HEARTBEATS / f"{name}.json"
        for f in (assignment, hb):
            f.unlink(missing_ok=True)
        proc = self.popen_fn({worker.SPARE_ENV: str(assignment), worker.SPARE_HEARTBEAT_ENV: str(hb),
                              worker.SPARE_HEARTBEAT_S_ENV: str(self.heartbeat_s), "PYTHONUNBUFFERED": "1"})
        self.spares.append(SpareProcess(k, proc, Output(proc, f"[{name}] ", self.run_dir / "logs" / f"{name}.log"),
                                        hb, assignment))
        return proc.pid

    def tend(self, now: float, may_start) -> bool:
        """Replaces spares that died or hung; starts new ones up to ``num`` when ``may_start()``
        (the caller's generation has settled: new spares must not compete for CPU with a
        recovering one; asked only when one is missing). Never a job failure. Returns whether
        the set changed."""
        changed = False
        for s in list(self.spares):
            rc = s.proc.poll()
            hb = s.heartbeat()
            why = None
            phase = (hb or {}).get("phase")
            if rc is not None:
                why = exit_reason(rc)
            elif phase != "spare" and now - s.started > self.startup_timeout_s:  # importing may hold the GIL
                why = f"not ready within --startup-timeout {self.startup_timeout_s:g} s (phase {phase})"
            elif phase == "spare" and now - hb["t"] > self.heartbeat_timeout_s:
                why = f"hung: heartbeat {now - hb['t']:.1f} s old"
            if why is None:
                continue
            s.kill()
            s.out.join(timeout=2)
            self.spares.remove(s)
            changed = True
            if phase != "spare":  # never got ready: back off before the next one
                self._failures += 1
                self._backoff_until = now + min(60.0, 2.0 ** self._failures)
            say(f"{self.who}spare {s.index} (pid {s.proc.pid}) {why}; replacing it"
                + (f" in {self._backoff_until - now:.0f} s" if self._backoff_until > now else ""))
        if len(self.spares) < self.num and now >= self._backoff_until and may_start():
            pids = [self.start_one() for _ in range(self.num - len(self.spares))]
            say(f"{self.who}started {len(pids)} warm spare(s): pids {pids}")
            changed = True
        for s in self.spares:
            if self._failures and s.ready(self.heartbeat_timeout_s):
                self._failures = 0
        return changed

    def ready(self) -> list:
        """The spares that are warm and waiting now (a fresh heartbeat, phase ``spare``)."""
        return [s for s in self.spares if s.ready(self.heartbeat_timeout_s)]

    def assign(self, s: "SpareProcess", env: LaunchEnv, prefix: str, log) -> "WorkerProcess":
        """Gives ready spare ``s`` its place (it then joins like a fresh worker): its output
        goes on under the worker's prefix and log, its assignment is ``env`` (atomically)."""
        self.spares.remove(s)
        return hand_place(s.proc, s.out, env, prefix, log, s.assignment, spare=s.index)

    def pids(self) -> dict[str, int]:
        return {str(s.index): s.proc.pid for s in self.spares if s.proc.poll() is None}

    def kill_all(self) -> None:
        stop_all(self.spares)
        self.spares.clear()


def hand_place(proc, out: "Output", env: LaunchEnv, prefix: str, log, assignment, spare: int | None = None
               ) -> "WorkerProcess":
    """A running process (a warm spare, or a live worker re-forming in its own process) takes
    its place ``env`` in a generation: its output goes on under the worker's ``prefix`` and
    ``log`` first (before it can read its place: see `Output`), then ``env`` is written to
    ``assignment``, whole (the process waits for that file)."""
    out.relabel(prefix, log)
    write_json(assignment, env.to_dict())
    return WorkerProcess(env.process_id, env, proc, out, spare=spare)


def not_ready_in_place(w) -> str | None:
    """Why live worker ``w`` cannot go on in place now (None: it can): its heartbeat says it
    is not in the bit-exact mode with one failure domain per process and a host store (or it
    has not started), or it has not completed a step of this generation."""
    hb = w.heartbeat() or {}
    if not hb.get("in_place"):
        return (f"process {w.process_id} cannot go on in place (not the bit-exact mode with one failure domain "
                f"per process and a host store, or not started yet)")
    if not hb.get("first_step_t"):
        return f"process {w.process_id} has not completed a step of this generation"
    return None


def generation_settled(workers, first: bool, since: float, timeout_s: float, now: float) -> bool:
    """New warm spares may start (`SparePool.tend`): with the first generation (no lost
    progress to win back yet, and an early failure finds them ready), else once every live
    worker of the generation (started at ``since``) has completed a step, or ``timeout_s``
    has passed: they must not compete for CPU with a recovering generation."""
    if first or now - since > timeout_s:
        return True
    return all(w.proc.poll() is not None or (w.heartbeat() or {}).get("first_step_t") for w in workers)


class WorkerProcess:
    def __init__(self, pid_: int, env: LaunchEnv, proc: subprocess.Popen, out: Output, spare: int | None = None):
        self.process_id = pid_
        self.slot = env.slot  # the job's process index (== process_id unless the generation is smaller)
        self.env = env
        self.proc = proc
        self.out = out
        self.spare = spare  # the spare index it was, or None (started fresh)
        self.standby: int | None = None  # the standby generation it came from, or None
        self.started = time.time()
        self.rc: int | None = None
        self.killed_for: str | None = None

    def heartbeat(self) -> dict | None:
        hb = read_json(self.env.heartbeat_file)
        return hb if hb is not None and hb.get("pid") == self.proc.pid and hb.get("generation") == self.env.generation \
            else None

    def kill(self, why: str | None = None):
        if self.proc.poll() is None and why and self.killed_for is None:
            self.killed_for = why
        kill_group(self.proc)

    def reap(self, why: str) -> str:
        """Kills it if it still runs (hung), waits for it; returns why it counts as dead."""
        if self.proc.poll() is None:
            self.kill(why)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.rc = self.proc.returncode
        return self.killed_for or why


def refused_config(procs) -> str | None:
    """Why a generation that failed must not be restarted (None: it may be): one of its
    workers exited `worker.EXIT_CONFIG`, its command having refused its configuration before
    its first step, which every restart would repeat."""
    for w in procs:
        if w.proc.poll() == worker.EXIT_CONFIG and w.killed_for is None:
            return (f"process {w.process_id} refused its configuration before its first step (exit "
                    f"{worker.EXIT_CONFIG}: its error is above); a restart would fail the same way")
    return None


def signal_running(procs, sig) -> None:
    """Sends ``sig`` to every process of ``procs`` (each with a ``proc``) that still runs."""
    for w in procs:
        if w.proc.poll() is None:
            try:
                w.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def stop_all(procs, why: str | None = None) -> None:
    """Kills the workers or spares ``procs`` (``why``: what a worker is recorded as killed
    for), then waits for each (up to 10 s) and for its output to be copied."""
    for p in procs:
        p.kill(why)
    for p in procs:
        try:
            p.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        p.out.join(timeout=2)
