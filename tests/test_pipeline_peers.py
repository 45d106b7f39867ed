"""Peer copies of `resilax.PipelineExecutor`'s stages taken in the pipeline's bubbles: each
stage's state is copied to a domain of another stage at the points the protection plan puts
into that stage's idle time (checked on the order the executor really dispatched); a stage
whose every replica is lost comes back from its copy, bitwise; one lost while its copy is
pending goes back to the previous complete copies (and replays), or, when those went down
with it, to the checkpoint; a lost keeper's copies are deleted."""

import jax
import numpy as np
import optax
import pytest

import resilax
from resilax._src.pipeline import protection
from resilax.tools.pipeline_models import executor_case

MODEL, PARAMS, MAKE_BATCHES = executor_case()
BATCHES = MAKE_BATCHES(5)
TX = optax.adam(1e-2)
STEPS = 5


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _ex(replicas, **kw):
    return resilax.PipelineExecutor(MODEL, TX, PARAMS, replicas=replicas, stages=4, microbatches=2, **kw)


def _train(ex, fail=None, rejoin=None):
    """Runs to STEPS; ``fail=(step_no, dispatch index, domain)`` loses the domain there; a
    step that finds a stage without a live domain rejoins ``rejoin`` and goes on from the
    step that returns (feeding the batches from there again)."""
    kept, executed = {}, {}
    while ex.step_no < STEPS:
        kw = {"fail_at": fail[1:]} if fail is not None and ex.step_no == fail[0] else {}
        try:
            ex(BATCHES[ex.step_no], **kw)
        except resilax.StateLostError:
            fail = None
            ex.rejoin(rejoin)  # the step it returns is ex.step_no
            continue
        kept[ex.step_no] = ex.params()
        executed[ex.step_no] = {d: list(ops) for d, ops in ex.executed.items()}
    return kept, executed


@pytest.fixture(scope="module")
def one_replica():
    ex = _ex(1, peer_every=1)
    kept, executed = _train(ex)
    return ex, kept, executed


def test_copies_go_where_the_plan_put_them_and_a_lost_stage_comes_back_from_its_copy_bitwise(one_replica):
    ref, ref_kept, ref_executed = one_replica
    plan = ref.protection_plan()
    protection.validate_plan(plan)  # in the replayed timeline: idle time only, no op delayed
    for step in (2, 5):  # every step copies the state of the step before
        for s in range(4):
            d = (0, s)
            ops = ref_executed[step][d]
            got = [sum(o[0] == "op" for o in ops[:i]) for i, o in enumerate(ops) if o[0] == "peer"]
            want = [o.before for o in plan.steady(d, 0) if o.kind == "peer"]
            assert got == want and got, (d, ops, want)
            assert {o[4] for o in ops if o[0] == "peer"} == {(0, (s + 1) % 4)}  # a domain of another stage
            assert sum(o[3] for o in ops if o[0] == "peer") == ref.pieces("peer", s)  # the whole stage
    # (0, 2) is lost halfway through step 3, after its copy of step 2 went out
    ex = _ex(1, peer_every=1)
    kept, _ = _train(ex, fail=(2, len(ex.table.dispatch_order()) // 2, (0, 2)), rejoin=(0, 2))
    kinds = [e["kind"] for e in ex.events]
    assert "rollback" not in kinds and kinds.count("restore_from_peer") == 1
    back = next(e for e in ex.events if e["kind"] == "restore_from_peer")
    assert back["step"] == 2 and back["keeper"] == (0, 3)
    assert all(_equal(kept[k], ref_kept[k]) for k in ref_kept)
    # the same through a fault plan (domain K = replica * 4 + stage): a step that finds the
    # stage gone raises, the next call's planned rejoin fills it and runs the step
    ex = _ex(1, peer_every=1, faults=["fail_slice@2:mid_step/2", "rejoin@2:before_step/2"])
    while ex.step_no < STEPS:
        try:
            ex(BATCHES[ex.step_no])
        except resilax.StateLostError:
            assert ex.step_no == 2 and (0, 2) in ex.lost
    assert [e["kind"] for e in ex.events].count("restore_from_peer") == 1
    assert _equal(ex.params(), ref_kept[STEPS])


def test_a_lost_keepers_copies_are_deleted_and_nothing_reads_them():
    ex = _ex(1, peer_every=1)
    for b in BATCHES[:2]:
        ex(b)
    dev = ex.devices[(0, 2)]
    held = [x for x in ex.peer_copies.arrays() if dev in x.devices()]
    assert held  # (0, 2) keeps stage 1's copy
    with pytest.raises(resilax.StateLostError):
        ex(BATCHES[2], fail_at=(3, (0, 2)))
    assert all(x.is_deleted() for x in held)
    assert not any(dev in x.devices() for x in ex.peer_copies.arrays())
    assert ex.peer_copies.base is None  # stage 1's copy of step 1 went with (0, 2)


def test_a_stage_lost_while_its_copy_is_pending_goes_back_to_the_previous_copies_and_replays_bitwise():
    """2 x 4: (1, 0) is lost at step 1 (rerouted), then (0, 0), stage 0's last replica, at
    the second dispatch of step 4, before its copy of step 3 went out: every stage goes back
    to the copies of step 2 and steps 3 and 4 are recomputed."""
    ref = _ex(2)
    for b in BATCHES:
        ref(b)
    ex = _ex(2, peer_every=1)
    ex(BATCHES[0])
    ex.fail_domain((1, 0))
    kept, _ = _train(ex, fail=(3, 1, (0, 0)), rejoin=(1, 0))
    back = [e for e in ex.events if e["kind"] in ("rollback", "restore_from_peer")]
    assert [(e["kind"], e["step"]) for e in back] == [("rollback", 2), ("restore_from_peer", 2)]
    assert back[0]["from"] == 3
    assert _equal(kept[STEPS], ref.params())


def test_with_one_replica_a_stage_lost_while_its_copy_is_pending_falls_back_to_the_checkpoint(one_replica, tmp_path):
    """1 x 4: (0, 0) keeps stage 3's copies and holds stage 0, whose copy of step 3 is not
    out at the failure: no consistent copies are left, the checkpoint of step 2 is."""
    _, ref_kept, _ = one_replica
    ex = _ex(1, peer_every=1, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    for b in BATCHES[:3]:
        ex(b)
    with pytest.raises(resilax.StateLostError, match="restore a checkpoint"):
        ex(BATCHES[3], fail_at=(1, (0, 0)))
    ex.close()
    again = _ex(1, peer_every=1)  # the replacement hardware
    assert again.restore(str(tmp_path)) == 2
    kept, _ = _train(again)
    assert _equal(kept[STEPS], ref_kept[STEPS])


def test_an_auto_cadence_counts_the_bubbles_as_free():
    small = _ex(1, peer_every="auto", peer_units=0.5)
    big = _ex(1, peers=resilax.PeersConfig(every="auto"), peer_units=8.0)  # the same cadence, named as for wrap
    assert small.peer_copies.every == 1
    plan = protection.place(big.table, {"peer": 8.0}, chunk=0.25)
    assert big.peer_copies.every == protection.cadence(plan, 0.01).every > 1
    assert protection.cadence(plan, 0.01, bubbles=False).every > big.peer_copies.every
    with pytest.raises(resilax.PipelineError, match="not both"):
        _ex(1, peers=resilax.PeersConfig(every=2), peer_every=1)


def test_a_copy_that_does_not_fit_one_steps_bubbles_takes_the_next_ones():
    """Copies every 2 steps of 6 units per stage (24 pieces; a step's bubbles hold 20): the
    plan spreads them over the bubbles of the 2 steps after the copied step, and the
    executor dispatches them there."""
    ex = _ex(1, peer_every=2, peer_units=6.0)
    plan = ex.protection_plan()
    assert plan.every == 2 and not any(plan.spill.values())
    protection.validate_plan(plan)
    _, executed = _train(ex)
    for s in range(4):
        d = (0, s)
        for offset, step in ((0, 3), (1, 4), (0, 5)):  # step 2's copy goes out in steps 3 and 4, step 4's from 5
            ops = executed[step][d]
            got = [(sum(o[0] == "op" for o in ops[:i]), o[3]) for i, o in enumerate(ops) if o[0] == "peer"]
            want = [(o.before, o.chunks) for o in plan.steady(d, offset) if o.kind == "peer"]
            assert got == want, (d, offset, got, want)
        assert sum(o[3] for k in (3, 4) for o in executed[k][d] if o[0] == "peer") == 24
    assert ex.peer_copies.base == 2  # step 4's copy is complete only once step 6's pieces are out too


def test_calibrate_plans_with_measured_costs_and_the_executor_follows_that_plan(one_replica):
    """The op costs and each stage's copy work are timed on this machine's devices; the plan
    (and the auto cadence) uses them, the executor dispatches that plan, and the maths stays
    the same bits."""
    _, ref_kept, _ = one_replica
    ex = _ex(1, peer_every="auto")
    got = ex.calibrate(BATCHES[0], repeats=3)
    assert got["costs"]["F"] == 1.0 and all(v > 0 for v in got["costs"].values())
    assert all(got["work"][s]["peer"] > 0 for s in range(4))
    plan = ex.protection_plan()
    assert dict(plan.costs) == {**plan.costs, **got["costs"]}
    assert {s: dict(w) for s, w in plan.work.items()} == {s: {"peer": got["work"][s]["peer"]} for s in range(4)}
    protection.validate_plan(plan)
    want_every = protection.cadence(protection.place(ex.table, {s: {"peer": got["work"][s]["peer"]} for s in range(4)},
                                                     costs=got["costs"], chunk=0.25), 0.01).every
    assert ex.peer_copies.every == got["every"] == want_every
    kept, executed = _train(ex)
    for s in range(4):  # the copy of step 0 goes out during step 1, as the measured plan says
        ops = executed[1][(0, s)]
        got_at = [(sum(o[0] == "op" for o in ops[:i]), o[3]) for i, o in enumerate(ops) if o[0] == "peer"]
        assert got_at == [(o.before, o.chunks) for o in plan.steady((0, s), 0) if o.kind == "peer"], (s, ops)
    assert _equal(kept[STEPS], ref_kept[STEPS])


def test_the_bench_runs_the_executor_on_its_protection_rows():
    """`resilax bench pipeline --protection` (measured) runs the executor with a checkpoint and
    a peer copy every step at the row's work: every piece went where the plan put it."""
    from resilax.tools.bench_pipeline_measure import protection_check

    got = protection_check(2, 4, 2, "zb-h1", {"snapshot": 0.3, "peer": 0.6}, steps=2)
    assert got == {"executed_as_planned": True, "pieces_per_step": 4 * (2 + 3), "bitwise_with_protection": True,
                   "spilled_pieces": 0}
