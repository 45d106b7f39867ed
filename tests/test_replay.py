"""Replay log and replay: bitwise-exact resume in grads and inputs modes, corrupt and
truncated entries, the selective policy, and a real SIGKILL mid-run."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import resilax
from resilax.tools import example as ex
from resilax._src.protect.disk_log import DiskLog, SelectivePolicy, decode_entry, encode_entry
from resilax._src.protect.replay import replay

SPEC = ex.ExampleSpec(features=16, hidden=32, depth=2, batch=16, examples=512)
TOPO = resilax.Topology.emulated(slices=2, devices_per_slice=4)


# ---------------------------------------------------------------- models
class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(SPEC.classes)(nn.relu(x))


class BNState(train_state.TrainState):
    batch_stats: dict


def make_bn_state():
    model = BNNet()
    v = model.init(jax.random.key(0), jnp.zeros((1, SPEC.features)), train=False)
    return BNState.create(apply_fn=model.apply, params=v["params"], batch_stats=v["batch_stats"], tx=optax.adamw(3e-3))


def bn_loss(params, state, batch):
    logits, upd = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["x"], train=True,
                                 mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, upd["batch_stats"]


def bn_step(state, batch):
    # The contract for non-param state: record everything the update consumes.
    (loss, new_bs), grads = jax.value_and_grad(bn_loss, has_aux=True)(state.params, state, batch)
    grads, new_bs = resilax.record((grads, new_bs))
    return state.apply_gradients(grads=grads).replace(batch_stats=new_bs), {"loss": loss}


def bn_step_bad(state, batch):
    # Records only the gradients: the update still needs the batch for batch_stats.
    (loss, new_bs), grads = jax.value_and_grad(bn_loss, has_aux=True)(state.params, state, batch)
    grads = resilax.record(grads)
    return state.apply_gradients(grads=grads).replace(batch_stats=new_bs), {"loss": loss}


MODELS = {
    "adamw": (lambda: ex.make_state(SPEC), ex.train_step),
    "sgd_momentum_schedule": (
        lambda: ex.make_state(SPEC, optax.sgd(optax.exponential_decay(0.05, 3, 0.7), momentum=0.9)), ex.train_step),
    "batchnorm": (make_bn_state, bn_step),
}


def flat(state):
    return ex.flat_state(state)


def assert_bitwise(a, b):
    assert sorted(a) == sorted(b)
    diff = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not diff, f"leaves differ: {diff[:5]}"


def make_step(model, cfg, faults=()):
    _, fn = MODELS[model]
    return resilax.wrap(fn, topology=TOPO, config=cfg, faults=resilax.FaultPlan(faults))


def train(model, cfg, steps, *, until=None):
    """Runs to ``steps`` steps; returns (flat final state, ResilientStep)."""
    make, _ = MODELS[model]
    data = ex.make_iterator(SPEC)
    step = make_step(model, cfg)
    with step:
        state = step.init(make(), data=data)
        while step.step < (until or steps):
            state, _ = step(state, next(data))
        out = flat(state)
    return out, step


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", ["grads", "inputs"])
@pytest.mark.parametrize("model", list(MODELS))
def test_resume_replays_log_bitwise(tmp_path, model, mode):
    """Run 9 steps with checkpoints at 4 and 8; drop 8, so a new init restores 4 and
    replays 4..8 from the log; the state equals the original run's at 9."""
    cfg = resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=4, async_save=False),
                         log=resilax.LogConfig(mode=mode, grads_budget=None))
    at9, _ = train(model, cfg, 9)
    # Resume: checkpoint 8 exists; remove it so the log must carry steps 4..8.
    import shutil
    shutil.rmtree(tmp_path / "ck" / "8")
    make, _ = MODELS[model]
    data = ex.make_iterator(SPEC)
    step = make_step(model, cfg)
    with step:
        state = step.init(make(), data=data)
        assert step.step == 9, step.events
        ev = [e for e in step.events if e.kind == "replay"][-1]
        assert (ev.fields["from_step"], ev.fields["steps"]) == (4, 5)
        assert ev.fields[f"{mode}_steps"] == 5
        assert_bitwise(flat(state), at9)
        assert data.get_state() == {"next_index": 9}


def test_update_only_replay_has_no_dots(tmp_path):
    """The program replay runs for a grads entry has no dot ops: the forward and backward
    passes are gone (timings are in `resilax bench replay`)."""
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log"), grads_budget=None))
    train("adamw", cfg, 3)
    step = make_step("adamw", cfg)
    with step:
        s = step.init(MODELS["adamw"][0]())  # replays 0..2 from the log, update part only
        assert step.step == 3
        ev = [e for e in step.events if e.kind == "replay"][-1]
        assert ev.fields["grads_steps"] == 3
        # the executable replay ran is the one training runs after the grad part
        txt_upd = step._program.update(None).as_text()
        full = jax.jit(step._split.full)
        txt_full = full.lower(s, next(ex.make_iterator(SPEC)), np.uint32(1)).compile().as_text()
    assert txt_full.count(" dot(") >= 3
    assert txt_upd.count(" dot(") == 0


def test_update_reading_batch_is_rejected_in_grads_mode(tmp_path):
    step = resilax.wrap(bn_step_bad, topology=TOPO, config=resilax.Config(log=resilax.LogConfig(directory=str(tmp_path))))
    state = step.init(make_bn_state())
    with pytest.raises(resilax.WrapError, match=r"still reads batch\['x'\]"):
        step(state, next(ex.make_iterator(SPEC)))
    step.close()


def _log_run(tmp_path, steps=6):
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log"), grads_budget=None))
    final, _ = train("adamw", cfg, steps)
    return cfg, final


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_entry_stops_replay_there_naming_the_step(tmp_path, damage):
    cfg, _ = _log_run(tmp_path)
    log = DiskLog(tmp_path / "log")
    path = log.directory / "0000000003.grads.rxl"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0xFF
    else:
        raw = raw[: len(raw) - 100]
    path.write_bytes(bytes(raw))
    with pytest.raises(resilax.ReplayLogError, match=r"step 3 \(grads.*(corrupt|truncated)"):
        log.read(3, "grads")
    # Replay without data: stops at step 3 and names steps 3..5 as not replayable.
    step = make_step("adamw", cfg)
    state = step.init(MODELS["adamw"][0]())
    assert step.step == 3
    ev = [e for e in step.events if e.kind == "replay"][-1]
    assert ev.fields["unreplayable"][0]["step"] == 3
    assert "sha256 mismatch" in ev.fields["unreplayable"][0]["reason"]
    # one line says it (no separate warning for the entries moved aside): issue 53
    from resilax._src.messages import describe

    assert ev.fields["quarantined"] >= 2  # steps 3..5's entries
    assert "the entry of step 3 is unusable" in describe(ev.to_json()) and "moved to record_log/quarantine" in \
        describe(ev.to_json())
    with pytest.raises(resilax.ReplayLogError, match=r"could not replay steps 3\.\.5"):
        replay(state, DiskLog(tmp_path / "log"), 3, 6, update=lambda *a: a[0])
    # Nothing deleted: the bad entry (and the ones after it) are in quarantine.
    assert any(p.name.startswith("0000000003.grads") for p in (log.directory / "quarantine").iterdir())
    step.close()


def test_damaged_grads_entry_falls_back_to_inputs_with_data(tmp_path):
    cfg, final = _log_run(tmp_path)
    path = tmp_path / "log" / "0000000002.grads.rxl"
    path.write_bytes(path.read_bytes()[:-7])
    data = ex.make_iterator(SPEC)
    step = make_step("adamw", cfg)
    with step:
        state = step.init(MODELS["adamw"][0](), data=data)
        assert step.step == 6
        ev = [e for e in step.events if e.kind == "replay"][-1]
        assert (ev.fields["grads_steps"], ev.fields["inputs_steps"]) == (5, 1)
        assert_bitwise(flat(state), final)
        assert data.get_state() == {"next_index": 6}


def test_entry_format_roundtrip_and_no_overwrite(tmp_path):
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int32)]
    data = encode_entry({"step": 7, "kind": "grads"}, arrays)
    h, back = decode_entry(data, where="x")
    assert h["step"] == 7 and all(np.array_equal(a, b) for a, b in zip(arrays, back))
    log = DiskLog(tmp_path)
    log.append(0, data_state={"next_index": 0})
    log.wait()
    first = (tmp_path / "0000000000.inputs.rxl").read_bytes()
    with pytest.warns(RuntimeWarning, match="quarantine"):
        log.append(0, data_state={"next_index": 5})
        log.wait()
    assert list((tmp_path / "quarantine").iterdir())[0].read_bytes() == first
    log.close()


def test_selective_policy_keeps_newest_grads_within_budget(tmp_path):
    probe = tmp_path / "probe"
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(probe), grads_budget=None))
    train("adamw", cfg, 1)
    per = (probe / "0000000000.grads.rxl").stat().st_size
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log"), budget_bytes=int(3.5 * per),
                                                         grads_budget=None))
    final, step = train("adamw", cfg, 8)
    log = DiskLog(tmp_path / "log")
    assert log.steps("grads") == [5, 6, 7] and log.steps("inputs") == list(range(8))
    assert log.nbytes("grads") <= 3.5 * per
    rows = SelectivePolicy.tradeoff(steps=8, grads_bytes=per, inputs_bytes=300, update_s=0.001, step_s=0.01)
    assert rows[0]["log_bytes"] < rows[-1]["log_bytes"] and rows[0]["replay_s"] > rows[-1]["replay_s"]
    # Mixed replay (inputs for 0..4, grads for 5..7) is still exact.
    data = ex.make_iterator(SPEC)
    step = make_step("adamw", cfg)
    with step:
        state = step.init(MODELS["adamw"][0](), data=data)
        ev = [e for e in step.events if e.kind == "replay"][-1]
        assert (ev.fields["inputs_steps"], ev.fields["grads_steps"]) == (5, 3)
        assert_bitwise(flat(state), final)


def test_truncate_after_checkpoint(tmp_path):
    cfg = resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=3))
    train("adamw", cfg, 10)
    log = DiskLog(tmp_path / "ck" / "record_log")
    # Saves at 3, 6, 9: at the save of 9 the log was truncated before 6 (checkpoint 6 committed).
    assert log.steps() == list(range(6, 10))


def test_wrong_start_state_is_refused(tmp_path):
    cfg, _ = _log_run(tmp_path, steps=2)
    step = make_step("adamw", cfg)
    other = ex.make_state(ex.ExampleSpec(**{**SPEC.__dict__, "seed": 1}))
    with pytest.raises(resilax.ReplayLogError, match="belongs to another run"):
        step.init(other)
    assert DiskLog(tmp_path / "log").steps() == [0, 1], "nothing in the log was touched"
    step.close()




@pytest.mark.parametrize("model", ["batchnorm", "adamw"])
def test_grads_budget_writes_few_grads_entries_and_resume_stays_bitwise(tmp_path, model):
    """`LogConfig.grads_budget` (default 1%): the first step's grads entry measures what one
    costs, then a token bucket lets through only as many as the budget pays for; every step
    keeps its inputs entry, so a resume replays the mixed log (grads: update only; inputs:
    the step rerun from the data iterator) and ends bitwise on the failure-free state."""
    cfg = resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=100, async_save=False),
                         log=resilax.LogConfig(grads_budget=0.01))
    final, step = train(model, cfg, 12)
    cad = step.log_cadence()
    assert cad["grads_entries"] + cad["inputs_only_entries"] == 12
    assert cad["grads_entries"] >= 1 and cad["inputs_only_entries"] >= 6, cad
    assert cad["grads_cost_s"] > 0 and cad["share"] is not None
    assert cad["meets_budget"] == (cad["share"] <= 0.01)
    log = DiskLog(tmp_path / "ck" / "record_log")
    assert log.steps("inputs") == list(range(12)) and 0 in log.steps("grads")
    assert len(log.steps("grads")) == cad["grads_entries"]
    data = ex.make_iterator(SPEC)
    step = make_step(model, cfg)
    with step:
        state = step.init(MODELS[model][0](), data=data)
        ev = [e for e in step.events if e.kind == "replay"][-1]
        assert step.step == 12 and ev.fields["inputs_steps"] >= 6 and ev.fields["grads_steps"] >= 1
        assert_bitwise(flat(state), final)
    # the whole step time as budget: at least as many grads entries (how many it pays for
    # depends on the entry's cost against these tiny steps' times)
    cfg2 = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log2"), grads_budget=1.0))
    _, step2 = train(model, cfg2, 12)
    cad2 = step2.log_cadence()
    assert cad2["grads_entries"] >= cad["grads_entries"] and cad2["grads_cost_s"] > 0, (cad2, cad)


def test_without_a_data_iterator_inputs_entries_carry_the_batch(tmp_path):
    """No data iterator: an inputs entry holds the step's batch (copied at the call: the
    caller's arrays are overwritten after each step here), so the grads budget applies and
    most steps pay for a batch, not their gradients; a resume replays the batches (and the
    few grads entries) and ends bitwise on the uninterrupted run."""
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log")))
    batches = [next(it) for it in [ex.make_iterator(SPEC)] for _ in range(8)]
    step = make_step("adamw", cfg)
    with step:
        state = step.init(MODELS["adamw"][0]())
        for b in batches:
            mine = jax.tree.map(np.copy, b)
            state, m = step(state, mine)
            jax.block_until_ready((state, m))
            for x in jax.tree.leaves(mine):
                x[...] = 7  # the caller reuses its buffers; the logged batch must not change
        final = flat(state)
        cad = step.log_cadence()
    assert cad["grads_entries"] >= 1 and cad["inputs_only_entries"] >= 4, cad
    log = DiskLog(tmp_path / "log")
    assert log.steps("inputs") == list(range(8)) and len(log.steps("grads")) == cad["grads_entries"]
    for i, b in enumerate(batches):
        got = log.read(i, "inputs").batch
        assert jax.tree.structure(got) == jax.tree.structure(b)
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(b))), i
    step = make_step("adamw", cfg)
    with step:
        state = step.init(MODELS["adamw"][0]())
        ev = [e for e in step.events if e.kind == "replay"][-1]
        assert step.step == 8 and ev.fields["inputs_steps"] >= 4 and ev.fields["grads_steps"] >= 1, ev.fields
        assert_bitwise(flat(state), final)


def _tiny_linear_step(state, batch):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(state.params)
    return state.apply_gradients(grads=resilax.record(g)), {"loss": loss}


def test_a_batch_larger_than_the_gradients_is_not_logged_every_step_keeps_grads(tmp_path):
    """No data iterator and a batch (256 x 4 + 256 floats) larger than the recorded values
    (4 floats): the smaller replayable record is the grads entry, so every step has one and
    no inputs entry carries a batch."""
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log")), peers=None)
    st = train_state.TrainState.create(apply_fn=None, params={"w": jnp.zeros((4,), jnp.float32)}, tx=optax.sgd(0.1))
    rng = np.random.default_rng(0)
    step = resilax.wrap(_tiny_linear_step, topology=TOPO, config=cfg)
    with step:
        state = step.init(st)
        for _ in range(5):
            state, _ = step(state, {"x": rng.normal(size=(256, 4)).astype(np.float32),
                                    "y": rng.normal(size=(256,)).astype(np.float32)})
        assert step.log_cadence()["inputs_only_entries"] == 0
    log = DiskLog(tmp_path / "log")
    assert log.steps("grads") == list(range(5))
    assert all(log.read(i, "inputs").batch is None for i in range(5))


def test_an_entry_whose_step_failed_is_left_out_and_the_log_goes_on(tmp_path):
    """A step whose computation failed (under `launch`: a collective broken by a dead peer)
    has no values to log: the writer leaves its entry out and says so, instead of failing
    the log (which ended the surviving process with a StorageError); later entries are
    written and a replay stops before the missing step."""

    class Failed:  # a device value whose computation failed: reading it raises what JAX raises then
        def __array__(self, *a, **k):
            raise jax.errors.JaxRuntimeError("INTERNAL: Gloo AllGather failed: Connection reset by peer")

    failed = Failed()
    log = DiskLog(tmp_path)
    log.append(0, data_state={"next_index": 0}, scalars={"verdict": np.int32(0)})
    log.append(1, data_state={"next_index": 1}, scalars={"verdict": failed})
    log.append(2, data_state={"next_index": 2}, scalars={"verdict": np.int32(0)})
    log.wait()
    assert [s for s, _ in log.unwritten] == [1] and log.steps() == [0, 2]
    out = replay(None, log, 0, update=lambda *a: a[0], full=lambda s, b, i: s, data=ex.make_iterator(SPEC))
    assert out.step == 1 and out.failed[0][0] == 1
    log.close()
