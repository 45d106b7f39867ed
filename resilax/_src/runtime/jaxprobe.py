"""Start-up probes of the JAX runtime behaviour `resilax launch` relies on.

`jaxdist.check` verifies the private *names* resilax uses; what it cannot see by looking is
how the runtime *behaves* when a process dies. `resilax launch` needs three behaviours
(measured on jax/jaxlib 0.10.2; MULTIPROCESS.md in the design notes):

- ``service_survives``: a coordination service started outside the workers with
  ``recoverable=True`` keeps serving the other processes after one is SIGKILLed (a
  service inside worker 0 dies with it and aborts the rest: hence resilax's own service);
- ``death_seen``: the service reports the SIGKILLed process as no longer live
  (``get_live_nodes``) within its heartbeat timeout;
- ``collective_timeout_flag``: XLA:CPU accepts ``--xla_cpu_collective_timeout_seconds``, so
  a collective waiting on a dead peer raises instead of blocking for 30 minutes.

`ensure` runs the probes once per installed jax/jaxlib (a service, one client here and
one in a child process that is SIGKILLed: a few seconds) in a process of their own, so the
caller's process never attaches to anything, and remembers a pass in the user's cache
directory. A JAX without one of them gets an error naming the behaviour, whatever its
version. ``RESILAX_SKIP_JAX_PROBES=1`` skips them (a machine where the probe cannot run).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from resilax._src.errors import ResilaxError

SKIP_ENV = "RESILAX_SKIP_JAX_PROBES"
BEHAVIOURS = {
    "service_survives": "a coordination service started outside the workers (recoverable=True) keeps serving the "
                        "other processes after one of them is SIGKILLed",
    "death_seen": "the coordination service reports a SIGKILLed process as no longer live (get_live_nodes) within "
                  "its heartbeat timeout",
    "collective_timeout_flag": "XLA:CPU accepts --xla_cpu_collective_timeout_seconds (a collective waiting on a "
                               "dead peer raises instead of blocking for 30 minutes)",
}
_HEARTBEAT_S = 2
_FLAG = "--xla_cpu_collective_timeout_seconds"  # what `jaxdist.initialize_worker` sets
_passed = False  # in this process (a cache that cannot be written does not make every generation probe)


class JaxBehaviourError(ResilaxError, RuntimeError):
    """The installed JAX lacks a runtime behaviour `resilax launch` relies on. Attribute
    ``behaviour``: a key of `BEHAVIOURS`."""

    def __init__(self, behaviour: str, detail: str):
        self.behaviour = behaviour
        super().__init__(f"resilax launch: the installed JAX does not show a behaviour resilax relies on: "
                         f"{BEHAVIOURS[behaviour]} ({behaviour}: {detail}). Multi-process runs need it; "
                         f"set {SKIP_ENV}=1 to start anyway")


def _versions() -> str:
    from importlib import metadata

    def v(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "none"

    return f"jax-{v('jax')}-jaxlib-{v('jaxlib')}"


def _cache_file() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "resilax" / f"jax-behaviour-{_versions()}.json"


def ensure(timeout_s: float = 120.0) -> None:
    """Raises `JaxBehaviourError` unless the installed JAX shows every behaviour in
    `BEHAVIOURS` (probed once per jax/jaxlib, then read from the cache)."""
    global _passed
    if _passed or os.environ.get(SKIP_ENV) == "1":
        return
    cache = _cache_file()
    try:
        if json.loads(cache.read_text()).get("ok") is True:
            _passed = True
            return
    except (OSError, ValueError):
        pass
    try:
        r = subprocess.run([sys.executable, "-m", "resilax._src.runtime.jaxprobe"], capture_output=True, text=True,
                           timeout=timeout_s, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except subprocess.TimeoutExpired:
        raise JaxBehaviourError("death_seen", f"the probe did not finish within {timeout_s:.0f} s") from None
    result = None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            break
    if result is None:
        raise JaxBehaviourError("service_survives", f"the probe process ended with code {r.returncode} and no "
                                                    f"result: {r.stderr.strip()[-600:]}")
    if not result["ok"]:
        raise JaxBehaviourError(result["behaviour"], result["detail"])
    _passed = True
    try:  # remembered per jax/jaxlib; a cache that cannot be written only means probing again next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"ok": True, "versions": _versions(), "seconds": result["seconds"]}))
        os.replace(tmp, cache)
    except OSError:
        pass


# ---------------------------------------------------------------- the probe process
def _child(address: str, flag: str) -> None:
    """Probe child: starts XLA:CPU with the collective timeout flag, joins as process 1, says
    so, and waits to be SIGKILLed."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}=5").strip()
    import jax

    jax.devices("cpu")  # XLA reads XLA_FLAGS as it builds the client: an unknown flag ends the process here
    print("xla ok", flush=True)
    from jax._src.lib import _jax

    c = _jax.get_distributed_runtime_client(address, 1, init_timeout=60, heartbeat_timeout=_HEARTBEAT_S,
                                            shutdown_timeout=1, use_compression=True)
    c.connect()
    c.key_value_set("resilax_probe/child", "ready")
    time.sleep(600)


_KEEP: list = []


def _probe(flag: str = _FLAG) -> dict:
    from jax._src.lib import _jax

    from resilax._src.runtime import ports

    t0 = time.perf_counter()
    port = ports.reserve_port("127.0.0.1")
    address = f"127.0.0.1:{port}"
    with ports.binding("127.0.0.1", port):
        service = _jax.get_distributed_runtime_service(address, 2, heartbeat_timeout=_HEARTBEAT_S, shutdown_timeout=1,
                                                       recoverable=True)
    _KEEP.append(service)  # until os._exit: a client outliving its service aborts the process
    child = subprocess.Popen([sys.executable, "-m", "resilax._src.runtime.jaxprobe", "child", address, flag],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "xla ok":  # (an empty line: the child ended first)
            code = child.wait()
            err = [ln for ln in child.stderr.read().splitlines() if ln and not ln.startswith("    @")]
            return {"ok": False, "behaviour": "collective_timeout_flag",
                    "detail": f"XLA:CPU with {flag}=5 in XLA_FLAGS exited with code {code}: {' '.join(err)[-300:]}"}
        client = _jax.get_distributed_runtime_client(address, 0, init_timeout=60, heartbeat_timeout=_HEARTBEAT_S,
                                                     shutdown_timeout=1, use_compression=True)
        _KEEP.append(client)
        try:
            client.connect()  # returns once both processes are connected
            client.blocking_key_value_get("resilax_probe/child", 60_000)
        except Exception as e:
            return {"ok": False, "behaviour": "service_survives", "detail": f"a second process could not join: {e!r}"}
        child.kill()
        child.wait()
        deadline = time.monotonic() + 10 * _HEARTBEAT_S + 10
        while True:
            try:
                live = dict(client.get_live_nodes([0, 1]))
            except Exception as e:
                return {"ok": False, "behaviour": "service_survives", "detail": f"get_live_nodes raised {e!r}"}
            if 1 not in live:
                break
            if time.monotonic() > deadline:
                return {"ok": False, "behaviour": "death_seen",
                        "detail": f"process 1 still live {10 * _HEARTBEAT_S + 10} s after its SIGKILL"}
            time.sleep(0.1)
        try:
            client.key_value_set("resilax_probe/after", "1")
            assert client.blocking_key_value_get("resilax_probe/after", 5_000) == "1"
        except Exception as e:
            return {"ok": False, "behaviour": "service_survives", "detail": f"after the death: {e!r}"}
        return {"ok": True, "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


if __name__ == "__main__":
    # python -m resilax._src.runtime.jaxprobe [--flag F]: the probes, one JSON line on stdout
    if len(sys.argv) > 3 and sys.argv[1] == "child":
        _child(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(_probe(sys.argv[2] if sys.argv[1:2] == ["--flag"] else _FLAG)), flush=True)
        os._exit(0)  # no teardown: the service and client hold threads that abort on a dead peer
