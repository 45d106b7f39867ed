# examples/train_nnx.py
"""Train a flax NNX MLP with resilax on 2 emulated CPU slices, resumable after a kill.

    python examples/train_nnx.py --steps 40 --checkpoint-dir /tmp/resilax-nnx

resilax's state is a pytree of arrays, so an NNX model enters it through ``nnx.split``: the
parameters (an ``nnx.State``) and the optax state form the train state, and the step
rebuilds the module with ``nnx.merge``. The graph definition is static: the step reads it
as a global at its first trace. Run the command again after a kill to resume;
``--kill-at N`` kills the process with a real SIGKILL after step N.
"""

import argparse
import hashlib

import resilax

resilax.request_cpu_devices(8)  # before anything starts JAX: 8 CPU devices, 2 slices of 4

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 64, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)  # static structure, arrays
optimizer = optax.adam(1e-2)


def make_data(batch_size=32, seed=0):
    """An endless, shuffled grain pipeline of global batches (numpy, on the host)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1024, 16)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.int32)
    ds = (grain.MapDataset.range(len(x)).shuffle(seed=seed).batch(batch_size, drop_remainder=True)
          .map(lambda idx: {"x": x[np.asarray(idx)], "y": y[np.asarray(idx)]}).repeat(None))
    return iter(ds.to_iter_dataset())


def train_step(state, batch):
    def loss_fn(params):
        model = nnx.merge(graphdef, params)
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    grads = resilax.record(grads)  # the optimizer inputs, once, as batch means
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def shard_rows(x):
    """Shard a leaf's first dimension over the 4 devices of a slice ("fsdp") when it divides."""
    return P("fsdp") if np.ndim(x) and np.shape(x)[0] % 4 == 0 else P()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpoint-dir", default="/tmp/resilax-nnx")
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after this step")
    args = ap.parse_args()

    state = {"params": params, "opt": optimizer.init(params)}
    step = resilax.wrap(
        train_step,
        topology=resilax.Topology.emulated(slices=2, devices_per_slice=4),  # mesh axes ("data", "fsdp")
        state_sharding=jax.tree.map(shard_rows, state),
        batch_sharding=P("data"),
        config=resilax.Config(checkpoint=resilax.CheckpointConfig(args.checkpoint_dir, every=10)),
        faults=resilax.FaultPlan([f"kill_process@{args.kill_at}"] if args.kill_at else []),
    )
    data = make_data()
    with step:
        state = step.init(state, data=data)
        if step.step:
            print(f"resumed at step {step.step}")
        while step.step < args.steps:
            state, metrics = step(state, next(data))
            if step.step % 10 == 0:
                print(f"step {step.step}: loss {float(metrics['loss']):.4f}")
    model = nnx.merge(graphdef, state["params"])  # a plain NNX module again, for eval or export
    leaves = jax.tree.leaves(jax.device_get(nnx.state(model, nnx.Param)))
    print("params digest", hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16])


if __name__ == "__main__":
    main()
