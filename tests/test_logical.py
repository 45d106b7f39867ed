"""flax logical axis annotations + rules as the state layout (deliver 4): the same placement
and bitwise the same training as the equivalent PartitionSpecs, recovery on it, and bad
rules named."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import resilax
from resilax.tools.models import tree_rel_diff

TOPO = resilax.Topology.emulated(2, 4)
RULES = [("embed", None), ("mlp", ("data", "fsdp")), ("vocab", None)]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dense = lambda n, names: nn.Dense(n, kernel_init=nn.with_logical_partitioning(  # noqa: E731
            nn.initializers.lecun_normal(), names), use_bias=False)
        h = nn.relu(dense(64, ("embed", "mlp"))(x))
        return dense(8, ("mlp", "vocab"))(h)


def make():
    variables = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))
    boxed = train_state.TrainState.create(apply_fn=MLP().apply, params=variables["params"], tx=optax.adam(1e-2))
    return boxed, nn.meta.unbox(boxed)


def step_fn(state, batch):
    def loss(p):
        return optax.softmax_cross_entropy_with_integer_labels(state.apply_fn({"params": p}, batch["x"]),
                                                               batch["y"]).mean()

    l, g = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=resilax.record(g)), {"loss": l}


def batches(n):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.integers(0, 8, 16).astype(np.int32)}
            for _ in range(n)]


def train(sharding, faults=(), rules=None):
    boxed, state = make()
    step = resilax.wrap(step_fn, topology=TOPO, state_sharding=sharding(boxed), logical_axis_rules=rules,
                        faults=resilax.FaultPlan(faults))
    s = step.init(state)
    for b in batches(5):
        s, _ = step(s, b)
    specs = jax.tree.map(lambda x: x.sharding.spec, s)
    out = jax.device_get(s)
    step.close()
    return out, specs, step


def explicit(boxed):
    """The PartitionSpecs the rules stand for, written by hand."""
    def spec(x):
        if isinstance(x, nn.LogicallyPartitioned):
            return P(*[{"embed": None, "mlp": ("data", "fsdp"), "vocab": None}[n] for n in x.names])
        return P()
    return jax.tree.map(spec, boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def test_logical_rules_place_and_train_like_the_specs_they_stand_for():
    got, got_specs, _ = train(nn.get_partition_spec, rules=RULES)
    want, want_specs, _ = train(explicit)
    assert jax.tree.leaves(got_specs) == jax.tree.leaves(want_specs)
    assert P(None, ("data", "fsdp")) in jax.tree.leaves(got_specs)  # the kernel really is sharded over all 8
    assert tree_rel_diff(got, want) == 0.0


def test_slice_loss_on_a_logical_layout():
    want, _, _ = train(explicit)
    got, _, step = train(nn.get_partition_spec, ["fail_slice@2:mid_step/0"], rules=RULES)
    assert any(e.kind == "recovery" and e.fields["source"] == "peer" for e in step.events)
    assert tree_rel_diff(got, want) < 1e-4


def test_unmapped_logical_name_is_named():
    with pytest.raises(resilax.WrapError, match=r"logical axis name\(s\) \['vocab'\].*rules name \['embed', 'mlp'\]"):
        train(nn.get_partition_spec, rules=RULES[:2])
    with pytest.raises(resilax.WrapError, match="flax logical names need logical_axis_rules"):
        train(nn.get_partition_spec)
