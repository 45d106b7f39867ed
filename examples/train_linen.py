# examples/train_linen.py
"""Train a flax linen MLP with resilax on 2 emulated CPU slices, resumable after a kill.

    python examples/train_linen.py --steps 40 --checkpoint-dir /tmp/resilax-linen

Kill it at any moment (Ctrl-C, kill -9) and run the same command again: it resumes from the
newest good checkpoint plus the record log, with the data iterator where it was, and ends
with the same bits as a run that was never interrupted (the last line prints a digest of the
final parameters to compare). ``--kill-at N`` kills the process with a real SIGKILL after
step N, to try it.
"""

import argparse
import hashlib

import resilax

resilax.request_cpu_devices(8)  # before anything starts JAX: 8 CPU devices, 2 slices of 4

import flax.linen as nn  # noqa: E402
import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def make_data(batch_size=32, seed=0):
    """An endless, shuffled grain pipeline of global batches (numpy, on the host)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1024, 16)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.int32)  # a learnable 10-class problem
    ds = (grain.MapDataset.range(len(x)).shuffle(seed=seed).batch(batch_size, drop_remainder=True)
          .map(lambda idx: {"x": x[np.asarray(idx)], "y": y[np.asarray(idx)]}).repeat(None))
    return iter(ds.to_iter_dataset())  # has get_state()/set_state(): resilax saves its position


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = resilax.record(grads)  # the optimizer inputs, once, as batch means
    return state.apply_gradients(grads=grads), {"loss": loss}


def shard_rows(x):
    """Shard a leaf's first dimension over the 4 devices of a slice ("fsdp") when it divides."""
    return P("fsdp") if np.ndim(x) and np.shape(x)[0] % 4 == 0 else P()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpoint-dir", default="/tmp/resilax-linen")
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after this step")
    args = ap.parse_args()

    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, 16), np.float32))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    faults = resilax.FaultPlan([f"kill_process@{args.kill_at}"] if args.kill_at else [])

    step = resilax.wrap(
        train_step,
        topology=resilax.Topology.emulated(slices=2, devices_per_slice=4),  # mesh axes ("data", "fsdp")
        state_sharding=jax.tree.map(shard_rows, state),
        batch_sharding=P("data"),  # the global batch is split over the slices
        config=resilax.Config(checkpoint=resilax.CheckpointConfig(args.checkpoint_dir, every=10)),
        faults=faults,
    )
    data = make_data()
    with step:  # close() waits for the last checkpoint
        state = step.init(state, data=data)  # restores the newest good checkpoint, if any
        if step.step:
            print(f"resumed at step {step.step}")
        while step.step < args.steps:
            state, metrics = step(state, next(data))
            if step.step % 10 == 0:
                print(f"step {step.step}: loss {float(metrics['loss']):.4f}")
    leaves = jax.tree.leaves(jax.device_get(state.params))
    print("params digest", hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16])


if __name__ == "__main__":
    main()
