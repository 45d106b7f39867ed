"""The worker side of `resilax launch`: join the job the supervisor set up, and report liveness.

The supervisor starts each worker with its place in the job in the environment
(``RESILAX_COORDINATOR``, ``RESILAX_PROCESS_ID``, ``RESILAX_NUM_PROCESSES``,
``RESILAX_GENERATION``, ``RESILAX_DEVICES_PER_PROCESS``, ``RESILAX_RUN_DIR``, ...).
`initialize` attaches the process to that generation's coordination service before JAX
starts (resilax calls it from `Topology.domains`, `wrap` and `resilax train`; calling it
first yourself is fine) and starts a heartbeat thread. The heartbeat file tells the
supervisor three things: the process runs (a SIGSTOPped or dead process stops writing it),
which phase it is in, and when the last step completed (a step that takes far longer than
the measured step time is a hang, and the supervisor kills the worker).

A *spare* (``resilax launch --spares S``) is a process of the same command started ahead of
need with ``RESILAX_SPARE`` (its assignment file) instead of a place in the job. `initialize`
in a spare imports JAX and resilax's heavy modules without starting a JAX backend, reports
the phase ``spare`` in its own heartbeat file, and waits for the supervisor to write its
assignment (the full `LaunchEnv`, as JSON); from then on it is a worker like any other
(`env()` and the ``RESILAX_*`` variables hold the assigned values).

Outside `resilax launch` every function here is a no-op (`env()` is None).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

from resilax._src.runtime import membership

ENV_PREFIX = "RESILAX_"
SPARE_ENV = "RESILAX_SPARE"  # a spare: the path of the assignment file the supervisor writes
SPARE_HEARTBEAT_ENV = "RESILAX_SPARE_HEARTBEAT"  # where a spare writes its heartbeat
SPARE_HEARTBEAT_S_ENV = "RESILAX_SPARE_HEARTBEAT_S"
# a process of a standby generation (`resilax launch --standby`): the path of its "go" file,
# where the supervisor writes its place (the same process id in the same generation, with
# the step to restore) when the generation it stands by for has failed
STANDBY_ENV = "RESILAX_STANDBY"
# written into a launched worker's output where it takes a new place (a spare assigned, a
# worker re-attached to a new generation): the supervisor's copy of its output switches logs
# there (`tools.processes.Output`) and drops the marker
LOG_SWITCH = "\x1eresilax:log-switch\n"
# sysexits' EX_CONFIG: a worker's command refused its configuration (`resilax.tools.cli`);
# every restart would fail the same way, so the supervisor and the agents stop the job
EXIT_CONFIG = 78
_TYPES = {"str": str, "int": int, "float": float}


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the supervisor told this worker (all from the environment)."""

    coordinator: str
    process_id: int
    num_processes: int
    generation: int
    devices_per_process: int
    run_dir: str
    heartbeat_file: str
    heartbeat_s: float
    jax_heartbeat_timeout_s: int
    collective_timeout_s: int
    init_timeout_s: int
    host_store: str = ""  # the supervisor's host state store root ("": none)
    host_store_step: int = -1  # the newest step every process can restore from it (-1: none)
    host_store_every: int = 1
    host_store_mirror: int = 1  # 0: no mirror to the ring neighbour (across hosts: its memory is not reachable)
    # Across hosts (`resilax launch --nodes`): the steps this host's store can give back to
    # every one of its processes, comma separated ("none": no step); the workers take the
    # newest step in every host's list (a key-value vote) instead of ``host_store_step``.
    # "": one host (the supervisor picked ``host_store_step``).
    host_store_steps: str = ""
    # Across hosts: the store server of the next live host, which keeps this process's
    # mirror ("host:port"; "": none), and those of the other live hosts, comma separated
    # (a re-formed mesh reads the pieces it needs from them: `hoststore_net`).
    host_store_remote: str = ""
    host_store_peers: str = ""
    in_place_wait_s: float = 0.0  # in-place shrink: how long survivors wait for the supervisor's verdict (0: off)
    # the supervisor's --step-deadline-factor: its deadline grows with the measured step time
    # (a loaded host), so a survivor's wait grows with it (`in_place_wait`; 0: unknown)
    step_deadline_factor: float = 0.0
    # A generation smaller than the job (survivors re-formed without spares for the dead):
    # ``slots`` is the job's process (failure-domain) index of each process id, comma
    # separated, and ``num_slots`` the job's size; "" / 0: every process, in order.
    slots: str = ""
    num_slots: int = 0
    # Across hosts: the identity of this generation (its proposal's sha256 in the rendezvous):
    # checkpoints carry it, and a restore takes none of a generation the rendezvous does not
    # hold or that was fenced (`fence`); "": one host (no fencing)
    generation_id: str = ""

    def __post_init__(self):
        if not self.slots:
            return
        try:
            got = [int(s) for s in self.slots.split(",")]
        except ValueError:
            got = None
        if got is None or len(got) != self.num_processes or len(set(got)) != len(got) or \
                not all(0 <= s < self.num_slots for s in got):
            from resilax._src.errors import ResilaxError

            raise ResilaxError(f"resilax launch: slots {self.slots!r} must name {self.num_processes} distinct process "
                               f"indices of the job in [0, num_slots={self.num_slots}), comma separated")

    @property
    def slot_list(self) -> list[int]:
        """The job's process index (its failure domain, its host store) of each process id."""
        return [int(s) for s in self.slots.split(",")] if self.slots else list(range(self.num_processes))

    @property
    def slot(self) -> int:
        """This process's place in the job (== process_id unless the generation is smaller)."""
        return self.slot_list[self.process_id]

    @property
    def job_processes(self) -> int:
        """How many processes the whole job has (more than this generation's when it is smaller)."""
        return self.num_slots or self.num_processes

    def to_env(self) -> dict[str, str]:
        return {ENV_PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, environ=None) -> "LaunchEnv | None":
        environ = os.environ if environ is None else environ
        if ENV_PREFIX + "COORDINATOR" not in environ:
            return None
        missing = [ENV_PREFIX + f.name.upper() for f in dataclasses.fields(cls)
                   if ENV_PREFIX + f.name.upper() not in environ and f.default is dataclasses.MISSING]
        if missing:
            from resilax._src.errors import ResilaxError

            raise ResilaxError(f"resilax launch worker: {missing[0]} is missing from the environment "
                               f"(RESILAX_COORDINATOR is set, so this process was started by `resilax launch`, which "
                               f"sets every RESILAX_* variable); got "
                               f"{sorted(k for k in environ if k.startswith(ENV_PREFIX))}")
        return cls._typed({f.name: environ[ENV_PREFIX + f.name.upper()] for f in dataclasses.fields(cls)
                           if ENV_PREFIX + f.name.upper() in environ}, "the environment")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d, where: str = "a spare's assignment") -> "LaunchEnv":
        """The inverse of `to_dict` (a spare's assignment file); every field without a default is required."""
        from resilax._src.errors import ResilaxError

        if not isinstance(d, dict):
            raise ResilaxError(f"resilax launch: {where} must be a JSON object of LaunchEnv fields, got "
                               f"{type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING]
        unknown = sorted(set(d) - names)
        if missing or unknown:
            raise ResilaxError(f"resilax launch: {where} lacks the fields {missing} / has unknown fields {unknown}")
        return cls._typed(d, where)

    @classmethod
    def _typed(cls, raw: dict, where: str) -> "LaunchEnv":
        kw = {}
        for f in dataclasses.fields(cls):
            if f.name in raw:
                try:
                    kw[f.name] = _TYPES[f.type](raw[f.name])
                except (TypeError, ValueError) as e:
                    from resilax._src.errors import ResilaxError

                    raise ResilaxError(f"resilax launch: {where}: {f.name} = {raw[f.name]!r} is not a {f.type}") from e
        return cls(**kw)


# the worker API's names that live in `membership` (`resilax.launched`)
Reform = membership.Reform
reform_due = membership.reform_due


def env() -> LaunchEnv | None:
    """This worker's `LaunchEnv`, or None when not started by `resilax launch` (or a spare
    not assigned yet)."""
    return _state.get("assigned") or LaunchEnv.from_env()


def is_spare() -> bool:
    """True in a spare that has no assignment yet (`initialize` will wait for one)."""
    return SPARE_ENV in os.environ and "assigned" not in _state and ENV_PREFIX + "COORDINATOR" not in os.environ


class _Heartbeat:
    """Writes ``{"pid", "generation", "process_id", "t", "phase", "step", "step_t", "step_s"}``
    to the heartbeat file every ``heartbeat_s`` seconds (atomically: write, then rename)."""

    def __init__(self, e: LaunchEnv):
        self.env = e
        self.phase = "init"
        self.step = None
        self.step_t = None
        self.step_s = None
        self.joined_t = None  # wall clock: attached to the service (a standby: told to go)
        self.marks: dict = {}  # wall clock of the set-up's phases (`mark`): where a new generation's seconds go
        self.first_step_t = None  # wall clock: first step of this process completed
        self.started = None  # the step being computed
        self.in_place = False  # this worker can go on in place when another dies (`offer_in_place`)
        self.epoch = 0  # the membership (`shrunk`) its newest completed step ran under
        self.exiting = False  # the process is ending (`exiting`): no more beats
        self.links_cut = 0  # the newest verdict's epoch `cut_links` cut the connections for
        self._links_lock = threading.Lock()
        self._stop = threading.Event()
        os.makedirs(os.path.dirname(e.heartbeat_file), exist_ok=True)
        self.beat()
        self._thread = threading.Thread(target=self._run, name="resilax-heartbeat", daemon=True)
        self._thread.start()
        _at_exit()

    def beat(self):
        rec = {"pid": os.getpid(), "generation": self.env.generation, "process_id": self.env.process_id,
               "t": time.time(), "phase": self.phase, "step": self.step, "step_t": self.step_t, "step_s": self.step_s,
               "joined_t": self.joined_t, "first_step_t": self.first_step_t, "started": self.started,
               "in_place": self.in_place, "epoch": self.epoch, "exiting": self.exiting, "marks": dict(self.marks)}
        tmp = f"{self.env.heartbeat_file}.{threading.get_ident()}.tmp"  # the main thread beats too
        with open(tmp, "w") as f:
            f.write(json.dumps(rec))
        os.replace(tmp, self.env.heartbeat_file)

    def _run(self):
        while not self._stop.wait(self.env.heartbeat_s):
            try:
                self.beat()
            except OSError:
                pass  # a full or vanished run dir: the supervisor sees a stale heartbeat and acts
            self.cut_links()

    def cut_links(self, m: dict | None = None):
        """Once the supervisor's verdict ``m`` (default: read it) names a dead process (under
        ``--in-place``: the others re-form, or go on on their backend), cuts this survivor's
        connections to the other workers (`peer_links`), so that a collective waiting on a
        survivor that already left it fails now instead of after the collective timeout.
        Once per verdict, by whichever comes first: the heartbeat thread (the main thread
        may be blocked in the collective) or the main thread on its way to the survivors'
        agreement (`in_place`), so that it never happens after the survivors' next
        collectives connected. Those run over other device lists (without the dead one's
        devices): new communicators, new connections; a re-form drops the backend anyway.
        One host only (across hosts the connections to the other hosts' store servers carry
        pieces the re-formed job reads)."""
        e = self.env
        if e.in_place_wait_s <= 0 or e.host_store_steps or e.host_store_remote or e.host_store_peers:
            return  # (not under `launch --in-place`, or across hosts: ``host_store_steps`` is set only there)
        with self._links_lock:
            m = m or membership.read_membership()
            if not (m and m.get("dead") and e.process_id in m.get("alive", ())
                    and m.get("epoch", 0) > self.links_cut):
                return
            from resilax._src.runtime import peer_links

            self.links_cut = m.get("epoch", 0)
            try:
                n = peer_links.cut(keep=[int(e.coordinator.rsplit(":", 1)[1])], within=bool(m.get("reform")))
            except OSError as err:
                say(f"processes {m['dead']} died; could not cut the connections to the other workers ({err}): "
                    f"a collective waiting on one ends at the collective timeout")
                return
        say(f"processes {m['dead']} died: cut {n} connection(s) to the other workers, so that no collective "
            f"waits for one that left it (--collective-timeout)")

    def stop(self):
        self._stop.set()


_state: dict = {}
_lock = threading.Lock()


def initialize() -> LaunchEnv | None:
    """Joins the job `resilax launch` set up (idempotent); None outside `resilax launch`. In a
    spare it first waits for the assignment (`spares.wait_for_assignment`).

    Raises:
      ResilaxError: JAX already started in this process, the service cannot be reached,
        or an assumption about JAX's internals broke (`jaxdist.JaxAssumptionError`).
    """
    with _lock:
        if "env" in _state:
            return _state["env"]
        from resilax._src.runtime import spares

        e = spares.wait_for_assignment()  # a spare waits here for its place in the job
        if e is None:
            return None
        from resilax._src.runtime import jaxdist

        hb = _Heartbeat(e)  # before connecting: joining the service can take a while
        if _state.get("reattached") and jaxdist.backends_initialized():
            from jax.extend.backend import clear_backends

            clear_backends()  # a thread of the old generation touched JAX after `reattach` dropped it
        jaxdist.initialize_worker(coordinator=e.coordinator, process_id=e.process_id, num_processes=e.num_processes,
                                  local_devices=e.devices_per_process,
                                  heartbeat_timeout_s=e.jax_heartbeat_timeout_s, init_timeout_s=e.init_timeout_s,
                                  collective_timeout_s=e.collective_timeout_s)
        hb.joined_t = time.time()
        hb.marks["attached"] = hb.joined_t
        _state["env"], _state["hb"] = e, hb
        if os.environ.get(STANDBY_ENV):
            _state["standby"] = os.environ[STANDBY_ENV]
        membership.joined(e)
        return e


def is_standby() -> bool:
    """True in a process of a standby generation that has not been told to go yet: it is
    attached to the next generation's service with its backend up, and must not touch the
    job's durable state (checkpoints, host stores, outputs) before `standby_wait` returns."""
    return "standby" in _state


def standby_wait() -> LaunchEnv | None:
    """In a process of a standby generation (`resilax launch --standby`): says ``standby`` in
    its heartbeat and blocks until the supervisor tells it to go, i.e. writes its place (the
    same coordinator, process id and generation it attached as, now with the heartbeat file
    of a worker and the host store's step to restore) to its go file; then that place is
    this worker's (`env()`, the ``RESILAX_*`` variables) and it goes on as a worker of the
    generation. Elsewhere returns None at once. `ResilientStep.init` calls it once the
    programs are built and before anything reads or writes the job's state.

    Raises:
      ResilaxError: the go file is not a LaunchEnv, or names another place than the one
        this process attached as (it cannot move to another service or process id).
    """
    path = _state.get("standby")
    if path is None:
        return None
    from resilax._src.errors import ResilaxError
    from resilax._src.runtime import spares

    hb, e = _state["hb"], _state["env"]
    hb.phase = "standby"
    hb.marks["parked"] = time.time()
    hb.beat()
    new = spares.await_assignment(path, "the standby generation's go", poll_s=0.01)
    same = ("coordinator", "process_id", "num_processes", "generation", "devices_per_process", "run_dir", "slots")
    moved = [f for f in same if getattr(new, f) != getattr(e, f)]
    if moved:
        raise ResilaxError(f"resilax launch --standby: the go file {path} moves this process to another place "
                           f"({', '.join(f'{f} {getattr(e, f)!r} -> {getattr(new, f)!r}' for f in moved)}); a standby "
                           f"process stays attached where it is")
    spares.switch_log()
    os.environ.update(new.to_env())
    os.environ.pop(STANDBY_ENV, None)
    with _lock:
        _state.pop("standby", None)
        _state["env"] = new
    membership.joined(new)
    hb.env = new  # from now on it beats into the worker's heartbeat file
    hb.joined_t = time.time()
    hb.marks["go"] = hb.joined_t
    hb.phase = "init"
    hb.beat()
    return new


def stepped() -> bool:
    """Whether this process completed a step under `resilax launch` (in any generation it ran)."""
    hb = _state.get("hb")
    return hb is not None and hb.first_step_t is not None


def mark(name: str) -> None:
    """Records the wall-clock time of set-up phase ``name`` in the heartbeat (``marks``):
    `resilax bench multiprocess` splits a new generation's way back by them."""
    hb = _state.get("hb")
    if hb is not None:
        hb.marks[name] = time.time()


_exit_hook = []  # (registered once per process: `_state` is cleared by `reattach`)


def _at_exit() -> None:
    """Says ``exiting`` once the interpreter starts to exit."""
    if not _exit_hook:
        import atexit

        atexit.register(exiting)
        _exit_hook.append(exiting)


def exiting() -> None:
    """This worker's work is done and the process is ending: says so in its heartbeat
    (``exiting: true``) and stops beating. The interpreter's teardown after it (the XLA
    backend, gloo, the coordination client; daemon threads, the heartbeat's among them, no
    longer run) took over 3 s on a loaded host, and the supervisor took the silent worker
    for a hung one and restarted a job whose workers had all finished (``resilax bench
    multiprocess``). The supervisor gives an exiting worker ``grace_s`` to end. Registered with ``atexit`` when
    the heartbeat starts (`initialize`); a command may call it earlier, once its outputs are
    written."""
    hb = _state.get("hb")
    if hb is None or hb.exiting:
        return
    hb.exiting = True
    hb.stop()
    try:
        hb.beat()
    except OSError:
        pass


def cut_links(m: dict) -> None:
    """Cuts this survivor's connections to the other workers for verdict ``m`` unless done
    (`_Heartbeat.cut_links`); outside `resilax launch --in-place` nothing."""
    hb = _state.get("hb")
    if hb is not None:
        hb.cut_links(m)


def set_phase(phase: str) -> None:
    """``init``, ``step``, ``save``, ``close``: the supervisor's step deadline applies in ``step`` only."""
    hb = _state.get("hb")
    if hb is not None and hb.phase != "preempted":  # the supervisor reads "preempted" after the exit
        hb.phase = phase


def step_started(step: int) -> None:
    """Step ``step`` (1-based: the step that will complete it) is being dispatched. When
    workers are stuck, the one that never started the step the others wait in is the hung one."""
    hb = _state.get("hb")
    if hb is not None:
        hb.started = int(step)


def in_place_wait(e: "LaunchEnv") -> float:
    """How long a survivor waits for the supervisor's verdict after a failed step: the fixed
    part the supervisor gave (``--min-step-deadline`` + heartbeat timeout + 10 s) plus what its
    step deadline (``factor x measured step time``) may exceed that minimum by, from this
    worker's own step time with half again for the slowest peer's (the steps are lock-step).
    A fixed wait gave up 0.5 s before the verdict when load made steps take 1 s (a 21 s
    deadline against an 18 s wait) and the run failed instead of going on."""
    hb = _state.get("hb")
    step_s = getattr(hb, "step_s", None) or 0.0
    return e.in_place_wait_s + 1.5 * e.step_deadline_factor * step_s


def progress(step: int, step_s: float | None) -> None:
    """A step completed; ``step_s`` is the measured step time the deadline is derived from."""
    hb = _state.get("hb")
    if hb is not None:
        now = time.time()
        hb.step, hb.step_t, hb.step_s, hb.phase = int(step), now, step_s, "step"
        hb.epoch = membership.epoch()  # the membership this step completed under
        if hb.first_step_t is None:
            hb.first_step_t = now


def resumed(step: int) -> None:
    """The job went on in place at ``step``: the step deadline counts from now (the
    recovery was no step), the phase is ``step`` again."""
    hb = _state.get("hb")
    if hb is not None:
        hb.step, hb.step_t, hb.phase = int(step), time.time(), "step"


def say(msg: str) -> None:
    """A line in this worker's log (stderr; the supervisor prefixes and forwards it)."""
    import sys

    t = time.time()
    print(f"resilax {time.strftime('%H:%M:%S', time.localtime(t))}.{int(t % 1 * 1000):03d}: {msg}", file=sys.stderr,
          flush=True)


def preemption_point(step: int) -> bool:
    """True on every worker at the same step once any of them got SIGTERM (JAX's preemption
    sync manager agrees on the step through the coordination service); call it after every
    step, with the same step numbers on all workers. Records the phase ``preempted`` for
    the supervisor when True. Always False outside `resilax launch`."""
    hb = _state.get("hb")
    if hb is None or membership.current() is not None:
        # after an in-place shrink JAX's preemption sync would wait for the dead process
        return False
    from jax.experimental import multihost_utils

    if not multihost_utils.reached_preemption_sync_point(int(step)):
        return False
    hb.phase = "preempted"
    hb.beat()
    return True


def offer_in_place(ok: bool) -> None:
    """Tells the supervisor whether this worker can go on in place when another dies (its
    heartbeat carries it); the supervisor shrinks in place only when every survivor can."""
    hb = _state.get("hb")
    e = _state.get("env")
    if hb is not None:
        hb.in_place = bool(ok) and e is not None and e.in_place_wait_s > 0


def reattach() -> LaunchEnv:
    """Leaves this generation and joins the next one in this process: detaches from the
    coordination service, then says ``detached`` in the heartbeat, drops JAX's backend (every array
    and executable of it is gone: the state is in the host store), waits for the
    supervisor's assignment and makes it this worker's place. The next `initialize` (the
    command's set-up, run again) attaches to the new service. Measured on jax 0.10.2:
    detaching takes milliseconds, also with a dead process still registered
    (benchmarks/results/mp_regrow_after_death.json).

    Raises:
      ResilaxError: no assignment within the init timeout, or a malformed one.
    """
    from jax.extend.backend import clear_backends

    from resilax._src.runtime import jaxdist

    e, hb = _state["env"], _state["hb"]
    # The heartbeat thread beats on until the wait below (it only writes a file): joining
    # Orbax's threads of a save the death broke took over 2 s in a soak run, and with the
    # beats stopped first the supervisor took the stale heartbeat for a dead worker (path
    # B). "detached" is said only once the service let this process go: the supervisor
    # shuts the old service down as soon as every worker says it.
    hb.phase = "detaching"
    hb.beat()
    jaxdist.shutdown()
    hb.phase = "detached"
    hb.beat()
    _join_orbax_threads(10.0)
    import gc

    gc.collect()  # what still holds the old backend's buffers, so that its memory can go
    clear_backends()
    gc.collect()
    _reset_orbax_process_state()
    hb.stop()
    # beating while it waits: the supervisor tells a waiting worker from a dead one
    from resilax._src.runtime import spares

    new = spares.await_assignment(membership.reform_assignment(e.run_dir, e.generation + 1, e.process_id),
                            f"the re-form assignment for generation {e.generation + 1}", poll_s=0.02,
                            timeout_s=e.init_timeout_s, beat=hb.beat)
    spares.switch_log()
    os.environ.update(new.to_env())
    with _lock:
        _state.clear()
        membership.reset()
        _state["assigned"] = new
        _state["reattached"] = True
    return new


def _join_orbax_threads(limit_s: float) -> None:
    """Waits (up to ``limit_s``) for Orbax's threads of the old generation to end. A save's
    commit thread waiting at a barrier of the old service fails once this process detached
    from it, and its error handling asks JAX for the process index: after `clear_backends`
    that would start a new, unattached backend (seen in a soak run: the re-attached process
    then refused to join, "JAX's backends already exist")."""
    deadline = time.time() + limit_s
    for t in threading.enumerate():
        target = getattr(t, "_target", None)
        mod = getattr(target, "__module__", None) or type(t).__module__
        if t is not threading.current_thread() and t.is_alive() and str(mod).startswith("orbax"):
            try:
                t.join(max(0.0, deadline - time.time()))
            except Exception:  # noqa: BLE001 (Orbax's finalize thread re-raises its failure on join: expected)
                pass


def _reset_orbax_process_state() -> None:
    """Makes this process's Orbax state that of a fresh process, as a spare joining the same
    generation has it. Orbax 0.12.8 keeps two things per process: the coordination client it
    first saw (``get_signaling_client``, an lru_cache: it would signal the old service) and a
    counter of operations (``OperationIdGenerator``) whose value names the key-value signals
    of each save, which every process must agree on (a survivor's count differs from a
    spare's: in a soak run process 0's final save then failed with FileExistsError on its
    temporary directory and its commit waited for good). The new service's key-value store
    is empty, so counting from 0 again collides with nothing.

    Raises:
      ResilaxError: Orbax is loaded but lacks one of these names (another version): this
        process cannot rejoin safely (the supervisor then restarts the job).
    """
    import itertools
    import sys

    from resilax._src.errors import ResilaxError

    if "orbax.checkpoint" not in sys.modules:
        return
    sc = sys.modules.get("orbax.checkpoint._src.futures.signaling_client")
    sync = sys.modules.get("orbax.checkpoint._src.futures.synchronization")
    gen = getattr(sync, "OperationIdGenerator", None)
    if not hasattr(getattr(sc, "get_signaling_client", None), "cache_clear") or \
            not hasattr(gen, "_operation_id_counter"):
        raise ResilaxError(
            "resilax: re-forming in this process needs Orbax's per-process state reset "
            "(orbax.checkpoint._src.futures.signaling_client.get_signaling_client.cache_clear and "
            "synchronization.OperationIdGenerator._operation_id_counter, as in orbax-checkpoint 0.12.8), and this "
            "Orbax lacks one; see resilax/_src/runtime/worker.py")
    sc.get_signaling_client.cache_clear()
    gen._operation_id_counter = itertools.count()
    gen._operation_id = next(gen._operation_id_counter)


def exit_if_shrunk(code: int) -> None:
    """Ends this process now (``os._exit``) if it ever went on in place after another died
    (also if the job re-formed since); else returns. Call it when the work is done and every
    output is written. At exit the interpreter joins every non-daemon thread, and Orbax's
    commit thread of a save in flight when the other process died (``async_save``, not a
    daemon) waits at a barrier the dead never reach: a worker that had gone on in place
    printed its last line and never exited (py-spy stacks; 2 of 15 soak runs of
    benchmarks/mp_in_place_soak.py before this, the job never ended). This skips the wait,
    and names any such thread left."""
    if not membership.went_on_in_place():
        return
    stuck = [t.name for t in threading.enumerate()
             if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if stuck:
        say(f"exiting without waiting for thread(s) {stuck}: they may wait on the dead process(es)")
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# what a collective's transport says when a peer process died, hung or is cut off (gloo on CPU,
# the coordination service, NCCL/gRPC): the worker's error is then a consequence, not the failure
_PEER_BROKE = ("gloo", "timed out waiting", "connection reset", "connection closed", "connection refused",
               "deadline_exceeded", "unavailable:", "heartbeat", "barrier", "nccl", "socket closed")


def collective_broke(e: BaseException) -> str | None:
    """Under `resilax launch`: ``"Type: message"`` of the `JaxRuntimeError` in ``e``'s chain
    that says a collective's transport broke (another process died, hung or is cut off: the
    supervisor names it and acts), else None (also outside a launch: any other error may be
    the user's to act on)."""
    if env() is None:
        return None
    import jax

    return _in_chain(e, lambda x: isinstance(x, jax.errors.JaxRuntimeError)
                     and any(w in str(x).lower() for w in _PEER_BROKE))


def _in_chain(e: BaseException, match) -> str | None:
    """``"Type: message"`` of the first exception in ``e``'s chain (causes, contexts) that
    ``match`` accepts, else None."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if match(x):
            return f"{type(x).__name__}: {x}"
        x = x.__cause__ or x.__context__
    return None


def storage_failed(e: BaseException) -> str | None:
    """Under a `resilax launch` of more than one process: the message of the `StorageError` in
    ``e``'s chain (a write under the run directory failed: full, read-only, an I/O error),
    else None. This worker then leaves its step while the others wait for it in their next
    collective, and the save in flight commits only once every process passed Orbax's
    barrier: it must not wait for that save (`ResilientStep.close` abandons it) nor for
    Orbax's commit thread at exit (`exit_after_broken_collective`). Waiting, a worker of a job
    whose run directory turned read-only hung in its close until its agent stopped it, its
    error never shown."""
    got = env()
    if got is None or got.num_processes < 2:
        return None
    from resilax._src.errors import StorageError

    return _in_chain(e, lambda x: isinstance(x, StorageError))


def exit_after_broken_collective(code: int) -> None:
    """Ends this worker now (``os._exit``) after its collective with another process broke
    and its outputs are written (`ResilientStep.close` ran): says ``exiting`` in the
    heartbeat first. A normal exit joins every non-daemon thread, and Orbax's commit thread of
    the checkpoint in flight (``async_save``) waits at a barrier that needs every process:
    across a partition it waited until the link came back (8 s and more after the collective
    had timed out, TCP's retransmission back-off included), and the interpreter's teardown
    then waited for the coordination client's shutdown against a service it could not reach
    (1-5 s). The supervisor acts once the worker exits, so both delayed detection."""
    stuck = [t.name for t in threading.enumerate()
             if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if stuck:
        say(f"exiting without waiting for thread(s) {stuck}: they wait on the other processes")
    exiting()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_primary() -> bool:
    """True in the process that writes job-wide outputs (the lowest live process id), or
    outside a launch."""
    e = _state.get("env") or env()
    return e is None or e.process_id == (membership.alive()[0] if "env" in _state else 0)
