"""A small flax transformer trained as 2 data replicas x 4 pipeline stages on 8 emulated CPU
devices, each stage of each replica its own failure domain (`slices/cpu-2x4-stages.toml`).

Stage 2 of replica 1 is lost at step 3: its micro-batches go to stage 2 of replica 0, which
holds the same weights (ReCycle), and nothing is restored. It comes back at step 6 and gets
its stage's state copied from replica 0. The run ends bitwise equal to the same run without
the failure.

    python examples/pipeline_gpt.py [--steps 10]
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 CPU devices

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import resilax  # noqa: E402

SEQ, VOCAB, WIDTH, LAYERS = 8, 32, 32, 4


class Block(nn.Module):
    """A pre-norm transformer block with dropout."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=WIDTH, deterministic=True)(
            nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(0.1, deterministic=not train)(y)
        y = nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))))
        return x + nn.Dropout(0.1, deterministic=not train)(y)


BLOCK = Block()


def first(p, batch, key):  # stage 0, before its blocks: token and position embeddings
    return p["tokens"][batch["tokens"][:, :-1]] + p["positions"][None]


def layer(w, h, key):  # one block; the key is (replica, micro-batch, layer)'s own
    return BLOCK.apply({"params": w}, h, rngs={"dropout": key})


def last(p, h, batch, key):  # the last stage, after its blocks: the loss summed over tokens
    logits = nn.LayerNorm().apply({"params": p["norm"]}, h) @ p["head"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return (ce * batch["mask"]).sum(), batch["mask"].sum()  # normalised by real tokens


def init_params(seed=0):
    keys = jax.random.split(jax.random.key(seed), LAYERS + 3)
    sample = jnp.zeros((1, SEQ, WIDTH))
    blocks = jax.vmap(lambda k: BLOCK.init(k, sample, train=False)["params"])(keys[:LAYERS])  # [LAYERS, ...]
    return {"first": {"tokens": jax.random.normal(keys[-3], (VOCAB, WIDTH)) * 0.02, "positions": jnp.zeros((SEQ, WIDTH))},
            "blocks": blocks,
            "last": {"norm": nn.LayerNorm().init(keys[-2], sample)["params"],
                     "head": jax.random.normal(keys[-1], (WIDTH, VOCAB)) * 0.02}}


def batches(n, size=16, seed=0):
    """Token sequences following next = (3 * cur + 1) mod VOCAB, some mostly padding."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        toks = rng.integers(0, VOCAB, size=(size, SEQ + 1)).astype(np.int32)
        toks[:, 1:] = (toks[:, :-1] * 3 + 1) % VOCAB
        lengths = rng.integers(2, SEQ + 1, size=size)
        yield {"tokens": toks, "mask": (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32)}


MODEL = resilax.PipelineModel(first=first, layer=layer, last=last)
TX = optax.adamw(3e-3)  # one object: a second run of the same model and optimizer reuses the compiled stages


def train(steps, faults):
    ex = resilax.PipelineExecutor(MODEL, TX, init_params(),
                                  topology=resilax.Topology.load("cpu-2x4-stages"), microbatches=2,
                                  schedule="zb-h1")
    losses = []
    for i, batch in enumerate(batches(steps)):
        if i in faults:
            faults[i](ex)
        losses.append(ex(batch)["loss"])
    return ex, [float(x) for x in losses]  # read on the host once, at the end


def main(steps=10):
    lost = (1, 2)  # stage 2 of replica 1
    ref, ref_losses = train(steps, {})
    ex, losses = train(steps, {3: lambda ex: ex.fail_domain(lost), 6: lambda ex: ex.rejoin(lost)})
    for e in ex.events:
        print("event:", e)
    print("loss per step:", " ".join(f"{x:.3f}" for x in losses))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ex.params()), jax.tree.leaves(ref.params())))
    print(f"with stage {lost} lost at step 3 and back at step 6: bitwise equal to the failure-free run: {same}")
    assert same and losses == ref_losses
    return same


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    main(ap.parse_args().steps)
