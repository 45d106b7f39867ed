"""Background work that resilax starts or abandons ends without printing tracebacks.

What a person reads while resilax recovers is one line per event (`messages`); the details
go to the run's events. Third-party work that resilax ends on purpose must not print pages
of tracebacks meanwhile. Each piece here is scoped to that work (a thread, a restore call),
never to the process: an error anywhere else is printed as Python prints it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Iterator

log = logging.getLogger("resilax")

#: seconds a restore's event loop waits, before it closes, for reads still in flight
DRAIN_S = 30.0

_scope = threading.local()


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that, on `close`, first lets the tasks still pending on it finish (the
    same holds for a save's writes: `reporting`).

    Orbax restores a checkpoint as one ``asyncio.gather`` of a tensorstore read per array, on
    an event loop it makes for the call and closes as soon as the gather returns. When one
    read fails (a corrupt checkpoint), the gather raises at once and the loop is closed with
    the other reads still in flight: each then completes into the closed loop
    (``call_soon_threadsafe`` -> "RuntimeError: Event loop is closed", printed as an
    unraisable exception: 54 tracebacks for one corrupt checkpoint), and the reads that failed
    too are garbage collected unretrieved ("Task exception was never retrieved", logged by
    asyncio with the whole tensorstore spec). Draining before closing ends them in order;
    their errors (the same corruption the first one reported, which the restore already
    names) go to resilax's debug log.
    """

    def __init__(self):
        super().__init__()
        self.set_exception_handler(_to_debug_log)

    def close(self):
        if not self.is_running() and not self.is_closed():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            if pending:
                # return_exceptions: every failed read is retrieved here, none logged at GC
                gathered = asyncio.gather(*pending, return_exceptions=True)
                try:
                    self.run_until_complete(asyncio.wait_for(gathered, DRAIN_S))
                except Exception as e:  # a read that never ends: leave it (it may print later), do not hang
                    log.debug("resilax: a restore's reads did not finish in %.0f s: %r", DRAIN_S, e)
        super().close()


def _to_debug_log(loop, context):
    exc = context.get("exception")
    log.debug("resilax: background read after a failed restore: %s: %r", context.get("message"), exc)


_policy_class: list = []  # the draining policy's class, made on first use (`_draining_policy`)


def _draining_policy(default):
    """A policy that is ``default`` (the interpreter's default policy: its state, each thread's
    current loop included, is shared), except that a loop made on a thread inside
    `draining_loops` drains. None where this Python has no policies to extend (they are
    deprecated from 3.14): restores then run on Orbax's plain loops."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        base = getattr(asyncio, "DefaultEventLoopPolicy", None)
        if base is None or type(default) is not base:
            return None
        if not _policy_class:
            class _Policy(base):
                def new_event_loop(self):
                    if getattr(_scope, "depth", 0) or (_in_op[0] > 0 and _orbax_thread()):
                        return _DrainingLoop()
                    return super().new_event_loop()

            _policy_class.append(_Policy)
        ours = _policy_class[0]()
    ours.__dict__.update(default.__dict__)  # each thread's current loop (and child watcher) stay as they were
    return ours


def _orbax_thread() -> bool:
    """Whether this thread is one of Orbax's (its class, or the function it runs, is Orbax's:
    a save's `_SignalingThread`s, its background commit)."""
    t = threading.current_thread()
    target = getattr(t, "_target", None)  # (threading.Thread keeps it while the thread runs)
    return type(t).__module__.startswith("orbax") or getattr(target, "__module__", "").startswith("orbax")


def _install_policy() -> None:
    """Installs the draining policy over the interpreter's default one (it only differs inside
    `draining_loops`, and on Orbax's threads while `reporting`); a policy of the user's own
    is left alone (then nothing changes here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        policy = asyncio.get_event_loop_policy()
        if not (_policy_class and type(policy) is _policy_class[0]):
            ours = _draining_policy(policy)
            if ours is not None:
                asyncio.set_event_loop_policy(ours)


@contextlib.contextmanager
def draining_loops() -> Iterator[None]:
    """Within it, event loops made on this thread (Orbax's, one per restore call) finish their
    pending tasks before they close (`_DrainingLoop`). Loops of other threads, and loops
    made outside it, are Python's own (but Orbax's during `reporting`)."""
    _install_policy()
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1


# ---------------------------------------------------------------- Orbax's logs about resilax's saves
_DIRS: dict[str, int] = {}  # the open checkpoint stores' directories (with os.sep), counted
_DIRS_LOCK = threading.Lock()
_in_op = [0]  # resilax's own Orbax calls in flight (each under `ORBAX_LOCK`)


class _OrbaxOnOwnDirectories(logging.Filter):
    """Drops Orbax's ERROR records (through absl's logger) about resilax's own
    checkpoints, after logging them to resilax's debug log: records that name the directory
    of an open resilax checkpoint store, and any made while resilax's own Orbax call is in
    flight (`reporting`: a save through its commit, a wait, a restore, a close; every Orbax
    save in the process holds `ORBAX_LOCK` as they do, so the Orbax work then is theirs),
    and those made on Orbax's own threads while a resilax store is open (a multi-process
    save's background write that failed on a full disk names no directory: each of the other
    processes printed a 50-line traceback while process 0 said the disk was full).

    A save that fails there (a full disk) raises in resilax's own wait, as a `StorageError`
    that says what happened and that the committed checkpoints are intact; a restore that
    fails there is named in the corrupt-checkpoint warning or `CorruptCheckpointError`. Orbax
    also logged each failure on each of its threads as an ERROR with a 30-80-line traceback
    (4 of them for one full disk), before resilax's one line. Records about other directories
    outside those calls (a user's own Orbax work in the process) pass as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in record.pathname:
            return True
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        if _in_op[0] <= 0:
            with _DIRS_LOCK:
                dirs = list(_DIRS)
            # (a save's background write that failed names no directory: on Orbax's own thread
            # while a resilax store is open, it is that store's save)
            if not any(d in text for d in dirs) and not (dirs and _orbax_thread()):
                return True
        log.debug("resilax: Orbax on a resilax checkpoint (resilax raises or reports it): %s", text[:4000])
        return False


_orbax_filter = _OrbaxOnOwnDirectories()


def _install() -> None:
    absl_log = logging.getLogger("absl")
    if _orbax_filter not in absl_log.filters:
        absl_log.addFilter(_orbax_filter)


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Around resilax's own Orbax calls (under `ORBAX_LOCK`), whose failures resilax raises or
    reports itself: what Orbax logs meanwhile goes to the debug log (`_OrbaxOnOwnDirectories`),
    and the event loops Orbax's threads make meanwhile (a save runs one per thread, with the
    restore's gather-then-close: a full disk left writes in flight into a closed loop) drain
    before they close (`_DrainingLoop`)."""
    _install()
    _install_policy()
    with _DIRS_LOCK:
        _in_op[0] += 1
    try:
        yield
    finally:
        with _DIRS_LOCK:
            _in_op[0] -= 1


def own_directory(directory) -> None:
    """Orbax's errors about ``directory`` are resilax's to report (`_OrbaxOnOwnDirectories`)
    until `release_directory`."""
    import os

    _install()
    d = os.path.join(os.fspath(directory), "")
    with _DIRS_LOCK:
        _DIRS[d] = _DIRS.get(d, 0) + 1


def release_directory(directory) -> None:
    import os

    d = os.path.join(os.fspath(directory), "")
    with _DIRS_LOCK:
        n = _DIRS.get(d, 0) - 1
        if n > 0:
            _DIRS[d] = n
        else:
            _DIRS.pop(d, None)
