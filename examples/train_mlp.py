"""A complete resilax run: flax MLP, optax, grain data, Orbax checkpoints, on 2 emulated CPU slices.

    python examples/train_mlp.py --steps 200 --checkpoint-dir /tmp/resilax-mlp

Kill it at any moment (Ctrl-C, kill -9) and start it again: it resumes from the newest good
checkpoint, replays the record log written after it (so it continues within a couple of
steps of where it died), with the data iterator where it was, and ends with the same bits
as a run that was never interrupted. Every protection is on by default (record log, peer
copies, NaN/spike skipping); checkpoints are on because a directory is given.
"""

import argparse

import jax

import resilax

# 2 emulated slices x 4 devices, before JAX starts; dispatched as an accelerator's are (a call
# returns while the previous step runs), which jax.config.update("jax_num_cpu_devices", 8)
# alone does not give on a machine with fewer cores than devices
resilax.request_cpu_devices(8)

import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from resilax.tools import example as ex  # noqa: E402  (the model and data; a user brings their own)


def train_step(state, batch):
    (loss, acc), grads = jax.value_and_grad(ex.loss_fn, has_aux=True)(state.params, state.apply_fn, batch)
    grads = resilax.record(grads)  # the optimizer inputs: batch means
    return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": acc}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--checkpoint-dir", default="/tmp/resilax-mlp")
    args = ap.parse_args()

    spec = ex.ExampleSpec()
    state = ex.make_state(spec, optax.adamw(3e-3))
    data = ex.make_iterator(spec)
    step = resilax.wrap(
        train_step,
        topology=resilax.Topology.emulated(slices=2, devices_per_slice=4),
        state_sharding=ex.fsdp_specs(state, "fsdp", 4),  # shard the big dims within a slice
        batch_sharding=P("data"),
        config=resilax.Config(checkpoint=resilax.CheckpointConfig(args.checkpoint_dir, every=25)),
    )
    with step:
        state = step.init(state, data=data)
        if step.step:
            print(f"resumed at step {step.step}")
        while step.step < args.steps:
            state, metrics = step(state, next(data))
            if step.step % 25 == 0:
                print(f"step {step.step}: loss {float(metrics['loss']):.4f}")
    print(f"done at step {step.step}")


if __name__ == "__main__":
    main()
