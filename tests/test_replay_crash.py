"""Crash recovery without lost work: a real SIGKILL mid-run resumes at the killed step
(checkpoint + replay log), bitwise equal to an uninterrupted run.

A kill right after a step (the fault plan's, resumed past the newest checkpoint with the
default log mode) is the demo's (test_cli), which was also test_crash's own test until the
suite had to fit in ten minutes; the kills at random moments below are external (the parent
kills the child), with the log in grads mode (entries of gradients, not only of inputs), and
carry the assertions of all three."""

import os
import random
import re
import signal
import subprocess
import time

import pytest

from helpers import child_env, flat_equal, reference_run
from test_crash import REFERENCE, committed, finish, train_cmd


GRADS = ("--log-mode", "grads")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, *REFERENCE)  # test_crash's: the same program


def test_random_external_sigkills_resume_bitwise_and_lose_nothing(tmp_path, reference):
    """The parent kills the child at random moments (mid-step, mid-save, whenever), three
    times; each restart resumes no earlier than `replay_max_lag` (2) steps before the last
    step the killed run printed, and the last one ends bitwise equal to the reference."""
    # a new draw each run (the kill moments explore), reproducible: RESILAX_TEST_SEED=<seed>
    seed = int(os.environ.get("RESILAX_TEST_SEED", "0")) or random.randrange(1, 1 << 31)
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    kills, last = [], None  # last: the newest step the previous (killed) run printed
    for life in range(3):
        target = rng.randrange(3, 12)
        err = open(tmp_path / f"stderr{life}.txt", "w")
        p = subprocess.Popen(train_cmd(ckpt, *GRADS), env=child_env(), stdout=subprocess.PIPE, stderr=err, text=True)
        seen = 0
        for line in p.stdout:
            m = re.match(r"resumed at step (\d+)", line)
            if m:
                # At least every step up to `last - 1 - replay_max_lag` was durable when the kill came.
                assert last is not None and int(m.group(1)) >= last - 3, (seed, last, line)
            if line.startswith("step"):
                seen += 1
                last = int(line.split()[1].split("/")[0])
                if seen >= target:
                    time.sleep(rng.uniform(0, 0.05))
                    os.kill(p.pid, signal.SIGKILL)
                    break
        p.wait()
        err.close()
        if p.returncode == 0:
            break  # it finished before we got to kill it
        assert p.returncode == -signal.SIGKILL, (seed, (tmp_path / f"stderr{life}.txt").read_text()[-3000:])
        kills.append(committed(ckpt)[-1] if committed(ckpt) else 0)
    assert kills, "at least one kill happened"
    state, summary = finish(tmp_path, ckpt, *GRADS)
    if len(kills) == 3:
        assert summary["resumed_from"] >= last - 3, (seed, last, summary)
    assert flat_equal(state, reference), seed
