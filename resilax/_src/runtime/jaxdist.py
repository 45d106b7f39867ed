"""Every private JAX name resilax relies on for multi-process runs, in one place.

resilax runs the coordination service in its supervisor (`resilax launch`), not inside
worker 0, because a service hosted by a worker dies with it and aborts every other worker
(MULTIPROCESS.md, measured on jax/jaxlib 0.10.2). That needs names JAX does not export:

- ``jax._src.lib._jax.get_distributed_runtime_service`` (with ``recoverable=``) and
  ``get_distributed_runtime_client``: the service and client constructors;
- ``jax._src.distributed.global_state``: where a client must be attached so that the
  CPU backend (and Orbax, ``multihost_utils``) find it, and its fields ``client``,
  ``service``, ``process_id``, ``num_processes``, ``coordinator_address``,
  ``preemption_sync_manager``;
- ``DistributedRuntimeClient.get_live_nodes`` and the key-value calls;
- ``jax_enable_recoverability``, ``jax_cpu_collectives_implementation`` (``"gloo"``),
  ``jax_num_cpu_devices``, and the XLA flag ``--xla_cpu_collective_timeout_seconds``
  (a collective waiting on a dead peer otherwise blocks for 30 minutes);
- ``jax._src.xla_bridge.backends_are_initialized``;
- ``jax._src.compiler.compile_or_get_cached`` and ``_cache_write``, and
  ``jax._src.compilation_cache.put_executable_and_time``: JAX writes its persistent
  compilation cache from process 0 only, so every other worker of a new generation compiled
  all its programs again (`share_compilation_cache`).

`check()` verifies the installed JAX against these assumptions once and raises
`JaxAssumptionError` naming the one that broke. Behaviour that cannot be checked by
looking (a service in another process survives a worker's death and reports it; XLA:CPU
takes the collective timeout flag) is probed once per jax/jaxlib before the first service
starts (`jaxprobe.ensure`), whatever the version: an error names the behaviour. (Every
restart is a new generation on a fresh service, because gloo refuses a replacement under
the same process id in the same service: measured on jax/jaxlib 0.10.2.)
"""

from __future__ import annotations

import inspect
import os

from resilax._src.errors import ResilaxError

MEASURED_ON = "0.10.2"  # the jax/jaxlib the assumptions were first measured on (for messages)
_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"

_checked = False


class JaxAssumptionError(ResilaxError, RuntimeError):
    """The installed JAX lacks a private name or behaviour resilax's multi-process runtime uses."""


def _fail(what: str, expected: str, got: str) -> JaxAssumptionError:
    import jax

    return JaxAssumptionError(
        f"resilax multi-process runtime: {what}: expected {expected}, but jax {jax.__version__} has {got}. "
        f"resilax's multi-process runtime uses this private name of JAX (resilax/_src/runtime/jaxdist.py; "
        f"first measured on jax {MEASURED_ON})")


def check() -> None:
    """Checks every assumption once per process; raises `JaxAssumptionError` if one breaks."""
    global _checked
    if _checked:
        return
    from jax._src import config as jcfg
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    _check_service(_jax)
    for name in ("get_distributed_runtime_client", "create_preemption_sync_manager"):
        if not callable(getattr(_jax, name, None)):
            raise _fail(f"jax._src.lib._jax.{name}", "a callable", "none")
    cli_doc = _jax.get_distributed_runtime_client.__doc__ or ""
    for kw in ("init_timeout", "heartbeat_timeout", "shutdown_timeout"):
        if kw not in cli_doc:
            raise _fail("_jax.get_distributed_runtime_client", f"keyword argument {kw}=",
                        f"signature {cli_doc.splitlines()[0] if cli_doc else '(undocumented)'}")
    for name in ("get_live_nodes", "key_value_set", "key_value_try_get", "blocking_key_value_get",
                 "wait_at_barrier", "connect", "shutdown"):
        if not hasattr(_jax.DistributedRuntimeClient, name):
            raise _fail(f"DistributedRuntimeClient.{name}", "a method", "none")
    gs = getattr(distributed, "global_state", None)
    for field in ("client", "service", "process_id", "num_processes", "coordinator_address",
                  "preemption_sync_manager", "initialize_preemption_sync_manager"):
        if gs is None or not hasattr(gs, field):
            raise _fail(f"jax._src.distributed.global_state.{field}", "an attribute", "none")
    if not callable(getattr(xla_bridge, "backends_are_initialized", None)):
        raise _fail("jax._src.xla_bridge.backends_are_initialized", "a callable", "none")
    for flag in ("jax_enable_recoverability", "jax_cpu_collectives_implementation", "jax_num_cpu_devices"):
        if flag not in jcfg.config._value_holders:
            raise _fail(f"config flag {flag}", "a registered flag", "none")
    if "gloo" not in inspect.getsource(xla_bridge):
        raise _fail("jax._src.xla_bridge", "gloo CPU collectives (make_gloo_tcp_collectives)", "no gloo path")
    _check_cache_names()
    _checked = True


def _check_cache_names() -> None:
    from jax._src import compilation_cache, compiler

    for name, params in (("compile_or_get_cached", ("backend", "computation", "devices")),
                         ("_cache_write", ("cache_key", "compile_time_secs", "module_name", "backend", "executable",
                                           "host_callbacks"))):
        fn = getattr(compiler, name, None)
        got = list(inspect.signature(fn).parameters)[:len(params)] if callable(fn) else None
        if got != list(params):
            raise _fail(f"jax._src.compiler.{name}", f"a function of ({', '.join(params)}, ...)",
                        "none" if got is None else f"({', '.join(got)}, ...)")
    put = getattr(compilation_cache, "put_executable_and_time", None)
    if not callable(put) or list(inspect.signature(put).parameters) != ["cache_key", "module_name", "executable",
                                                                         "backend", "compile_time"]:
        raise _fail("jax._src.compilation_cache.put_executable_and_time",
                    "a function of (cache_key, module_name, executable, backend, compile_time)", "another")


_local_program = None  # threading.local: the program being compiled runs on this process's devices only


def share_compilation_cache() -> None:
    """Lets every worker write its own programs into JAX's persistent compilation cache.

    JAX writes cache entries from process 0 only (``_cache_write``: "contention for writes on
    some filesystems"), but a key is rarely shared between processes: it holds the program's
    device assignment and, on CPU, the fingerprint of the devices' topology, which differs
    from process to process (measured on jax 0.10.2: the ``accelerator_config`` part of the
    key, the same for a process id across generations). So processes 1.. never found a
    program in the cache, and every new generation compiled them all again (``resilax bench
    multiprocess``: 13.7 of a 17 s recovery on 2 cores). Here each process writes the
    programs it compiled: those on its own devices only (no other process computes their
    key), and on CPU every program (the topology part makes the key its own). Elsewhere a
    program over several processes is still written by process 0 only, as JAX does.
    Idempotent; changes nothing in process 0.

    Raises:
      JaxAssumptionError: the private names it wraps changed (`check`).
    """
    global _local_program
    check()
    import threading

    from jax._src import compilation_cache, compiler, config, distributed

    if getattr(compiler.compile_or_get_cached, "_resilax", False):
        return
    _local_program = threading.local()
    compile_or_get_cached, cache_write = compiler.compile_or_get_cached, compiler._cache_write

    def compile_any(backend, computation, devices, *args, **kwargs):
        me = distributed.global_state.process_id
        prev = getattr(_local_program, "local", False)
        _local_program.local = all(d.process_index == me for d in devices.flat)
        try:
            return compile_or_get_cached(backend, computation, devices, *args, **kwargs)
        finally:
            _local_program.local = prev

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        own = getattr(_local_program, "local", False) or backend.platform == "cpu"
        if (distributed.global_state.process_id in (0, None) or not own or host_callbacks
                or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
            return cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:  # what JAX's own write does past its process-0 check
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 (as JAX: a cache that cannot be written is a warning)
            import warnings

            warnings.warn(f"resilax: could not write the persistent compilation cache entry for {module_name!r}: "
                          f"{type(e).__name__}: {e}")

    compile_any._resilax = True
    compiler.compile_or_get_cached, compiler._cache_write = compile_any, write


# ---------------------------------------------------------------- supervisor side
def _service_lib():
    """jaxlib's extension module, with the service constructor `start_service` calls checked.

    Imported without ``jax`` where it can be (``jaxlib._jax``, the module ``jax._src.lib``
    re-exports): a supervisor or an agent only hosts the coordination service, and importing
    all of JAX for it cost each one ~0.8 CPU-s at start (a whole second on a loaded host).
    The workers, which import JAX, check every other name (`check`)."""
    # the C++ log level JAX's own import sets first (the service's INFO lines are not shown)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    try:
        import jaxlib._jax as _jax
    except ImportError:  # another layout: through jax, as the workers see it
        from jax._src.lib import _jax
    return _check_service(_jax)


def _check_service(_jax):
    """``_jax`` if its service constructor takes what `start_service` passes; else raises."""
    fn = getattr(_jax, "get_distributed_runtime_service", None)
    if not callable(fn):
        raise _fail("jax._src.lib._jax.get_distributed_runtime_service", "a callable", "none")
    doc = fn.__doc__ or ""
    if "recoverable" not in doc or "heartbeat_timeout" not in doc:
        raise _fail("_jax.get_distributed_runtime_service", "keyword arguments recoverable= and heartbeat_timeout=",
                    f"signature {doc.splitlines()[0] if doc else '(undocumented)'}")
    return _jax


def start_service(port: int, num_processes: int, *, heartbeat_timeout_s: int, shutdown_timeout_s: int = 5,
                  host: str = "127.0.0.1"):
    """Starts a coordination service for ``num_processes`` workers on ``host:port``.

    The caller must do no JAX compute in this process: the service only relays
    coordination traffic. ``recoverable=True`` keeps it serving the others after a worker
    dies (the supervisor decides what a death means, not the service).

    ``port``: one held by `ports.reserve_port` in this process, or one nothing on this host is
    bound to (a gRPC service binds beside another's ``SO_REUSEPORT`` socket silently).

    Raises:
      PortInUseError: ``port`` is not held here and another socket is bound to it.
      JaxAssumptionError: a private name resilax uses is missing (`check`).
      JaxBehaviourError: the installed JAX lacks a behaviour resilax relies on
        (`jaxprobe.ensure`: probed once per jax/jaxlib, a few seconds, then cached).
    """
    _jax = _service_lib()
    from resilax._src.runtime import jaxprobe, ports

    jaxprobe.ensure()
    with ports.binding(host, port):
        return _jax.get_distributed_runtime_service(
            f"{host}:{port}", num_processes, heartbeat_timeout=heartbeat_timeout_s,
            shutdown_timeout=shutdown_timeout_s, recoverable=True)


# ---------------------------------------------------------------- worker side
def backends_initialized() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def initialize_worker(*, coordinator: str, process_id: int, num_processes: int, local_devices: int,
                      heartbeat_timeout_s: int, init_timeout_s: int, collective_timeout_s: int) -> None:
    """Attaches this process to the coordination service as ``process_id``: what
    ``jax.distributed.initialize`` does, minus starting a service in process 0.

    Must run before JAX creates its backends (any ``jax.devices()``, any array).

    Raises:
      JaxAssumptionError: an assumption about JAX broke (see `check`).
      ResilaxError: the backends already exist, or the service cannot be reached.
    """
    check()
    import jax
    from jax._src import distributed
    from jax._src.lib import _jax

    if backends_initialized():
        raise ResilaxError(
            "resilax: this process was started by `resilax launch` (RESILAX_COORDINATOR is set), so resilax must "
            "attach it to the coordination service before JAX starts, but JAX's backends already exist (some "
            "JAX call ran first: jax.devices(), an array, a PRNG key). Build the resilax.Topology (or call "
            "resilax.launched.initialize()) before any other JAX call")
    gs = distributed.global_state
    if gs.client is not None:
        raise ResilaxError("resilax: jax.distributed is already initialized in this process; under `resilax launch` "
                           "resilax initializes it (do not call jax.distributed.initialize yourself)")
    # The XLA flag is read once, when the CPU client is built: set it before that.
    flags = os.environ.get("XLA_FLAGS", "")
    if _TIMEOUT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_TIMEOUT_FLAG}={int(collective_timeout_s)}".strip()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", int(local_devices))
    client = _jax.get_distributed_runtime_client(
        coordinator, process_id, init_timeout=init_timeout_s, heartbeat_timeout=heartbeat_timeout_s,
        shutdown_timeout=5, use_compression=True)
    try:
        client.connect()
    except Exception as e:  # the service's own error type is private too
        raise ResilaxError(f"resilax: process {process_id} could not join the coordination service at "
                           f"{coordinator} within {init_timeout_s} s: {e}") from e
    gs.coordinator_address = coordinator
    gs.process_id = process_id
    gs.num_processes = num_processes
    gs.client = client
    gs.initialize_preemption_sync_manager()
    share_compilation_cache()


def client():
    """The attached coordination client, or None outside a multi-process run."""
    from jax._src import distributed

    return distributed.global_state.client


def live_nodes(process_ids) -> dict[int, int]:
    """``{process id: incarnation}`` of the processes the service still sees alive."""
    c = client()
    if c is None:
        raise ResilaxError("resilax.live_nodes: this process is not attached to a coordination service")
    return dict(c.get_live_nodes(list(process_ids)))


def shutdown() -> None:
    """Detaches from the service (preemption manager first: it uses the client)."""
    from jax._src import distributed

    distributed.global_state.shutdown()
