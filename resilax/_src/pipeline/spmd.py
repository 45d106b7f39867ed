"""`resilax.pipeline`: layers stacked with a leading layer dimension, run as a pipeline over
a ``stage`` mesh axis, inside the user's loss.

The pipeline is one SPMD program (as MaxText, praxis and the JAX shard_map notes build it):
the ``L`` stacked layers are cut into ``S`` stages (``S`` = the size of the stage axis) of
``L / (S * repeats)`` layers each; the batch is cut into ``M`` micro-batches; ``M * repeats
+ S - 1`` ticks are unrolled in Python, and at each tick every stage applies its layers to
the activations its neighbour handed it on the tick before (a ``ppermute`` around the stage
ring). ``jax.grad`` through it is the backward (GPipe). With ``repeats = R > 1`` the
schedule is circular: stage ``s`` holds layers of every repeat and a micro-batch goes
around the ring ``R`` times, so the bubble shrinks by ``R``.

What holds, and why:

- **No conditional, loop or callback.** Ticks are unrolled (``lax.scan`` lowers to a
  ``while``) and every per-device choice (which micro-batch, which repeat's weights, is this
  tick a bubble) is a select or a dynamic slice, so the program stays asynchronous on a GPU
  (XLA:GPU evaluates a conditional's predicate on the host). The price is compile time
  growing with the ticks.
- **Bubbles never reach a gradient.** A bubble tick computes on whatever its input holds
  (zeros, or garbage). Its weights and inputs enter the stage body through
  ``where(valid, x, stop_gradient(x))``, and its output is read by no valid tick, so a NaN or
  inf made in a bubble is selected away in the forward and in the backward (a select, not a
  multiply: ``0 * inf`` would be NaN).
- **Stage-input remat** (``remat=True``): each tick's stage body runs under
  ``jax.checkpoint``; the backward keeps one activation per tick (the stage's input) and
  recomputes the layers inside the stage.
- **The same examples.** Micro-batch ``m`` takes examples ``m, m + M, m + 2M, ...`` of the
  batch, so a batch sharded over a data axis gives every data shard an equal part of every
  micro-batch (no data moves between data shards), and the output is put back in the
  batch's order. The maths is the unpipelined model's up to rounding; only layers that
  mix examples (batch statistics) see a micro-batch instead of the batch, as in every
  pipeline.
- **Randomness.** With ``key``, layer ``l`` on micro-batch ``m`` gets
  ``fold_in(fold_in(key, l), m)``: keyed by the layer and the micro-batch, never by the
  device, so a run on fewer data replicas (global batch shapes) draws the same bits.
- **Placement.** The mesh comes from the context (``jax.set_mesh``, or `resilax.wrap`,
  which sets it while it traces each program). Stage ``s`` holds layers ``[s * L / S,
  (s + 1) * L / S)`` when ``repeats = 1``, which is the layout of the leading dimension
  sharded over the stage axis (`pipeline_sharding`): no weight moves. With ``repeats > 1``
  stage ``s`` runs layers ``r * S * k + s * k + j`` (``k`` layers per stage per repeat), so
  layers stored sharded over the stage axis are moved to their stage in each step (XLA
  inserts the transfers).

Costs: each device holds the whole (data-sharded) input batch and one output buffer of ``M``
micro-batches; the unrolled program has ``M * R + S - 1`` copies of the stage body.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from resilax._src.errors import PipelineError

_WHERE = "resilax.pipeline"
_local = threading.local()


class NeedsMesh(BaseException):
    """Raised by `pipeline` while `detecting` is on and no mesh is in context: the step reads
    the context mesh, so resilax traces it under each program's mesh. A BaseException so
    that a user's ``except Exception`` around the call does not swallow it."""


@contextlib.contextmanager
def detecting():
    """Within: `pipeline` without a mesh in context raises `NeedsMesh` instead of an error.
    resilax traces a step first without a mesh (the trace is then shared by every mesh
    shape, which keeps recoveries from retracing) and only steps that use `pipeline` are
    traced under each program's mesh."""
    before = getattr(_local, "detecting", False)
    _local.detecting = True
    try:
        yield
    finally:
        _local.detecting = before


def pipeline(layer_fn: Callable, weights: Any, x: Any, *, microbatches: int, axis: str = "stage",
             repeats: int = 1, remat: bool = True, key: jax.Array | None = None):
    """Applies ``L`` stacked layers to ``x`` as a pipeline over mesh axis ``axis``.

    Args:
      layer_fn: ``layer_fn(w, h) -> h`` (``layer_fn(w, h, key)`` when ``key`` is given): one
        layer, with ``w`` one layer's weights (a leaf of ``weights`` without its leading
        dimension) and ``h`` the activations of one micro-batch (a pytree like ``x``, of the
        same shapes going in and out).
      weights: a pytree whose leaves all have the leading layer dimension ``L``.
      x: the activations (a pytree), every leaf with the leading batch dimension ``B``.
      microbatches: ``M``; divides ``B``. ``M >= S`` when ``repeats > 1``.
      axis: the mesh axis of the stages; ``S`` is its size. ``S * repeats`` divides ``L``.
      repeats: circular repeats ``R`` (1: GPipe).
      remat: keep only each stage's input for the backward (recompute the layers).
      key: a PRNG key for layers that draw random bits (dropout).

    Returns:
      ``h`` after the ``L`` layers, in the batch order of ``x``.

    Raises:
      PipelineError: no mesh with ``axis`` in context, or shapes that do not divide.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty and getattr(_local, "detecting", False):
        raise NeedsMesh()
    if mesh.empty or axis not in mesh.axis_names:
        have = [] if mesh.empty else list(mesh.axis_names)
        raise PipelineError(
            f"{_WHERE} needs a mesh with axis {axis!r} in context (resilax.wrap sets it while tracing; with plain "
            f"jax use `with jax.set_mesh(mesh):`), but the mesh in context has axes {have}")
    S = int(mesh.shape[axis])
    R, M = _positive("repeats", repeats), _positive("microbatches", microbatches)
    L = _leading("weights", weights, "layer")
    B = _leading("x", x, "batch")
    if L % (S * R):
        raise PipelineError(f"{_WHERE}: {L} stacked layers do not divide into {S} stages (axis {axis!r}) x {R} repeats")
    if B % M:
        raise PipelineError(f"{_WHERE}: a batch of {B} does not divide into {M} micro-batches")
    if R > 1 and M < S:
        raise PipelineError(f"{_WHERE}: a circular pipeline (repeats={R}) needs at least as many micro-batches as "
                            f"stages ({S}), but got microbatches={M}")
    k = L // (S * R)
    if key is not None and _arity(layer_fn) == 2:
        raise PipelineError(f"{_WHERE}: key given, but layer_fn takes 2 arguments; it must take (w, h, key)")

    # [B, ...] -> [M, B/M, ...]: micro-batch m holds examples m, m + M, ...
    xs = jax.tree.map(lambda a: jnp.swapaxes(a.reshape((B // M, M) + a.shape[1:]), 0, 1), x)
    # [L, ...] -> [S, R, k, ...]: stage s, repeat r, layer j is layer r*S*k + s*k + j
    ws = jax.tree.map(lambda w: jnp.swapaxes(w.reshape((R, S, k) + w.shape[1:]), 0, 1), weights)
    body = _stage_body(layer_fn, k, S, R, key is not None, remat)
    keys = key if key is not None else jnp.zeros((), jnp.uint32)
    # The micro-batches enter every stage (replicated over the axis), so the backward sums
    # their cotangents over the stages: in float32 for 16-bit floats (an exact widening going
    # in; XLA:CPU's all-reduce promotion aborts on the bf16 all-reduce the transpose makes).
    dtypes = jax.tree.map(lambda a: a.dtype, xs)
    xs = jax.tree.map(lambda a: a.astype(jnp.float32) if _narrow(a.dtype) else a, xs)

    def run(ws, xs, keys):
        return _ticks(body, jax.tree.map(lambda w: w[0], ws), xs, keys, dtypes, S=S, R=R, M=M, axis=axis)

    out = jax.shard_map(run, mesh=mesh, in_specs=(P(axis), P(), P()), out_specs=P(axis),
                        axis_names=frozenset({axis}))(ws, xs, keys)
    # every stage returns its output buffer; the last stage's holds the pipeline's output
    return jax.tree.map(lambda a: jnp.swapaxes(a[-1], 0, 1).reshape((B,) + a.shape[3:]), out)


def _ticks(body, w_local, xs, key, dtypes, *, S, R, M, axis):
    """The unrolled schedule on one stage (inside shard_map over ``axis``). ``xs`` may be
    wider than ``dtypes`` (see `pipeline`): a micro-batch is narrowed only after the select
    that makes it per-stage, so the backward's sum over the stages stays wide."""
    s = jax.lax.axis_index(axis)
    mb = jax.tree.map(lambda a, d: a[0].astype(d), xs, dtypes)
    zeros = jax.tree.map(jnp.zeros_like, mb)
    carry = zeros
    loop = [zeros] * M if R > 1 else None  # stage 0's copy of each micro-batch between repeats
    out = [zeros] * M
    ring = [(j, (j + 1) % S) for j in range(S)]
    for t in range(M * R + S - 1):
        if t < M * R:  # stage 0's input at tick t: iteration t, a Python int
            first = jax.tree.map(lambda a: a[t % M], xs) if t < M else loop[t % M]
            inp = jax.tree.map(lambda f, c: jnp.where(s == 0, f, c.astype(f.dtype)).astype(c.dtype), first, carry)
        else:
            inp = carry
        i = t - s  # this stage's iteration (repeat * M + micro-batch); a bubble outside [0, M*R)
        valid = (i >= 0) & (i < M * R)
        ic = jnp.clip(i, 0, M * R - 1)
        y = body(w_local, inp, valid, ic // M, ic % M, s, key)
        last = t - (S - 1)  # the last stage's iteration at tick t
        if (R - 1) * M <= last < R * M:
            out[last % M] = y
        carry = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, ring), y)
        if R > 1 and 0 <= last < (R - 1) * M:
            loop[last % M] = carry  # arrives at stage 0 from the last stage; read at its next repeat
    return jax.tree.map(lambda *a: jnp.stack(a)[None], *out)


def _stage_body(layer_fn, k, S, R, keyed, remat):
    def body(w_local, inp, valid, r, m, s, key):
        # bubbles: weights and inputs enter through a select with a stopped gradient, so
        # whatever a bubble computes (NaN included) reaches no gradient
        w = jax.tree.map(lambda a: a[r] if R > 1 else a[0], w_local)
        w = jax.tree.map(lambda a: jnp.where(valid, a, jax.lax.stop_gradient(a)), w)
        h = jax.tree.map(lambda a: jnp.where(valid, a, jax.lax.stop_gradient(a)), inp)
        for j in range(k):
            wj = jax.tree.map(lambda a: a[j], w)
            if keyed:
                layer = r * (S * k) + s * k + j
                h = layer_fn(wj, h, jax.random.fold_in(jax.random.fold_in(key, layer), m))
            else:
                h = layer_fn(wj, h)
        return h

    return jax.checkpoint(body) if remat else body


def pipeline_sharding(weights: Any, axis: str = "stage", inner: Any = None):
    """PartitionSpecs for stacked layer weights: the leading (layer) dimension over ``axis``,
    so stage ``s`` holds the layers it runs (``repeats=1``). ``inner``: a PartitionSpec tree
    (or one PartitionSpec) for the dimensions after the layer one, e.g. ``P(None, "fsdp")``."""

    def spec(w, rest):
        if not np.ndim(w):
            raise PipelineError("resilax.pipeline_sharding: stacked weights need a leading layer dimension, but a "
                                "leaf is a scalar")
        return P(axis, *(rest or ()))

    if inner is None or isinstance(inner, P):
        return jax.tree.map(lambda w: spec(w, inner), weights)
    return jax.tree.map(spec, weights, inner, is_leaf=lambda v: isinstance(v, P))


def _narrow(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise PipelineError(f"{_WHERE}: {name} must be a positive int, but got {v!r}")
    return int(v)


def _leading(name, tree, what):
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise PipelineError(f"{_WHERE}: {name} has no arrays")
    dims = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if None in dims or len(dims) != 1:
        raise PipelineError(f"{_WHERE}: every leaf of {name} needs the same leading {what} dimension, but the "
                            f"leading dimensions are {sorted(str(d) for d in dims)}")
    return dims.pop()


def _arity(fn) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
