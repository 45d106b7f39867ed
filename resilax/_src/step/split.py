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

    def full(self, state, batch, step_no):
        """The whole step as the user wrote it: ``(state, metrics)`` (a reference, not used
        by resilax's own programs)."""
        return self._call(state, batch, step_no)

    def grad(self, state, batch, step_no, key=None):
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

    def update(self, state, batch_template, step_no, recorded):
        with _record.injecting(recorded) as frame:
            new_state, _ = self._call(state, batch_template, step_no)
        if frame.calls == 0:
            raise WrapError("resilax.wrap: train_step never called resilax.record(...)")
        return new_state


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
