"""A GPT-style flax language model: bf16 compute, f32 parameters, AdamW, dropout through
``rng=True`` (the model of issue 26's GPU report; used by ``resilax bench gpt`` and tests).

``SIZES["small"]`` is the reported one (d 768, 12 layers, seq 512, batch 32, vocab 32k:
~110 M parameters, 1.33 GB of train state with AdamW); ``SIZES["tiny"]`` runs on CPU.
"""

from __future__ import annotations

import functools
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state


@dataclasses.dataclass(frozen=True)
class GPTSize:
    d: int
    layers: int
    heads: int
    seq: int
    batch: int
    vocab: int
    dropout: float = 0.1


SIZES = {
    "tiny": GPTSize(d=32, layers=1, heads=2, seq=16, batch=8, vocab=128),  # compiles in seconds on CPU
    "small": GPTSize(d=768, layers=12, heads=12, seq=512, batch=32, vocab=32_000),
}


class Block(nn.Module):
    size: GPTSize

    @nn.compact
    def __call__(self, x, train: bool):
        s = self.size
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(num_heads=s.heads, dtype=jnp.bfloat16, dropout_rate=s.dropout,
                                            deterministic=not train)(h, h, mask=mask)
        x = x + nn.Dropout(s.dropout, deterministic=not train)(h)
        h = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        h = nn.Dense(4 * s.d, dtype=jnp.bfloat16)(h)
        h = nn.Dense(s.d, dtype=jnp.bfloat16)(nn.gelu(h))
        return x + nn.Dropout(s.dropout, deterministic=not train)(h)


class GPT(nn.Module):
    size: GPTSize

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        s = self.size
        emb = nn.Embed(s.vocab, s.d, dtype=jnp.bfloat16)
        pos = self.param("pos", nn.initializers.normal(0.02), (s.seq, s.d))
        x = emb(tokens) + pos[: tokens.shape[1]].astype(jnp.bfloat16)
        for _ in range(s.layers):
            x = Block(s)(x, train)
        x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        return emb.attend(x).astype(jnp.float32)  # tied output embedding, logits in f32


@functools.lru_cache(maxsize=None)
def _adamw():
    """One optimizer object: states made alike are then the same tree, so a second wrap of
    the same step reuses the first's traces (see `resilax.tools.example._adamw`)."""
    return optax.adamw(3e-4, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def _gpt(size: GPTSize) -> "GPT":
    """One model object per size (a state's tree holds ``model.apply``; see `_adamw`)."""
    return GPT(size)


def make_state(size: GPTSize, seed: int = 0):
    model = _gpt(size)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, size.seq), jnp.int32), train=False)["params"])(
        jax.random.key(seed))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=_adamw())


def train_step(state, batch, rng):
    """Next-token cross entropy; the step `resilax.wrap(..., rng=True)` calls."""
    import resilax

    grads, loss = plain_grad(state, batch, rng)
    return state.apply_gradients(grads=resilax.record(grads)), {"loss": loss}


def plain_grad(state, batch, rng):
    """``(grads, loss)`` of the step without `resilax.record`: the grad half of
    `plain_step`, for the bench's plain two-program reference."""
    def loss_fn(p):
        logits = state.apply_fn({"params": p}, batch["tokens"], train=True, rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["tokens"][:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return grads, loss


def plain_step(state, batch, rng):
    """The same step without `resilax.record` (for a plain ``jax.jit``)."""
    grads, loss = plain_grad(state, batch, rng)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batches(size: GPTSize, n: int, seed: int = 0) -> list[dict]:
    r = np.random.default_rng(seed)
    return [{"tokens": r.integers(0, size.vocab, (size.batch, size.seq)).astype(np.int32)} for _ in range(n)]


def fsdp_spec(state, axis="fsdp", n: int = 4):
    """Every leaf whose first dim divides by ``n`` sharded over ``axis`` on it; the rest replicated."""
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda x: P(axis) if np.ndim(x) >= 1 and np.shape(x)[0] % n == 0 else P(), state)
