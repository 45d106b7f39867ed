"""The user's step, split at `resilax.record` into its parts.

- ``full``:   ``(state, batch, step_no) -> (state, metrics, recorded)`` — the whole step,
  also returning what was recorded (the optimizer inputs), in one program.
- ``grad``:   ``(state, batch, step_no) -> (recorded, metrics)`` — only the part before
  `record` (the update is dead code).
- ``update``: ``(state, batch, step_no, recorded) -> state`` — only the part after
  `record`: `record` returns the given value, so the forward and backward passes that
  produced it are dead code and XLA removes them. ``batch`` is still an argument, but a
  step whose update reads the batch other than through `record` is caught by
  `update_reads_batch`.

RNG: a step that takes ``rng`` gets ``fold_in(key(seed), step_no)`` in every part, so a
part run later (replay) sees the same key as the original step.
"""

from __future__ import annotations

import inspect

import jax

from resilax._src.step import record as _record
from resilax._src.errors import WrapError


def takes_rng(fn) -> bool:
    try:
        params = [
            p for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3


class Split:
    """The three parts of one user step. Pure functions of their arguments; jit them."""

    def __init__(self, train_step, seed: int):
        self.train_step = train_step
        self.seed = seed
        self.rng = takes_rng(train_step)

    def _call(self, state, batch, step_no):
        if self.rng:
            out = self.train_step(state, batch, jax.random.fold_in(jax.random.key(self.seed), step_no))
        else:
            out = self.train_step(state, batch)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise WrapError(
                f"resilax.wrap: train_step must return a (state, metrics) tuple, but returned {type(out).__name__}"
            )
        return out

    def full(self, state, batch, step_no):
        with _record.capturing() as frame:
            new_state, metrics = self._call(state, batch, step_no)
        return new_state, metrics, frame.value

    def grad(self, state, batch, step_no):
        with _record.capturing() as frame:
            _, metrics = self._call(state, batch, step_no)
        if frame.calls == 0:
            raise WrapError("resilax: train_step never called resilax.record(...); wrap the optimizer inputs with it")
        return frame.value, metrics

    def update(self, state, batch, step_no, recorded):
        with _record.injecting(recorded) as frame:
            new_state, _ = self._call(state, batch, step_no)
        if frame.calls == 0:
            raise WrapError("resilax: train_step never called resilax.record(...); wrap the optimizer inputs with it")
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
