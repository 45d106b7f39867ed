"""The calling thread's CPU time inside compiled executables' calls, and the medians the
host-time benchmarks report (host_overhead.py, bit_exact_host.py)."""

import statistics
import time


class ExecutableClock:
    """While active, adds the calling thread's CPU time in every compiled executable's call
    to ``total``."""

    def __init__(self):
        from jax._src import stages

        self._cls = stages.Compiled
        self._orig = stages.Compiled.__call__
        self.total = 0.0

    def __enter__(self):
        orig, clock = self._orig, self

        def timed(exe, *a, **k):
            t0 = time.thread_time()
            try:
                return orig(exe, *a, **k)
            finally:
                clock.total += time.thread_time() - t0

        self._cls.__call__ = timed
        return self

    def __exit__(self, *exc):
        self._cls.__call__ = self._orig
        return False


def finish(runs, states, times, inside):
    """Waits for every run's state, closes the wrapped steps, and returns ``(thread CPU ms,
    ms inside executables' calls, Python ms)`` per variant: medians over the timed blocks."""
    import jax

    for k in runs:
        jax.block_until_ready(states[k])
        if k != "plain":
            runs[k].close()
    host = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    exe = {k: statistics.median(v) * 1e3 for k, v in inside.items()}
    py = {k: statistics.median(a - b for a, b in zip(times[k], inside[k])) * 1e3 for k in runs}
    return host, exe, py
