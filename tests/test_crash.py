"""Real processes, real SIGKILL: a killed run started again ends bitwise equal to an uninterrupted one."""

import io
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
    test time: the same checkpoint steps relative to the faults.) A NaN at 6 and a loss spike at
    15, in every run, are skipped alike (their verdicts are records). Each fault is one line
    of the output and no run prints a traceback (issue 53)."""
    base = [sys.executable, "-m", "resilax", "train", "--steps", "24", "--checkpoint-every", "4", "--layout", "sharded",
            "--quiet", "--fault", "nan@6", "--fault", "spike@15"]
    ref = subprocess.run(base + ["--checkpoint-dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.npz")],
                         env=_env(), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    d = str(tmp_path / "D")
    r = subprocess.run(base + ["--checkpoint-dir", d, "--fault", "fail_slice@12:mid_step/1", "--fault", "kill_process@20"],
                       env=_env(), capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    text = r.stdout + r.stderr
    assert "Traceback" not in text, text[-4000:]
    for said in ("step 6: NaN/Inf in the step's values: its update was skipped inside the step",
                 "step 15: a loss spike (", "slice(s) [1] lost; state from"):
        assert len([ln for ln in text.splitlines() if said in ln]) == 1, (said, text[-3000:])
    r = subprocess.run(base + ["--checkpoint-dir", d, "--out", str(tmp_path / "got.npz"),
                               "--summary", str(tmp_path / "s.json")], env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    text = _no_traceback(r)
    assert "resumed at step" in text and "faults done before this restart (not fired again): " in text, text[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert 18 <= summary["resumed_from"] <= 20 and summary["checkpoint_step"] <= summary["resumed_from"]
    got, want = load(tmp_path / "got.npz"), load(tmp_path / "ref.npz")
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    # the run's report covers both processes: the killed one's (as of the goodput.json it
    # wrote after its last committed checkpoint) and the restart's resume
    from resilax.tools.report import report

    rep = report(d, png=False, out=io.StringIO())
    lines = rep["events"]
    assert any(ln.startswith("process 1 of 2:") and "step 6: NaN/Inf" in ln for ln in lines), lines
    assert any(ln.startswith("process 2 of 2:") for ln in lines), lines
    assert rep["totals"]["lost"] > 0 and min(rep["totals"].values()) >= 0, rep["totals"]
    assert sum(rep["totals"].values()) == pytest.approx(rep["wall_s"])


def _no_traceback(r):
    """A run that ended 0 printed no traceback (resilax's own threads and the ones it abandons,
    Orbax's and tensorstore's included, end quietly: issue 53)."""
    text = r.stdout + r.stderr
    assert "Traceback" not in text and "Event loop is closed" not in text and "never retrieved" not in text, text[-4000:]
    return text


def test_a_corrupt_newest_checkpoint_and_a_torn_log_entry_say_one_line_each_and_end_bitwise(tmp_path, reference):
    """A user's view of two storage faults at one restart: the process is SIGKILLed after step
    22, then the newest checkpoint's OCDBT root node gets 64 bytes flipped (every array read
    fails: Orbax's gather raised on the first while the others were in flight, which printed
    27-54 asyncio tracebacks) and the log entry of step 17 is cut in half. The restart quarantines
    the checkpoint, restores the previous one, replays the log up to the torn entry, trains
    the rest from the data and ends bitwise the uninterrupted run; its output is one line per
    event and no traceback."""
    ckpt = tmp_path / "ckpt"
    r = subprocess.run(train_cmd(ckpt, "--fault", "kill_process@22", "--quiet"), env=_env(), capture_output=True,
                       text=True)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    newest = committed(ckpt)[-1]
    assert newest >= 15, committed(ckpt)
    root = [p for p in (ckpt / str(newest) / "state" / "d").iterdir()]  # the OCDBT b-tree nodes (CRC-checked)
    assert root, "the checkpoint has its b-tree node files"
    for victim in root:
        raw = bytearray(victim.read_bytes())
        for i in range(len(raw) // 2, min(len(raw) // 2 + 64, len(raw))):
            raw[i] ^= 0xFF
        victim.write_bytes(bytes(raw))
    torn = newest - 3
    for entry in (ckpt / "record_log").glob(f"{torn:010d}.*.rxl"):
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    out, summary = tmp_path / "out.npz", tmp_path / "summary.json"
    r = subprocess.run(train_cmd(ckpt, "--fault", "kill_process@22", "--out", str(out), "--summary", str(summary)),
                       env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    text = _no_traceback(r)
    assert flat_equal(load(out), reference), "the restart is not bitwise the uninterrupted run"
    s = json.loads(summary.read_text())
    assert s["checkpoint_step"] == newest - EVERY and s["resumed_from"] == torn, s["events"][:3]
    # one line each: the checkpoint that failed, what was restored instead and where the bad
    # one went; the entry that could not be used and that nothing is lost
    bad = [ln for ln in text.splitlines() if f"checkpoint(s) [{newest}]" in ln]
    assert len(bad) == 1 and "failed verification" in bad[0] and "CRC-32C" in bad[0], text[-3000:]
    assert f"restored the previous good checkpoint {newest - EVERY} instead" in bad[0] and "quarantine/" in bad[0]
    assert "tensorstore_spec" not in text and len(bad[0]) < 600, bad[0]
    line = [ln for ln in text.splitlines() if f"the entry of step {torn} is unusable" in ln]
    assert len(line) == 1 and "truncated" in line[0] and "nothing is lost" in line[0], text[-3000:]
    assert f"resumed at step {torn} (checkpoint + {torn - newest + EVERY} steps replayed from the log)" in text
    # `resilax report` lists the same events in the same words
    rep = subprocess.run([sys.executable, "-m", "resilax", "report", str(ckpt), "--no-png"], env=_env(),
                         capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert bad[0].split("checkpoint(s) ", 1)[1] in rep.stdout and line[0] in rep.stdout, rep.stdout


def test_a_second_run_in_a_checkpoint_directory_in_use_is_refused_and_a_resume_after_a_kill_is_bitwise(
        tmp_path, reference):
    """Two runs in one checkpoint directory delete each other's checkpoints (Orbax keeps the
    newest of whatever it finds there) and a resume may read the other's. A single-process
    run holds its checkpoint directory (an flock the kernel drops with the process): while
    the first run is still alive (its main thread hung after step 12, past checkpoint 10),
    a second one exits 2 with one line naming the directory and the first run's pid, and
    no checkpoint changes. Once the first is SIGKILLed, a run there resumes from its newest
    checkpoint and ends bitwise equal to a failure-free run."""
    import time

    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen(train_cmd(ckpt, "--fault", "hang@12:after_step"), env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.time()
        while 10 not in committed(ckpt) if ckpt.is_dir() else True:
            assert first.poll() is None and time.time() - t0 < 120, "the first run did not commit checkpoint 10"
            time.sleep(0.1)
        before = committed(ckpt)
        r = subprocess.run(train_cmd(ckpt), env=_env(), capture_output=True, text=True, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("resilax")]
        assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
        assert f"the checkpoint directory {str(ckpt)!r} is in use by another run (pid {first.pid}," in lines[0], lines
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        assert first.poll() is None and committed(ckpt) == before, (committed(ckpt), before)
    finally:
        first.kill()
        first.wait(timeout=30)
    state, summary = finish(tmp_path, ckpt)
    assert summary["checkpoint_step"] >= 10 and summary["resumed_from"] >= 10, summary
    assert flat_equal(state, reference)
