"""`resilax.record`: the marker between "compute the optimizer inputs" and "apply the update".

`record(tree)` is the identity when called outside resilax. While resilax traces a user's
step it consults the active frame:

- ``capture``: remember the recorded tree (to return it from the compiled step);
- ``inject``: return a given tree instead, so every value the recorded tree depended on
  (the forward and backward pass) becomes dead code that XLA removes.

Frames are per-thread and only live during tracing, so `record` costs nothing at run time.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax

from resilax._src.errors import WrapError

_local = threading.local()


class _Frame:
    __slots__ = ("mode", "value", "weight", "calls")

    def __init__(self, mode: str, value: Any = None):
        self.mode = mode
        self.value = value
        self.weight = None
        self.calls = 0


def record(tree, *, weight=None):
    """Marks ``tree`` (the gradients, or whatever the update consumes) as the optimizer
    inputs of this step. Returns ``tree`` (or, during replay, the logged value).

    Call it once per step, inside the function given to `resilax.wrap`. The recorded values
    must be *means* over the batch: plain batch means, or means normalised by a count the
    step computes (tokens that are not padding, say). Give that count as ``weight`` (a
    scalar): when a smaller mesh has to cut the global batch into microbatches, resilax
    combines them as ``sum(weight_i * value_i) / sum(weight_i)``, which is the full batch's
    value; without ``weight`` every microbatch counts the same (right for plain means).
    """
    frame = getattr(_local, "frame", None)
    if frame is None:
        return tree
    frame.calls += 1
    if frame.calls > 1:
        raise WrapError(
            "resilax.record must be called once per train_step (it marks the single split point between "
            f"gradients and update), but it was called {frame.calls} times; record one pytree holding all inputs"
        )
    if frame.mode == "capture":
        frame.value = tree
        frame.weight = weight
        return tree
    # inject: hand back the logged tree, checked against what the step computes.
    want = jax.tree.structure(tree)
    got = jax.tree.structure(frame.value)
    if want != got:
        raise WrapError(f"resilax.record: replayed value has structure {got}, but the step records {want}")
    return frame.value


@contextlib.contextmanager
def _frame(mode: str, value: Any = None):
    prev = getattr(_local, "frame", None)
    f = _Frame(mode, value)
    _local.frame = f
    try:
        yield f
    finally:
        _local.frame = prev


def capturing():
    """Context for tracing the user's step; ``frame.value`` is the recorded tree (or None)."""
    return _frame("capture")


def injecting(value):
    """Context for tracing the user's step with ``record`` returning ``value``."""
    return _frame("inject", value)
