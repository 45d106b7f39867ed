"""`resilax.pipeline`: an SPMD pipeline over a ``stage`` mesh axis inside the user's loss, on
its own and wrapped (data x pipeline on ``cpu-2x4-pp``: a failure domain is a whole pipeline
replica). Linen and NNX transformers with dropout and a token-weighted loss; bf16; bubbles
that compute NaN; losing a replica, bitwise in the bit-exact mode; checkpoint and resume.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import resilax
from resilax.tools import pipeline_models as pm
from resilax.tools.hlo_scan import host_sync_ops


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "stage"))


def _grads(case, params, batch, mesh, pipelined):
    key = jax.random.key(3)
    fn = jax.value_and_grad(lambda p: case.loss(p, batch, key, pipelined=pipelined)[0])
    if not pipelined:
        return jax.jit(fn)(params)
    # the specs from the state's shapes: a state made under the mesh ran the initialiser's ~100
    # eager ops again, each compiled for 8 devices (2-4 CPU-s a test)
    specs = case.state_sharding(jax.eval_shape(lambda: case.make_state(0))).params
    with jax.set_mesh(mesh):
        sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        return jax.jit(fn, in_shardings=(sh,))(params)


def _worst(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))) /
                     (np.max(np.abs(np.asarray(y, np.float64))) + 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("make,layers,micro,repeats,dtype,tol,stages", [
    (pm.linen_case, 4, 2, 1, jnp.float32, 1e-5, 4),   # GPipe, one block per stage
    (pm.linen_case, 4, 2, 2, jnp.float32, 1e-5, 2),   # circular: two repeats around a ring of 2 stages
    (pm.linen_case, 4, 2, 1, jnp.bfloat16, 2 ** -8, 4),  # bf16 blocks: bf16's epsilon
    (pm.nnx_case, 4, 2, 1, jnp.float32, 1e-5, 4),
], ids=["linen-gpipe", "linen-circular", "linen-bf16", "nnx-gpipe"])
def test_pipeline_loss_and_gradients_equal_the_unpipelined_model(make, layers, micro, repeats, dtype, tol, stages):
    mesh = Mesh(np.array(jax.devices()).reshape(8 // stages, stages), ("data", "stage"))
    kw = {"dtype": dtype} if dtype is not jnp.float32 else {}
    case = make(layers=layers, microbatches=micro, repeats=repeats, rate=0.0, **kw)
    params = case.make_state(0).params
    batch = case.make_batches(1)[0]
    (v, g), (rv, rg) = _grads(case, params, batch, mesh, True), _grads(case, params, batch, mesh, False)
    if dtype is jnp.float32:
        assert abs(float(v) - float(rv)) <= tol * abs(float(rv))
        assert _worst(g, rg) <= tol
    else:  # both runs round in bf16: the pipeline's error (vs float32) within that of the plain model's
        f32 = make(layers=layers, microbatches=micro, repeats=repeats, rate=0.0)
        xv, xg = _grads(f32, params, batch, mesh, False)
        assert abs(float(v) - float(xv)) <= 2 * abs(float(rv) - float(xv)) + tol * abs(float(xv))
        assert _worst(g, xg) <= 2 * _worst(rg, xg) + tol
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(g))


def _nan_layer(w, h):
    # zeros in (every bubble's input) -> 0 / 0: a bubble computes NaN in its forward and backward
    return jnp.tanh(h @ w["w"] / jnp.sum(jnp.abs(h), -1, keepdims=True) + w["b"])


def test_bubbles_that_compute_nan_reach_no_gradient_and_no_program_has_a_loop_cond_or_callback(mesh):
    rng = np.random.default_rng(0)
    w = {"w": jnp.asarray(rng.normal(size=(8, 8, 8)), jnp.float32), "b": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)

    def ref(w, x):
        for i in range(8):
            x = _nan_layer(jax.tree.map(lambda a: a[i], w), x)
        return jnp.mean(x ** 2)

    rv, rg = jax.value_and_grad(ref)(w, x)
    for repeats in (1, 2):
        fn = jax.value_and_grad(lambda w, x: jnp.mean(resilax.pipeline(_nan_layer, w, x, microbatches=4,
                                                                        repeats=repeats) ** 2))
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn).lower(w, x).compile()
            v, g = compiled(w, x)
        assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g)), f"NaN leaked (repeats={repeats})"
        assert _worst(g, rg) < 1e-5 and abs(float(v) - float(rv)) < 1e-5
        hlo = compiled.as_text()
        assert "collective-permute" in hlo  # the stages hand activations on: a real pipeline
        assert not host_sync_ops(hlo), f"{host_sync_ops(hlo)} in the pipeline's program (repeats={repeats})"


def test_pipeline_says_what_is_wrong(mesh):
    w = {"w": jnp.zeros((6, 4, 4))}
    x = jnp.zeros((8, 4))
    layer = lambda w, h: h @ w["w"]  # noqa: E731
    with pytest.raises(resilax.PipelineError, match="needs a mesh with axis 'stage'"):
        resilax.pipeline(layer, w, x, microbatches=4)
    with jax.set_mesh(mesh):
        with pytest.raises(resilax.PipelineError, match="6 stacked layers do not divide into 4 stages"):
            resilax.pipeline(layer, w, x, microbatches=4)
        with pytest.raises(resilax.PipelineError, match="a batch of 8 does not divide into 3 micro-batches"):
            resilax.pipeline(layer, {"w": jnp.zeros((4, 4, 4))}, x, microbatches=3)
        with pytest.raises(resilax.PipelineError, match="needs at least as many micro-batches as stages"):
            resilax.pipeline(layer, {"w": jnp.zeros((8, 4, 4))}, x, microbatches=2, repeats=2)
        with pytest.raises(resilax.PipelineError, match="must take \\(w, h, key\\)"):
            resilax.pipeline(layer, {"w": jnp.zeros((4, 4, 4))}, x, microbatches=2, key=jax.random.key(0))


# ---------------------------------------------------------------- wrapped: data x pipeline
CASE = pm.linen_case(layers=4, microbatches=2, rate=0.1)  # dropout in every block, token-weighted loss


@functools.cache
def _specs():
    """The state's layout, from its shapes (a state made only for its layout ran the
    initialiser's eager ops once more)."""
    return CASE.state_sharding(jax.eval_shape(lambda: CASE.make_state(0)))


def _run(faults=(), config=None, steps=5, state=None, batches=None):
    st = CASE.make_state(0) if state is None else state
    step = resilax.wrap(CASE.train_step, topology=resilax.Topology.load("cpu-2x4-pp"),
                        state_sharding=_specs(), batch_sharding=P("data"), rng=True,
                        metric_reductions=CASE.metric_reductions, config=config or resilax.Config(),
                        faults=resilax.FaultPlan(list(faults)))
    s = step.init(st)
    losses = []
    for b in (batches if batches is not None else CASE.make_batches(steps)):
        s, m = step(s, b)
        losses.append(float(m["loss"]))
    step.close()
    return jax.tree.map(np.asarray, s), step, losses


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_losing_a_whole_pipeline_replica_continues_bitwise_in_the_bit_exact_mode():
    det = resilax.Config(deterministic=resilax.DeterministicConfig())
    ref, _, ref_losses = _run(config=det)
    got, step, losses = _run(["fail_slice@2/1"], config=det)
    assert [e.kind for e in step.events].count("recovery") == 1
    assert len(step.mesh.devices.flat) == 4 and dict(step.mesh.shape)["stage"] == 4
    assert losses == ref_losses
    assert _equal(got, ref)


def test_default_mode_protections_on_a_pipeline_nan_skip_replica_loss_checkpoint_resume(tmp_path):
    """Every default protection on a pipelined job: a NaN step is skipped inside the program,
    a lost replica continues from the live one within rounding, and a run stopped after
    step 3 and resumed from its checkpoint (step 2) + record log (step 3) ends bitwise the
    uninterrupted run."""
    batches = CASE.make_batches(5)
    ref, _, _ = _run(["nan@1"], batches=batches)
    assert int(np.asarray(ref.step)) == 4  # 5 steps, the NaN one skipped
    got, step, _ = _run(["nan@1", "fail_slice@3/0"], batches=batches)
    assert "recovery" in [e.kind for e in step.events]
    assert _worst(got, ref) < 1e-5

    ck = resilax.Config(checkpoint=resilax.CheckpointConfig(directory=str(tmp_path / "ck"), every=2))
    _run(["nan@1"], config=ck, batches=batches[:3])
    st2 = resilax.wrap(CASE.train_step, topology=resilax.Topology.load("cpu-2x4-pp"),
                       state_sharding=_specs(), batch_sharding=P("data"), rng=True,
                       metric_reductions=CASE.metric_reductions, config=ck, faults=resilax.FaultPlan(["nan@1"]))
    s = st2.init(CASE.make_state(0))
    assert st2.step == 3
    for b in batches[st2.step:]:
        s, _ = st2(s, b)
    st2.close()
    assert _equal(jax.tree.map(np.asarray, s), ref)
