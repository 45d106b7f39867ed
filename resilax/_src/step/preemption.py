"""Preemption under `resilax launch`: stop every worker after one step, checkpointed.

Every worker stops after the same step (the agreed preemption point,
`worker.preemption_point`), that step is checkpointed, and the next call raises `Preempted`.
Functions of the step (`ResilientStep`), through its public surface.
"""

from __future__ import annotations

from resilax._src.errors import Preempted
from resilax._src.runtime import worker


def refuse_if_preempted(run) -> None:
    """Raises `Preempted` once the job stopped at its preemption point."""
    if run.preempted:
        raise Preempted(f"resilax.ResilientStep: the job was preempted: every worker stopped after step {run.step} "
                        f"and a checkpoint of it was saved; exit, and relaunch to resume", step=run.step)


def stop_if_due(run, saved: bool) -> None:
    """After a step: if it is the preemption point, checkpoints it (unless ``saved``: this
    step's save already started; all processes take part) and waits until it is committed;
    the next call raises `Preempted`."""
    if not worker.preemption_point(run.step):  # SIGTERM reached some worker: every one stops after this step
        return
    ckpt = run._checkpointer
    if ckpt is not None:
        if not saved:
            run.save(run._live)
        ckpt.store.wait()
    run.preempted = True
    run._event("preempted", run.step, checkpoint=ckpt is not None,
              detail="every worker stopped after this step; the next call raises resilax.Preempted")
