"""The small model and data set the demo, benchmarks and tests train on.

A flax MLP classifier on a generated 10-class problem (class prototypes pushed through a
fixed random non-linear map, plus noise), served by a grain pipeline whose iterator state
is resumable. Everything is seeded: the same arguments give the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from resilax._src.step.record import record


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
    features: int = 64
    classes: int = 10
    hidden: int = 256
    depth: int = 3
    batch: int = 64
    examples: int = 8192
    learning_rate: float = 3e-3
    noise: float = 2.0  # class overlap: the task is learnable but not trivial
    seed: int = 0


def make_data(spec: ExampleSpec):
    """Returns ``(x, y)`` numpy arrays of the generated data set."""
    rng = np.random.default_rng(spec.seed)
    protos = rng.normal(size=(spec.classes, spec.features)).astype(np.float32)
    mix = rng.normal(size=(spec.features, spec.features)).astype(np.float32) / np.sqrt(spec.features)
    y = rng.integers(0, spec.classes, size=spec.examples).astype(np.int32)
    x = np.tanh((protos[y] + spec.noise * rng.normal(size=(spec.examples, spec.features))) @ mix).astype(np.float32)
    return x, y


def make_dataset(spec: ExampleSpec) -> grain.MapDataset:
    """An endless, shuffled, batched grain dataset of ``{"x", "y"}`` batches."""
    x, y = make_data(spec)
    n = (len(x) // spec.batch) * spec.batch
    return (
        grain.MapDataset.range(n)
        .shuffle(seed=spec.seed)
        .batch(spec.batch, drop_remainder=True)
        .map(lambda idx: {"x": x[np.asarray(idx)], "y": y[np.asarray(idx)]})
        .repeat(None)
    )


def make_iterator(spec: ExampleSpec):
    """A grain iterator with ``get_state()``/``set_state()``.

    Read-ahead is a few batches on 2 threads: grain's default (500 elements on 16 threads)
    refills after every ``set_state`` (a resume, an inputs-mode replay) and, on a CPU
    backend, steals the cores the step runs on for the next ~50 steps. The batches and
    the iterator state are the same either way."""
    opts = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
    return iter(make_dataset(spec).to_iter_dataset(read_options=opts))


class MLP(nn.Module):
    hidden: int
    depth: int
    classes: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(x)


class PipelinedMLP(nn.Module):
    """The MLP with its hidden layers (``layers`` of them, stacked) run by `resilax.pipeline`
    over the ``stage`` mesh axis in ``microbatches`` micro-batches (`resilax train` on a
    topology with a ``stage`` axis, such as ``cpu-2x4-pp``)."""
    hidden: int
    layers: int
    classes: int
    microbatches: int

    @nn.compact
    def __call__(self, x):
        import resilax

        x = nn.relu(nn.Dense(self.hidden)(x))
        init = nn.initializers.lecun_normal()
        blocks = {"kernel": self.param("blocks_kernel", lambda k: jax.vmap(lambda k: init(k, (self.hidden, self.hidden)))(
                      jax.random.split(k, self.layers))),
                  "bias": self.param("blocks_bias", nn.initializers.zeros, (self.layers, self.hidden))}
        if not self.is_initializing():  # (init makes the parameters only: no mesh, a batch of 1)
            x = resilax.pipeline(lambda w, h: nn.relu(h @ w["kernel"] + w["bias"]), blocks, x,
                                 microbatches=self.microbatches)
        return nn.Dense(self.classes)(x)


def make_pipeline_state(spec: ExampleSpec, stages: int, microbatches: int = 4):
    """The example as a pipeline: one hidden layer per stage (``stages`` of them), the rest as
    `make_state`."""
    return _creator(spec.hidden, stages, spec.classes, spec.features, _adamw(spec.learning_rate),
                    microbatches)(jax.random.key(spec.seed))


def pipeline_specs(state, axis: str = "stage"):
    """The stacked hidden layers (and their optimizer moments) over ``axis``; the rest
    replicated."""
    from jax.sharding import PartitionSpec as P

    return jax.tree_util.tree_map_with_path(
        lambda path, x: P(axis) if any(str(getattr(k, "key", "")).startswith("blocks_") for k in path) else P(), state)


@functools.lru_cache(maxsize=None)
def _adamw(learning_rate: float) -> optax.GradientTransformation:
    """One optimizer object per learning rate: states made alike are then the same tree (it
    names the optimizer's functions), so a second wrap of the same step reuses the first's
    traces (resilax's trace cache keys on the tree, as jax.jit's cache does)."""
    return optax.adamw(learning_rate)


@functools.lru_cache(maxsize=None)
def _mlp(hidden: int, depth: int, classes: int, microbatches: int | None = None) -> nn.Module:
    """One model object per shape: a state's tree holds ``model.apply``, and two bound
    methods are equal only on the same object (see `_adamw`). ``microbatches``: the
    pipelined MLP (``depth`` stacked layers)."""
    return MLP(hidden, depth, classes) if microbatches is None else PipelinedMLP(hidden, depth, classes, microbatches)


def make_state(spec: ExampleSpec, optimizer: optax.GradientTransformation | None = None):
    """A fresh state (new buffers each call: a run may donate them)."""
    tx = optimizer if optimizer is not None else _adamw(spec.learning_rate)
    return _creator(spec.hidden, spec.depth, spec.classes, spec.features, tx)(jax.random.key(spec.seed))


@functools.lru_cache(maxsize=64)
def _creator(hidden: int, depth: int, classes: int, features: int, tx, microbatches: int | None = None):
    """The state's initialiser, traced and compiled once per shape and optimizer in a
    process (one compiled program instead of dozens of eager initializer ops, seconds on
    CPU; a test module or a campaign builds the same state many times)."""
    model = _mlp(hidden, depth, classes, microbatches)

    def create(key):
        params = model.init(key, jnp.zeros((1, features)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return jax.jit(create)


def loss_fn(params, apply_fn, batch):
    logits = apply_fn({"params": params}, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return loss, acc


def train_step(state, batch):
    """The user's step, as resilax expects it: gradients, ``record``, update."""
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.apply_fn, batch)
    grads = record(grads)
    return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": acc}


def fsdp_specs(state, axis: str | tuple[str, ...] = "fsdp", size: int = 4):
    """Shards each array's first dimension over ``axis`` (one mesh axis, or several together,
    of ``size`` devices) where it divides; replicates the rest."""
    from jax.sharding import PartitionSpec as P

    def one(x):
        shape = np.shape(x)
        return P(axis) if shape and shape[0] % size == 0 and shape[0] >= size else P()

    return jax.tree.map(one, state)


def flat_state(state) -> dict[str, np.ndarray]:
    """``{path: numpy array}`` of a state, for saving with ``np.savez`` (no pickle)."""
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
