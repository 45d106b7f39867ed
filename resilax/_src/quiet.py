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
    """An event loop that, on `close`, first lets the tasks still pending on it finish.

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


class _Policy(asyncio.DefaultEventLoopPolicy):
    """The default policy, except that a loop made on a thread inside `draining_loops` drains."""

    def new_event_loop(self):
        if getattr(_scope, "depth", 0):
            return _DrainingLoop()
        return super().new_event_loop()


@contextlib.contextmanager
def draining_loops() -> Iterator[None]:
    """Within it, event loops made on this thread (Orbax's, one per restore call) finish their
    pending tasks before they close (`_DrainingLoop`). Loops of other threads, and loops
    made outside it, are Python's own.

    Installs `_Policy` over the default policy the first time (it only differs inside this
    scope); a policy of the user's own is left alone (then nothing changes here)."""
    policy = asyncio.get_event_loop_policy()
    if type(policy) is asyncio.DefaultEventLoopPolicy:
        ours = _Policy()
        ours.__dict__.update(policy.__dict__)  # each thread's current loop (and child watcher) stay as they were
        asyncio.set_event_loop_policy(ours)
    _scope.depth = getattr(_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _scope.depth -= 1
