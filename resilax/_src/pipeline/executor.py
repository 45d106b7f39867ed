"""The per-stage pipeline executor: a data x pipeline job whose failure domain is one stage of
one replica, ``(r, s)``, that keeps training when a domain is lost by sending its work to
the same stage of the other replicas (ReCycle), with the same bits as a failure-free run.

A mesh cannot have a hole, so this does not run one SPMD program: every domain runs small
per-stage programs dispatched from a schedule table (`schedule`), single-controller (one
process sees every device: CPU emulation, one GPU host, Pathways).

- **Per-stage programs.** Stage ``s``'s forward ``F`` returns its output and its VJP
  residuals (``jax.vjp``: first-class); ``B`` takes the residuals and the output's
  cotangent and returns the input's (what the previous stage waits for); ``W`` returns the
  weights' gradient (zb-h1 splits them; gpipe and 1f1b run ``BW``, both at once). Each is
  one function for every stage of a shape (the first stage holds the embedding, the last
  the loss, the middle ones only layers), called on the device of the domain that runs it;
  a rerouted op runs the same function on a peer's device, whose same-shaped program
  computes the same bits.
- **Canonical accumulation.** The gradient of stage ``s`` is
  ``(sum_v (sum_m dW[v, m, s])) / sum_{v, m} weight[v, m]``, each sum in index order, keyed
  by the micro-batch's *origin* replica ``v`` wherever it ran. So a healthy, a rerouted, a
  replica-dropped and a rejoined step add the same numbers in the same order.
- **Randomness** of micro-batch ``m`` of replica ``v`` is ``fold_in(fold_in(key(step), v),
  m)``, then folded with the layer index: never keyed by a device.
- **Update.** Each stage's optimizer update runs on every live domain of the stage (its
  replicas hold the same state, bitwise), as soon as that stage's gradient is complete
  (staggered), and is committed by a select on the step's verdict, resilax's anomaly
  verdict (`AnomalyConfig`): every stage's gradient and the loss finite, and the loss no
  spike against the window of good steps. A skipped step changes nothing, with no
  conditional and no host read; every domain keeps the spike window (saved in checkpoints). The
  optimizer must be separable by stage (elementwise: sgd, adam, adamw); one that reduces
  over every parameter (``clip_by_global_norm``) is refused at construction, by comparing a
  whole-tree update with per-stage ones.
- **A lost domain** ``(r, s)`` (`fail_domain`; also in the middle of a step) loses nothing:
  stage ``s`` lives on the other replicas. Its buffers are deleted, the step in flight is
  abandoned (nothing was committed: the live state is replaced only after a step's last
  commit) and redone on the rerouted table, computed ahead. When every replica of a stage
  is gone, rerouting cannot help: with peer copies (`peers`) the job waits for a domain of
  the stage to rejoin and fills it from the copy, else `StateLostError` says to restore a
  checkpoint. A domain that comes back (`rejoin`) gets its stage's state copied from a
  live replica of the stage, or from the peer copy.
- **Protection in the bubbles** (`bubbles`, `peers`): checkpoint parts and peer copies are
  dispatched into each stage's idle time as `protection.place` plans them
  (`protection_plan`); `calibrate` measures the plan's costs.
- **Checkpoints** (`save` / `restore`): one Orbax checkpoint of every stage's state, taken
  from any live replica of each stage, with on-device checksums verified at restore.

Costs: ``D * M * S * (2 or 3)`` op dispatches per step plus the accumulation adds and one
update per live domain; activations and residuals are kept as the table's in-flight count
says; every domain holds its stage's parameters and optimizer state.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from resilax._src.errors import CorruptCheckpointError, PipelineError, StateLostError
from resilax._src.pipeline import schedule as _schedule
from resilax._src.pipeline.stage_programs import (_check_faults, _device_of, _abstract, _sums, write_checkpoint, _programs, _check_separable)  # noqa: F401


_DEFAULT = object()
_CHUNK = 0.25  # the protection plan's pieces, in cost units
_BUDGET = 0.01  # the share of the step an "auto" protection cadence may add


@dataclasses.dataclass(frozen=True)
class PipelineModel:
    """A pipelined model in three pieces, with parameters ``{"first", "blocks", "last"}``
    (``blocks``: leaves stacked with a leading layer dimension ``L``):

    - ``first(p_first, batch, key) -> h``: stage 0, before its layers (an embedding);
    - ``layer(w, h, key) -> h``: one layer (``w``: one layer's slice of ``blocks``);
    - ``last(p_last, h, batch, key) -> (loss_sum, weight)``: the last stage, after its layers:
      the loss *summed* over the micro-batch and what it is normalised by (examples, or
      tokens that are not padding). The step's loss is ``sum(loss_sum) / sum(weight)``.
    """
    first: Callable
    layer: Callable
    last: Callable


@dataclasses.dataclass
class _Attempt:
    """One try at a step: the values in flight (dropped when a failure abandons it)."""
    acts: dict = dataclasses.field(default_factory=dict)   # (v, m, s) -> F's output
    vjps: dict = dataclasses.field(default_factory=dict)   # (v, m, s) -> F's residuals
    cts: dict = dataclasses.field(default_factory=dict)    # (v, m, s) -> cotangent of F(v, m, s)'s output
    acc: dict = dataclasses.field(default_factory=dict)    # (v, s) -> (next m, running sum)
    pending: dict = dataclasses.field(default_factory=dict)  # (v, s) -> {m: dW} that arrived early
    loss: dict = dataclasses.field(default_factory=dict)   # (v, m) -> loss_sum
    weight: dict = dataclasses.field(default_factory=dict)  # (v, m) -> weight
    dispatches: int = 0

    def arrays(self):
        return jax.tree.leaves((self.acts, self.vjps, self.cts, self.acc, self.pending, self.loss, self.weight))


class _Abandon(Exception):
    pass


class PipelineExecutor:
    """Trains ``model`` with ``tx`` on ``replicas x stages`` failure domains of one device
    each (domain ``(r, s)`` on ``devices[r * stages + s]``).

    Args:
      model: the `PipelineModel`.
      topology: a `resilax.Topology` with a ``[pipeline]`` table (``cpu-2x4-stages``): gives
        ``replicas``, ``stages`` and the devices of each domain (one device per domain).
      tx: an optax optimizer, separable by stage (see the module docstring).
      params: ``{"first", "blocks", "last"}``; ``L`` divisible by ``stages``.
      replicas, stages, microbatches: ``D``, ``S`` and ``M`` (micro-batches per replica); a
        step's batch has ``D * M`` micro-batches.
      schedule: ``"zb-h1"`` (B and W split), ``"1f1b"`` or ``"gpipe"``.
      on_failure: ``"reroute"`` (ReCycle) or ``"drop"`` (drop the replica, its micro-batches
        run on the others: the same maths).
      seed: the run's randomness, ``fold_in(key(seed), step)``.
      devices: default ``jax.devices()[:replicas * stages]``.
      lost: domains already lost when the job starts (a restart on the hardware that is
        left): the job starts on their degraded table; `restore` fills the live ones.
      anomaly: `resilax.AnomalyConfig` (default on: NaN/Inf and loss spikes skip the step;
        ``on_anomaly`` must be ``"skip"``), or None (every finite step is applied: NaN/Inf
        still skip it).
      checkpoint_dir, checkpoint_every, checkpoint_placement, checkpoint_units: a checkpoint
        every ``checkpoint_every`` steps (0: only `save`; ``"auto"``: the fewest steps that
        keep it within 1% of the step, idle time counted free), its per-stage parts copied to
        the host in the bubbles of the next step (``"bubbles"``, `bubbles.BubbleCheckpoints`)
        or at the step's end (``"end"``); ``checkpoint_units``: one stage's snapshot in units
        of one forward op (its bytes over the host link's bandwidth, over an F op's time:
        `protection.work_units`); `restore` reads them.
      peer_every, peer_units: a peer copy of every stage every ``peer_every`` steps (0: none;
        ``"auto"``: the fewest steps that keep the copies within 1% of the step, idle time
        counted free), dispatched in the bubbles of the next step to a domain of another
        stage (`peers.BubblePeers`), so a stage whose every replica is lost comes back from it
        at `rejoin`; ``peer_units``: one stage's copy in units of one forward op (its bytes
        over the link between domains, over an F op's time).
      peers: a `resilax.PeersConfig` instead of ``peer_every``: its ``every`` (a number of
        steps, or ``"auto"`` as above) sets the cadence; its other fields are for
        `resilax.wrap`'s ring copies and must stay at their defaults here.
      faults: chaos testing, as `resilax.FaultPlan` (or its strings): ``fail_slice@N[:phase]/K``
        and ``rejoin@N/K`` with ``K = r * stages + s`` (phases ``before_step``, ``after_step``,
        ``mid_step``: half of step ``N + 1``'s ops dispatched, ``during_save``: right after
        the save of step ``N`` returned), ``nan@N`` (step ``N``'s float inputs NaN),
        ``spike@N`` (the loss step ``N``'s verdict sees is 1000x) and ``kill_process@N[:phase]``
        (a real SIGKILL after step ``N``, or halfway through step ``N + 1``'s dispatches).
        A ``rejoin@N:before_step`` waits for its domain to be lost, so
        ``["fail_slice@N:mid_step/K", "rejoin@N:before_step/K"]`` brings back a stage's last replica
        before step ``N + 1`` is tried again.

    Raises:
      PipelineError: shapes that do not divide, too few devices, an optimizer that is not
        separable by stage.
    """

    def __init__(self, model: PipelineModel, tx, params, *, microbatches: int, topology=None,
                 replicas: int | None = None, stages: int | None = None, schedule: str = "zb-h1",
                 on_failure: str = "reroute", seed: int = 0, devices=None, lost=(), faults=(),
                 anomaly=_DEFAULT, checkpoint_dir: str | None = None, checkpoint_every: int | str = 0,
                 checkpoint_placement: str = "bubbles", checkpoint_units: float = 1.0,
                 peer_every: int | str = 0, peer_units: float = 1.0, peers=None):
        where = "resilax.PipelineExecutor"
        from resilax._src.config import AnomalyConfig, PeersConfig
        if peers is not None:
            if not isinstance(peers, PeersConfig):
                raise PipelineError(f"{where}: peers must be a resilax.PeersConfig, but got {type(peers).__name__}")
            other = {f: getattr(peers, f) for f in ("log_entries_between", "budget", "max_every")
                     if getattr(peers, f) != getattr(PeersConfig(), f)}
            if other or peer_every:
                raise PipelineError(f"{where}: give peer_every or peers=PeersConfig(every=...), not both; the executor "
                                    f"reads only PeersConfig.every (it also got {other or {'peer_every': peer_every}})")
            peer_every = peers.every
        from resilax._src.protect import anomaly as _anomaly

        anomaly = AnomalyConfig() if anomaly is _DEFAULT else anomaly
        if anomaly is not None and anomaly.on_anomaly != "skip":
            raise PipelineError(f"{where}: AnomalyConfig(on_anomaly={anomaly.on_anomaly!r}) is not supported; the "
                                f"executor skips anomalous steps (on_anomaly='skip')")
        if topology is not None:
            if not topology.pipeline or topology.devices_per_domain != 1:
                raise PipelineError(f"{where}: topology {topology.name!r} must have a [pipeline] table and one device "
                                    f"per failure domain (e.g. cpu-2x4-stages)")
            replicas, stages = topology.pipeline["replicas"], topology.pipeline["stages"]
            devices = [d for dom in topology.domains(devices) for d in dom]
        if replicas is None or stages is None:
            raise PipelineError(f"{where}: give a topology with a [pipeline] table, or replicas and stages")
        if on_failure not in ("reroute", "drop"):
            raise PipelineError(f"{where}: on_failure must be 'reroute' or 'drop', but got {on_failure!r}")
        if schedule not in _schedule.SCHEDULES:
            raise PipelineError(f"{where}: schedule must be one of {_schedule.SCHEDULES}, but got {schedule!r}")
        if set(params) != {"first", "blocks", "last"}:
            raise PipelineError(f"{where}: params must be a dict with keys first, blocks, last, but has {sorted(params)}")
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < replicas * stages:
            raise PipelineError(f"{where}: {replicas} replicas x {stages} stages need {replicas * stages} devices, "
                                f"but {len(devices)} are given")
        L = {np.shape(x)[0] for x in jax.tree.leaves(params["blocks"])}
        if len(L) != 1 or next(iter(L)) % stages:
            raise PipelineError(f"{where}: the stacked blocks' leading dimensions {sorted(L)} must be one L "
                                f"divisible by {stages} stages")
        self.model, self.tx = model, tx
        self.D, self.S, self.M = replicas, stages, microbatches
        self.L = next(iter(L))
        self.k = self.L // stages
        self.schedule, self.on_failure, self.seed = schedule, on_failure, seed
        self.devices = {(r, s): devices[r * stages + s] for r in range(replicas) for s in range(stages)}
        self.lost: set = set()
        self.step_no = 0
        self.events: list[dict] = []
        self.last_dispatches = 0
        host = [self._stage_params(params, s) for s in range(stages)]
        _check_separable(tx, params, host, self.k)
        states = [(p, tx.init(p)) for p in host]
        self.state = {d: jax.device_put(states[d[1]], dev) for d, dev in self.devices.items()}
        # the spike window, one bitwise copy per domain (a NaN-only guard without spikes)
        guard = _anomaly.init_guard(anomaly or AnomalyConfig(spike_window=3, min_history=1))
        self.guard = {d: jax.device_put(guard, dev) for d, dev in self.devices.items()}
        self._spike = False
        self.table = _schedule.healthy(schedule, replicas, stages, microbatches)
        self._exe = _programs(model, tx, self.L, self.k, stages, anomaly)
        self._ckpt = None  # (directory, orbax CheckpointManager) of the save in flight
        self.faults = _check_faults(faults, replicas * stages)
        self.bubbles = self.peer_copies = None
        self.executed: dict = {}  # domain -> [("op", kind, v, m) | ("snapshot" | "peer", stage, piece, count, ...)]
        self._plans: dict = {}
        self._plan_every = 1
        self._work = {s: {} for s in range(stages)}  # stage -> {kind: units per protected step}, one F op = 1
        self._costs = None  # op costs of the plan (None: unit ones; `calibrate` measures them)
        self._auto = set()  # the kinds whose cadence is "auto"
        for name, every, units, kind in (("checkpoint", checkpoint_every, checkpoint_units, "snapshot"),
                                         ("peer", peer_every, peer_units, "peer")):
            if every != "auto" and not (isinstance(every, int) and not isinstance(every, bool) and every >= 0):
                raise PipelineError(f"{where}: {name}_every must be an int >= 0 or 'auto', but got {every!r}")
            if every and not (isinstance(units, (int, float)) and units > 0):
                raise PipelineError(f"{where}: {name}_units must be > 0 (cost units), but got {units!r}")
            if every:
                for w in self._work.values():
                    w[kind] = float(units)
            if every == "auto":
                self._auto.add(kind)
        if peer_every and stages < 2:
            raise PipelineError(f"{where}: peer copies go to a domain of another stage, so they need stages >= 2, "
                                f"but stages={stages}")
        if checkpoint_every:
            from resilax._src.pipeline.bubbles import BubbleCheckpoints

            if checkpoint_dir is None:
                raise PipelineError(f"{where}: checkpoint_every={checkpoint_every} needs a checkpoint_dir")
            try:
                self.bubbles = BubbleCheckpoints(self, checkpoint_dir, checkpoint_every,
                                                 placement=checkpoint_placement, units=checkpoint_units,
                                                 chunk=_CHUNK)
            except ValueError as e:
                raise PipelineError(str(e)) from None
        if peer_every:
            from resilax._src.pipeline import protection as _protection
            from resilax._src.pipeline.peers import BubblePeers

            if peer_every == "auto":  # the fewest steps between copies that add <= 1%, bubbles counted free
                c = _protection.cadence(self.protection_plan(), _BUDGET)
                if c.every is None:
                    raise PipelineError(f"{where}: no peer copy cadence keeps {peer_units} units of copy work per "
                                        f"stage within {_BUDGET:.0%} of the step")
                peer_every = c.every
                self.events.append({"kind": "peer_cadence", "every": c.every, "overhead": c.overhead,
                                    "bubbles": c.bubbles})
            self.peer_copies = BubblePeers(self, peer_every)
        self._plan_every = math.gcd(*[p.every for p in (self.bubbles, self.peer_copies) if p is not None] or [1])
        for d in lost:
            self.fail_domain(d)

    # ------------------------------------------------------------------ public
    def protection_plan(self, every: int | None = None):
        """The `protection.ProtectionPlan` of the table in use with every protection this
        executor runs (``snapshot``: checkpoints, ``peer``: peer copies), validated: its ops
        sit in idle time only. ``every`` (default: the greatest common divisor of the
        checkpoint and peer cadences, so both copy on the plan's protected steps): a copy's
        pieces may use the bubbles of that many steps. One plan per table and cadence."""
        from resilax._src.pipeline import protection as _protection

        table, every = self.table, every or self._plan_every
        if (id(table), every) not in self._plans:
            plan = _protection.place(table, self._work, costs=self._costs, chunk=_CHUNK, every=every)
            _protection.validate_plan(plan)
            self._plans[(id(table), every)] = (table, plan)
        return self._plans[(id(table), every)][1]

    def pieces(self, kind: str, s: int) -> int:
        """How many pieces stage ``s``'s ``kind`` work is cut into (the plan's count)."""
        return max(1, math.ceil(self._work[s].get(kind, 0.0) / _CHUNK - 1e-9))

    def calibrate(self, batch, *, repeats: int = 5) -> dict:
        """Times each stage's programs on ``batch``'s first micro-batch and each stage's
        copies (to the host, to its peer copy's keeper), blocking, and plans protection with
        those costs from then on (op costs relative to F, each stage's work in units of F);
        an ``"auto"`` cadence is chosen again. Returns what `calibrate.measure` measured.
        Call it between steps, with no copy in progress (before the first step, or right
        after a checkpoint or peer copy completed). Raises PipelineError otherwise."""
        from resilax._src.pipeline import calibrate as _calibrate
        from resilax._src.pipeline import protection as _protection

        if any(p is not None and p.pending is not None for p in (self.bubbles, self.peer_copies)):
            raise PipelineError("resilax.PipelineExecutor.calibrate: a checkpoint or peer copy is in progress; "
                                "call it before the first step or once the copy is complete")
        got = _calibrate.measure(self, batch, repeats=repeats)
        self._costs = got["costs"]
        self._work = {s: {k: max(got["work"][s].get(k, 0.0), 1e-6) for k in self._work[s]} for s in range(self.S)}
        self._plans.clear()
        if self._auto:
            c = _protection.cadence(self.protection_plan(every=1), _BUDGET)
            if c.every is None:
                raise PipelineError(f"resilax.PipelineExecutor.calibrate: with the measured costs no cadence keeps "
                                    f"protection within {_BUDGET:.0%} of the step")
            for kind, p in (("snapshot", self.bubbles), ("peer", self.peer_copies)):
                if kind in self._auto:
                    p.every = c.every
            got["every"] = c.every
        self._plan_every = math.gcd(*[p.every for p in (self.bubbles, self.peer_copies) if p is not None] or [1])
        self.events.append({"kind": "calibrated", "step": self.step_no, "costs": dict(got["costs"]),
                            "every": self._plan_every})
        return got

    def __call__(self, batch, *, fail_at: tuple[int, tuple[int, int]] | None = None):
        """One step on ``batch`` (a pytree of host arrays with leading dimension divisible by
        ``D * M``). ``fail_at=(i, (r, s))``: domain ``(r, s)`` is lost before the step's
        ``i``-th dispatch (chaos testing); the step is then redone on the degraded table.
        Returns ``{"loss", "verdict"}``: device scalars, not read on the host (verdict 0:
        applied, 1: skipped for NaN/Inf, 2: skipped for a loss spike)."""
        n = self.step_no
        for f in self._due(n, ("before_step",), ("fail_slice",)):
            self.fail_domain(self._domain(f.target))
        # a planned rejoin waits for its domain to be lost (one lost in this step's first try
        # comes back before the step is tried again)
        for f in self._due(n, ("before_step",), ("rejoin",), lambda f: self._domain(f.target) in self.lost):
            self.rejoin(self._domain(f.target))
        self._check_live()
        if self.step_no != n:  # a rejoin filled a stage from older peer copies: every stage went back
            raise StateLostError(f"resilax.PipelineExecutor: a rejoin went back to the peer copies of step "
                                 f"{self.step_no} (step {n}'s were incomplete); feed the batches from step "
                                 f"{self.step_no} again")
        mid = self._due(n, ("mid_step",), ("fail_slice", "kill_process"))
        if mid and fail_at is None:
            fail_at = (len(self.table.dispatch_order()) // 2,
                       None if mid[0].kind == "kill_process" else self._domain(mid[0].target))
        self._spike = bool(self._due(n, None, ("spike",)))
        if self._due(n, None, ("nan",)):
            batch = jax.tree.map(lambda x: np.full_like(x, np.nan) if np.issubdtype(np.asarray(x).dtype, np.floating)
                                 else x, batch)
        key = jax.random.fold_in(jax.random.key(self.seed), n)
        mbs = self._microbatches(batch)
        while True:
            self._check_live()
            try:
                metrics = self._step(key, mbs, fail_at)
                break
            except _Abandon:
                fail_at = None  # the failure happened; redo the step on the new table
        self.step_no += 1
        for f in self._due(self.step_no, ("after_step",), ("fail_slice", "rejoin", "kill_process")):
            if f.kind == "kill_process":
                jax.block_until_ready(self.state)
                os.kill(os.getpid(), 9)
            (self.fail_domain if f.kind == "fail_slice" else self.rejoin)(self._domain(f.target))
        return metrics

    def _check_live(self) -> None:
        if self.table is None:
            gone = [s for s in range(self.S) if not any(d[1] == s for d in self.state)]
            raise StateLostError(f"resilax.PipelineExecutor: stage(s) {gone} have no live domain; their state is in "
                                 f"peer copies: rejoin a domain of each (rejoin((r, s))), then feed the batch of "
                                 f"the step rejoin returns")

    def _due(self, step, phases, kinds, ready=lambda f: True) -> list:
        """The planned faults of ``kinds`` at ``step`` and one of ``phases`` (None: any)
        that are ``ready``, removed from the plan."""
        due = [f for f in self.faults if f.step == step and f.kind in kinds and (phases is None or f.phase in phases)
               and ready(f)]
        self.faults = [f for f in self.faults if f not in due]
        return due

    def _domain(self, k: int) -> tuple[int, int]:
        return divmod(k, self.S)

    def fail_domain(self, domain, *, attempt: _Attempt | None = None) -> None:
        """Domain ``(r, s)`` is lost: its buffers are deleted (nothing reads them after) and
        the next step runs on the degraded table. Raises StateLostError when no replica of
        a stage is left."""
        d = tuple(domain)
        if d not in self.devices or d in self.lost:
            raise PipelineError(f"resilax.PipelineExecutor.fail_domain: {d} is not a live domain")
        copies = self.peer_copies.arrays() if self.peer_copies is not None else []
        jax.block_until_ready((self.state, attempt.arrays() if attempt else [], copies))  # work in flight ends first
        dev = self.devices[d]
        for x in jax.tree.leaves((self.state.pop(d), self.guard.pop(d))) + (attempt.arrays() if attempt else []):
            if isinstance(x, jax.Array) and not x.is_deleted() and dev in x.devices():
                x.delete()
        if self.peer_copies is not None:
            self.peer_copies.lost(d)
        self.lost.add(d)
        self._replan(f"lost domain {d}")

    def rejoin(self, domain) -> int:
        """Domain ``(r, s)`` is back: its stage's state is copied from a live replica of the
        stage (bitwise), or, when none is left, from the stage's peer copy (`peers`), and the
        healthy table (or the one for what is still lost) is used again. Returns the step the
        job continues from: ``step_no``, or an earlier one when the peer copy of the current
        step was not complete (every stage went back to the newest complete copies; feed the
        batches from that step again). Raises StateLostError when no copy holds the stage."""
        d = tuple(domain)
        if d not in self.lost:
            raise PipelineError(f"resilax.PipelineExecutor.rejoin: {d} is not a lost domain")
        peer = next((p for p in sorted(self.state) if p[1] == d[1]), None)
        if peer is not None:
            self.state[d] = jax.device_put(self.state[peer], self.devices[d])
            self.guard[d] = jax.device_put(self.guard[peer], self.devices[d])
            why = f"domain {d} rejoined from {peer}"
        elif self.peer_copies is not None:
            step = self.peer_copies.restore(d)
            why = f"domain {d} rejoined from its stage's peer copy of step {step}"
        else:
            raise StateLostError(f"resilax.PipelineExecutor.rejoin: no live domain and no peer copy holds stage "
                                 f"{d[1]}; restore a checkpoint")
        self.lost.discard(d)
        self._replan(why)
        return self.step_no

    def stage_state(self, s: int):
        """Stage ``s``'s ``(params, optimizer state)`` from a live replica."""
        return self.state[next(d for d in sorted(self.state) if d[1] == s)]

    def params(self):
        """The whole model's parameters ``{"first", "blocks", "last"}`` (host arrays)."""
        stages = [jax.device_get(self.stage_state(s)[0]) for s in range(self.S)]
        blocks = jax.tree.map(lambda *a: np.concatenate(a), *[p["blocks"] for p in stages])
        return {"first": stages[0]["first"], "blocks": blocks, "last": stages[-1]["last"]}

    def save(self, directory: str, *, wait: bool = True) -> None:
        """A checkpoint of every stage (from any live replica) at ``directory/<step>``, with
        on-device checksums. The call returns once the state is copied to the host (Orbax's
        async save); ``wait``: also until it is written. A domain lost after the call loses
        nothing of the checkpoint."""
        import orbax.checkpoint as ocp

        directory = os.path.abspath(directory)
        if self._ckpt is not None and self._ckpt[0] != directory:
            self.close()
        if self._ckpt is None:
            self._ckpt = (directory, ocp.CheckpointManager(directory))
        mgr = self._ckpt[1]
        tree = {f"stage_{s:03d}": self.stage_state(s) for s in range(self.S)}
        tree["guard"] = self.guard[min(self.guard)]
        write_checkpoint(mgr, self.step_no, tree)
        self.events.append({"kind": "save", "step": self.step_no})
        for f in self._due(self.step_no, ("during_save",), ("fail_slice",)):
            self.fail_domain(self._domain(f.target))
        if wait:
            mgr.wait_until_finished()

    def close(self) -> None:
        """Writes the last step's checkpoint if it is due, waits for saves in flight and
        closes their checkpoint managers."""
        if self.bubbles is not None:
            self.bubbles.flush(self.step_no)
            self.bubbles.close()
        if self._ckpt is not None:
            self._ckpt[1].wait_until_finished()
            self._ckpt[1].close()
            self._ckpt = None

    def restore(self, directory: str) -> int:
        """Restores the newest checkpoint under ``directory`` whose checksums match onto
        every live domain; returns its step. Raises CorruptCheckpointError when none does."""
        import orbax.checkpoint as ocp

        self.close()
        with ocp.CheckpointManager(os.path.abspath(directory)) as mgr:
            steps = sorted(mgr.all_steps(), reverse=True)
            abstract = {f"stage_{s:03d}": jax.tree.map(_abstract, self.stage_state(s)) for s in range(self.S)}
            abstract["guard"] = jax.tree.map(_abstract, self.guard[min(self.guard)])
            for step in steps:
                got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                meta=ocp.args.JsonRestore()))
                sums = np.concatenate(jax.device_get([_sums(got["state"][k]) for k in sorted(got["state"])]))
                if sums.tolist() != got["meta"]["sums"]:
                    self.events.append({"kind": "corrupt_checkpoint", "step": step})
                    continue
                for d in self.state:
                    self.state[d] = jax.device_put(got["state"][f"stage_{d[1]:03d}"], self.devices[d])
                    self.guard[d] = jax.device_put(got["state"]["guard"], self.devices[d])
                self.step_no = step
                if self.peer_copies is not None:
                    self.peer_copies.reset()
                return step
        raise CorruptCheckpointError(f"resilax.PipelineExecutor.restore: no checkpoint under {directory!r} matches "
                                     f"its checksums (steps tried: {steps})")

    # ------------------------------------------------------------------ the step
    def _replan(self, why: str) -> None:
        lost = frozenset(self.lost)
        gone = [s for s in range(self.S) if all((r, s) in lost for r in range(self.D))]
        if gone and self.peer_copies is not None and self.peer_copies.covers(gone):
            self.table = None  # no step runs until a domain of each stage in `gone` rejoins
            self.events.append({"kind": "wait_rejoin", "step": self.step_no, "stages": gone, "why": why})
            return
        if not lost:
            self.table = _schedule.healthy(self.schedule, self.D, self.S, self.M)
        elif self.on_failure == "drop":
            try:
                self.table = _schedule.dropped(self.schedule, self.D, self.S, self.M, lost)
            except ValueError as e:
                raise StateLostError(f"resilax.PipelineExecutor: {why}: no whole replica is left ({e}); restore "
                                     f"a checkpoint") from None
        else:
            if gone:
                self.events.append({"kind": "reroute_impossible", "step": self.step_no, "stages": gone})
                raise StateLostError(f"resilax.PipelineExecutor: {why}: every replica of stage(s) {gone} is lost, "
                                     f"so rerouting cannot help and their state is gone; restore a checkpoint")
            self.table = _schedule.rerouted(self.schedule, self.D, self.S, self.M, lost)
        self.events.append({"kind": "replan", "step": self.step_no, "why": why, "lost": sorted(lost),
                            "table": "healthy" if not lost else ("dropped" if self.on_failure == "drop" else
                                                                 "rerouted")})

    def _microbatches(self, batch):
        n = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
        if len(n) != 1 or next(iter(n)) % (self.D * self.M):
            raise PipelineError(f"resilax.PipelineExecutor: a batch needs one leading dimension divisible by "
                                f"{self.D} replicas x {self.M} micro-batches, but has {sorted(n)}")
        mb = next(iter(n)) // (self.D * self.M)
        return {(v, m): jax.tree.map(lambda x: np.asarray(x)[(v * self.M + m) * mb:(v * self.M + m + 1) * mb], batch)
                for v in range(self.D) for m in range(self.M)}

    def _step(self, key, mbs, fail_at):
        S, ex, at = self.S, self._exe, _Attempt()
        put = jax.device_put
        keys = {}
        prot, pos = [p for p in (self.bubbles, self.peer_copies) if p is not None], dict.fromkeys(self.table.order, 0)
        if prot:
            self.executed = {d: [] for d in self.table.order}
        for p in prot:
            p.begin(self.step_no)
        for i, (d, op) in enumerate(self.table.dispatch_order()):
            if fail_at is not None and fail_at[0] == i:
                if fail_at[1] is None:  # kill_process mid-step: no cleanup, no flush
                    jax.block_until_ready(at.arrays())
                    os.kill(os.getpid(), 9)
                self.events.append({"kind": "fail", "step": self.step_no, "domain": tuple(fail_at[1]), "op": i})
                self.fail_domain(fail_at[1], attempt=at)
                raise _Abandon()
            for p in prot:  # protection pieces planned into this domain's idle time
                p.before(d, pos[d])
            if prot:
                self.executed[d].append(("op", op.kind, op.replica, op.microbatch))
            pos[d] += 1
            dev, (p, _) = self.devices[d], self.state[d]
            v, m, s = op.replica, op.microbatch, op.stage
            if op.kind == "F":
                if (v, m) not in keys:
                    keys[(v, m)] = jax.random.fold_in(jax.random.fold_in(key, v), m)
                x = put(at.acts.pop((v, m, s - 1)), dev) if s > 0 else None
                b = put(mbs[(v, m)], dev) if s in (0, S - 1) else None
                out, at.vjps[(v, m, s)] = ex.fwd(s)(p, x, b, put(keys[(v, m)], dev), np.int32(s * self.k))
                if s == S - 1:
                    at.loss[(v, m)], at.weight[(v, m)] = out
                    at.cts[(v, m, s)] = put(jnp.ones((), out[0].dtype), dev)
                else:
                    at.acts[(v, m, s)] = out
            elif op.kind == "B":
                if s == 0:
                    continue  # stage 0's input is the data: no input gradient to make
                at.cts[(v, m, s - 1)] = ex.bwd_x(at.vjps[(v, m, s)], put(at.cts[(v, m, s)], dev))
            else:  # W, or BW: the last use of this stage's residuals and output cotangent
                vjp, ct = at.vjps.pop((v, m, s)), put(at.cts.pop((v, m, s)), dev)
                if op.kind == "W":
                    dw = ex.bwd_w(vjp, ct)
                else:
                    dw, dx = ex.bwd(vjp, ct)
                    if s > 0:
                        at.cts[(v, m, s - 1)] = dx
                self._accumulate(at, v, m, s, dw)
            at.dispatches += 1
        for p in prot:
            for d, n in pos.items():
                p.before(d, n)  # pieces planned before the domain's update
        out = self._update(at)
        for p in prot:
            p.end()
        return out

    def _accumulate(self, at, v, m, s, dw):
        """``acc[v, s] = ((dW_0 + dW_1) + dW_2) + ...`` in micro-batch order, whichever domain
        computed each and in whichever order they arrive."""
        at.pending.setdefault((v, s), {})[m] = dw
        nxt, acc = at.acc.get((v, s), (0, None))
        while nxt in at.pending[(v, s)]:
            x = at.pending[(v, s)].pop(nxt)
            if acc is None:
                acc = x
            else:
                acc = self._exe.add(acc, jax.device_put(x, _device_of(acc)))
                at.dispatches += 1
            nxt += 1
        at.acc[(v, s)] = (nxt, acc)

    def _update(self, at):
        """Every stage's gradient combined in a fixed order on each of its live domains, the
        verdict (all finite), each stage's update and its commit by a select."""
        put, ex = jax.device_put, self._exe
        order = [(v, m) for v in range(self.D) for m in range(self.M)]
        grads, flags = {}, {}
        for d in sorted(self.state):
            dev, s = self.devices[d], d[1]
            accs = [put(at.acc[(v, s)][1], dev) for v in range(self.D)]
            grads[d], flags[d] = ex.combine(accs, [put(at.weight[vm], dev) for vm in order])
        # each stage's update is dispatched as soon as its gradient is (staggered: it waits for
        # its own stage only); only the commit, a select, waits for every stage's verdict
        updated = {d: ex.update(*self.state[d], grads[d]) for d in sorted(self.state)}
        first = {s: flags[next(d for d in sorted(flags) if d[1] == s)] for s in range(self.S)}
        d0 = min(self.state)
        dev0 = self.devices[d0]
        loss = ex.loss([put(at.loss[vm], dev0) for vm in order], [put(at.weight[vm], dev0) for vm in order])
        if self._spike:  # chaos testing: the loss the verdict sees is 1000x
            loss = loss * 1000.0
        new_state, new_guard = {}, {}
        for d in sorted(self.state):
            dev = self.devices[d]
            # the step's loss moved to every domain, judged against that domain's copy of the
            # spike window (the same bits everywhere, so every copy moves alike)
            verdict, new_guard[d] = ex.verdict([put(first[s], dev) for s in range(self.S)], put(loss, dev),
                                               self.guard[d])
            new_state[d] = ex.commit(verdict, updated[d], self.state[d])
            if d == d0:
                out = {"loss": loss, "verdict": verdict}
        self.last_dispatches = at.dispatches + 4 * len(self.state) + 1
        self.state, self.guard = new_state, new_guard  # the commit point: a failure before it redoes the step
        return out

    def _stage_params(self, params, s):
        blocks = jax.tree.map(lambda a: np.asarray(a)[s * self.k:(s + 1) * self.k], params["blocks"])
        return {"first": params["first"] if s == 0 else None, "blocks": blocks,
                "last": params["last"] if s == self.S - 1 else None}

