"""Small pipelined transformers for the pipeline tests, the pipeline bench and the example:
a token embedding, ``L`` pre-norm transformer blocks stacked with a leading layer
dimension and run by `resilax.pipeline` over the ``stage`` mesh axis (dropout inside the
blocks, keyed by layer and micro-batch), and a head with a token-normalised loss recorded
with ``weight=``.

- `linen_case(...)`: flax linen blocks (the stacked parameters of ``L`` inits of one
  `Block`); the train state is a flax ``TrainState`` under AdamW.
- `nnx_case(...)`: the same architecture as flax NNX modules, split into a graph and a
  state whose leaves are stacked; ``nnx.merge`` rebuilds one layer inside the pipeline.

`executor_case(...)`: a small model in the three pieces `resilax.PipelineExecutor` takes.

Each case has ``make_state(seed)``, ``train_step(state, batch, rng)``, ``loss(params,
batch, rng, pipelined)`` (``pipelined=False``: the same layers applied one after another
on the whole batch, the reference) and ``make_batches(n, seed)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import resilax

SEQ, VOCAB, WIDTH = 8, 32, 16


@dataclasses.dataclass(frozen=True)
class PipelineCase:
    name: str
    make_state: Callable
    train_step: Callable
    loss: Callable
    make_batches: Callable
    state_sharding: Callable  # state -> PartitionSpecs (blocks over "stage", the rest replicated)
    metric_reductions: dict = dataclasses.field(default_factory=lambda: {"denominator": "sum"})


def token_batches(n: int, seed: int = 0, batch: int = 16):
    """Batches of ``{"tokens": int32 [B, SEQ + 1], "mask": float32 [B, SEQ]}``: a learnable
    next-token rule, and some examples mostly padding (the token-normalised loss matters)."""
    rng = np.random.default_rng(seed + 11)
    out = []
    for _ in range(n):
        toks = rng.integers(0, VOCAB, size=(batch, SEQ + 1)).astype(np.int32)
        toks[:, 1:] = (toks[:, :-1] * 5 + 3) % VOCAB
        lengths = rng.integers(1, SEQ + 1, size=batch)
        lengths[rng.random(batch) < 0.4] = 1
        out.append({"tokens": toks, "mask": (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)})
    return out


# ---------------------------------------------------------------- linen
class Block(nn.Module):
    """One pre-norm transformer block with dropout (rate ``rate``) after attention and MLP."""
    rate: float = 0.1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=WIDTH, use_bias=False, deterministic=True,
                                            dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x), mask=mask)
        x = x + nn.Dropout(self.rate, deterministic=not train)(y)
        y = nn.Dense(WIDTH, dtype=self.dtype)(nn.gelu(nn.Dense(2 * WIDTH, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))))
        return x + nn.Dropout(self.rate, deterministic=not train)(y)


def _token_loss(logits, batch):
    mask = batch["mask"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["tokens"][:, 1:])
    return (ce * mask).sum() / mask.sum(), mask.sum()


def linen_case(layers: int = 8, microbatches: int = 4, repeats: int = 1, rate: float = 0.1,
               dtype=jnp.float32) -> PipelineCase:
    block = Block(rate=rate, dtype=dtype)
    sample = jnp.zeros((1, SEQ, WIDTH), dtype)

    def init(seed):
        keys = jax.random.split(jax.random.key(seed), layers + 2)
        blocks = jax.vmap(lambda k: block.init(k, sample, train=False)["params"])(keys[:layers])
        embed = jax.random.normal(keys[-2], (VOCAB, WIDTH), jnp.float32) * 0.1
        head = jax.random.normal(keys[-1], (WIDTH, VOCAB), jnp.float32) * 0.1
        return {"embed": embed, "pos": jnp.zeros((SEQ, WIDTH)), "blocks": blocks, "head": head}

    def layer(w, h, key):
        return block.apply({"params": w}, h, train=rate > 0, rngs={"dropout": key})

    def loss(params, batch, rng, pipelined=True):
        h = (params["embed"][batch["tokens"][:, :-1]] + params["pos"][None]).astype(dtype)
        if pipelined:
            h = resilax.pipeline(layer, params["blocks"], h, microbatches=microbatches, repeats=repeats, key=rng)
        else:  # the reference: the same layers one after another on the whole batch (dropout off)
            for i in range(layers):
                h = block.apply({"params": jax.tree.map(lambda a: a[i], params["blocks"])}, h, train=False)
        return _token_loss(h.astype(jnp.float32) @ params["head"], batch)

    return _case(f"linen_pipeline_lm_{layers}x{microbatches}x{repeats}", init, loss)


# ---------------------------------------------------------------- NNX
class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rate: float = 0.1):
        self.ln1, self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs), nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=WIDTH, qkv_features=WIDTH, use_bias=False,
                                           decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs), nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)
        self.rate = rate

    def __call__(self, x, key=None):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self._drop(self.attn(self.ln1(x), mask=mask, deterministic=True), key, 0)
        return x + self._drop(self.down(nnx.gelu(self.up(self.ln2(x)))), key, 1)

    def _drop(self, y, key, i):
        if key is None or self.rate == 0:
            return y
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - self.rate, y.shape)
        return jnp.where(keep, y / (1 - self.rate), 0)


def nnx_case(layers: int = 8, microbatches: int = 4, repeats: int = 1, rate: float = 0.1) -> PipelineCase:
    graph = nnx.split(NNXBlock(nnx.Rngs(0), rate))[0]

    def init(seed):
        states = [nnx.split(NNXBlock(nnx.Rngs(seed * 1000 + i), rate))[1] for i in range(layers)]
        blocks = jax.tree.map(lambda *a: jnp.stack(a), *states)
        keys = jax.random.split(jax.random.key(seed), 2)
        return {"embed": jax.random.normal(keys[0], (VOCAB, WIDTH)) * 0.1, "pos": jnp.zeros((SEQ, WIDTH)),
                "blocks": blocks, "head": jax.random.normal(keys[1], (WIDTH, VOCAB)) * 0.1}

    def layer(w, h, key):
        return nnx.merge(graph, w)(h, key if rate > 0 else None)

    def loss(params, batch, rng, pipelined=True):
        h = params["embed"][batch["tokens"][:, :-1]] + params["pos"][None]
        if pipelined:
            h = resilax.pipeline(layer, params["blocks"], h, microbatches=microbatches, repeats=repeats, key=rng)
        else:
            for i in range(layers):
                h = nnx.merge(graph, jax.tree.map(lambda a: a[i], params["blocks"]))(h)
        return _token_loss(h @ params["head"], batch)

    return _case(f"nnx_pipeline_lm_{layers}x{microbatches}x{repeats}", init, loss)


# ---------------------------------------------------------------- shared
_ADAMW = optax.adamw(3e-3)


def _case(name, init, loss) -> PipelineCase:
    def make_state(seed=0):
        return train_state.TrainState.create(apply_fn=None, params=init(seed), tx=_ADAMW)

    def train_step(state, batch, rng):
        (value, denom), grads = jax.value_and_grad(lambda p: loss(p, batch, rng), has_aux=True)(state.params)
        grads = resilax.record(grads, weight=denom)
        return state.apply_gradients(grads=grads), {"loss": value, "denominator": denom}

    def state_sharding(state):
        from jax.sharding import PartitionSpec as P

        specs = jax.tree.map(lambda _: P(), state)
        blocks = resilax.pipeline_sharding(state.params["blocks"])
        # the optimizer's moments of the blocks live with them, on their stage
        return _stage_like(state, specs, blocks)

    return PipelineCase(name, make_state, train_step, loss, token_batches, state_sharding)


def _stage_like(state, specs, blocks):
    """Every leaf whose path runs through ``["blocks"]`` (parameters and their optimizer
    moments) gets the stacked blocks' spec; the rest stay replicated."""
    from jax.sharding import PartitionSpec as P

    block_spec = jax.tree.leaves(blocks, is_leaf=lambda x: isinstance(x, P))[0]

    def spec(path, leaf_spec):
        return block_spec if any(getattr(k, "key", None) == "blocks" for k in path) else leaf_spec

    return jax.tree_util.tree_map_with_path(spec, specs, is_leaf=lambda x: isinstance(x, P))


# ---------------------------------------------------------------- the per-stage executor's model
def executor_case(width: int = 8, layers: int = 8, vocab: int = 16, rate: float = 0.1, seed: int = 0):
    """``(PipelineModel, params, make_batches)`` for `resilax.PipelineExecutor`: an embedding,
    ``layers`` residual tanh layers with dropout (rate ``rate``) and a softmax head whose
    cross-entropy is weighted per example (some examples weigh 0: a padding-style
    normalisation, recorded as the loss's weight)."""
    from resilax._src.pipeline.executor import PipelineModel

    def first(p, b, key):
        return p["emb"][b["x"]]

    def layer(w, h, key):
        y = jnp.tanh(h @ w["w"] + w["b"])
        if rate:
            y = jnp.where(jax.random.bernoulli(key, 1 - rate, y.shape), y / (1 - rate), 0)
        return h + y

    def last(p, h, b, key):
        ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], b["y"])
        return (ce * b["w"]).sum(), b["w"].sum()

    rng = np.random.default_rng(seed)
    params = {"first": {"emb": (rng.normal(size=(vocab, width)) / 2).astype(np.float32)},
              "blocks": {"w": (rng.normal(size=(layers, width, width)) / 3).astype(np.float32),
                         "b": np.zeros((layers, width), np.float32)},
              "last": {"out": (rng.normal(size=(width, vocab)) / 3).astype(np.float32)}}

    def make_batches(n, batch=16, seed=1):
        r = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            x = r.integers(0, vocab, size=(batch,)).astype(np.int32)
            out.append({"x": x, "y": ((x * 3 + 1) % vocab).astype(np.int32),
                        "w": (r.random(batch) < 0.7).astype(np.float32)})
        return out

    return PipelineModel(first, layer, last), params, make_batches
