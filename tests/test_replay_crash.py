"""Crash recovery without lost work: a real SIGKILL mid-run resumes at the killed step
(checkpoint + replay log), bitwise equal to an uninterrupted run."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from test_replay import assert_bitwise


# ---------------------------------------------------------------- real crashes
def _train_cmd(workdir, *extra, quiet=True):
    return [sys.executable, "-m", "resilax", "train", "--steps", "40", "--checkpoint-every", "10",
            "--checkpoint-dir", str(workdir / "ck"), "--log-mode", "grads", *(["--quiet"] if quiet else []), *extra]


def _final(path):
    z = np.load(path, allow_pickle=False)
    return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request):
    work = tmp_path_factory.mktemp("ref")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).parents[1]), PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    subprocess.run(_train_cmd(work, "--out", str(work / "ref.npz")), check=True, env=env)
    return _final(work / "ref.npz")


def test_sigkill_after_step_resumes_at_that_step(tmp_path, reference, child_env):
    kill_at = 27
    r = subprocess.run(_train_cmd(tmp_path, "--fault", f"kill_process@{kill_at}:after_step"), env=child_env)
    assert r.returncode == -signal.SIGKILL
    r = subprocess.run(_train_cmd(tmp_path, "--out", str(tmp_path / "out.npz"), "--summary", str(tmp_path / "s.json")),
                       env=child_env)
    assert r.returncode == 0
    summ = json.loads((tmp_path / "s.json").read_text())
    # Guarantee: entries up to kill_at - 1 - replay_max_lag (2) are durable; checkpoint 20 is the newest.
    assert kill_at - 3 <= summ["resumed_from"] <= kill_at, summ
    assert summ["resumed_from"] > 20
    assert_bitwise(_final(tmp_path / "out.npz"), reference)


def test_sigkill_at_random_moment_loses_nothing(tmp_path, reference, child_env):
    rng = random.Random()
    p = subprocess.Popen(_train_cmd(tmp_path, "--log-every", "1", quiet=False), env=child_env,
                         stdout=subprocess.PIPE, text=True)
    target = rng.randrange(12, 36)
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
