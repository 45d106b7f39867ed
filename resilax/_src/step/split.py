"""The user's step, split at `resilax.record` into its two parts.

- ``grad``:   ``(state, batch, step_no) -> (recorded, weight, metrics)`` — the part before
  `record` (the update is dead code and XLA removes it).
- ``update``: ``(state, recorded, step_no) -> state`` — the part after `record`: `record`
  returns the given value, so the forward and backward pass that produced it are dead code.
  The batch the user's step takes is a zero template here; a step whose update reads the
  batch other than through `record` is caught by `update_reads_batch` at wrap time.

Training runs ``grad`` then ``update`` as two executables, and replay runs the very same
``update`` executable on logged values: a replayed step is bitwise the original by
construction (as one fused program XLA may fuse gradient ops into the optimizer's fusions
and round differently; seen with BatchNorm on CPU).

RNG: with ``rng=True`` the step is called ``train_step(state, batch, rng)`` with
``rng = fold_in(key(seed), step_no)`` in both parts, so a part run later (replay) sees the
same key as the original step. Whether a step takes a key is said, never guessed from its
signature: a third parameter with a default must not silently receive one.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import jax
import jax.numpy as jnp

from resilax._src.errors import WrapError
from resilax._src.step import record as _record


class Split:
    """The parts of one user step. Pure functions of their arguments; jit them."""

    def __init__(self, train_step, seed: int, rng: bool):
        self.train_step = train_step
        self.seed = seed
        self.rng = rng
        traces = _traces_of(train_step, seed, rng)
        self.full = _TracedOnce(self._full, traces.setdefault("full", {}))
        self.grad = _TracedOnce(self._grad, traces.setdefault("grad", {}))
        self.update = _TracedOnce(self._update, traces.setdefault("update", {}))
        # the argument shapes `programs.check_step` has validated the step on (shared like the traces)
        self.checked: set = traces.setdefault("checked", set())
        self._shared = traces

    @property
    def reads_mesh(self) -> bool:
        """Whether the step reads the mesh in context (it calls `resilax.pipeline`): found by
        `programs.check_step` on the first trace."""
        return self._shared.get("reads_mesh", False)

    def mark_reads_mesh(self) -> None:
        self._shared["reads_mesh"] = True

    def on(self, mesh):
        """The context to trace the step in for a program on ``mesh``: that mesh (abstract)
        for a step that reads it, so its shard_maps place work on the program's devices and
        the trace caches (JAX's and `_TracedOnce`'s, keyed by the trace context) keep one
        trace per mesh shape; nothing for other steps (one trace for every mesh)."""
        if not self.reads_mesh or mesh is None:
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)

    @staticmethod
    def shapes_key(*args):
        """What a check of the step on ``args`` depends on (as a trace does: `_signature`);
        None where JAX's trace context is not known, so no check is reused."""
        if _trace_context is None:
            return None
        leaves, tree = jax.tree.flatten(args)
        return _signature(tree, leaves)

    def key(self, step_no):
        return jax.random.fold_in(jax.random.key(self.seed), step_no)

    def _call(self, state, batch, step_no, key=None):
        if self.rng:
            out = self.train_step(state, batch, self.key(step_no) if key is None else key)
        else:
            out = self.train_step(state, batch)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise WrapError(
                f"resilax.wrap: train_step must return a (state, metrics) tuple, but returned {type(out).__name__}"
            )
        return out

    def _full(self, state, batch, step_no):
        """The whole step as the user wrote it: ``(state, metrics)`` (a reference, not used
        by resilax's own programs)."""
        return self._call(state, batch, step_no)

    def _grad(self, state, batch, step_no, key=None):
        """``(recorded, weight, metrics)``; ``weight`` is None unless `record` was given one."""
        with _record.capturing() as frame:
            _, metrics = self._call(state, batch, step_no, key)
        if frame.calls == 0:
            raise WrapError("resilax.wrap: train_step never called resilax.record(...); wrap the optimizer inputs "
                            "(the gradients) with it")
        weight = None if frame.weight is None else jnp.asarray(frame.weight, jnp.float32)
        if weight is not None and weight.shape != ():
            raise WrapError(f"resilax.record: weight must be a scalar, but got shape {weight.shape}")
        return frame.value, weight, metrics

    def _update(self, state, batch_template, step_no, recorded):
        with _record.injecting(recorded) as frame:
            new_state, _ = self._call(state, batch_template, step_no)
        if frame.calls == 0:
            raise WrapError("resilax.wrap: train_step never called resilax.record(...)")
        return new_state


try:  # public since jax 0.4.30; a JAX without it traces in place (slower, the same programs)
    from jax.extend.core import jaxpr_as_fun as _AS_FUN
except ImportError:  # pragma: no cover
    _AS_FUN = None
try:  # JAX's own jit cache keys on it: the config a trace depends on (x64, matmul precision, ...)
    from jax._src.config import trace_context as _trace_context
except ImportError:  # pragma: no cover
    _trace_context = None


def _signature(tree, leaves) -> tuple:
    """What a trace of the step on arguments ``tree`` with ``leaves`` (arrays, avals or
    ShapeDtypeStructs) depends on: the tree, each leaf's shape, dtype and weak type, and
    JAX's trace context (x64, matmul precision, ...; None where it cannot be read)."""
    return (tree, tuple((tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))) for x in leaves),
            None if _trace_context is None else _trace_context())


_BY_STEP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TRACING = threading.RLock()  # one trace of the user's step at a time (tracing holds the GIL anyway)


def _traces_of(train_step, seed, rng) -> dict:
    """The traces of ``train_step``'s parts, shared by every wrap of the same step, seed and
    rng flag in this process (a reference run and a faulted one, a bench's configurations):
    each is a trace of the same function on the same shapes, as ``jax.jit`` shares its own
    cache between calls of one function. Held as long as the step function lives. Not shared
    where JAX's trace context cannot be read (a config change between wraps would otherwise
    reuse a stale trace) or the step cannot be weakly referenced."""
    if _trace_context is None:
        return {}
    try:
        return _BY_STEP.setdefault(train_step, {}).setdefault((seed, rng), {})
    except TypeError:
        return {}


class _TracedOnce:
    """``fn`` traced once per argument shapes and dtypes; each call inside a program evaluates
    the cached jaxpr on that program's tracers.

    Every program calls the user's step: each mesh a recovery lands on, each microbatch count,
    each variant (log ring, injected faults, the cross-check), and each shape query. Retracing
    a flax model is most of what building a program costs (seconds of Python per recovery),
    while the jaxpr depends only on the shapes: the shardings the program gives its inputs are
    not part of it (the mesh's axes are automatic; GSPMD partitions the whole program after).
    Evaluating the jaxpr binds the same primitives in the same order, so the program is the
    one tracing in place would build. Called outside any trace it just runs ``fn``.
    """

    def __init__(self, fn, cache: dict):
        self.fn = fn
        self._cache = cache

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        if _AS_FUN is None or not any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self.fn(*args)
        avals = [jax.typeof(x) for x in leaves]
        key = _signature(tree, avals)
        hit = self._cache.get(key)
        if hit is None:
            with _TRACING:  # the bit-exact mode builds its domains' programs on threads at once
                hit = self._cache.get(key)  # (each traced the step: two traces for one key)
                if hit is None:
                    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
                    closed, out = jax.make_jaxpr(self.fn, return_shape=True)(*jax.tree.unflatten(tree, abstract))
                    hit = self._cache[key] = (_AS_FUN(closed), jax.tree.structure(out))
        run, out_tree = hit
        return jax.tree.unflatten(out_tree, run(*leaves))


def update_reads_batch(split: Split, state, batch, recorded) -> list[str]:
    """Paths of batch leaves the update part still reads (after dead-code removal).

    Empty means the update depends on the batch only through `record`, so replaying it
    from logged values is exact and needs no data.
    """
    from jax._src.interpreters import partial_eval as pe

    closed = jax.make_jaxpr(split.update)(state, batch, jax.ShapeDtypeStruct((), "uint32"), recorded)
    jaxpr = closed.jaxpr
    _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    n_state = len(jax.tree.leaves(state))
    batch_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    used_batch = used[n_state : n_state + len(batch_paths)]
    return [p for p, u in zip(batch_paths, used_batch) if u]
