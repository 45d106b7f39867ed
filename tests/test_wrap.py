"""resilax.wrap: validation errors, and the wrapped step computing what the plain step computes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import resilax
from resilax.tools import example as ex
from helpers import SMALL

TOPO = resilax.Topology.emulated(2, 4)


def test_wrap_validates_arguments():
    with pytest.raises(resilax.WrapError, match="requires a callable train_step as its first argument, but got int"):
        resilax.wrap(3, topology=TOPO)
    with pytest.raises(resilax.WrapError, match="topology must be a resilax.Topology.*but got str"):
        resilax.wrap(ex.train_step, topology="cpu-2x4")
    with pytest.raises(resilax.WrapError, match="config must be a resilax.Config, but got dict"):
        resilax.wrap(ex.train_step, topology=TOPO, config={"checkpoint_every": 3})
    with pytest.raises(resilax.WrapError, match=r"state_sharding uses mesh axis 'model', but topology 'cpu-2x4' has axes \['data', 'fsdp'\]"):
        resilax.wrap(ex.train_step, topology=TOPO, state_sharding=P("model"))
    with pytest.raises(resilax.WrapError, match="batch_sharding must be a jax.sharding.PartitionSpec.*got a leaf of type str"):
        resilax.wrap(ex.train_step, topology=TOPO, batch_sharding={"x": "data"})


def test_call_before_init_and_after_close():
    step = resilax.wrap(ex.train_step, topology=TOPO)
    with pytest.raises(resilax.WrapError, match=r"call step.init\(state\) before step\(state, batch\)"):
        step(None, None)
    state = step.init(ex.make_state(SMALL))
    step.close()
    with pytest.raises(resilax.WrapError, match="was closed"):
        step(state, next(ex.make_iterator(SMALL)))


def test_a_call_after_the_preemption_point_exits_the_process_cleanly():
    """Under `resilax launch` the call whose step is the agreed preemption point saves and sets
    ``step.preempted`` (tested with real workers and SIGTERM in test_launch.py); the next call
    raises `resilax.Preempted`, a SystemExit with code 0, before doing anything."""
    step = resilax.wrap(ex.train_step, topology=TOPO)
    it = ex.make_iterator(SMALL)
    state, _ = step(step.init(ex.make_state(SMALL)), next(it))
    assert step.preempted is False
    step.preempted = True
    with pytest.raises(resilax.Preempted, match="stopped after step 1") as e:
        step(state, next(it))
    assert isinstance(e.value, SystemExit) and e.value.code == 0 and e.value.step == 1 and step.step == 1
    step.close()


def test_sharding_that_does_not_divide_names_the_leaf():
    state = ex.make_state(SMALL)
    specs = jax.tree.map(lambda x: P(("data", "fsdp")) if np.ndim(x) == 1 else P(), state)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=specs)
    with pytest.raises(resilax.WrapError, match=r"state_sharding.*params.*Dense_2.*bias.*dimension 0 of shape \(10,\) is not divisible by mesh axes \('data', 'fsdp'\) of total size 8"):
        step.init(state)


def test_batch_that_does_not_divide_is_named():
    step = resilax.wrap(ex.train_step, topology=TOPO)
    state = step.init(ex.make_state(SMALL))
    bad = {"x": np.zeros((3, SMALL.features), np.float32), "y": np.zeros((3,), np.int32)}
    with pytest.raises(resilax.WrapError, match=r"batch_sharding\['x'\]: dimension 0 of shape \(3, 16\) is not divisible by mesh axes data of total size 2"):
        step(state, bad)


def test_every_batch_is_checked_against_the_first():
    """A batch of another shape, dtype or structure than the first is refused (the compiled
    step and the log depend on them), also after batches of the same shapes took the
    cheap path; the step goes on with a good batch after the refusal."""
    step = resilax.wrap(ex.train_step, topology=TOPO, config=resilax.Config(log=None, peers=None, verify=None))
    it = ex.make_iterator(SMALL)
    state = step.init(ex.make_state(SMALL))
    b = next(it)
    for _ in range(2):
        state, _ = step(state, next(it))
    bad = [{k: v[: len(v) // 2] for k, v in b.items()}, {**b, "x": b["x"].astype(np.float16)},
           {**b, "extra": b["y"]}, {**b, "x": jnp.asarray(b["x"][:, :1])}]
    for x in bad:
        with pytest.raises(resilax.WrapError, match="every batch must have the first batch's structure"):
            step(state, x)
    state, _ = step(state, next(it))
    assert step.step == 3
    step.close()


def test_step_must_keep_state_structure_and_record_once():
    def changes_shape(state, batch):
        return {"w": jnp.zeros(3)}, {}

    step = resilax.wrap(changes_shape, topology=TOPO)
    state = step.init({"w": jnp.zeros(2)})
    with pytest.raises(resilax.WrapError, match=r"changed state\['w'\] from \(2,\) float32 to \(3,\) float32"):
        step(state, {"x": np.zeros((8,), np.float32)})

    def records_twice(state, batch):
        resilax.record(batch["x"])
        resilax.record(batch["x"])
        return state, {}

    step = resilax.wrap(records_twice, topology=TOPO)
    state = step.init({"w": jnp.zeros(2)})
    with pytest.raises(resilax.WrapError, match="called once per train_step.*called 2 times"):
        step(state, {"x": np.zeros((8,), np.float32)})


def test_record_is_identity_outside_wrap():
    t = {"a": jnp.arange(3)}
    assert resilax.record(t) is t


def test_wrapped_equals_plain_jit_bitwise():
    """The wrapped step must compute exactly what jit of the user's step computes on the same
    mesh, with replicated and with FSDP state. Run in a process with XLA:CPU's default code
    generation (tests/wrap_probe.py): under the suite's test-speed emitters (conftest) XLA
    fuses the split and the whole program differently and they differ in the last bit."""
    import json
    import os
    import subprocess
    import sys

    from helpers import ROOT, child_env, default_codegen_env

    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "wrap_probe.py")], env=default_codegen_env(child_env()),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = {d["specs"]: d for d in map(json.loads, r.stdout.splitlines())}
    assert sorted(got) == ["fsdp", "replicated"], r.stdout
    for specs, d in got.items():
        assert d == {"specs": specs, "steps": 5, "losses_equal": True, "state_equal": True, "template_usable": True}, d


def test_decorator_form_and_rng_argument():
    seen = []

    @resilax.wrap(topology=TOPO, rng=True)
    def step_fn(state, batch, rng):
        noise = resilax.record(jax.random.normal(rng, state["w"].shape))
        return {"w": state["w"] + noise}, {"n": noise.sum()}

    assert isinstance(step_fn, resilax.ResilientStep)
    state = step_fn.init({"w": jnp.zeros(4)})
    for _ in range(3):
        state, m = step_fn(state, {"x": np.zeros(8, np.float32)})
        seen.append(float(m["n"]))
    expect = [float(jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (4,)).sum()) for i in range(3)]
    np.testing.assert_allclose(seen, expect, rtol=1e-6)


def test_several_optimizers_train():
    for tx in (optax.sgd(optax.exponential_decay(0.1, 10, 0.5), momentum=0.9), optax.adamw(1e-3)):
        state = ex.make_state(SMALL, tx)
        step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=ex.fsdp_specs(state, "fsdp", 4))
        s = step.init(state)
        data = ex.make_iterator(SMALL)
        losses = []
        for _ in range(20):
            s, m = step(s, next(data))
            losses.append(float(m["loss"]))
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "bit-exact"])
def test_the_step_is_traced_once_whatever_meshes_a_run_lands_on(deterministic, monkeypatch):
    """The user's step is traced once per argument shapes, not once per program: a run that
    loses two slices (3 meshes, each with its own programs) traces it as often as a run that
    loses none, and ends where that run ends (tolerance: another mesh reassociates sums; the
    bit-exact mode: bitwise). A second wrap of the same step on a state of the same tree
    reuses those traces. The first-step cross-check (on by default) reuses them too: it once
    traced the step again, its one-device call passing the live state's weakly typed step
    counter (and, without rng, a key argument of None), other signatures."""
    topo = resilax.Topology.emulated(4, 2)
    det = resilax.DeterministicConfig() if deterministic else None

    def run(train_step, traces, faults, verify=None):
        cfg = resilax.Config(deterministic=det, verify=verify)
        step = resilax.wrap(train_step, topology=topo, config=cfg, faults=resilax.FaultPlan(faults))
        state = step.init(ex.make_state(SMALL))
        it = ex.make_iterator(SMALL)
        for _ in range(5):
            state, _ = step(state, next(it))
        step.close()
        assert step.step == 5
        return len(traces), jax.device_get(state.params), [e.kind for e in step.events if e.fields.get("checked", True)]

    def counting():  # a step function of its own (traces are shared per step function)
        traces = []

        def train_step(state, batch):
            traces.append(1)
            return ex.train_step(state, batch)

        return train_step, traces

    from resilax._src.step import programs

    checks = []  # the wrap-time validation of the step (state shapes kept, update reads no batch)
    real_reads = programs.update_reads_batch
    monkeypatch.setattr(programs, "update_reads_batch", lambda *a: checks.append(1) or real_reads(*a))
    ref_step, ref_traces = counting()
    n_ref, ref, _ = run(ref_step, ref_traces, [])
    assert len(checks) == 1
    got_step, got_traces = counting()
    n, got, kinds = run(got_step, got_traces, ["fail_slice@2:after_step/1", "fail_slice@3:after_step/2"])
    assert kinds.count("recovery") == 2, kinds
    assert n == n_ref, (n, n_ref)
    if deterministic:
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    else:
        assert all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    # the same step function again (a fresh state, the same tree): no new trace, the same result
    n_again, again, _ = run(ref_step, ref_traces, [])
    assert len(checks) == 2, "a second wrap of the same step on the same shapes validates it again"
    assert n_again == n_ref and all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(ref)))
    # with the cross-check (the default VerifyConfig): it checked the first step (events of
    # skipped checks are left out above), and traced nothing more
    v_step, v_traces = counting()
    n_v, _, kinds = run(v_step, v_traces, [], verify=resilax.VerifyConfig())
    assert "crosscheck" in kinds and n_v == n_ref, (n_v, n_ref)


def _parts_state(kind):
    params = {"w": jnp.full((4, 3), 0.1), "b": jnp.zeros((3,))}
    state = {"params": params, "opt": optax.adam(1e-2).init(params), "count": jnp.zeros((), jnp.int32)}
    if kind == "key":
        state["rng"] = jax.random.key(0)  # a typed key no part of the step reads
    return state


def _parts_step(kind):
    def train_step(state, batch):
        def loss(p):
            err = batch["x"] @ p["w"] + p["b"] - batch["y"]
            scale = 1.0 + state["count"].astype(jnp.float32) if kind == "reads_count" else 1.0
            return jnp.mean(err ** 2) * scale

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = optax.adam(1e-2).update(resilax.record(grads), state["opt"], state["params"])
        return {**state, "params": optax.apply_updates(state["params"], updates), "opt": opt,
                "count": state["count"] + 1}, {"loss": value}
    return train_step


@pytest.mark.parametrize("kind", ["adam", "reads_count", "key"])
def test_the_gradient_part_is_handed_only_the_state_it_reads(kind, monkeypatch):
    """The gradient part's executable takes the state's top-level parts its program reads
    (the optimizer's moments are never read there; a call hands over and checks every leaf it
    takes, ~0.4-0.6 us of host time each). Three steps give the same bits as with the whole
    state handed over; a part the loss reads stays; a part with a typed PRNG key (no zeros
    to stand in for it) keeps the whole state."""
    from resilax._src.step import program as prog_mod

    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 3)).astype(np.float32)}
               for _ in range(3)]

    def run():
        step = resilax.wrap(_parts_step(kind), topology=TOPO)
        state = step.init(_parts_state(kind))
        for b in batches:
            state, metrics = step(state, b)
        exe = step._program.grad(False)
        out = jax.device_get((state, metrics))
        step.close()
        return out, exe

    (state, metrics), exe = run()
    given = len(jax.tree.leaves(exe.args_info[0][0]))
    want = {"adam": 2, "reads_count": 3, "key": len(jax.tree.leaves(_parts_state("key")))}[kind]
    assert given == want, (kind, given, want)
    monkeypatch.setattr(prog_mod, "_read_parts", lambda *a: None)
    (whole, whole_metrics), exe_whole = run()
    assert len(jax.tree.leaves(exe_whole.args_info[0][0])) == len(jax.tree.leaves(_parts_state(kind)))
    for a, b in zip(jax.tree.leaves((state, metrics)), jax.tree.leaves((whole, whole_metrics))):
        if jnp.issubdtype(a.dtype, jax.dtypes.extended):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(state["count"]) == 3
