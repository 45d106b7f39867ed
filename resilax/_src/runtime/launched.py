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

Outside `resilax launch` every function here is a no-op (`env()` is None).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

ENV_PREFIX = "RESILAX_"


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

    def to_env(self) -> dict[str, str]:
        return {ENV_PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, environ=None) -> "LaunchEnv | None":
        environ = os.environ if environ is None else environ
        if ENV_PREFIX + "COORDINATOR" not in environ:
            return None
        kw = {}
        for f in dataclasses.fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key not in environ and f.default is not dataclasses.MISSING:
                kw[f.name] = f.default
                continue
            if key not in environ:
                from resilax._src.errors import ResilaxError

                raise ResilaxError(f"resilax launch worker: {key} is missing from the environment (RESILAX_COORDINATOR "
                                   f"is set, so this process was started by `resilax launch`, which sets every "
                                   f"RESILAX_* variable); got {sorted(k for k in environ if k.startswith(ENV_PREFIX))}")
            kw[f.name] = environ[key]
        return cls(coordinator=kw["coordinator"], process_id=int(kw["process_id"]),
                   num_processes=int(kw["num_processes"]), generation=int(kw["generation"]),
                   devices_per_process=int(kw["devices_per_process"]), run_dir=kw["run_dir"],
                   heartbeat_file=kw["heartbeat_file"], heartbeat_s=float(kw["heartbeat_s"]),
                   jax_heartbeat_timeout_s=int(kw["jax_heartbeat_timeout_s"]),
                   collective_timeout_s=int(kw["collective_timeout_s"]), init_timeout_s=int(kw["init_timeout_s"]),
                   host_store=str(kw["host_store"]), host_store_step=int(kw["host_store_step"]),
                   host_store_every=int(kw["host_store_every"]))


def env() -> LaunchEnv | None:
    """This worker's `LaunchEnv`, or None when not started by `resilax launch`."""
    return LaunchEnv.from_env()


class _Heartbeat:
    """Writes ``{"pid", "generation", "process_id", "t", "phase", "step", "step_t", "step_s"}``
    to the heartbeat file every ``heartbeat_s`` seconds (atomically: write, then rename)."""

    def __init__(self, e: LaunchEnv):
        self.env = e
        self.phase = "init"
        self.step = None
        self.step_t = None
        self.step_s = None
        self.joined_t = None  # wall clock: attached to the service
        self.first_step_t = None  # wall clock: first step of this process completed
        self.started = None  # the step being computed
        self._stop = threading.Event()
        os.makedirs(os.path.dirname(e.heartbeat_file), exist_ok=True)
        self.beat()
        self._thread = threading.Thread(target=self._run, name="resilax-heartbeat", daemon=True)
        self._thread.start()

    def beat(self):
        rec = {"pid": os.getpid(), "generation": self.env.generation, "process_id": self.env.process_id,
               "t": time.time(), "phase": self.phase, "step": self.step, "step_t": self.step_t, "step_s": self.step_s,
               "joined_t": self.joined_t, "first_step_t": self.first_step_t, "started": self.started}
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

    def stop(self):
        self._stop.set()


_state: dict = {}
_lock = threading.Lock()


def initialize() -> LaunchEnv | None:
    """Joins the job `resilax launch` set up (idempotent); None outside `resilax launch`.

    Raises:
      ResilaxError: JAX already started in this process, the service cannot be reached,
        or an assumption about JAX's internals broke (`jaxdist.JaxAssumptionError`).
    """
    e = env()
    if e is None:
        return None
    with _lock:
        if "env" in _state:
            return _state["env"]
        from resilax._src.runtime import jaxdist

        hb = _Heartbeat(e)  # before connecting: joining the service can take a while
        jaxdist.initialize_worker(coordinator=e.coordinator, process_id=e.process_id, num_processes=e.num_processes,
                                  local_devices=e.devices_per_process,
                                  heartbeat_timeout_s=e.jax_heartbeat_timeout_s, init_timeout_s=e.init_timeout_s,
                                  collective_timeout_s=e.collective_timeout_s)
        hb.joined_t = time.time()
        _state["env"], _state["hb"] = e, hb
        return e


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


def progress(step: int, step_s: float | None) -> None:
    """A step completed; ``step_s`` is the measured step time the deadline is derived from."""
    hb = _state.get("hb")
    if hb is not None:
        now = time.time()
        hb.step, hb.step_t, hb.step_s, hb.phase = int(step), now, step_s, "step"
        if hb.first_step_t is None:
            hb.first_step_t = now


def preemption_point(step: int) -> bool:
    """True on every worker at the same step once any of them got SIGTERM (JAX's preemption
    sync manager agrees on the step through the coordination service); call it after every
    step, with the same step numbers on all workers. Records the phase ``preempted`` for
    the supervisor when True. Always False outside `resilax launch`."""
    hb = _state.get("hb")
    if hb is None:
        return False
    from jax.experimental import multihost_utils

    if not multihost_utils.reached_preemption_sync_point(int(step)):
        return False
    hb.phase = "preempted"
    hb.beat()
    return True


def agree(ok: bool, what: str) -> bool:
    """True when every worker of this generation passed ``ok=True`` for ``what`` (through
    the coordination service's key-value store; waits up to the init timeout)."""
    e = _state.get("env")
    if e is None:
        return ok
    from resilax._src.runtime import jaxdist

    c = jaxdist.client()
    prefix = f"resilax/agree/g{e.generation}/{what}"
    c.key_value_set(f"{prefix}/{e.process_id}", "1" if ok else "0")
    votes = [c.blocking_key_value_get(f"{prefix}/{i}", e.init_timeout_s * 1000) for i in range(e.num_processes)]
    return all(v == "1" for v in votes)


def barrier(name: str) -> None:
    """Every worker of this generation waits here (a coordination-service barrier, not an XLA
    collective: its timeout is the init timeout, not the short collective timeout). Used
    before the first step: a worker still compiling must not make the others' first
    collective time out."""
    e = _state.get("env")
    if e is None:
        return
    from resilax._src.runtime import jaxdist

    jaxdist.client().wait_at_barrier(f"resilax/g{e.generation}/{name}", e.init_timeout_s * 1000)


def is_primary() -> bool:
    """True in the process that writes job-wide outputs (process 0), or outside a launch."""
    e = _state.get("env") or env()
    return e is None or e.process_id == 0
