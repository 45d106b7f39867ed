"""A real full disk (a tiny tmpfs) under the checkpoint directory: a clear error, nothing lost."""

import gc
import logging
import subprocess
import sys

import jax
import pytest

import resilax
from resilax.tools import example as ex
from helpers import SMALL, state_equal

TOPO = resilax.Topology.emulated(2, 4)


@pytest.fixture
def tiny_fs(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(d)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _step(ckpt):
    template = ex.make_state(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=ex.fsdp_specs(template, "fsdp", 4),
                        config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(ckpt), every=2, keep=50)))
    return template, step


def test_full_disk_is_a_clear_error_and_committed_checkpoints_survive(tiny_fs, capfd, caplog, monkeypatch):
    unraisable = []  # a write completing into a loop Orbax closed: "Event loop is closed"
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    template, step = _step(tiny_fs / "ckpt")
    data = ex.make_iterator(SMALL)
    s = step.init(template, data=data)
    states = {}
    with pytest.raises(resilax.StorageError, match=r"the disk is full .* committed checkpoints are intact"):
        for _ in range(200):
            s, _ = step(s, next(data))
            states[step.step] = jax.device_get(s)
            if step.step % 2 == 0:
                step.checkpoints.wait()  # surface a failed background write at once
    try:
        step.close()
    except resilax.StorageError:
        pass
    committed = step.checkpoints.steps()
    assert committed, "some checkpoints fit before the disk filled"
    # the StorageError is the one message: Orbax's own ERROR records of the failed save (4
    # tracebacks of 30-80 lines, one per thread) go to resilax's debug log (issue 53)
    shown = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name != "resilax"]
    assert not shown, [r.getMessage()[:200] for r in shown]
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, (out + err)[-3000:]
    # a new run restores the newest committed checkpoint, intact
    template, again = _step(tiny_fs / "ckpt")
    restored = again.init(template)
    # the newest committed checkpoint, then the record log's entries written before the
    # disk filled (each checksummed; a torn one ends the replay there)
    assert again.events[0].kind == "restore" and again.events[0].step == max(committed)
    assert again.step >= max(committed)
    assert state_equal(jax.device_get(restored), states[again.step])
    gc.collect()  # a failed write collected unretrieved: "Task exception was never retrieved" (asyncio's ERROR)
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert not unraisable, [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable]


@pytest.mark.filterwarnings("ignore:resilax. could not write goodput.json:RuntimeWarning")
def test_a_run_directory_turned_read_only_at_a_save_is_a_clear_error_and_nothing_saved_is_lost(tiny_fs, monkeypatch):
    """The shared run directory turns read-only (a remount, as an NFS server or a Kubernetes
    volume does on an error) while the job saves: the save fails with a `StorageError` naming
    the directory and the read-only file system, every checkpoint committed before is still
    there and restores, bitwise the state of its step."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    template, step = _step(tiny_fs / "ckpt")
    data = ex.make_iterator(SMALL)
    s = step.init(template, data=data)
    states = {}
    for _ in range(4):  # checkpoints 2 and 4 committed
        s, _ = step(s, next(data))
        states[step.step] = jax.device_get(s)
    step.checkpoints.wait()
    before = step.checkpoints.steps()
    assert before == [2, 4]
    r = subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], capture_output=True)
    assert r.returncode == 0, r.stderr
    try:
        with pytest.raises(resilax.StorageError, match=r"Read-only file system"):
            for _ in range(4):
                s, _ = step(s, next(data))
                if step.step % 2 == 0:
                    step.checkpoints.wait()
        try:
            step.close()
        except resilax.StorageError:
            pass
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tiny_fs)], capture_output=True)
    template, again = _step(tiny_fs / "ckpt")
    restored = again.init(template)
    assert again.checkpoints.steps() == before  # nothing saved was lost or overwritten
    assert again.events[0].kind == "restore" and again.events[0].step == 4
    assert state_equal(jax.device_get(restored), states[again.step])
