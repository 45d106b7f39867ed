"""A pipelined job on `resilax.PipelineExecutor` for tests/test_pipeline_executor.py's kill and
resume: 2 replicas x 4 stages on 8 CPU devices, domain (1, 2) lost from step 2 on (rerouted),
a checkpoint every 2 steps; writes ``DIR/progress`` after each step and ``DIR/final.npz`` at
the end. A restart (``--resume``) runs on the hardware that is left: (1, 2) lost from the start.

``--bubbles``: instead, checkpoints every 2 steps taken in the bubbles of the step after,
and a SIGKILL halfway through step 5 (checkpoint 4's parts partly on the host, not written);
the restart resumes from checkpoint 2.

Usage: python tests/pipeline_job.py DIR STEPS [--resume] [--bubbles]
"""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import resilax  # noqa: E402
from resilax.tools.pipeline_models import executor_case  # noqa: E402

LOST, FAIL_AT = (1, 2), 2


def main(run_dir, steps, resume, bubbles):
    model, params, make_batches = executor_case()
    batches = make_batches(steps)
    ckpt = os.path.join(run_dir, "ckpt")
    if bubbles:
        kw = dict(checkpoint_dir=ckpt, checkpoint_every=2, faults=[] if resume else ["kill_process@4:mid_step"])
    else:
        kw = dict(lost=[LOST] if resume else ())
    ex = resilax.PipelineExecutor(model, optax.adam(1e-2), params, topology=resilax.Topology.load("cpu-2x4-stages"),
                                  microbatches=2, **kw)
    if resume:
        print("resumed at", ex.restore(ckpt), flush=True)
    while ex.step_no < steps:
        if ex.step_no == FAIL_AT and not resume and not bubbles:
            ex.fail_domain(LOST)
        jax.block_until_ready(ex(batches[ex.step_no]))
        if bubbles and ex.step_no == 4 and ex.bubbles._mgr is not None:
            ex.bubbles._mgr.wait_until_finished()  # checkpoint 2 on disk before the kill, however loaded the host
        if ex.step_no % 2 == 0 and not bubbles:
            ex.save(ckpt)
        with open(os.path.join(run_dir, "progress"), "w") as f:
            f.write(str(ex.step_no))
    ex.close()
    np.savez(os.path.join(run_dir, "final.npz"), *jax.tree.leaves(ex.params()))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--resume" in sys.argv, "--bubbles" in sys.argv)
