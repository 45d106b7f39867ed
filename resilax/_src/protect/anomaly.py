"""Numerical anomalies: NaN/Inf and loss spikes, detected off the critical path.

How detection stays off the critical path: the compiled step itself computes one boolean
(all recorded values and float metrics finite) and the loss as a scalar, next to the new
state, in the same program. Their device-to-host copies start right after dispatch
(``copy_to_host_async``), and the host only *reads* them one step later, after the next
step has been dispatched: by then the device is busy with step ``k+1`` and the values of
step ``k`` are already on the host, so the check costs no host sync. A step that will be
checkpointed is checked at once (the save synchronises anyway), so a checkpoint never
holds a state that failed its check.

Spikes use a robust z-score, ``(x - median) / (1.4826 * MAD)`` over the last ``window``
good losses: the median and the median absolute deviation ignore the occasional outlier
that would inflate a mean/std detector. Only upward spikes count.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from resilax._src.errors import ResilaxError
from resilax._src.runtime.faults import register_kind

MAD_TO_SIGMA = 1.4826


class AnomalyError(ResilaxError):
    """A step produced NaN/Inf or a loss spike and the policy is ``on_anomaly="stop"``
    (or no good state to roll back to exists).

    Attributes: ``step`` (the anomalous step), ``cause`` (``"nonfinite"`` or ``"spike"``).
    """

    def __init__(self, msg, *, step: int, cause: str):
        super().__init__(msg)
        self.step = step
        self.cause = cause


def finite_flag(*trees):
    """Traced: True when every float leaf of ``trees`` is finite (one fused reduction)."""
    flags = [jnp.all(jnp.isfinite(x)) for t in trees for x in jax.tree.leaves(t)
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def robust_zscore(x: float, history) -> float:
    """``(x - median) / (1.4826 * MAD)`` of ``history``; 0 when the spread is zero."""
    h = np.asarray(history, np.float64)
    med = np.median(h)
    mad = np.median(np.abs(h - med)) * MAD_TO_SIGMA
    if not np.isfinite(mad) or mad <= 0:
        return 0.0
    return float((x - med) / mad)


@dataclasses.dataclass
class SpikeDetector:
    """Loss-spike detector over a window of recent good losses.

    ``check(loss)`` returns ``None`` for a normal loss (and adds it to the window) or a
    description of the spike (the window is left unchanged, so a skipped batch does not
    shift the baseline). No verdict before ``min_history`` losses were seen.
    """

    zscore: float = 6.0
    window: int = 50
    min_history: int = 10

    def __post_init__(self):
        self._hist: collections.deque = collections.deque(maxlen=self.window)

    def check(self, loss: float) -> str | None:
        if len(self._hist) >= self.min_history:
            z = robust_zscore(loss, self._hist)
            if z > self.zscore:
                return f"loss {loss:.6g} is a spike: robust z-score {z:.1f} > {self.zscore} over the last {len(self._hist)} steps"
        self._hist.append(float(loss))
        return None


class Verdict:
    """The lagged check of one step: its finite flag and loss, copied to host asynchronously."""

    __slots__ = ("step", "finite", "loss")

    def __init__(self, step, finite, loss):
        self.step = step
        self.finite = finite
        self.loss = loss
        for x in (finite, loss):
            if x is not None:
                x.copy_to_host_async()

    def cause(self, spikes: SpikeDetector | None) -> tuple[str, str] | None:
        """``(cause, detail)`` or None. Reads the host copies (ready by now when lagged)."""
        if not bool(np.asarray(self.finite)):
            return "nonfinite", "NaN/Inf in the recorded values or metrics"
        if spikes is not None and self.loss is not None:
            detail = spikes.check(float(np.asarray(self.loss)))
            if detail:
                return "spike", detail
        return None


# ---------------------------------------------------------------- fault kind `nan`
def _poison(fault, ctx):
    """``nan@N``: the next step to run (step number ``N``) gets a batch whose float leaves are NaN."""
    guard = getattr(ctx, "_replay", None)
    if guard is None:
        raise ResilaxError("resilax fault 'nan' needs a ResilientStep (the fault fires inside step calls)")
    guard.poison_next = True


def poison_batch(batch):
    """A host copy of ``batch`` with every float leaf set to NaN."""
    def one(x):
        x = np.array(x, copy=True)
        if np.issubdtype(x.dtype, np.floating):
            x[...] = np.nan
        return x
    return jax.tree.map(one, batch)


register_kind("nan", _poison)
