"""The interpreter's switch interval while resilax's own Python runs on a background thread
beside the step loop (a checkpoint's save on the persister thread).

The step loop gives up the GIL at every dispatch and transfer. When another thread runs
Python meanwhile (Orbax's save is mostly Python: its metadata, its asyncio loop, its
handlers), the loop waits for the GIL to come back up to the switch interval each time:
5 ms by default (`sys.getswitchinterval`), longer than a whole step of a small model.
Measured with `resilax bench gpt --size tiny --every 10` (20 saves a variant, 2 CPU cores):
the steps' time above the median summed per save was 164-218 ms with the default and
140-150 ms at 0.5 ms, in two interleaved pairs of runs.
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def shorter_switch_interval(seconds: float | None):
    """``sys.setswitchinterval(seconds)`` while inside, if that is shorter than the current
    one (None: nothing changes); the old value comes back after, unless something else
    changed it meanwhile (then that value stays)."""
    prev = sys.getswitchinterval()
    if seconds is None or prev <= seconds:
        yield
        return
    sys.setswitchinterval(seconds)
    mine = sys.getswitchinterval()
    try:
        yield
    finally:
        if sys.getswitchinterval() == mine:
            sys.setswitchinterval(prev)
