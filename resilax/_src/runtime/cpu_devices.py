"""Emulated CPU devices that dispatch like accelerators.

XLA:CPU's client runs a program on several devices as one task per device on its client
thread pool, which has max(cores, devices) threads (``NPROC``, when set, replaces the core
count). A running program holds one thread per device until it finishes, so when a second
multi-device program is called while the first runs, its per-device tasks find no free
thread and the call returns only once the first program has finished: the host cannot run
ahead of the "device". On an accelerator a call returns once the program is queued.

resilax runs a step as two programs (the grad part, then the update part), so on an
emulated mesh of 8 devices on 2 cores the update's call waited for the whole grad part
(the tiny GPT of `resilax bench gpt`: a call returned after 12.8 of its 14.1 ms, against
3.0 ms for a plain jit call; with a pool of 16 threads: 1.1 ms). Plain jit hides it only
because it runs one program per step. A pool of twice the devices holds a running program
and the next one's dispatch, so a call returns once dispatched, as on a GPU or TPU, and a
test on emulated devices sees any call that waits for the device.

`resilax launch`'s workers keep XLA's default pool for now: with the larger one their
calls ran ahead of their devices too, which changed what the multi-process tests observe
(a worker's reported step could be one its host store did not yet hold when it was killed:
work in flight, lost as on a GPU, but the in-place test's assertion said otherwise). Moving
them over needs those assertions restated for steps in flight.
"""

from __future__ import annotations

import os

# the client's thread pool is sized from this variable (XLA's DefaultThreadPoolSize) when the
# CPU client is built; set after that, it changes nothing
_VAR = "NPROC"


def dispatch_threads(devices: int) -> int:
    """The client pool size that lets one ``devices``-device program run while the next is
    dispatched: twice the devices, never fewer than the cores this process may use (the
    same number also sizes XLA:CPU's intra-op pool, which must not shrink)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cores = os.cpu_count() or 1
    return max(cores, 2 * int(devices))


def reserve_dispatch_threads(devices: int) -> None:
    """Sizes XLA:CPU's client thread pool for ``devices`` devices (see the module's text);
    call before JAX builds its CPU client. A value the user set is kept."""
    if devices > 1 and not os.environ.get(_VAR):
        os.environ[_VAR] = str(dispatch_threads(devices))


def request_cpu_devices(n: int) -> None:
    """Starts JAX's CPU backend with ``n`` devices (emulated slices), dispatched as an
    accelerator's are: a call of a program returns while the previous one still runs. Must
    run before anything else starts JAX's backends (``jax.config.update("jax_num_cpu_devices",
    n)`` alone gives the devices, but a second program's call then waits for the first).

    ``NPROC`` is set only while the client is built: processes started later (a `resilax
    launch` job's workers, which may hold another number of devices) size their own."""
    import jax

    before = os.environ.get(_VAR)
    reserve_dispatch_threads(n)
    try:
        jax.config.update("jax_num_cpu_devices", int(n))
        jax.devices("cpu")  # XLA reads NPROC as it builds the CPU client: now
    finally:
        if before is None:
            os.environ.pop(_VAR, None)
