"""Real processes, real SIGKILL: a killed run started again ends bitwise equal to an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import child_env as _env, flat_equal, load_npz as load, reference_run

STEPS, EVERY = 30, 5


def train_cmd(ckpt, *extra):
    return [sys.executable, "-m", "resilax", "train", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
            "--checkpoint-dir", str(ckpt), "--log-every", "1", *extra]


# The failure-free run every restart here is compared with; test_replay_crash compares with the
# same program (made once per test process: helpers.reference_run).
REFERENCE = ("--steps", STEPS, "--checkpoint-every", EVERY, "--quiet")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, *REFERENCE)


def committed(ckpt):
    return sorted(int(p) for p in os.listdir(ckpt) if p.isdigit())


def finish(tmp_path, ckpt, *extra):
    out = tmp_path / "out.npz"
    summary = tmp_path / "summary.json"
    r = subprocess.run(train_cmd(ckpt, "--out", str(out), "--summary", str(summary), *extra), env=_env(),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return load(out), json.loads(summary.read_text())


def test_sigkill_during_a_checkpoint_save_resumes_bitwise(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    r = subprocess.run(train_cmd(ckpt, "--fault", "kill_process@20:during_save"), env=_env(), capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    # the save of step 20 was in flight: it must not look committed
    assert 20 not in committed(ckpt), os.listdir(ckpt)
    assert any(p.startswith("20.") for p in os.listdir(ckpt)), "the interrupted save left its temporary directory"
    state, summary = finish(tmp_path, ckpt)
    assert summary["checkpoint_step"] == 15
    assert 20 - 2 <= summary["resumed_from"] <= 20
    assert not any(p.startswith("20.") and "tmp" in p for p in os.listdir(ckpt)), "temporary directory cleaned up"
    assert flat_equal(state, reference)


def test_slice_loss_then_sigkill_resumes_near_the_kill(tmp_path):
    """Every protection on by default: a slice is lost mid-step at 12 (the run goes on on
    one slice), then the process is SIGKILLed at 20. The restart (the same command without
    faults) resumes within LogConfig.max_lag of the kill, from the newest checkpoint plus the
    record log, and ends bitwise where a failure-free run ends (the CLI's default is the
    bit-exact mode; the default mode's 1e-4 is checked in test_pipeline). (60 steps, a
    checkpoint every 10, the loss at 30 and the kill at 50 until this was scaled by 0.4 for
    test time: the same checkpoint steps relative to the faults.)"""
    base = [sys.executable, "-m", "resilax", "train", "--steps", "24", "--checkpoint-every", "4", "--layout", "sharded",
            "--quiet"]
    ref = subprocess.run(base + ["--checkpoint-dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.npz")],
                         env=_env(), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    d = str(tmp_path / "D")
    r = subprocess.run(base + ["--checkpoint-dir", d, "--fault", "fail_slice@12:mid_step/1", "--fault", "kill_process@20"],
                       env=_env(), capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    r = subprocess.run(base + ["--checkpoint-dir", d, "--out", str(tmp_path / "got.npz"),
                               "--summary", str(tmp_path / "s.json")], env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert 18 <= summary["resumed_from"] <= 20 and summary["checkpoint_step"] <= summary["resumed_from"]
    got, want = load(tmp_path / "got.npz"), load(tmp_path / "ref.npz")
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k
