"""Verdicts are records (issue 27): a step skipped for NaN/Inf or a loss spike stays skipped
across a SIGKILL and restart with the same fault plan, a slice loss, and replay from the
record log in grads and inputs mode; each run ends bitwise where the uninterrupted run
with the same plan ends.

A killed run is a real child process (this file run as a script); its restart runs here,
with the same plan, and is compared with a failure-free reference run here (same config,
same plan without the kill). Tiny models, a dozen steps."""

import json
import os
import signal
import subprocess
import sys

import jax

if __name__ == "__main__":  # the killed child: its devices before anything starts JAX
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import pytest

import resilax
from resilax._src.errors import StorageError
from resilax._src.protect import anomaly
from resilax._src.runtime.faults import FaultPlan
from resilax.tools.models import CASES

STEPS, EVERY = 12, 4


class Batches:
    """A deterministic data iterator over a list of batches (get_state/set_state like grain's)."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def __iter__(self):
        return self

    def __next__(self):
        b = self.batches[self.i]
        self.i += 1
        return b

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def _batches(model, data_nan):
    bs = CASES[model].make_batches(STEPS + 2)
    if data_nan is not None:  # a NaN produced by the data itself
        bs[data_nan] = dict(bs[data_nan], x=np.where(np.arange(bs[data_nan]["x"].shape[1]) == 3, np.nan,
                                                     bs[data_nan]["x"]).astype(np.float32))
    return bs


def run(work, faults, *, model="dropout_mlp", log="inputs", data_nan=None, deterministic=False, steps=STEPS,
        layout="fsdp", peers_between=True):
    """The run of one case (resumes from ``work`` when something is there). Returns
    ``(final state as {path: array}, events)``."""
    case = CASES[model]
    ck = resilax.CheckpointConfig(os.path.join(work, "ck"), every=EVERY) if work else None
    logc = None
    if log is not None:
        logc = resilax.LogConfig(mode=log, grads_budget=None,
                                 directory=os.path.join(work, "log") if work else None)
    cfg = resilax.Config(checkpoint=ck, log=logc, peers=resilax.PeersConfig(every=3, log_entries_between=peers_between),
                         anomaly=resilax.AnomalyConfig(min_history=3, spike_window=8),
                         deterministic=resilax.DeterministicConfig() if deterministic else None)
    st = case.make_state(0)
    topo = resilax.Topology.emulated(2, 4)
    spec, n = (jax.sharding.PartitionSpec("fsdp"), 4) if layout == "fsdp" else (
        jax.sharding.PartitionSpec(("data", "fsdp")), 8)  # "sharded": one copy of each shard, peers hold the other
    shard = jax.tree.map(lambda x: spec if np.ndim(x) and np.shape(x)[0] % n == 0 else jax.sharding.PartitionSpec(), st)
    step = resilax.wrap(case.train_step, topology=topo, state_sharding=shard, rng=True, config=cfg,
                        metric_reductions=case.metric_reductions, faults=FaultPlan(faults))
    data = Batches(_batches(model, data_nan))
    with step:
        s = step.init(st, data=data if log == "inputs" else None)
        while step.step < steps:
            b = next(data) if log == "inputs" else data.batches[step.step]
            s, _ = step(s, b)
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(s)[0]}
    return flat, [(e.kind, e.step, dict(e.fields)) for e in step.events]


def _equal(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _skipped(events):
    return sorted({(s, f["cause"]) for k, s, f in events if k == "anomaly"})


CASES_KILL = {
    # name: (faults without the kill, the kill, run options)
    "nan_at_ckpt_inputs_log": (["nan@8"], "kill_process@10", dict(log="inputs")),
    "nan_before_and_after_ckpt_grads_log": (["nan@7", "nan@9:before_step"], "kill_process@11", dict(log="grads")),
    "nan_during_save": (["nan@8"], "kill_process@8:during_save", dict(log="inputs")),
    "nan_at_ckpt_no_log": (["nan@8"], "kill_process@10", dict(log=None)),
    "spike_after_ckpt": (["spike@9"], "kill_process@11", dict(log="inputs")),
    "data_nan_bn": ([], "kill_process@11", dict(log="grads", data_nan=9, model="batchnorm_mlp")),
}

_REFS: dict = {}


def _reference(faults, opts):
    key = (tuple(faults), tuple(sorted(opts.items())))
    if key not in _REFS:
        _REFS[key] = run(None, faults, **dict(opts, log=opts.get("log") and "grads"))
    return _REFS[key]


@pytest.mark.parametrize("name", list(CASES_KILL))
def test_sigkill_and_restart_with_the_same_plan_is_bitwise(tmp_path, name, child_env):
    faults, kill, opts = CASES_KILL[name]
    plan = faults + [kill]
    arg = json.dumps({"work": str(tmp_path), "faults": plan, "opts": opts})
    r = subprocess.run([sys.executable, __file__, arg], env=child_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    got, events = run(str(tmp_path), plan, **opts)  # the same command again: the same plan
    ref, ref_events = _reference(faults, opts)
    skipped = _skipped(ref_events)
    assert skipped, "the reference run skipped no step: the fault had no effect"
    assert _equal(got, ref), f"{name}: the restart is not bitwise the uninterrupted run (skipped {skipped})"
    resumed = [e for e in events if e[0] in ("restore", "replay")]
    assert resumed, "the restart did not resume"
    # the restart judged or replayed the skipped steps after its checkpoint as the first run did
    start = min(e[1] if e[0] == "restore" else e[2]["from_step"] for e in resumed)
    assert {s for s, _ in _skipped(events)} == {s for s, _ in skipped if s >= start}


def test_restart_without_the_verdicts_would_differ():
    """The comparison above can fail: the same runs without the NaN end elsewhere."""
    faults, _, opts = CASES_KILL["nan_at_ckpt_inputs_log"]
    assert not _equal(_reference([], opts)[0], _reference(faults, opts)[0])


def _rel(a, b):
    return max(float(np.linalg.norm(a[k].astype(np.float64) - b[k]) / max(np.linalg.norm(b[k].astype(np.float64)), 1e-30))
               for k in b)


@pytest.mark.parametrize("faults,redo", [
    # the step in flight (9) and the one before it get NaN; rebuilt from the peer copy of 9
    (["nan@8", "nan@9:before_step", "fail_slice@9:mid_step/1"], {9}),
    # a spike between peer copies (9, 12), redone from the retained batches
    (["spike@9", "fail_slice@10:mid_step/0"], {9, 10}),
])
def test_slice_loss_redoes_steps_with_their_recorded_verdicts(faults, redo):
    """A slice loss rebuilds the state from the peer copy and redoes the steps after it from
    the retained batches (state sharded over both slices; no log entries between copies):
    each redone step is gated by its recorded verdict, the injected NaN or spike is not
    injected again. The default mode: the rest runs on one slice (same maths up to reduction
    order), so the comparison has a tolerance far below one step's update."""
    grad_only = [f for f in faults if not f.startswith("fail_slice")]
    opts = dict(log="grads", layout="sharded", peers_between=False)
    got, events = run(None, faults, **opts)
    rec = [e for e in events if e[0] == "recovery"]
    assert rec and rec[0][2]["source"] == "peer" and rec[0][2]["steps_recomputed"] == len(redo), rec
    ref, ref_events = _reference(grad_only, opts)
    assert {s for s, _ in _skipped(ref_events)} & redo
    assert _rel(got, ref) < 1e-5
    assert _rel(_reference([], opts)[0], ref) > 1e-3  # a skipped step applied would be far off


# ---------------------------------------------------------------- units
def test_fault_plan_on_restart():
    plan = FaultPlan(["nan@3", "nan@5", "spike@6:before_step", "fail_slice@5:after_step/1", "fail_slice@5:mid_step/1",
                      "kill_process@7", "rejoin@9/1"])
    dropped = plan.resume(5, None)
    assert sorted(f.spec() for f in dropped) == ["fail_slice@5:after_step/1", "nan@3:after_step"]
    left = {f.spec() for f in plan.pending}
    # nan@5:after_step belongs to step index 5, which the restart computes: it fires before it
    assert "nan@5:before_step" in left and "fail_slice@5:mid_step/1" in left and "kill_process@7:after_step" in left


def test_a_kill_fires_once_per_run_directory(tmp_path, monkeypatch):
    import resilax._src.runtime.faults as F

    killed = []
    monkeypatch.setitem(F._KINDS, "kill_process", lambda f, ctx: killed.append(f.spec()))
    plan = FaultPlan(["kill_process@4"])
    plan.resume(0, str(tmp_path))
    plan.fire("after_step", 4)
    assert killed == ["kill_process@4:after_step"]
    again = FaultPlan(["fail_slice@3:mid_step/1", "kill_process@4", "fail_slice@4:after_step/0", "nan@3",
                       "fail_slice@4:mid_step/1"])
    # the kill and what came no later than it happened to the process that died; nan@3 is
    # injected again (step 3 is computed again); what comes after the kill fires as planned
    assert [f.spec() for f in again.resume(2, str(tmp_path))] == [
        "fail_slice@3:mid_step/1", "kill_process@4:after_step", "fail_slice@4:after_step/0"]
    assert [f.spec() for f in again.pending] == ["nan@3:after_step", "fail_slice@4:mid_step/1"]
    (tmp_path / F.FIRED_FILE).write_text((tmp_path / F.FIRED_FILE).read_text()[:-5])  # truncated
    with pytest.raises(StorageError, match="truncated or corrupt"):
        FaultPlan(["kill_process@4"]).resume(2, str(tmp_path))


def test_recorded_verdict_is_checked():
    assert anomaly.recorded_verdict(np.int32(2), 3) == anomaly.SPIKE
    for bad in (None, 7, "1", 1.0):
        with pytest.raises(resilax.ReplayLogError, match="step 3 has no valid recorded verdict"):
            anomaly.recorded_verdict(bad, 3)


def test_replay_passes_the_recorded_verdicts(tmp_path):
    from resilax._src.protect.disk_log import DiskLog
    from resilax._src.protect.replay import replay

    log = DiskLog(tmp_path / "log")
    for s, v in enumerate((0, 1, 2)):
        log.append(s, recorded={"g": np.full(2, s, np.float32)}, scalars={"verdict": v, "value": 1.0})
    log.append(3, recorded={"g": np.zeros(2, np.float32)}, scalars={"value": 1.0})  # no verdict
    log.close()
    seen = []
    out = replay(0, log, 0, 3, update=lambda st, s, rec, sig, v: seen.append((s, v)) or st, verdicts=True)
    assert seen == [(0, 0), (1, 1), (2, 2)] and out.verdicts == (0, 1, 2)
    with pytest.raises(resilax.ReplayLogError, match="step 3 has no valid recorded verdict"):
        replay(0, log, 3, 4, update=lambda st, *a: st, verdicts=True)


class _Pending:
    """A verdict whose computation has not finished: reading it would block."""

    def __init__(self, v):
        self.v, self.ready = v, False

    def is_ready(self):
        return self.ready

    def copy_to_host_async(self):
        pass

    def __array__(self, *a, **k):
        if not self.ready:
            raise AssertionError("the watcher read a verdict that was not ready (the step would wait)")
        return np.asarray(self.v, np.int32)


class _Run:
    step = 0

    def __init__(self):
        self.events = []

    def _event(self, kind, step, **f):
        self.events.append((kind, step, f))

    def _goodput_lost_step(self):
        pass


def test_watch_never_reads_a_verdict_that_is_not_ready():
    from types import SimpleNamespace

    w = anomaly.Watch(resilax.AnomalyConfig())
    run = _Run()
    vs = [_Pending(v) for v in (0, 1, 0, 2)]
    for i, v in enumerate(vs):
        w.after_step(run, SimpleNamespace(step=i, gout=SimpleNamespace(ok=v, loss=None)))
    assert not run.events and len(w._queue) == 4
    vs[0].ready = vs[1].ready = True
    w.after_step(run, SimpleNamespace(step=4, gout=SimpleNamespace(ok=np.int32(0), loss=None)))
    assert [e[1] for e in run.events] == [1] and len(w._queue) == 3  # judged in order, up to the first not ready
    for v in vs:
        v.ready = True
    run.step = 5
    rec = w.record(run)  # a flush point: reads them all
    assert rec["skipped"] == [[1, 1], [3, 2]] and rec["through"] == 4 and not w._queue


if __name__ == "__main__":  # the child that is killed
    a = json.loads(sys.argv[1])
    run(a["work"], a["faults"], **a["opts"])
    sys.exit(3)  # the kill should have fired
