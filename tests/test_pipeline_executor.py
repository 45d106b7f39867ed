"""`resilax.PipelineExecutor`: a data x pipeline job whose failure domain is one stage of one
replica (``cpu-2x4-stages``: 2 replicas x 4 stages, one device each). Losing a domain sends
its micro-batches to the same stage of the other replica (ReCycle); healthy, rerouted,
replica-dropped and rejoined runs end bitwise equal on a dropout model with a weighted loss,
also when the domain is lost in the middle of a step, during a save, or twice, and after a
SIGKILL and a resume."""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import ROOT, child_env

import resilax
from resilax._src.pipeline import schedule
from resilax.tools.pipeline_models import executor_case

MODEL, PARAMS, MAKE_BATCHES = executor_case()
BATCHES = MAKE_BATCHES(4)
TX = optax.adam(1e-2)
TOPO = "cpu-2x4-stages"


def _run(events=(), *, schedule="zb-h1", on_failure="reroute", steps=4, tx=TX, save=None, faults=()):
    ex = resilax.PipelineExecutor(MODEL, tx, PARAMS, topology=resilax.Topology.load(TOPO), microbatches=2,
                                  schedule=schedule, on_failure=on_failure, faults=faults)
    losses = []
    for i, b in enumerate(BATCHES[:steps]):
        kw = {}
        for at, kind, dom, *op in events:
            if at == i and kind == "fail":
                ex.fail_domain(dom)
            elif at == i and kind == "fail_mid_step":
                kw["fail_at"] = (op[0], dom)
            elif at == i and kind == "rejoin":
                ex.rejoin(dom)
        losses.append(float(ex(b, **kw)["loss"]))
        if save is not None and i == 1:
            save(ex)
    ex.close()
    return ex, losses


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def reference():
    ex, losses = _run()
    return ex.params(), losses, ex


def test_rerouted_dropped_rejoined_and_twice_failed_runs_end_bitwise_the_healthy_one(reference):
    ref, ref_losses, healthy = reference
    assert healthy.table.lost == frozenset() and not healthy.events
    runs = {
        "rerouted": [(1, "fail", (1, 2))],
        "mid-step, then rejoined": [(1, "fail_mid_step", (0, 1), 9), (3, "rejoin", (0, 1))],
        "two failures, different replicas": [(1, "fail", (0, 1)), (2, "fail", (1, 3))],
    }
    # the same through a fault plan: domain K = replica * 4 + stage
    runs["fault plan: before a step, then mid-step"] = ["fail_slice@1:before_step/1", "fail_slice@2:mid_step/7"]
    for name, events in runs.items():
        ex, losses = _run(faults=events) if name.startswith("fault plan") else _run(events)
        assert losses == ref_losses, name
        assert _equal(ex.params(), ref), name
        # every state replica of every stage is the same bits (a rejoined domain included)
        for s in range(4):
            copies = [ex.state[d] for d in ex.state if d[1] == s]
            assert all(_equal(c, copies[0]) for c in copies[1:]), (name, s)
    ex, _ = _run(runs["rerouted"])
    assert ex.table.lost == {(1, 2)} and ex.table.rerouted_ops()[(0, 2)] > 0  # (0, 2) did replica 1's stage 2
    assert (1, 2) not in ex.table.order and (1, 2) not in ex.state
    mid, _ = _run(runs["mid-step, then rejoined"])
    assert [e["kind"] for e in mid.events] == ["fail", "replan", "replan"] and mid.table.lost == frozenset()
    dropped, losses = _run([(1, "fail", (1, 2))], on_failure="drop")
    assert dropped.table.dropped == {1} and losses == ref_losses and _equal(dropped.params(), ref)


def test_a_failed_domains_buffers_are_gone_and_nothing_runs_there():
    ex, _ = _run(steps=1)
    lost_dev = ex.devices[(1, 2)]
    held = jax.tree.leaves(ex.state[(1, 2)])
    ex.fail_domain((1, 2))
    assert all(x.is_deleted() for x in held)
    ex(BATCHES[1])
    assert set(ex.state) == set(ex.devices) - {(1, 2)}
    for st in ex.state.values():
        assert all(lost_dev not in x.devices() and not x.is_deleted() for x in jax.tree.leaves(st))


def test_the_executors_gradient_is_the_whole_models(reference):
    """One SGD step of rate 1: ``params - new`` is the gradient, against ``jax.grad`` of the
    whole model with the same per-micro-batch keys, summed and normalised as documented."""
    ex = resilax.PipelineExecutor(MODEL, optax.sgd(1.0), PARAMS, replicas=2, stages=4, microbatches=2)
    b = BATCHES[0]
    ex(b)
    got = jax.tree.map(lambda a, n: a - n, PARAMS, ex.params())
    key = jax.random.fold_in(jax.random.key(0), 0)

    def loss(p):
        total, weight = 0.0, 0.0
        for v in range(2):
            for m in range(2):
                k = jax.random.fold_in(jax.random.fold_in(key, v), m)
                rows = slice((v * 2 + m) * 4, (v * 2 + m + 1) * 4)
                mb = jax.tree.map(lambda x: x[rows], b)
                h = MODEL.first(p["first"], mb, jax.random.fold_in(k, 8))
                for layer in range(8):
                    h = MODEL.layer(jax.tree.map(lambda a: a[layer], p["blocks"]), h, jax.random.fold_in(k, layer))
                ls, w = MODEL.last(p["last"], h, mb, jax.random.fold_in(k, 9))
                total, weight = total + ls, weight + w
        return total / weight

    want = jax.grad(loss)(jax.tree.map(jnp.asarray, PARAMS))
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-6)


def test_a_domain_lost_during_a_save_leaves_a_checkpoint_that_restores_bitwise(reference, tmp_path):
    ref = reference[0]
    kept = {}

    def save(ex):  # the save returns once the host has the state; the source domain dies before it is written
        assert next(d for d in sorted(ex.state) if d[1] == 2) == (0, 2)  # stage 2's source: domain K = 2
        kept["params"] = ex.params()
        ex.save(str(tmp_path / "ck"), wait=False)
        assert (0, 2) in ex.lost

    ex, _ = _run(save=save, faults=["fail_slice@2:during_save/2"])
    assert _equal(ex.params(), ref)
    back = resilax.PipelineExecutor(MODEL, TX, PARAMS, topology=resilax.Topology.load(TOPO), microbatches=2,
                                    lost=[(0, 0)])
    assert back.restore(str(tmp_path / "ck")) == 2
    assert _equal(back.params(), kept["params"])
    for b in BATCHES[2:]:
        back(b)
    assert _equal(back.params(), ref)  # resumed on the remaining hardware: the same run


def test_losing_every_replica_of_a_stage_says_rerouting_cannot_help_and_a_global_optimizer_is_refused():
    ex = resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2)
    ex.fail_domain((0, 2))
    with pytest.raises(resilax.StateLostError, match=r"every replica of stage\(s\) \[2\] is lost"):
        ex.fail_domain((1, 2))
    assert ex.events[-1]["kind"] == "reroute_impossible"
    clipped = optax.chain(optax.clip_by_global_norm(1e-3), optax.adam(1e-2))
    with pytest.raises(resilax.PipelineError, match="not separable by stage"):
        resilax.PipelineExecutor(MODEL, clipped, PARAMS, replicas=2, stages=4, microbatches=2)
    with pytest.raises(resilax.PipelineError, match="hang_slice"):
        resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2, faults=["hang_slice@1/2"])
    with pytest.raises(resilax.TopologyError, match=r"\[pipeline\] 2 replicas x 4 stages need one failure domain"):
        resilax.Topology.from_dict({"platform": "cpu", "domains": 4, "devices_per_domain": 1,
                                    "mesh": {"axes": {"data": 4}}, "pipeline": {"replicas": 2, "stages": 4}})


def test_the_tables_the_executor_ran_counted_and_checked():
    for sched in schedule.SCHEDULES:
        for lost in ((), ((1, 2),)):
            t = schedule.rerouted(sched, 2, 4, 2, lost) if lost else schedule.healthy(sched, 2, 4, 2)
            schedule.validate(t)
    ex, _ = _run([(1, "fail", (1, 2))], steps=2, schedule="1f1b")
    ops = sum(sum(c.values()) for c in ex.table.ops_per_domain().values())
    assert ops == 2 * 2 * 4 * 2  # D * M * S * (F + BW)
    assert ex.last_dispatches >= ops - 4  # every op but stage 0's input gradients, plus the adds and updates


def test_sigkill_in_a_rerouted_run_then_resume_ends_bitwise(reference, tmp_path):
    ref = reference[0]
    env = child_env()
    job = [sys.executable, os.path.join(ROOT, "tests", "pipeline_job.py"), str(tmp_path), "4"]
    proc = subprocess.Popen(job, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress = tmp_path / "progress"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if progress.exists() and progress.read_text() == "3":  # rerouted since step 2, checkpoint at 2
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == -signal.SIGKILL, out[-2000:]
    assert not (tmp_path / "final.npz").exists()
    res = subprocess.run(job + ["--resume"], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "resumed at 2" in res.stdout
    with np.load(tmp_path / "final.npz") as f:
        got = [f[f"arr_{i}"] for i in range(len(f.files))]
    assert all(np.array_equal(a, b) for a, b in zip(got, jax.tree.leaves(ref)))


def test_the_pipeline_example_loses_a_stage_rejoins_and_ends_bitwise():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pipeline_gpt.py"), "--steps", "7"],
                         env=child_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "bitwise equal to the failure-free run: True" in res.stdout
    assert "'table': 'rerouted'" in res.stdout and "'table': 'healthy'" in res.stdout


def test_nan_and_spike_steps_are_skipped_on_every_stage_by_the_commit_select(reference):
    """A NaN in one micro-batch's loss weight makes every stage's gradient NaN, and a spiking
    loss (``spike@N``, after ``min_history`` good steps) is an anomaly too: the verdict keeps
    every stage's state as it was (also rerouted), and the next step trains on."""
    bad = jax.tree.map(np.copy, BATCHES[1])
    bad["w"][0] = np.nan
    for lost in ((), ((1, 2),)):
        ex = resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2, lost=lost)
        ex(BATCHES[0])
        before = jax.tree.map(np.asarray, {d: ex.state[d] for d in ex.state})
        out = ex(bad)
        assert not np.isfinite(float(out["loss"])) and int(out["verdict"]) == 1
        assert all(_equal(jax.device_get(ex.state[d]), before[d]) for d in ex.state)
        ex(BATCHES[2])
        assert not _equal(jax.device_get(ex.state[(0, 0)]), before[(0, 0)])
    spiky = resilax.AnomalyConfig(spike_window=3, min_history=2)
    ex = resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2, anomaly=spiky,
                                  faults=["spike@3"], lost=[(0, 1)])
    verdicts = []
    for b in BATCHES * 2:
        before = jax.tree.map(np.asarray, dict(ex.state))
        verdicts.append(int(ex(b)["verdict"]))
        if ex.step_no == 4:
            assert all(_equal(jax.device_get(ex.state[d]), before[d]) for d in ex.state)
    assert verdicts == [0, 0, 0, 2, 0, 0, 0, 0], verdicts
