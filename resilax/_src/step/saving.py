"""Checkpointing from the step loop: the body of `ResilientStep.save`.

The one wait a save may make, the health checks before anything is persisted (hung domains,
corrupted replicas), whether the live buffers can be persisted uncopied, and what the record
log does with a new checkpoint (its anchor, and its entries before the previous one
dropped).
"""

from __future__ import annotations

import time
import os
import warnings
from typing import Callable

import jax

from resilax._src.errors import StorageError, WrapError
from resilax._src.runtime import worker
from resilax._src.runtime.goodput import GOODPUT_FILE, GoodputFileError, load_goodput


def save(run, state, recover: Callable[[], None], save_goodput: Callable[[], None]) -> tuple[float, bool]:
    """Checkpoints ``state`` (the live state, or another state of this step) as step
    ``run.step``, asynchronously. ``recover()``: the step's recovery of pending failures.
    Returns the seconds blocked and whether the next step must keep (not donate) its input:
    the persister reads the live buffers uncopied."""
    ckpt, log = run._checkpointer, run._record_log
    if ckpt is None:
        raise WrapError("resilax.ResilientStep.save: Config.checkpoint is None (no checkpoint directory)")
    if ckpt.paused:
        raise StorageError(f"resilax.ResilientStep.save: checkpoints are paused: {ckpt.paused}")
    if ckpt.store.in_flight():  # the previous save is still writing: the one wait a save may make
        t_wait, prev = time.perf_counter(), ckpt.store.last_step
        with run._goodput_recorder.span("checkpoint_save", step=run.step, phase="previous save still writing"):
            ckpt.store.settle()
        run._event("checkpoint_wait", run.step, seconds=time.perf_counter() - t_wait, previous=prev)
    if run._liveness is not None and state is run._live and run._recovery.health_boundary():
        state = run._live  # a hung domain was failed first: the same step, from the others
    if run._replica_check is not None and state is run._live:  # never persist a corrupted replica
        run._replica_check.before_save(run, state, run.step)
        if run._recovery.pending:
            recover()
        state = run._live  # a recovery, or the rebuilt state adopted in place of corrupted replicas
    after = (lambda: run._faults.fire("during_save", run.step, run)) if run._faults else None
    # The live state needs no copy when the next step keeps its input (the variant was
    # compiled ahead at start): the persister reads these very buffers, and `settle`
    # (before any failure deletes buffers, before a recovery) waits for it.
    prog, donate = run._program, run.config.donate_state
    variants = [None] if run._peers is None else [None, *run._peers.variants()]
    uncopied = (state is run._live and prog is not None and
                (not donate or all(prog.has_update(v, keep_input=True) for v in variants)))
    with run._goodput_recorder.span("checkpoint_save", step=run.step):
        dt = ckpt.save(run, state, after_dispatch=after, copy=not uncopied)
    keep_input = uncopied and donate
    if log is not None:
        log.checkpointed(run.step)
        if log.disk is not None:
            # entries behind the newest committed checkpoint are not needed (the one just
            # started is in flight on the persister: it may still fail); unlinking a few
            # hundred MB of grads files took ~0.6 s on the loop, so the persister does it
            prev = [s for s in ckpt.store.steps() if s < run.step]
            if prev:
                disk, floor = log.disk, prev[-1]
                ckpt.store.after_commit(lambda: disk.truncate_before(floor))
    if run.run_dir:
        ckpt.store.after_commit(save_goodput)
    if run._recovery.pending:  # a domain was lost while the save was in flight
        recover()  # nothing may read the state before this: some of its buffers are gone
        state = run._live  # the same step, rebuilt bitwise
    if log is not None:  # uncopied: the buffers stay valid, the log's writer checksums them
        log.anchor(run.step, state, run._guard, defer=keep_input or not donate)
    return dt, keep_input


def continue_goodput(run) -> None:
    """A resumed run: the goodput.json that the processes before this one saved in the run
    directory is kept as their part of the run (`GoodputRecorder.continue_from`), so
    ``resilax report`` covers the whole run. A damaged file is reported and left out."""
    if not run.run_dir or not os.path.exists(os.path.join(run.run_dir, GOODPUT_FILE)):
        return
    try:
        prev = load_goodput(run.run_dir)
    except GoodputFileError as e:
        warnings.warn(f"resilax: the run's earlier goodput is left out of its report: {e}", RuntimeWarning,
                      stacklevel=3)
        return
    run._goodput_recorder.continue_from(prev)


def save_goodput(run) -> None:
    """Writes the run's goodput.json (after each committed save, and at close); a failure to
    write it is warned about once, never raised. In a multi-process job process 0 writes it:
    each process would write the same file with its own timings, and which came last would
    decide the report."""
    if not run.run_dir or worker.is_standby():
        return  # (a standby process that failed before its go: the run's goodput is the live generation's)
    if jax.process_index() != 0:
        return
    try:
        run._goodput_recorder.save(run.run_dir)
    except OSError as e:
        if not run._goodput_warned:
            run._goodput_warned = True
            warnings.warn(f"resilax: could not write goodput.json to {run.run_dir!r}: {e}", RuntimeWarning, stacklevel=3)
