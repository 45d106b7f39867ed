"""Four small models the example MLP is not, for the recovery tests and `resilax campaign`: dropout, BatchNorm, a
token-weighted loss and a transformer LM with dropout and a token-normalised loss.

Each `ModelCase` has ``make_state(seed)``, ``train_step(state, batch, rng)`` (calls
``resilax.record`` once, with ``weight=`` where the loss is normalised by a count),
``make_batches(n, seed)`` and ``metric_reductions``. Leading parameter dims divide by 8.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import resilax

B = 16  # global batch
SEQ, VOCAB = 16, 64


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str
    make_state: Callable
    train_step: Callable
    make_batches: Callable
    metric_reductions: dict = dataclasses.field(default_factory=dict)
    batch_size: int = B


# One optimizer object for every state these models make: a state's tree names its
# optimizer's functions, so two states built alike are the same tree only with the same
# object, and then a second wrap of the same step reuses the first's traces (resilax's
# trace cache keys on the tree, as jax.jit's cache does).
_ADAMW = optax.adamw(1e-2)


_CREATE: dict = {}  # (model, state class, extra collections) -> the jitted initialiser


def _state(model, sample, seed, cls=train_state.TrainState, **extra_vars):
    """A fresh state (new buffers each call: a run may donate them). The initialiser is
    traced and compiled once per model and process: a campaign or a test module builds
    states of the same models many times (0.3 s a time on 2 cores, built anew)."""
    k = (id(model), cls, tuple(sorted(extra_vars)))
    if k not in _CREATE:
        def create(key):
            variables = model.init({"params": key, "dropout": key}, sample)
            kw = {n: variables[n] for n in extra_vars}
            return cls.create(apply_fn=model.apply, params=variables["params"], tx=_ADAMW, **kw)

        _CREATE[k] = jax.jit(create)
    return _CREATE[k](jax.random.key(seed))


def _classify_batches(n, seed):
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(10, 16)).astype(np.float32)
    out = []
    for _ in range(n):
        y = rng.integers(0, 10, size=B).astype(np.int32)
        x = (protos[y] + rng.normal(size=(B, 16))).astype(np.float32)
        out.append({"x": x, "y": y})
    return out


# ---------------------------------------------------------------- 1. dropout MLP
class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        x = nn.relu(nn.Dense(64)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(16)(x)


def _dropout_step(state, batch, rng):
    def loss_fn(p):
        logits = state.apply_fn({"params": p}, batch["x"], rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = resilax.record(grads)
    return state.apply_gradients(grads=grads), {"loss": loss}


# ---------------------------------------------------------------- 2. BatchNorm MLP
class BNState(train_state.TrainState):
    batch_stats: Any = None


class BNMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        # no bias before BatchNorm: it would have an identically zero gradient (BN removes
        # the mean), which Adam turns from reduction-order noise into full-size updates
        x = nn.Dense(64, use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))
        x = nn.Dense(32, use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))
        return nn.Dense(16)(x)


def _bn_step(state, batch, rng):
    def loss_fn(p):
        logits, upd = state.apply_fn({"params": p, "batch_stats": state.batch_stats}, batch["x"],
                                     mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), upd["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads, stats = resilax.record((grads, stats))
    return state.apply_gradients(grads=grads).replace(batch_stats=stats), {"loss": loss}


# ---------------------------------------------------------------- 3/4. token models
def _token_batches(n, seed):
    rng = np.random.default_rng(seed + 7)
    out = []
    for _ in range(n):
        toks = rng.integers(0, VOCAB, size=(B, SEQ + 1)).astype(np.int32)
        toks[:, 1:] = (toks[:, :-1] * 3 + 1) % VOCAB  # learnable: next = 3 * cur + 1
        lengths = rng.integers(1, SEQ + 1, size=B)
        lengths[rng.random(B) < 0.4] = rng.integers(1, 3)  # some examples are mostly padding
        mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
        out.append({"tokens": toks, "mask": mask})
    return out


class TokenMLP(nn.Module):
    @nn.compact
    def __call__(self, toks, train: bool = True):
        h = nn.Embed(VOCAB, 32)(toks)
        h = nn.relu(nn.Dense(64)(h))
        return nn.Dense(VOCAB)(h)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        causal = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        # no qkv bias: the key bias has an identically zero gradient (softmax is shift-invariant),
        # so Adam turns pure reduction-order noise into full-size updates of it (see test notes)
        y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, use_bias=False, deterministic=True)(
            nn.LayerNorm()(x), mask=causal)
        x = x + nn.Dropout(0.1, deterministic=not train)(y)
        y = nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))
        return x + nn.Dropout(0.1, deterministic=not train)(y)


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, toks, train: bool = True):
        x = nn.Embed(VOCAB, 32)(toks) + self.param("pos", nn.initializers.normal(0.02), (SEQ, 32))[None]
        x = Block()(x, train)  # one block: a transformer's every op; a second only doubled the tests' tracing
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _token_step(state, batch, rng, weighted=True):
    """``weighted=False``: the record weight dropped (a test's control: microbatches then
    combine as a plain mean of means)."""
    inputs, targets, mask = batch["tokens"][:, :-1], batch["tokens"][:, 1:], batch["mask"]
    denom = mask.sum()

    def loss_fn(p):
        logits = state.apply_fn({"params": p}, inputs, rngs={"dropout": rng})
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (ce * mask).sum() / denom  # token-normalised

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = resilax.record(grads, weight=denom) if weighted else resilax.record(grads)
    return state.apply_gradients(grads=grads), {"loss": loss, "denominator": denom}


_SAMPLE_X = jnp.zeros((1, 16))
_SAMPLE_T = jnp.zeros((1, SEQ), jnp.int32)

# One model object per case, like the optimizer: a state's tree holds ``model.apply``, and two
# bound methods are equal only on the same object.
_MODELS = {"dropout_mlp": DropoutMLP(), "batchnorm_mlp": BNMLP(), "token_lm": TokenMLP(), "transformer_lm": Transformer()}

CASES = {c.name: c for c in (
    ModelCase("dropout_mlp", lambda seed=0: _state(_MODELS["dropout_mlp"], _SAMPLE_X, seed), _dropout_step,
              _classify_batches),
    ModelCase("batchnorm_mlp", lambda seed=0: _state(_MODELS["batchnorm_mlp"], _SAMPLE_X, seed, BNState,
                                                     batch_stats=True), _bn_step, _classify_batches),
    ModelCase("token_lm", lambda seed=0: _state(_MODELS["token_lm"], _SAMPLE_T, seed), _token_step, _token_batches,
              {"denominator": "sum"}),
    ModelCase("transformer_lm", lambda seed=0: _state(_MODELS["transformer_lm"], _SAMPLE_T, seed), _token_step,
              _token_batches, {"denominator": "sum"}),
)}
for _c in CASES.values():  # defaults for the seed argument of make_batches
    object.__setattr__(_c, "make_batches", (lambda f: lambda n, seed=0: f(n, seed))(_c.make_batches))


def many_leaves(layers: int, width: int = 4):
    """``(state, train_step)``: a chain of ``layers`` tiny dense layers under Adam, a train
    state of ``6 * layers + 1`` leaves (kernel and bias per layer for the parameters and both
    moments, and the step count), so small that the host's per-step work is what a step
    costs (`benchmarks/host_overhead.py`; `tests/test_async.py`: Python work per call does
    not grow with the leaves). ``train_step(state, batch)`` with ``batch = {"x", "y"}`` of
    ``(rows, width)``; outside a wrapped step `resilax.record` returns its input, so plain
    jit runs the same step."""
    params = {f"l{i:03d}": {"w": jnp.full((width, width), 0.05, jnp.float32), "b": jnp.zeros((width,), jnp.float32)}
              for i in range(layers)}

    def apply(p, x):
        for i in range(layers):
            x = jnp.tanh(x @ p[f"l{i:03d}"]["w"] + p[f"l{i:03d}"]["b"])
        return x

    def step(state, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2))(state.params)
        return state.apply_gradients(grads=resilax.record(g)), {"loss": loss}

    return train_state.TrainState.create(apply_fn=apply, params=params, tx=optax.adam(1e-3)), step


def tree_rel_diff(a, b) -> float:
    """Max over leaves of ||a - b|| / ||b|| (float64 norms); inf if an integer leaf differs."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if not np.issubdtype(y.dtype, np.floating):
            if not np.array_equal(x, y):
                return float("inf")
            continue
        d = np.linalg.norm(x.astype(np.float64) - y.astype(np.float64))
        worst = max(worst, float(d / max(np.linalg.norm(y.astype(np.float64)), 1e-30)))
    return worst
