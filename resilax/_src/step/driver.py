"""`resilax.wrap`: the train-step transform and `ResilientStep`, the driver it returns.

The driver owns the run (mesh, step program, live state, step count, data position) and a
list of protections (`resilax._src.protect`): it asks them what the step program should
output and hands them what each step produced. What happens off the failure-free path lives
in modules of its own, each reading the step through its public surface:
`step.programs` (the programs of each mesh, compiled ahead), `step.resume` (init: the newest
copy, then the disk log replayed), `step.recovery` (a lost, corrupted, hung or returning
failure domain), `step.in_place` (`resilax launch --in-place`, re-forming) and
`step.preemption`. It owns no protection logic.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.config import Config
from resilax._src.errors import ResilaxError, StepBrokenError, StorageError, WrapError
from resilax._src.events import Event, event
from resilax._src.protect import anomaly as _anomaly, base as _base, hoststore as _hoststore
from resilax._src.protect.checkpoint_protection import Checkpoints
from resilax._src.protect.data_state import encode_data_state
from resilax._src.protect.crosscheck import CrossCheck
from resilax._src.protect.peers import Peers
from resilax._src.protect.record_log import RecordLog
from resilax._src.protect.sdc import SdcCheck
from resilax._src.runtime import fence, membership, worker
from resilax._src.runtime import xlaflags as _xlaflags
from resilax._src.runtime.faults import FaultPlan
from resilax._src.runtime.goodput import GoodputRecorder
from resilax._src.runtime.topology import Topology
from resilax._src.step import in_place
from resilax._src.step import preemption as _preemption
from resilax._src.step import resume as _resume
from resilax._src.step import saving as _saving
from resilax._src.step import sharding as _sh
from resilax._src.step.program import REDUCTIONS, Program
from resilax._src.step.programs import Programs, build_standby, check_step, make, program_spec
from resilax._src.step.recovery import Recovery
from resilax._src.step.split import Split


def wrap(
    train_step: Callable | None = None,
    /,
    *,
    topology: Topology,
    state_sharding: Any = None,
    batch_sharding: Any = None,
    config: Config | None = None,
    faults: FaultPlan | None = None,
    rng: bool = False,
    logical_axis_rules=None,
    metric_reductions: dict | None = None,
):
    """Makes ``train_step`` resilient: placed on the topology's mesh, protected, resumable.

    Args:
      train_step: ``train_step(state, batch) -> (state, metrics)`` (``rng=True``:
        ``train_step(state, batch, rng)``); global-view, pure, jit-able. Call
        ``resilax.record(grads)`` once inside it on the optimizer inputs. Traced once
        per argument shapes and state tree in a process, as ``jax.jit`` traces a
        function, and that trace serves every mesh and every later wrap of the same
        function: Python globals it reads are read at that first trace.
      topology: failure domains and mesh axes (`Topology.emulated` or `Topology.load`).
      state_sharding: ``PartitionSpec`` (or a pytree prefix of the state of them) over the
        topology's axis names, or over flax logical axis names with ``logical_axis_rules``
        (also flax ``Partitioned`` boxes); default replicated.
      batch_sharding: same for the batch; default ``PartitionSpec(<elastic axis>)``.
      config: `resilax.Config`; default ``Config()`` (every protection the run allows).
      faults: optional `FaultPlan` (chaos testing), validated against the topology here.
      rng: pass ``fold_in(key(config.seed), step)`` as the step's third argument.
      logical_axis_rules: flax's ``[(logical name, mesh axis or None), ...]``.
      metric_reductions: ``{metric name: "mean" | "sum" | "max" | "min" | "last"}`` for
        combining microbatch metrics on a degraded mesh; default weighted mean for floats,
        sum for integers.

    Returns:
      A `ResilientStep`. Without ``train_step``, a decorator. Each call of it donates the
      state it is given (``Config.donate_state``, default True), as ``jax.jit(...,
      donate_argnums=0)`` does: the input's buffers are reused for the new state and the
      input's arrays are deleted, so continue with the state the call returns.

    Raises:
      WrapError, ConfigError: an argument has the wrong type, names a mesh axis the
        topology lacks, or a fault cannot apply to this topology.
    """
    kwargs = dict(topology=topology, state_sharding=state_sharding, batch_sharding=batch_sharding, config=config,
                  faults=faults, rng=rng, logical_axis_rules=logical_axis_rules, metric_reductions=metric_reductions)
    if train_step is None:
        return functools.partial(wrap, **kwargs)
    return ResilientStep(train_step, **kwargs)


class ResilientStep:
    """A train step that survives failures. Create it with `resilax.wrap`.

    Contract: ``state = step.init(state)`` once, then ``state, metrics = step(state, batch)``
    per global batch (a host-side numpy pytree), then ``step.close()``. ``step.step`` counts
    completed steps (restored ones included); ``step.mesh`` is the current mesh;
    ``step.events`` lists what happened; ``step.state`` is the live state.

    The state passed to ``__call__`` is donated (``Config.donate_state``): use the returned
    one. If a call raises after donating it, ``step.state`` still holds the newest good
    state (or the error says it is gone).

    Under `resilax launch`, ``step.preempted`` turns true after the step every worker
    stopped at on SIGTERM (saved); the next call raises `resilax.Preempted`.

    Besides that contract it offers reports: ``goodput()``, ``run_dir``, ``checkpoints``
    (the checkpoint store: ``checkpoints.steps()``), ``checkpoints_paused``,
    ``alive_domains``, ``retained()``, ``peer_cadence()``, ``log_cadence()``,
    ``sdc_cadence()``, and ``wait_compiled()`` / ``compile_ahead()`` for the programs
    compiled ahead. Names with a leading underscore are resilax's own hooks; faults are
    injected through `resilax.FaultPlan`.
    """

    def __init__(self, train_step, *, topology, state_sharding, batch_sharding, config, faults, rng,
                 logical_axis_rules, metric_reductions):
        if not callable(train_step):
            raise WrapError(f"resilax.wrap requires a callable train_step as its first argument, but got {type(train_step).__name__}")
        if not isinstance(topology, Topology):
            raise WrapError(
                f"resilax.wrap: topology must be a resilax.Topology (Topology.emulated(...) or Topology.load(...)), "
                f"but got {type(topology).__name__}")
        config = Config() if config is None else config
        if not isinstance(config, Config):
            raise WrapError(f"resilax.wrap: config must be a resilax.Config, but got {type(config).__name__}")
        if faults is not None and not isinstance(faults, FaultPlan):
            raise WrapError(f"resilax.wrap: faults must be a resilax.FaultPlan, but got {type(faults).__name__}")
        if not isinstance(rng, bool):
            raise WrapError(f"resilax.wrap: rng must be True or False, but got {rng!r}")
        reductions = dict(metric_reductions or {})
        for k, v in reductions.items():
            if v not in REDUCTIONS:
                raise WrapError(f"resilax.wrap: metric_reductions[{k!r}] must be one of {REDUCTIONS}, but got {v!r}")
        state_sharding = _sh.from_logical(state_sharding, logical_axis_rules)
        batch_sharding = _sh.from_logical(batch_sharding, logical_axis_rules)
        _sh.check_axes(state_sharding, topology.axis_names, "state_sharding", topology.name)
        _sh.check_axes(batch_sharding, topology.axis_names, "batch_sharding", topology.name)
        worker.initialize()  # under `resilax launch`: join the job before anything touches JAX devices
        functools.update_wrapper(self, train_step, updated=())
        self.train_step = train_step
        self.topology = topology
        self.config = config
        self._faults = faults if faults is not None else FaultPlan()
        self._faults.validate(topology, config)
        if config.deterministic is not None:
            # the bit-exact mode computes and holds the state per failure domain (sharded inside one only)
            from resilax._src.step.deterministic import strip_axis
            state_sharding = strip_axis(state_sharding, topology.elastic_axis)
        self._state_spec = state_sharding
        self._batch_spec = P(topology.elastic_axis) if batch_sharding is None else batch_sharding
        self._reductions = reductions
        self._split = Split(train_step, config.seed, rng)
        self.step = 0
        self.mesh = None
        self._program: Program | None = None
        self._warm: Program | None = None  # built before its first batch (a standby generation: `programs.build_standby`)
        self.events: list[Event] = []
        self._live = None
        self._guard = None
        self._data = None
        self._data_position = None  # the data iterator's encoded position after step ``self.step``
        self._closed = False
        self._broken: str | None = None
        self._collective_broke: str | None = None  # under `launch`: a collective broke, or a write (the others wait)
        self._reforming = False  # leaving for the next generation (`in_place.leave_for_reform`)
        self.preempted = False  # set by the call whose step was the agreed preemption point (`resilax launch`)
        self._protections: list = []
        self._ckpt: Checkpoints | None = None
        self._log: RecordLog | None = None
        self._watch = None
        self._peers = None
        self._sdc = None
        self._domains: list = []
        self._alive: list = []
        self._programs = Programs(lambda alive: self.topology.mesh([self._domains[i] for i in alive]))
        self._recovery = Recovery(self, recover=self._recover)
        self._grad_faults: dict[int, tuple] = {}
        self._liveness = None
        self._step_s = None
        self._copy_in_flight = False
        self._keep_input = False  # the next step does not donate the live state (a save reads it)
        self._store = None  # the host state store (under `resilax launch`)
        self._finished = None  # (step, metrics) of the current call once its step completed
        self._lookahead = in_place.Lookahead()  # (under `launch --in-place`: how far the host runs ahead)
        self._batch_key = None  # (treedef, shapes and dtypes) of the last batch checked against the program
        self._timed_prog = None  # the program the last step_seconds sample ran on
        self._steady_dt = None  # the last step's seconds, None after a program's first step
        self._goodput_recorder = GoodputRecorder()
        self._loop_span = contextlib.ExitStack()
        self._loop_open = False
        self._goodput_warned = False
        if config.peers is not None and topology.num_domains == 1:
            warnings.warn(
                f"resilax.wrap: topology {topology.name!r} has one failure domain, so there are no peers to hold "
                f"copies of the state; losing it is recoverable only from checkpoints (+ the record log)",
                RuntimeWarning, stacklevel=3)
        _xlaflags.warn_once_nondeterministic(topology.platform)

    # ================================================================ set-up
    @property
    def state(self):
        """The live state (after the newest completed step)."""
        return self._live

    def init(self, state, *, data=None):
        """Places ``state`` on the mesh, or restores the newest good checkpoint and replays the
        record log's disk entries after it.

        Args:
          state: the initial train state; its shapes and dtypes are the template a
            checkpoint is restored into.
          data: optional data iterator with ``get_state()``/``set_state()`` (grain's have);
            its position is saved with every checkpoint and log entry, and restored here.

        Returns:
          The placed (or restored) state. ``self.step`` is its step (0 if fresh).

        Raises:
          TopologyError: the devices present do not fit the topology.
          WrapError: a sharding does not fit the state.
          CheckpointError: the checkpoints belong to a different state, or none is good.
        """
        if self._closed:
            raise WrapError("resilax.ResilientStep.init: this step was closed")
        if data is not None and not (hasattr(data, "get_state") and hasattr(data, "set_state")):
            raise WrapError(
                f"resilax.ResilientStep.init: data must have get_state() and set_state() (a grain iterator does), "
                f"but got {type(data).__name__}")
        state = jax.tree.map(_sh.as_array, state)
        self._domains = [list(d) for d in self.topology.domains()]
        # a `resilax launch` generation smaller than the job starts with the dead domains empty; a
        # leaf of its state that no longer divides drops the elastic axis, as in a shrink
        self._alive = [i for i, d in enumerate(self._domains) if d]
        self.mesh = self.topology.mesh([self._domains[i] for i in self._alive])
        self._abstract_state = _sh.abstract(state)
        spec = self._state_spec if len(self._alive) == len(self._domains) else _sh.fit_specs(  # as a shrink does
            self._state_spec, state, self.mesh, self.topology.elastic_axis)[0]
        self._state_sh = _sh.resolve(spec, state, self.mesh, "state_sharding")
        self._data = data
        cfg = self.config
        self._guard = None
        if cfg.anomaly is not None:
            self._guard = _sh.put(_anomaly.init_guard(cfg.anomaly), NamedSharding(self.mesh, P()))
        sums = None
        if worker.is_standby():  # (`resilax launch --standby`): programs now, then wait for the go;
            # nothing above touched the job's checkpoints or host stores, everything below may
            self._warm, sums = build_standby(self, state, data)
            worker.standby_wait()
        if cfg.checkpoint is not None:
            self._ckpt = Checkpoints(cfg.checkpoint)
            if sums is not None:
                self._ckpt.store.adopt_checksums(*sums)
        if cfg.log is not None:
            self._log = RecordLog(cfg.log, cfg.log_directory, peers=cfg.peers is not None,
                                  checksums=self._ckpt.store.checksums if cfg.checkpoint is not None else None)
        if cfg.anomaly is not None:
            self._watch = _anomaly.Watch(cfg.anomaly)
        peers = Peers(cfg.peers, has_log=cfg.log is not None) if cfg.peers is not None and self.topology.num_domains > 1 else None
        # after_step order: the log records, peers snapshot (and tell the log), the watcher reads the last verdict
        check = CrossCheck(cfg.verify) if cfg.verify is not None else None
        job = worker.env()
        store = _hoststore.HostStore.for_job(job) if job is not None and job.host_store else None
        sdc = SdcCheck(cfg.health) if cfg.health is not None else None
        self._protections = [p for p in (check, sdc, self._log, peers, self._watch, store, self._ckpt) if p is not None]
        self._store = store
        self._sdc = sdc
        self._peers = peers
        if self._liveness is not None:
            self._liveness.close()
        self._liveness = None
        if cfg.health is not None and cfg.health.hang_detect_s is not None and jax.process_count() == 1:
            from resilax._src.runtime.health import Liveness
            self._liveness = Liveness(cfg.health, self._domains, self._alive)
        worker.mark("protections")
        state = _resume.newest_state(self, state, self._state_sh, job)
        worker.mark("restored")
        self._data_position = encode_data_state(data.get_state()) if data is not None else None
        state = _resume.replay_disk_log(self, state, self._first_program)
        if self.step > 0:
            _saving.continue_goodput(self)
        fence.record_resume(job, self.step)  # across hosts: older generations' later checkpoints are fenced off
        # the plan on a restart: what belongs before this step is done (faults.py)
        self._faults.resume(self.step, self.run_dir or cfg.log_directory, jax.process_index())
        self._live = state
        for p in self._protections if self._program is not None else ():
            p.start(self, state)
        return state

    def _abstract_guard(self, mesh):
        """The anomaly detector's state as abstract arrays replicated on ``mesh`` (None without one)."""
        return None if self.config.anomaly is None else _sh.replicated(_anomaly.abstract_guard(self.config.anomaly), mesh)

    # ---------------------------------------------------------------- programs
    def _first_program(self, abstract_batch) -> Program:
        """The full mesh's program; validates the step against the state and batch. A program
        built ahead for the same batch shapes (`programs.build_standby`) is taken instead."""
        warm, self._warm = self._warm, None
        if warm is not None and _sh.same_abstract(warm.spec.abstract_batch, abstract_batch):
            return warm
        spec = program_spec(self.config, self.topology, self._split, self._state_spec, self._batch_spec,
                            self._abstract_state, abstract_batch, self._reductions)
        check_step(self._split, self._abstract_state, abstract_batch, self.mesh)
        with self._goodput_recorder.span("compile"):
            prog = make(spec, self.mesh, full_mesh=len(self._alive) == len(self._domains))
            prog.grad(False)
            prog.update(None)
        self._programs.add(self._alive, prog)
        return prog

    def compile_ahead(self):
        """``PeersConfig.compile_ahead`` (default on; always when the worker can go on in
        place): compiles the programs of every mesh one more domain loss would leave, on a
        background thread (`Programs.compile_ahead`), so that neither a step nor a recovery
        waits for XLA. An event ``compile_ahead`` says which meshes and how long it took."""
        pc = self.config.peers
        if not ((pc is not None and pc.compile_ahead) or in_place.possible(self)) or len(self._alive) < 2:
            return
        at = self.step

        def report(meshes, seconds):
            try:
                self._event("compile_ahead", at, meshes=meshes, seconds=seconds, background=True)
            except Exception:  # the run was closed meanwhile: nobody reads the event
                pass

        variants = self._peers.variants() if self._peers is not None else ()
        self._programs.compile_ahead(self._alive, self._program.spec, variants, report)

    def _compile_in_background(self, prog, variants):
        """A future that compiles ``prog``'s update ``variants`` and its grad part (with and
        without the log's ring copy: `Program.compile_all`) on the compile-ahead thread."""
        return self._programs.in_background(prog, variants)

    def _background_idle(self) -> bool:
        """Whether no background compile of a degraded mesh is in flight (they would compete
        with a measurement for the cores)."""
        return self._programs.idle()

    def peer_cadence(self) -> dict | None:
        """The peer-copy cadence: ``every``, whether the record log's device entries cover
        the steps between copies, and with ``PeersConfig(every="auto")`` how it was chosen
        (phase, measured costs, share of step time, ``meets_budget``). None without peers."""
        return None if self._peers is None else self._peers.report()

    def sdc_cadence(self) -> dict | None:
        """How often the replicas are compared (`HealthConfig.sdc_every`): ``every``, the
        phase (``auto``/``calibrate`` before it is chosen, ``set``, ``fixed``), each choice's
        measured check and step time and share of step time, and ``rebuildable`` (a
        checkpoint is committed: until then the auto cadence checks every step). None
        without `HealthConfig`."""
        if self._sdc is None:
            return None
        out = self._sdc.report()
        out["rebuildable"] = self._ckpt is not None and bool(self._ckpt.store.steps())
        return out

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Blocks until the background compiles (degraded meshes, the peer cadence's
        variants) are done (benchmarks, tests); returns whether they are."""
        cad = self._peers.cadence if self._peers is not None else None
        return self._programs.wait(timeout, cad.ready if cad is not None else None)

    # ================================================================ the step
    def __call__(self, state, batch):
        """Runs one step on the global ``batch``; returns ``(state, metrics)``.

        Raises:
          WrapError: called before `init`, after `close` or after a failed call; a batch
            that does not fit.
          StateLostError: a failure left no copy of some state (the message names the
            leaves and the newest good checkpoint).
          StorageError: a checkpoint or log write failed (committed data is untouched).
          Preempted: the job was preempted (`resilax launch`) after the previous step.
        """
        if self.mesh is None or self._closed:
            raise WrapError("resilax.ResilientStep: call step.init(state) before step(state, batch)"
                            if not self._closed else "resilax.ResilientStep: this step was closed")
        _preemption.refuse_if_preempted(self)
        if self._broken:
            raise StepBrokenError(f"resilax.ResilientStep: an earlier call failed ({self._broken}); the step cannot "
                                  f"continue. Start a new ResilientStep and init() it (it restores the newest checkpoint)")
        if state is not self._live:
            self._live = state  # the caller's state is the one to use (e.g. after init)
        in_place.grow_back_if_due(self)  # under `resilax launch`: a job smaller than -n grows back now
        if not self._loop_open:
            self._loop_span.close()
            self._loop_span.enter_context(self._goodput_recorder.span("productive"))
            self._loop_open = True
        entry = self.step
        self._finished = None  # (step, metrics) once this call's step completed (a save may still fail)
        try:
            return self._call(batch)
        except BaseException as e:
            if in_place.possible(self) and isinstance(e, (jax.errors.JaxRuntimeError, StorageError)):
                # under `resilax launch --in-place`: a collective broke; if a process died, go on without it
                out = in_place.go_on(self, e, entry, batch, self._finished, self._call)
                if out is not None:
                    return out
            self._broken_if_lost()  # (under --in-place: no process was declared dead, the error stands)
            if not in_place.possible(self):
                self._collective_broke = self._collective_broke or worker.collective_broke(e) or worker.storage_failed(e)
            if self._broken and not isinstance(e, ResilaxError):
                raise ResilaxError(f"resilax.ResilientStep: the step failed after the state was donated ({e!r}); "
                                   f"step.state holds nothing usable") from e
            raise

    def _broken_if_lost(self):
        leaves = [x for x in jax.tree.leaves(self._live) if isinstance(x, jax.Array)]
        if any(x.is_deleted() for x in leaves):
            self._broken = "the live state's buffers are gone"

    def _call(self, batch):
        key = (self._program, _sh.batch_key(batch))
        if self._program is None:
            self._program = self._first_program(_sh.abstract(batch))
            for p in self._protections:
                p.start(self, self._live)
                worker.mark("start:" + type(p).__name__)
            worker.mark("started")
            self.compile_ahead()
            worker.offer_in_place(in_place.possible(self))
            membership.barrier("compiled")  # no worker enters the first collective while another still compiles
            worker.mark("compiled")
        elif key[1] is None or key != self._batch_key:  # the same shapes as the last batch: checked already
            _sh.check_batch(batch, self._program.spec.abstract_batch)
        self._batch_key = (self._program, key[1])
        worker.step_started(self.step + 1)  # the supervisor tells a hung worker from the ones waiting on it
        lv = self._liveness
        if lv is not None:
            lv.call_begin()
        self._fire("before_step")
        recovered = self._recovery.health_boundary()
        for p in self._protections:
            p.before_step(self, self._live, self.step)
        if self._recovery.pending:  # a health check found a bad domain: recover before anything reads it
            self._recover()
        k = self.step
        prog = self._program
        copy = next((c for c in (p.copy_variant(self, k + 1) for p in self._protections) if c), None)
        log_ring = any(p.wants_log_ring(self, copy) for p in self._protections)
        before = self._data_position
        after = encode_data_state(self._data.get_state()) if self._data is not None else None
        t0 = time.perf_counter()
        dev_batch = prog.put_batch(batch)
        # kept, not popped: a step redone from its batch (`in_place.go_on`) gets its fault, so its first verdict
        gout = prog.grad(log_ring, self._grad_faults.get(k))(self._live, self._guard, dev_batch, np.uint32(k))
        self._lookahead.push(gout.ok)
        for p in self._protections:
            p.before_update(self, self._live, batch, k, gout, prog)
        keep, self._keep_input = self._keep_input, False  # a checkpoint's persister still reads this state
        new_state, ring, local = prog.update(copy, keep_input=keep)(self._live, gout.rec, gout.ok, np.uint32(k))
        self._live, self._guard, self.step, self._data_position = new_state, gout.guard, k + 1, after
        timers = [p for p in self._protections if p.blocks()]
        if timers:  # a calibration sample (peer copy or replica check cadence): the whole step, waited on
            jax.block_until_ready(new_state)
            for p in timers:
                p.timed(self, time.perf_counter() - t0)
        rec = _base.StepRecord(k, batch, gout, copy, new_state, ring, local, before, after, prog)
        with self._goodput_recorder.span("protection"):
            for p in self._protections:
                p.after_step(self, rec)
        # ``mid_step@N``: N steps completed, step N+1 (index k = N) in flight
        self._copy_in_flight = copy is not None
        self._fire("mid_step", k)
        self._fire("during_peer_copy", k)  # the step in flight makes the peer copy
        self._copy_in_flight = False
        self._step_seconds(time.perf_counter() - t0)
        worker.progress(self.step, self._step_s)  # the supervisor's step deadline (no-op outside a launch)
        self._finished = (self.step, gout.metrics)
        self._fire("after_step")
        saved = self._ckpt is not None and self._ckpt.due(self.step)
        if saved:
            self.save(self._live)
        _preemption.stop_if_due(self, saved)
        if lv is not None:
            lv.call_end(record=not recovered and not self._recovery.pending)
        return self._live, gout.metrics

    def _step_seconds(self, dt):
        self._step_s = dt if self._step_s is None else 0.9 * self._step_s + 0.1 * dt
        # the step's own time, except a program's first (a compile): budgets paid per step are not paid by a compile
        first, self._timed_prog = self._timed_prog is not self._program, self._program
        self._steady_dt = None if first else dt

    # ================================================================ failures (`step.recovery`)
    def _fire(self, phase, at=None):
        if self._faults:
            self._faults.fire(phase, self.step if at is None else at, self)
        if self._recovery.pending:
            self._recover()

    def _recover(self):
        with self._goodput_recorder.span("recovery"):
            self._do_recover()

    def _do_recover(self):
        self._recovery.recover_pending()

    def _inject(self, kind: str, step: int):
        """``nan``/``spike`` faults: step ``step``'s recorded values are NaN, or its watched
        metric is multiplied (a spike), inside the grad part where real ones appear."""
        # several at one step all apply (a NaN and a spike together: the NaN decides)
        self._grad_faults[step] = tuple(sorted(set(self._grad_faults.get(step, ())) | {kind}))

    def _fail_domain(self, domain: int, phase: str, at: float | None = None) -> dict | None:
        """Emulates losing failure domain ``domain``: its memory is gone (`Recovery.fail_domain`)."""
        return self._recovery.fail_domain(domain, phase, at)

    def _corrupt_domain(self, domain: int, phase: str = "after_step") -> dict | None:
        """Emulates a bit flip in domain ``domain``'s replica (`Recovery.corrupt_domain`)."""
        return self._recovery.corrupt_domain(domain, phase)

    def _hang_domain(self, domain: int, phase: str = "after_step") -> None:
        """Fault ``hang_slice``: domain ``domain`` stops answering (`Recovery.hang_domain`)."""
        self._recovery.hang_domain(domain, phase)

    def _slow_domain(self, domain: int, phase: str = "after_step") -> None:
        """Fault ``slow_slice``: domain ``domain`` becomes a straggler (`Recovery.slow_domain`)."""
        self._recovery.slow_domain(domain, phase)

    def _repair_domain(self, domain: int, phase: str = "after_step") -> None:
        """Fault ``repair_slice``: failed domain ``domain``'s hardware is back (`Recovery.repair_domain`)."""
        self._recovery.repair_domain(domain, phase)

    def _rejoin_domain(self, domain: int, phase: str = "after_step", **found) -> dict | None:
        """Domain ``domain`` is back: the mesh grows to include it (`Recovery.rejoin_domain`)."""
        return self._recovery.rejoin_domain(domain, phase, **found)

    def _rebuilt_state(self, step: int, trusted_through: int):
        """The state at ``step`` rebuilt from trusted sources (`Recovery.rebuilt_state`)."""
        return self._recovery.rebuilt_state(step, trusted_through)

    def _adopt(self, state, guard, since: int) -> None:
        """The live state becomes the rebuilt ``state`` (`Recovery.adopt`)."""
        self._recovery.adopt(state, guard, since)

    # ---------------------------------------------------------------- hooks the run's modules call
    def _moved(self, prog: Program, alive: list[int]) -> None:
        """The run goes on with ``prog``, on the mesh of the live domains ``alive`` (a
        recovery, a rejoin, an in-place shrink)."""
        self._program, self.mesh, self._alive = prog, prog.mesh, list(alive)

    def _resume_at(self, step: int, state, guard, data_position) -> None:
        """The run goes on from ``step`` with ``state`` read back from a copy (an in-place
        shrink): nothing reads the old live state any more, so the next step may donate."""
        self._live, self._guard, self.step, self._data_position = state, guard, step, data_position
        self._keep_input = False

    def _mark_broken(self, why: str, *, reforming: bool = False) -> None:
        """This step object cannot go on (``why``: the next call says so); ``reforming``: it
        leaves for the job's next generation (`in_place.leave_for_reform`)."""
        self._broken = why
        self._reforming = self._reforming or reforming

    def _event(self, kind: str, step: int, **fields) -> Event:
        """Records an event in ``self.events`` and on the goodput timeline."""
        ev = event(kind, step, **fields)
        self.events.append(ev)
        self._goodput_recorder.event(kind, step=int(step), **fields)
        return ev

    def _goodput_lost_step(self):
        """A step whose result was thrown away (an anomalous step) counts as lost time: its
        time was booked as productive (its verdict is read later, inside the protection
        work of a later call, whose small bucket it must not come from)."""
        if self._step_s:
            self._goodput_recorder.add("lost", self._step_s, source="productive")

    def _host_replica(self, x):
        """Host copy of a replicated device array, from a surviving device's buffer."""
        return self._recovery.host_replica(x)

    def _log_covered(self, step: int):
        if self._log is not None:
            self._log.covered_through(step)

    def retained(self) -> dict:
        """What the record log holds for recovery now: ``device_log_bytes`` (entries between
        peer copies), ``host_batch_steps`` and ``host_batch_bytes`` (batches kept since the
        oldest start a recovery may need: the newest checkpoint or peer copy)."""
        if self._log is None:
            return {"device_log_bytes": 0, "host_batch_steps": [], "host_batch_bytes": 0}
        return self._log.retained()

    def log_cadence(self) -> dict | None:
        """How the disk record log kept to `LogConfig.grads_budget` (grads entries written,
        inputs-only entries, measured cost of one grads entry, share of step time,
        ``meets_budget``); None without a disk log in grads mode."""
        return None if self._log is None else self._log.cadence()

    def _peer_log_entries(self) -> bool:
        """Whether the step in flight keeps its record-log device entry (`PeersConfig.every`)."""
        return self._peers is None or self._peers.log_entries()

    def _log_over_cap(self) -> bool:
        return self._log is not None and self._log.over_cap()

    # ---------------------------------------------------------------- read-only views of the run
    @functools.cached_property
    def _leaf_names(self) -> list[str]:
        """The state's leaves as ``keystr`` paths, in tree order (for errors and events)."""
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self._abstract_state)[0]]

    @property
    def _step_deadline_s(self) -> float | None:
        """The liveness watchdog's step deadline now (None: no watchdog, or too few calls
        measured yet)."""
        return None if self._liveness is None else self._liveness.deadline()

    @property
    def alive_domains(self) -> list[int]:
        """The live failure domains (original indices), in mesh order."""
        return list(self._alive)

    # the run's parts, for the modules of `step` and the protections (read-only)
    _checkpointer = property(lambda self: self._ckpt, doc="The `Checkpoints` protection, or None.")
    _record_log = property(lambda self: self._log, doc="The `RecordLog` protection, or None.")
    _replica_check = property(lambda self: self._sdc, doc="The `SdcCheck` protection, or None.")
    _host_store = property(lambda self: self._store, doc="The `HostStore` (under `resilax launch`), or None.")

    # ================================================================ checkpoints, close
    def save(self, state=None) -> float:
        """Checkpoints the live state as step ``self.step`` (async); returns seconds blocked."""
        dt, self._keep_input = _saving.save(self, self._live if state is None else state, self._recover,
                                            lambda: _saving.save_goodput(self))
        return dt

    @property
    def checkpoints_paused(self) -> str | None:
        """Why `save` cannot checkpoint now (under `resilax launch --in-place`, after processes
        died and the others went on), or None."""
        return None if self._ckpt is None else self._ckpt.paused

    @property
    def checkpoints(self):
        return self._ckpt.store if self._ckpt is not None else None

    @property
    def run_dir(self) -> str | None:
        return self.config.run_dir or (self.config.checkpoint.directory if self.config.checkpoint else None)

    def goodput(self) -> dict[str, float]:
        """Seconds of wall time (since `wrap`) per bucket; they sum to the wall time."""
        return self._goodput_recorder.totals()

    def close(self) -> None:
        """Reads the last verdict, waits for pending checkpoint and log writes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        worker.set_phase("close")  # waiting for the last save is not a step: no step deadline
        try:
            if self._watch is not None and not self._broken:
                self._watch.flush(self)
        finally:
            try:
                for p in self._protections:
                    if p is not self._ckpt:
                        p.close()
            finally:
                try:
                    if self._ckpt is not None and self._collective_broke:
                        # the save in flight commits only once every process passed Orbax's barrier: across
                        # a partition that waited for the link to come back, and the supervisor acts only
                        # once this worker exits. The newest committed checkpoint and the host stores stay.
                        self._ckpt.store.abandon()
                        self._event("checkpoint_abandoned", self.step, why=f"this worker's step failed: "
                                    f"{self._collective_broke[:200]}")
                    if self._ckpt is not None:
                        with self._goodput_recorder.span("checkpoint_save", phase="final wait"):
                            try:
                                self._ckpt.close()
                            except (jax.errors.JaxRuntimeError, StorageError) as e:
                                if not in_place.possible(self) or self._broken:
                                    raise
                                in_place.after_failed_close(self, e)  # a process died: re-form (or it stands)
                finally:
                    if self._liveness is not None:
                        self._liveness.close()
                    self._programs.close(wait=self._reforming)  # re-forming drops the backend: no compile then
                    self._loop_span.close()
                    _saving.save_goodput(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
