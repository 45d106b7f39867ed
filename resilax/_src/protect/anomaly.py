"""Numerical anomalies (NaN/Inf, loss spikes), decided inside the compiled step.

The grad part computes ``ok``: every recorded value and float metric is finite, and the
watched metric is not an upward spike (robust z-score ``(x - median) / (1.4826 * MAD)``
over the last ``window`` good steps, only once ``min_history`` good steps were seen). The
update part applies the update only when ``ok`` (`resilax._src.step.program`), so a bad
batch changes nothing: no host sync on the critical path, no rollback, no replay. The
detector's state (the window) is a small replicated array carried from step to step
(`init_guard`, `check`), checkpointed with the state, and advanced in replay from the
logged verdicts and losses (`advance`), so a replayed or resumed run decides the same.

The host reads ``ok`` once it is ready (its copy started right after dispatch; `Watch`
never makes a step wait for it) to report a skipped step as an event, or to stop
(``on_anomaly="stop"``, at most one step late). Verdicts are records: each is written with
the step's log entry, the skipped steps in checkpoint metadata and host copies, and every
replay, resume and rebuild applies the recorded verdict (`recorded_verdict`), never a
recomputed one.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from resilax._src.errors import ResilaxError
from resilax._src.protect.base import Protection

MAD_TO_SIGMA = 1.4826


class AnomalyError(ResilaxError):
    """A step produced NaN/Inf or a loss spike and ``AnomalyConfig.on_anomaly="stop"``.

    Attributes: ``step`` (the anomalous step), ``cause`` (``"nonfinite"`` or ``"spike"``).
    The state is the one before that step (its update was not applied).
    """

    def __init__(self, msg, *, step: int, cause: str):
        super().__init__(msg)
        self.step = step
        self.cause = cause


def _all_finite(leaves):
    """Traced, exact: True when every element of every leaf is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def finite_flag(*trees):
    """Traced: True when every float leaf of ``trees`` is finite.

    Exact and branch-free: XLA's ``is-finite`` per element, reduced with ``and`` per leaf,
    read in whatever layout the leaf already has. No ``lax.cond`` (an earlier version ran a
    plain sum first and the exact check under a cond only when the sum was not finite: on
    a GPU, XLA evaluates a conditional's predicate on the host, so every step waited for
    the device) and no arithmetic shortcut: a sum overflows on finite values, ``x * 0`` is
    a multiply-reduce that XLA:CPU turned into a transposing library call, and XLA:CPU's
    ``max`` reduction of float32 drops NaN (measured: ``isfinite(max(abs(x)))`` said True
    for a float32 leaf holding a NaN)."""
    leaves = [x for t in trees for x in jax.tree.leaves(t)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and np.size(x)]
    if not leaves:
        return jnp.array(True)
    return _all_finite(leaves)


def sharded_finite_flag(leaves, shardings):
    """Traced: `finite_flag` of the flat list ``leaves`` (NamedShardings ``shardings`` on one
    mesh): each device counts its blocks that hold a non-finite element, then one ``psum``
    over the mesh (one collective for every leaf, where XLA would partition a global
    reduction of each sharded leaf into its own all-reduce). Falls back to `finite_flag`
    when a leaf is not evenly divided by its sharding."""
    pairs = [(x, s) for x, s in zip(leaves, shardings)
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and np.size(x)]
    if not pairs:
        return jnp.array(True)
    mesh = pairs[0][1].mesh
    xs = [x for x, _ in pairs]
    even = all(getattr(s, "mesh", None) == mesh and _divides(s, x.shape) for x, s in pairs)
    if not even:
        return finite_flag(xs)
    axes = tuple(mesh.axis_names)

    def body(*blocks):
        bad = sum(jnp.any(~jnp.isfinite(b)).astype(jnp.int32) for b in blocks)
        return jax.lax.psum(bad, axes)

    bad = jax.shard_map(body, mesh=mesh, in_specs=tuple(s.spec for _, s in pairs),
                        out_specs=jax.sharding.PartitionSpec(), check_vma=False)(*xs)
    return bad == 0


def _divides(sharding, shape) -> bool:
    """Whether ``sharding`` cuts ``shape`` into equal blocks (jax refuses otherwise)."""
    try:
        sharding.shard_shape(tuple(shape))
    except ValueError:
        return False
    return True


def robust_zscore(x: float, history) -> float:
    """Host reference of the in-program score: ``(x - median) / (1.4826 * MAD)``; 0 when the
    spread is zero."""
    h = np.asarray(history, np.float64)
    med = np.median(h)
    mad = np.median(np.abs(h - med)) * MAD_TO_SIGMA
    if not np.isfinite(mad) or mad <= 0:
        return 0.0
    return float((x - med) / mad)


def init_guard(cfg):
    """The detector's state: the last ``spike_window`` good values (NaN = empty) and a count."""
    return {"window": jnp.full((cfg.spike_window,), jnp.nan, jnp.float32), "count": jnp.zeros((), jnp.int32)}


def abstract_guard(cfg):
    return {"window": jax.ShapeDtypeStruct((cfg.spike_window,), jnp.float32),
            "count": jax.ShapeDtypeStruct((), jnp.int32)}


def advance(guard, value, ok):
    """Traced: pushes ``value`` into the window when ``ok`` (a skipped step leaves the
    baseline unchanged). Exact (moves and selects only), so replay reproduces it bitwise."""
    pushed = {"window": jnp.roll(guard["window"], 1).at[0].set(value), "count": guard["count"] + 1}
    return jax.tree.map(lambda new, old: jnp.where(ok, new, old), pushed, guard)


def zscore(guard, value):
    """Traced robust z-score of ``value`` against the window (0 while the spread is 0)."""
    w = guard["window"]
    med = jnp.nanmedian(w)
    mad = jnp.nanmedian(jnp.abs(w - med)) * MAD_TO_SIGMA
    return jnp.where((mad > 0) & jnp.isfinite(mad), (value - med) / jnp.where(mad > 0, mad, 1.0), 0.0)


OK, NONFINITE, SPIKE = 0, 1, 2
CAUSES = {NONFINITE: "nonfinite", SPIKE: "spike"}


def make_check(cfg):
    """``(guard, rec, metrics, rec_shardings=None) -> (verdict, value, guard)``, traced into
    the grad part (``rec_shardings``: the recorded values' NamedShardings, when known);
    ``verdict`` is `OK`, `NONFINITE` or `SPIKE` (int32); the update applies only on `OK`."""

    def check(guard, rec, metrics, rec_shardings=None):
        if rec_shardings is None:
            finite = finite_flag(rec, metrics)
        else:  # the recorded values are sharded: reduced per device, one collective
            finite = sharded_finite_flag(jax.tree.leaves(rec), jax.tree.leaves(rec_shardings)) & finite_flag(metrics)
        value = _metric(metrics, cfg.metric)
        if value is None or cfg.spike_zscore is None:
            verdict = jnp.where(finite, OK, NONFINITE).astype(jnp.int32)
            return verdict, jnp.zeros((), jnp.float32) if value is None else value, guard
        spike = (guard["count"] >= cfg.min_history) & (zscore(guard, value) > cfg.spike_zscore)
        verdict = jnp.where(finite, jnp.where(spike, SPIKE, OK), NONFINITE).astype(jnp.int32)
        return verdict, value, advance(guard, value, verdict == OK)

    return check


def _metric(metrics, name):
    if isinstance(metrics, dict) and name in metrics:
        return jnp.asarray(metrics[name], jnp.float32).reshape(())
    return None


def recorded_verdict(v, step: int) -> int:
    """A recorded verdict (from a log entry, a host copy or a device scalar) as an int in
    (`OK`, `NONFINITE`, `SPIKE`).

    Raises:
      ReplayLogError: it is missing or not a verdict: the step's recorded outcome is
        unknown, and recomputing it could apply an update the original step skipped.
    """
    from resilax._src.errors import ReplayLogError

    try:
        x = None if v is None else np.asarray(v)
        code = int(x) if x is not None and x.shape == () and x.dtype.kind in "iu" else None
    except (TypeError, ValueError):
        code = None
    if code not in (OK, NONFINITE, SPIKE):
        raise ReplayLogError(f"resilax replay: step {step} has no valid recorded verdict (got {v!r}; expected "
                             f"{OK} applied, {NONFINITE} skipped for NaN/Inf or {SPIKE} skipped for a spike)")
    return code


MAX_SKIPPED_KEPT = 1000  # skipped steps listed in a checkpoint's metadata (the newest; counts are total)


class Watch(Protection):
    """Host side of anomaly protection: reads verdicts without ever making a step wait,
    records skipped steps as events (and in checkpoint metadata), or stops.

    Each step's verdict (and watched value) is queued with its host copy started at
    dispatch; a step call judges, in step order, only the queued verdicts whose arrays are
    ready (`jax.Array.is_ready`), so on an accelerator the host runs ahead of the device
    and reads no device value synchronously. It blocks only at flush points: a checkpoint
    save (whose metadata lists the skipped steps; its snapshot waits for the same step
    anyway), a recovery, close, and when more than ``MAX_LAG`` verdicts are unread (a
    bound on host memory, never reached while the device keeps up). With
    ``on_anomaly="stop"`` a verdict is read at most one step late, blocking if needed (the
    documented lag: `AnomalyError` comes from the call after the anomalous step's, at the
    latest; its update was never applied).
    """

    name = "anomaly"
    MAX_LAG = 16

    def __init__(self, cfg):
        self.cfg = cfg
        self._queue: collections.deque = collections.deque()  # (step, verdict, value), unread, oldest first
        self.skipped: dict[int, int] = {}  # step -> verdict of the steps whose update was not applied
        self.counts = {CAUSES[NONFINITE]: 0, CAUSES[SPIKE]: 0}

    # ---------------------------------------------------------------- the step path
    def after_step(self, run, rec):
        g = rec.gout
        for x in (g.ok, g.loss):
            if isinstance(x, jax.Array):
                x.copy_to_host_async()
        self._queue.append((rec.step, g.ok, g.loss))
        # One step late, blocking, when the run stops on an anomaly, or when the liveness
        # watchdog (`HealthConfig.hang_detect_s`, opt-in) times each step by its completion on
        # the host: its probes and step deadlines assume the previous step is done when the
        # next is dispatched (with the host running ahead, probes queued behind a running step
        # made a healthy domain look like a straggler in the fresh-clone suite).
        stop = self.cfg.on_anomaly == "stop" or getattr(run, "_liveness", None) is not None
        while self._queue:
            step, ok, value = self._queue[0]
            late = len(self._queue) > (1 if stop else self.MAX_LAG)
            if not late and not _ready(ok):
                break  # judged by a later call, or at the next flush point
            self._queue.popleft()
            self._judge(run, (step, ok, value))

    def flush(self, run):
        """Reads every queued verdict now (blocking): before a checkpoint, at close."""
        while self._queue:
            self._judge(run, self._queue.popleft())

    # ---------------------------------------------------------------- the record
    def record(self, run) -> dict:
        """The verdict record of the steps before ``run.step`` (flushes first): JSON for a
        checkpoint's or a host copy's metadata."""
        self.flush(run)
        return resolve_record(self.snapshot(run))  # (nothing is left unread after the flush)

    def snapshot(self, run) -> dict:
        """What `record` gives, without reading a device value: the verdicts judged so far and
        the unread ones' arrays (`resolve_record` reads them, off the step loop's path)."""
        return {"through": int(run.step) - 1, "counts": dict(self.counts), "skipped": dict(self.skipped),
                "pending": [(step, ok) for step, ok, _ in self._queue]}

    def restored(self, record) -> None:
        """The run resumed from a checkpoint or host copy whose metadata holds ``record``."""
        self._queue.clear()
        self.skipped, self.counts = {}, {CAUSES[NONFINITE]: 0, CAUSES[SPIKE]: 0}
        if not record:
            return
        self.skipped = {int(s): int(v) for s, v in record.get("skipped", [])}
        self.counts.update({k: int(v) for k, v in (record.get("counts") or {}).items() if k in self.counts})

    def replayed(self, run, step: int, verdict) -> None:
        """Step ``step`` was replayed from the record log with its recorded ``verdict``."""
        code = recorded_verdict(verdict, step)
        if code != OK and step not in self.skipped:
            self._note(step, code)
            run._event("anomaly", step, cause=CAUSES[code], value=None, action="replayed",
                      detail="replayed from the record log with its recorded verdict: the update was not applied")

    def _note(self, step, code):
        self.skipped[step] = code
        cause = CAUSES.get(code)
        if cause in self.counts:
            self.counts[cause] += 1
        if len(self.skipped) > 4 * MAX_SKIPPED_KEPT:
            for s in sorted(self.skipped)[:-MAX_SKIPPED_KEPT]:
                del self.skipped[s]

    def _judge(self, run, item):
        step, ok, value = item
        verdict = int(np.asarray(ok))
        if verdict == OK:
            return
        self._note(step, verdict)
        cause = CAUSES.get(verdict, "anomaly")
        v = None if value is None else float(np.asarray(value))
        # events are written as JSON (goodput files): a NaN or Inf value goes as its name
        shown = v if v is None or np.isfinite(v) else str(v)
        run._event("anomaly", step, cause=cause, value=shown, action=self.cfg.on_anomaly,
                  detail="the step's update was not applied (state left as it was)")
        run._goodput_lost_step()
        if self.cfg.on_anomaly == "stop":
            raise AnomalyError(
                f"resilax: step {step} is anomalous ({cause}{'' if v is None else f', {self.cfg.metric} = {v:.6g}'}); "
                f"its update was not applied and AnomalyConfig.on_anomaly='stop'", step=step, cause=cause)

    # ---------------------------------------------------------------- failures
    def start(self, run, state):
        self._queue.clear()

    def adopted(self, run, state, since):
        # verdicts on corrupted replicas: the rebuilt steps had their own
        self._queue = collections.deque(q for q in self._queue if q[0] <= since)
        for s in [s for s in self.skipped if s > since]:
            del self.skipped[s]

    def shrunk(self, run, state, alive):
        """The unread verdicts of steps the run goes on from are judged (their arrays live on
        every process's devices); those of later steps, or ones a failed collective left
        unreadable, are dropped: those steps are computed again."""
        queue, self._queue = self._queue, collections.deque()
        for item in queue:
            if item[0] >= run.step:
                continue
            try:
                self._judge(run, item)
            except jax.errors.JaxRuntimeError:  # the computation that made it failed with the dead process
                pass

    def restart(self, run, state):
        """The unread verdicts' arrays lost their dead devices' buffers: read a survivor's."""
        self._queue = collections.deque(
            (step, run._host_replica(ok), None if value is None else run._host_replica(value))
            for step, ok, value in self._queue)

    def held(self):
        return [x for item in self._queue for x in item[1:] if isinstance(x, jax.Array)]


def resolve_record(snap: dict) -> dict:
    """The verdict record of a `Watch.snapshot` (as `Watch.record`): reads its unread
    verdicts (blocking until their steps are done); no event, no change to the watcher."""
    skipped, counts = dict(snap["skipped"]), dict(snap["counts"])
    for step, ok in snap["pending"]:
        code = int(np.asarray(ok))
        if code != OK and step not in skipped:
            skipped[step] = code
            if CAUSES.get(code) in counts:
                counts[CAUSES[code]] += 1
    newest = sorted(skipped)[-MAX_SKIPPED_KEPT:]
    return {"through": snap["through"], "counts": counts, "skipped": [[int(s), int(skipped[s])] for s in newest]}


def _ready(x) -> bool:
    """Whether a verdict can be read without waiting (a host value always can)."""
    is_ready = getattr(x, "is_ready", None)
    return is_ready is None or bool(is_ready())
