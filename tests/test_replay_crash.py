"""Crash recovery without lost work: a real SIGKILL mid-run resumes at the killed step
(checkpoint + replay log), bitwise equal to an uninterrupted run.

The kill right after a step (grads mode, resumed past the newest checkpoint) is
test_crash.test_sigkill_after_a_step_resumes_bitwise: it was the same two processes as that
test's, with the same assertions."""

import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import reference_run
from test_crash import REFERENCE
from test_replay import assert_bitwise


# ---------------------------------------------------------------- real crashes
# the program of test_crash's reference run (30 steps, a checkpoint every 5): it is shared
def _train_cmd(workdir, *extra, quiet=True):
    return [sys.executable, "-m", "resilax", "train", "--steps", "30", "--checkpoint-every", "5",
            "--checkpoint-dir", str(workdir / "ck"), "--log-mode", "grads", *(["--quiet"] if quiet else []), *extra]


def _final(path):
    z = np.load(path, allow_pickle=False)
    return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    assert REFERENCE[:4] == ("--steps", 30, "--checkpoint-every", 5)
    return reference_run(tmp_path_factory, *REFERENCE)


def test_sigkill_at_random_moment_loses_nothing(tmp_path, reference, child_env):
    rng = random.Random()
    p = subprocess.Popen(_train_cmd(tmp_path, "--log-every", "1", quiet=False), env=child_env,
                         stdout=subprocess.PIPE, text=True)
    target = rng.randrange(9, 26)  # 12..35 of 40 steps until 30 were enough: the same 4 steps' margin at the end
    seen = 0
    for line in p.stdout:
        if line.startswith("step"):
            seen = int(line.split()[1].split("/")[0])
            if seen >= target:
                time.sleep(rng.random() * 0.05)
                p.send_signal(signal.SIGKILL)
                break
    p.wait()
    assert p.returncode == -signal.SIGKILL, f"finished before the kill (saw step {seen})"
    r = subprocess.run(_train_cmd(tmp_path, "--out", str(tmp_path / "out.npz"), "--summary", str(tmp_path / "s.json")),
                       env=child_env)
    assert r.returncode == 0
    summ = json.loads((tmp_path / "s.json").read_text())
    # At least every step up to `seen - 1 - replay_max_lag` was durable when the kill came.
    assert summ["resumed_from"] >= seen - 3, (seen, summ)
    assert_bitwise(_final(tmp_path / "out.npz"), reference)
