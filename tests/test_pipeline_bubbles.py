"""Checkpoints of `resilax.PipelineExecutor` taken in the pipeline's bubbles: each stage's state
is copied to the host in pieces at the points the protection plan puts into that stage's idle
time during the next step (checked on the order the executor really dispatched), and
committed as one checkpoint that restores bitwise, also when the stage's source domain is
lost while its part is pending, and after a SIGKILL halfway through the step that takes the
parts."""

import os
import subprocess
import sys

import jax
import numpy as np
import optax

from helpers import ROOT, child_env

import resilax
from resilax._src.pipeline import protection
from resilax.tools.pipeline_models import executor_case

MODEL, PARAMS, MAKE_BATCHES = executor_case()
BATCHES = MAKE_BATCHES(6)
TX = optax.adam(1e-2)


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _run(tmp_path, faults=(), steps=5, placement="bubbles"):
    ex = resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2,
                                  checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2,
                                  checkpoint_placement=placement, faults=faults)
    kept, executed = {}, {}
    for b in BATCHES[:steps]:
        ex(b)
        kept[ex.step_no] = ex.params()
        executed[ex.step_no] = {d: list(ops) for d, ops in ex.bubbles.executed.items()}
    ex.close()
    return ex, kept, executed


def _restored(tmp_path, step):
    back = resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2)
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(str(tmp_path / "ck")) as mgr:  # keep only checkpoints up to `step`
        for s in mgr.all_steps():
            if s > step:
                mgr.delete(s)
    assert back.restore(str(tmp_path / "ck")) == step
    return back.params()


def test_each_stages_parts_go_where_the_plan_put_them_and_the_checkpoint_restores_bitwise(tmp_path):
    ex, kept, executed = _run(tmp_path)
    assert ex.bubbles.committed == [2, 4]
    plan = ex.bubbles._plan()
    protection.validate_plan(plan)  # in the replayed timeline: idle time only, no op delayed
    for s in range(4):
        d = (0, s)  # the stage's source: its lowest live replica
        ops = executed[3][d]  # step 3 takes checkpoint 2's parts
        got = [i - n for n, i in enumerate(k for k, o in enumerate(ops) if o[0] == "snapshot")]
        want = [o.before for o in plan.steady(d, 0) if o.kind == "snapshot"]
        assert got == want and got, (d, ops, want)
        assert all(o[0] != "snapshot" for o in executed[3][(1, s)])  # one replica per stage copies
        # every stage but the first starts idle: its part goes before its first op
        if s > 0:
            assert ops[0][0] == "snapshot"
    assert all(o[0] != "snapshot" for ops in executed[2].values() for o in ops)  # nothing due in step 2
    assert _equal(_restored(tmp_path, 4), kept[4])


def test_a_source_lost_while_its_part_is_pending_is_covered_by_its_peer(tmp_path):
    ex, kept, executed = _run(tmp_path, faults=["fail_slice@2:mid_step/2"], steps=4)  # (0, 2), during step 3
    assert (0, 2) in ex.lost and 2 in ex.bubbles.committed
    assert any(o[0] == "snapshot" and o[1] == 2 for o in executed[3][(1, 2)])  # retaken from replica 1
    ref = _run(tmp_path / "ref", steps=4)[1]
    assert _equal(kept[4], ref[4])  # the failure changed nothing of the run
    assert _equal(_restored(tmp_path, 2), ref[2])


def test_a_kill_halfway_through_the_step_that_takes_the_parts_then_resume_is_bitwise(tmp_path):
    job = [sys.executable, os.path.join(ROOT, "tests", "pipeline_job.py"), str(tmp_path), "6", "--bubbles"]
    killed = subprocess.run(job, env=child_env(), capture_output=True, text=True, timeout=240)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert sorted(int(p) for p in os.listdir(tmp_path / "ckpt") if p.isdigit()) == [2]  # 4's parts: never written
    res = subprocess.run(job + ["--resume"], env=child_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "resumed at 2" in res.stdout
    ex, kept, _ = _run(tmp_path / "ref", steps=6)
    with np.load(tmp_path / "final.npz") as f:
        got = [f[f"arr_{i}"] for i in range(len(f.files))]
    assert all(np.array_equal(a, b) for a, b in zip(got, jax.tree.leaves(kept[6])))


def test_an_auto_cadence_counts_the_bubbles_as_free_and_checkpoints_that_often(tmp_path):
    """``checkpoint_every="auto"``: small snapshots fit the bubbles every step; larger ones
    get the fewest steps between checkpoints that keep them within 1% of the step, and the
    executor writes exactly those checkpoints."""
    small = resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2,
                                     checkpoint_dir=str(tmp_path / "a"), checkpoint_every="auto", checkpoint_units=0.25)
    big = resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=2, stages=4, microbatches=2,
                                   checkpoint_dir=str(tmp_path / "b"), checkpoint_every="auto", checkpoint_units=8.0)
    assert small.bubbles.every == 1
    plan = protection.place(big.table, {"snapshot": 8.0}, chunk=0.25)
    assert big.bubbles.every == protection.cadence(plan, 0.01).every > 1
    assert protection.cadence(plan, 0.01, bubbles=False).every > big.bubbles.every  # the bubbles bought steps
    n = big.bubbles.every
    for b in (BATCHES * 4)[: 2 * n + 1]:
        big(b)
    big.close()
    assert big.bubbles.committed == [n, 2 * n]
