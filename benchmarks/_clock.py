"""The calling thread's CPU time inside compiled executables' calls, and the medians the
host-time benchmarks report (host_overhead.py, bit_exact_host.py)."""

import statistics
import time


class ExecutableClock:
    """While active, adds the calling thread's CPU time in every compiled executable's call
    to ``total``; ``also``: ``(class or module, function name)`` pairs timed the same way (an
    outermost call only: time inside one of them is not counted twice)."""

    def __init__(self, also=()):
        from jax._src import stages

        self._targets = [(stages.Compiled, "__call__")] + list(also)
        self._orig = [getattr(c, n) for c, n in self._targets]
        self.total = 0.0
        self._depth = 0

    def __enter__(self):
        clock = self

        def wrap(orig):
            def timed(obj, *a, **k):
                if clock._depth:
                    return orig(obj, *a, **k)
                clock._depth += 1
                t0 = time.thread_time()
                try:
                    return orig(obj, *a, **k)
                finally:
                    clock.total += time.thread_time() - t0
                    clock._depth -= 1
            return timed

        for (c, n), orig in zip(self._targets, self._orig):
            setattr(c, n, wrap(orig))
        return self

    def __exit__(self, *exc):
        for (c, n), orig in zip(self._targets, self._orig):
            setattr(c, n, orig)
        return False


def finish(runs, states, times, inside):
    """Waits for every run's state, closes the wrapped steps, and returns ``(thread CPU ms,
    ms inside executables' calls, Python ms)`` per variant: medians over the timed blocks."""
    import jax

    for k in runs:
        jax.block_until_ready(states[k])
        if hasattr(runs[k], "close"):  # (a wrapped step; not plain jit or the bare split)
            runs[k].close()
    host = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    exe = {k: statistics.median(v) * 1e3 for k, v in inside.items()}
    py = {k: statistics.median(a - b for a, b in zip(times[k], inside[k])) * 1e3 for k in runs}
    return host, exe, py
