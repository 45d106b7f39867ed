"""Processes that wait for their place in a `resilax launch` job: a spare (started ahead,
imported ahead, given a place when a generation needs one: `wait_for_assignment`) and the
go of a standby generation's process (`worker.standby_wait`), both read from a file the
supervisor writes whole (`await_assignment`)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from resilax._src.runtime import worker
from resilax._src.runtime.worker import LOG_SWITCH, SPARE_ENV, SPARE_HEARTBEAT_ENV, SPARE_HEARTBEAT_S_ENV, LaunchEnv


class _SpareHeartbeat(threading.Thread):
    """A spare's heartbeat: ``{"pid", "spare", "t", "phase"}`` with phase ``warming`` (importing)
    then ``spare`` (ready for an assignment); the supervisor kills a spare whose file goes stale."""

    def __init__(self, path: str, every_s: float):
        super().__init__(name="resilax-spare-heartbeat", daemon=True)
        self.path, self.every_s, self.phase = path, every_s, "warming"
        self._halt = threading.Event()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.beat()
        self.start()

    def beat(self):
        tmp = f"{self.path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"pid": os.getpid(), "spare": os.environ.get(SPARE_ENV), "t": time.time(),
                                "phase": self.phase}))
        os.replace(tmp, self.path)

    def run(self):
        while not self._halt.wait(self.every_s):
            try:
                self.beat()
            except OSError:
                pass

    def stop(self):
        self._halt.set()


# Imported ahead by a spare: what a worker imports between joining and its first step. None
# of these starts a JAX backend (that waits for jax_num_cpu_devices and the client).
PREFETCH = ("jax", "jax.numpy", "jax.experimental.multihost_utils", "numpy", "orbax.checkpoint", "tensorstore",
            "flax.linen", "optax", "resilax", "resilax._src.step.driver", "resilax.tools.runner",
            "resilax.tools.example")


def _prefetch() -> None:
    import importlib

    for name in PREFETCH:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # what the command cannot import it will not need (or will fail on after assignment)
    from resilax._src.runtime import jaxdist

    jaxdist.check()  # its JaxAssumptionError now rather than after the assignment
    if jaxdist.backends_initialized():
        from resilax._src.errors import ResilaxError

        raise ResilaxError("resilax launch spare: JAX's backends already exist in this spare (some JAX call ran "
                           "before resilax.launched.initialize()), so it cannot take a place in the job")


def wait_for_assignment(prefetch: bool = True, poll_s: float = 0.01) -> LaunchEnv | None:
    """In a spare: imports ahead (``prefetch``), reports ``spare`` in its heartbeat and blocks
    until the supervisor writes its assignment; then sets the ``RESILAX_*`` variables to it
    and returns it. Elsewhere: `env()` (no wait). `initialize` calls this first.

    Raises:
      ResilaxError: the assignment file is not a LaunchEnv, or JAX started in this spare.
    """
    if not worker.is_spare():
        return worker.env()
    path = os.environ[SPARE_ENV]
    hb = _SpareHeartbeat(os.environ[SPARE_HEARTBEAT_ENV], float(os.environ.get(SPARE_HEARTBEAT_S_ENV, "0.5")))
    try:
        if prefetch:
            _prefetch()
        hb.phase = "spare"
        hb.beat()
        e = await_assignment(path, "the assignment", poll_s=poll_s)
        hb.phase = "assigned"
        hb.beat()
    finally:
        hb.stop()
    switch_log()
    os.environ.update(e.to_env())  # child code (and LaunchEnv.from_env) sees the assigned place
    os.environ.pop(SPARE_ENV, None)
    worker._state["assigned"] = e
    return e


def switch_log() -> None:
    """Marks, in this process's output, where the lines of its new place begin (`LOG_SWITCH`):
    what Python buffered is flushed first, so that it lands in the old log."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        os.write(1, LOG_SWITCH.encode())
    except OSError:
        pass


def await_assignment(path: str, what: str, *, poll_s: float = 0.01, timeout_s: float | None = None,
                      beat=None) -> LaunchEnv:
    """Waits for the supervisor to write ``path`` (whole: temporary file + rename) and reads
    the `LaunchEnv` in it; ``beat()`` is called while waiting.

    Raises:
      ResilaxError: nothing within ``timeout_s`` (None: no limit), or not a LaunchEnv's JSON.
    """
    from resilax._src.errors import ResilaxError

    deadline = None if timeout_s is None else time.time() + timeout_s
    while True:
        try:
            with open(path) as f:
                raw = f.read()
            break
        except FileNotFoundError:
            if deadline is not None and time.time() > deadline:
                raise ResilaxError(f"resilax launch: {what} {path} did not come within {timeout_s:g} s") from None
            if beat is not None:
                beat()
            time.sleep(poll_s)
    try:
        d = json.loads(raw)
    except ValueError as err:
        raise ResilaxError(f"resilax launch: {what} {path} is not JSON: {err}") from err
    return LaunchEnv.from_dict(d, f"{what} {path}")
