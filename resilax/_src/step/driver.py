"""`resilax.wrap`: the train-step transform and `ResilientStep`, the driver it returns.

The driver owns the run (mesh, step program, live state, step count, data position) and a
list of protections (`resilax._src.protect`): it asks them what the step program should
output, hands them what each step produced, and on a failure gathers what they hold, asks
the pure planner (`protect.planner`) for a plan, restores, redoes steps and lets them start
again on the new mesh. It owns no protection logic.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.config import Config
from resilax._src.errors import Preempted, ReplayLogError, ResilaxError, StateLostError, StorageError, WrapError
from resilax._src.events import Event, event
from resilax._src.protect import anomaly as _anomaly
from resilax._src.protect import base as _base
from resilax._src.protect import hoststore as _hoststore
from resilax._src.protect import planner as _planner
from resilax._src.protect import ring as _ring
from resilax._src.protect.checkpoints import decode_data_state, encode_data_state
from resilax._src.protect.checkpoints import Checkpoints
from resilax._src.protect.crosscheck import CrossCheck
from resilax._src.protect.sdc import SdcCheck
from resilax._src.protect.checksum import tree_checksums
from resilax._src.protect.peers import Peers
from resilax._src.protect.record_log import RecordLog
from resilax._src.protect.disk_log import batch_template, scalar_value
from resilax._src.runtime.faults import FaultPlan
from resilax._src.runtime import worker
from resilax._src.runtime.goodput import GoodputRecorder
from resilax._src.runtime import xlaflags as _xlaflags
from resilax._src.step import sharding as _sh
from resilax._src.step import program as _program
from resilax._src.step.program import Program, ProgramSpec
from resilax._src.step.split import Split, update_reads_batch
from resilax._src.runtime.topology import Topology


_gpu_warned = False


def _warn_nondeterministic_gpu(platform: str) -> None:
    """Once per process: a GPU run without deterministic XLA is not bitwise (runtime/xlaflags.py)."""
    global _gpu_warned
    msg = _xlaflags.determinism_warning(platform, os.environ.get("XLA_FLAGS", ""))
    if msg is not None and not _gpu_warned:
        _gpu_warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


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
        ``resilax.record(grads)`` once inside it on the optimizer inputs.
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
      A `ResilientStep`. Without ``train_step``, a decorator.

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
        from resilax._src.step.program import REDUCTIONS
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
        self.faults = faults if faults is not None else FaultPlan()
        self.faults.validate(topology, config)
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
        self.program: Program | None = None
        self.events: list[Event] = []
        self.live = None
        self.guard = None
        self.data = None
        self._data_pos = None
        self._closed = False
        self._broken: str | None = None
        self._reforming = False  # leaving for the next generation (`_leave_for_reform`)
        self.preempted = False  # set by the call whose step was the agreed preemption point (`resilax launch`)
        self._protections: list = []
        self._ckpt: Checkpoints | None = None
        self._log: RecordLog | None = None
        self._watch = None
        self._programs: dict = {}
        self._ahead: dict = {}  # mesh key -> Future of a Program compiled in the background
        self._ahead_pool = None
        self._ahead_done = None
        self._dead: set = set()
        self._failures: list[dict] = []
        self._bufmaps: dict = {}
        self._held: list = []
        self._grad_faults: dict[int, tuple] = {}
        self._liveness = None
        self._step_s = None
        self._copy_in_flight = False
        self._keep_input = False  # the next step does not donate the live state (a save reads it)
        self._store = None  # the host state store (under `resilax launch`)
        self._finished = None  # (step, metrics) of the current call once its step completed
        self._timed_prog = None  # the program the last step_seconds sample ran on
        self._steady_dt = None  # the last step's seconds, None after a program's first step
        self.goodput_recorder = GoodputRecorder()
        self._loop_span = contextlib.ExitStack()
        self._loop_open = False
        self._goodput_warned = False
        if config.peers is not None and topology.num_domains == 1:
            warnings.warn(
                f"resilax.wrap: topology {topology.name!r} has one failure domain, so there are no peers to hold "
                f"copies of the state; losing it is recoverable only from checkpoints (+ the record log)",
                RuntimeWarning, stacklevel=3)
        _warn_nondeterministic_gpu(topology.platform)

    # ================================================================ set-up
    @property
    def state(self):
        """The live state (after the newest completed step)."""
        return self.live

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
        # a `resilax launch` generation smaller than the job starts with the dead domains empty
        self._alive = [i for i, d in enumerate(self._domains) if d]
        self.mesh = self.topology.mesh([self._domains[i] for i in self._alive])
        self._abstract_state = _sh.abstract(state)
        self._state_sh = _sh.resolve(self._state_spec, state, self.mesh, "state_sharding")
        self.data = data
        cfg = self.config
        self.guard = None
        if cfg.anomaly is not None:
            self.guard = _sh.put(_anomaly.init_guard(cfg.anomaly), NamedSharding(self.mesh, P()))
        if cfg.checkpoint is not None:
            self._ckpt = Checkpoints(cfg.checkpoint)
        if cfg.log is not None:
            self._log = RecordLog(cfg.log, cfg.log_directory, peers=cfg.peers is not None,
                                  checkpoints=cfg.checkpoint is not None)
        if cfg.anomaly is not None:
            self._watch = _anomaly.Watch(cfg.anomaly)
        peers = Peers(cfg.peers, has_log=cfg.log is not None) if cfg.peers is not None and self.topology.num_domains > 1 else None
        # after_step order: the log records the step, peers snapshot it (and tell the log),
        # the watcher reads the previous verdict; checkpoints are saved by the driver.
        check = CrossCheck(cfg.verify) if cfg.verify is not None else None
        job = worker.env()
        store = (_hoststore.HostStore(job.host_store, job.slot, job.job_processes, job.host_store_every,
                                      alive=job.slot_list)
                 if job is not None and job.host_store else None)
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
        restored = None
        from_store = False
        want = job.host_store_step if store is not None and job.host_store_step >= 0 else None
        if want is not None and not (self._ckpt is not None and max(self._ckpt.store.steps(), default=-1) > want):
            # under `resilax launch`: the hosts' copies first (newer than any checkpoint, which
            # would only be read to be thrown away); every process takes the same branch
            placed = _hoststore.resume(self, store, _sh.place_copy(state, self._state_sh), want,
                                       lambda ok: worker.agree(ok, f"host_store/{want}"))
            if self.step == want:
                state, from_store = placed, True
        if self._ckpt is not None and not from_store:
            t0 = time.perf_counter()
            abstract = self._ckpt.tree(_sh.abstract(state, self._state_sh), self._abstract_guard(self.mesh))
            with self.goodput_recorder.span("checkpoint_restore"):
                restored = self._ckpt.store.restore_newest(abstract)
            if restored is not None:
                self.step = restored.step
                if data is not None and restored.meta.get("data_state") is not None:
                    data.set_state(decode_data_state(restored.meta["data_state"]))
                self.event("restore", restored.step, source="checkpoint", seconds=time.perf_counter() - t0,
                           skipped=[{"step": s, "reason": r} for s, r in restored.skipped])
                state = restored.state["state"]
                self.guard = restored.state.get("guard")
                if self._log is not None:
                    self._log.checkpointed(restored.step)
                if self._watch is not None:
                    self._watch.restored(restored.meta.get("verdicts"))
        if restored is None and not from_store:
            state = _sh.place_copy(state, self._state_sh)
        self._data_pos = encode_data_state(data.get_state()) if data is not None else None
        state = self._resume_from_disk(state)
        # the plan on a restart: what belongs before this step is done (faults.py)
        self.faults.resume(self.step, self.run_dir or cfg.log_directory, jax.process_index())
        self.live = state
        if self.program is not None:
            self._start_protections(state)
        return state

    def _abstract_guard(self, mesh):
        if self.config.anomaly is None:
            return None
        rep = NamedSharding(mesh, P())
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                            _anomaly.abstract_guard(self.config.anomaly))

    def _start_protections(self, state):
        for p in self._protections:
            p.start(self, state)

    # ---------------------------------------------------------------- programs
    def _spec(self, abstract_batch) -> ProgramSpec:
        cfg = self.config
        return ProgramSpec(
            split=self._split, state_specs=self._state_spec, batch_specs=self._batch_spec,
            abstract_state=self._abstract_state, abstract_batch=abstract_batch,
            abstract_guard=None if cfg.anomaly is None else _anomaly.abstract_guard(cfg.anomaly),
            elastic_axis=self.topology.elastic_axis, donate=cfg.donate_state,
            metric_reductions=self._reductions,
            anomaly_check=None if cfg.anomaly is None else _anomaly.make_check(cfg.anomaly),
            memory_limit=None if cfg.peers is None else cfg.peers.device_memory_bytes,
            watched_metric=cfg.anomaly.metric if cfg.anomaly is not None else "loss",
            replicas=None if cfg.deterministic is None else (cfg.deterministic.replicas or self.topology.num_domains))

    def _first_program(self, abstract_batch):
        """The full mesh's program; validates the step against the state and batch."""
        spec = self._spec(abstract_batch)
        u32 = jax.ShapeDtypeStruct((), np.uint32)
        try:
            new_state, _ = jax.eval_shape(self._split.full, self._abstract_state, abstract_batch, u32)
        except ResilaxError:
            raise
        if jax.tree.structure(new_state) != jax.tree.structure(self._abstract_state):
            raise WrapError(
                "resilax.wrap: train_step must return (state, metrics) with the state's structure unchanged, but the "
                f"returned state has structure {jax.tree.structure(new_state)} vs {jax.tree.structure(self._abstract_state)}")
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(self._abstract_state)[0], jax.tree.leaves(new_state)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise WrapError(
                    f"resilax.wrap: train_step changed state{jax.tree_util.keystr(path)} from {a.shape} {a.dtype} to "
                    f"{b.shape} {b.dtype}; the state must keep its shapes and dtypes")
        rec, _, _ = jax.eval_shape(self._split.grad, self._abstract_state, abstract_batch, u32)
        reads = update_reads_batch(self._split, self._abstract_state, abstract_batch, rec)
        if reads:
            raise WrapError(
                f"resilax.wrap: the update part of train_step (after resilax.record) still reads batch"
                f"{', batch'.join(reads)}; replay and recovery redo the update from the recorded values only. Record "
                f"everything the update needs, e.g. resilax.record((grads, new_batch_stats))")
        with self.goodput_recorder.span("compile"):
            prog = _program.make(spec, self.mesh, full_mesh=len(self._alive) == len(self._domains))
            prog.grad(False)
            prog.update(None)
        self._programs[tuple(self._alive)] = prog
        return prog

    def _program_for(self, alive) -> tuple[Program, bool]:
        """The program of the mesh of domains ``alive``, and whether it was compiled ahead.

        A compile ahead still in flight is waited for (never compiled twice); one that has
        not started yet is cancelled and built here."""
        key = tuple(alive)
        if key in self._programs:
            return self._programs[key], True
        fut = self._ahead.pop(key, None)
        if fut is not None and not fut.cancel():
            try:
                prog = fut.result()
            except Exception:  # built again below: a real error repeats there, on this thread
                prog = None
            if prog is not None:
                self._programs[key] = prog
                return prog, True
        mesh = self.topology.mesh([self._domains[i] for i in alive])
        prog = _program.make(self.program.spec, mesh, full_mesh=False)
        prog.fits_global_batch()
        self._programs[key] = prog
        return prog, False

    def _compile_ahead(self):
        """``PeersConfig.compile_ahead`` (default on): compiles the executables of every mesh
        one more domain loss would leave, on a background thread, so that neither a step nor
        a recovery waits for XLA (a recovery that comes first waits for the one it needs, or
        builds it itself if it has not started). Compiling reads only shapes and shardings,
        never a buffer, so it cannot touch a dead device's memory. When all are built, an
        event ``compile_ahead`` says which meshes and how long it took."""
        pc = self.config.peers
        if not ((pc is not None and pc.compile_ahead) or self._in_place) or len(self._alive) < 2:
            return
        keys = [tuple(j for j in self._alive if j != i) for i in self._alive]
        keys = [k for k in keys if k not in self._programs and k not in self._ahead]
        if not keys:
            return
        pool = self._compile_pool()
        spec, at = self.program.spec, self.step
        variants = self._peers.variants() if self._peers is not None else ()
        t0 = time.perf_counter()
        futs = []
        for k in keys:
            mesh = self.topology.mesh([self._domains[i] for i in k])
            futs.append(pool.submit(_build_ahead, spec, mesh, variants))
            self._ahead[k] = futs[-1]

        def report():
            meshes = []
            for f in futs:
                if f.cancelled() or f.exception() is not None:
                    continue
                meshes.append(dict(f.result().mesh.shape))
            try:
                self.event("compile_ahead", at, meshes=meshes, seconds=time.perf_counter() - t0, background=True)
            except Exception:  # the run was closed meanwhile: nobody reads the event
                pass

        self._ahead_done = pool.submit(report)

    def _compile_pool(self):
        """The one background thread every compile ahead of need runs on."""
        if self._ahead_pool is None:
            self._ahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resilax-compile-ahead")
        return self._ahead_pool

    def compile_in_background(self, prog, variants):
        """A future that compiles ``prog``'s update ``variants`` and its grad part (with and
        without the log's ring copy: `Program.compile_all`) on the compile-ahead thread."""
        return self._compile_pool().submit(prog.compile_all, variants)

    def background_idle(self) -> bool:
        """Whether no background compile of a degraded mesh is in flight (they would compete
        with a measurement for the cores)."""
        return self._ahead_done is None or self._ahead_done.done()

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
        for fut in (self._ahead_done, cad.ready if cad is not None else None):
            if fut is None:
                continue
            try:
                fut.result(timeout)
            except concurrent.futures.TimeoutError:
                return False
            except concurrent.futures.CancelledError:
                pass
        return True

    # ================================================================ the step
    def __call__(self, state, batch):
        """Runs one step on the global ``batch``; returns ``(state, metrics)``.

        Raises:
          WrapError: called before `init`, after `close` or after a failed call; a batch
            that does not fit.
          StateLostError: a failure left no copy of some state (the message names the
            leaves and the newest good checkpoint).
          StorageError: a checkpoint or log write failed (committed data is untouched).
        """
        if self.mesh is None or self._closed:
            raise WrapError("resilax.ResilientStep: call step.init(state) before step(state, batch)"
                            if not self._closed else "resilax.ResilientStep: this step was closed")
        if self.preempted:
            raise Preempted(f"resilax.ResilientStep: the job was preempted: every worker stopped after step {self.step} "
                            f"and a checkpoint of it was saved; exit, and relaunch to resume", step=self.step)
        if self._broken:
            raise WrapError(f"resilax.ResilientStep: an earlier call failed ({self._broken}); the step cannot continue. "
                            f"Start a new ResilientStep and init() it (it restores the newest checkpoint)")
        if state is not self.live:
            self.live = state  # the caller's state is the one to use (e.g. after init)
        if worker.reform_due(self.step):  # the job, smaller than -n, grows back now
            e = worker.env()
            if self._store is not None and self._store.newest() != self.step:  # the store's cadence skipped it
                self._store.write(self.step, self.live, self.guard, self._data_pos)
            if self._ckpt is not None and self._ckpt.paused is None:
                self._ckpt.store.wait()  # every worker is here: a save in flight commits before they detach
            self._leave_for_reform(e.generation + 1, f"the job grows back to {e.job_processes} processes")
        if not self._loop_open:
            self._loop_span.close()
            self._loop_span.enter_context(self.goodput_recorder.span("productive"))
            self._loop_open = True
        entry = self.step
        self._finished = None  # (step, metrics) once this call's step completed (a save may still fail)
        try:
            return self._call(batch)
        except (ResilaxError, jax.errors.JaxRuntimeError) as e:
            if self._in_place and isinstance(e, (jax.errors.JaxRuntimeError, StorageError)):
                # under `resilax launch --in-place`: a collective broke; if a process died, go on without it
                return self._go_on_in_place(e, entry, batch)
            self._broken_if_lost()
            if isinstance(e, ResilaxError):
                raise
            if self._broken:
                raise ResilaxError(f"resilax.ResilientStep: the step failed after the state was donated ({e!r}); "
                                   f"step.state holds nothing usable") from e
            raise
        except BaseException as e:
            self._broken_if_lost()
            if self._broken:
                raise ResilaxError(f"resilax.ResilientStep: the step failed after the state was donated ({e!r}); "
                                   f"step.state holds nothing usable") from e
            raise

    # ================================================================ in place (`resilax launch --in-place`)
    @property
    def _in_place(self) -> bool:
        """Whether this worker can go on in place when another process of the job dies: under
        `resilax launch --in-place`, in the bit-exact mode (every process holds the whole state:
        nothing of it lives only on the dead one), each failure domain within one process,
        with the host store (the step the survivors agree on is read back from it) and no
        protection that holds device copies across processes (record log, peers, replica
        checks)."""
        e = worker.env()
        return (e is not None and e.in_place_wait_s > 0 and self.config.deterministic is not None
                and self._store is not None and self._log is None and self._peers is None and self._sdc is None
                and bool(self._domains)
                and all(len({d.process_index for d in dom}) == 1 for dom in self._domains if dom))

    def _go_on_in_place(self, err: BaseException, entry: int, batch):
        """A step failed under `resilax launch --in-place` (``err``: a collective or a save
        broke). Waits for the supervisor's verdict; if it names dead processes, the others
        (this one among them) agree on the newest step all of them hold in their own host
        store, restore it onto the mesh of the live domains, redo the steps after it up to
        ``entry`` from the data iterator, and run this call's step. Without a verdict the
        error is raised: the supervisor then restarts the job (a new generation)."""
        e = worker.env()
        t_err = time.perf_counter()
        worker.set_phase("recover")  # not a step: the supervisor's step deadline does not apply
        worker.say(f"step {entry + 1} failed ({type(err).__name__}: {str(err)[:160]}); waiting up to "
                     f"{e.in_place_wait_s:.0f} s for the supervisor's verdict (--in-place)")
        m = worker.wait_membership(worker.epoch(), e.in_place_wait_s)
        worker.say(f"verdict: {m}")
        if m is None or jax.process_index() not in m["alive"]:
            worker.say("no process was declared dead (or this one was): the error stands")
            self._broken_if_lost()
            raise err
        if m.get("reform"):  # the others re-form (with warm spares, or alone as a smaller job): leave
            worker.shrunk(m)  # (threads may wait on the dead for good: see worker.exit_if_shrunk)
            if self._ckpt is not None:
                self._ckpt.store.abandon()  # a save in flight waits on the dead: nothing waits for it
            self._leave_for_reform(m["reform"], f"processes {m['dead']} died: the others re-form on a new backend",
                                   cause=err, dead_processes=m["dead"], after_error=True)
        finished = self._finished if self._finished is not None and self._finished[0] == entry + 1 else None
        with self.goodput_recorder.span("recovery"):
            while True:
                try:  # a step this call completed before the error (in its save) is not redone
                    fields = self._shrink(m, entry, entry + (finished is not None), t_err)
                    break
                except worker.MembershipChanged as changed:  # another died meanwhile: agree again without it
                    m = changed.membership
                    if jax.process_index() not in m["alive"]:
                        raise err from changed
        self.event("recovery", self.step, **fields)
        redo = fields["steps_recomputed"]
        if redo:  # steps some survivor had not completed: recomputed from their batches
            with self.goodput_recorder.span("replay"):
                if self.data is None:
                    self._broken = "in-place shrink without a data iterator"
                    raise StateLostError(
                        f"resilax: going on in place after processes {m['dead']} died needs steps "
                        f"{self.step + 1}..{entry} again, but step.init(state) got no data iterator (data=...) to "
                        f"read their batches from; the supervisor restarts the job instead")
                here = self.data.get_state()
                self.data.set_state(decode_data_state(self._data_pos))
                for _ in range(redo):
                    self._call(next(self.data))
                self.data.set_state(here)
        self._compile_ahead()
        if self.step == entry + 1:  # every survivor completed this call's step: its metrics stand
            return self.live, finished[1]
        return self._call(batch)

    def _leave_for_reform(self, generation: int, why: str, cause: BaseException | None = None, **fields):
        """This step object is done: the job re-forms as ``generation`` (``why``), with every
        step this process completed in its host store. Raises `worker.Reform` for the
        worker command to rejoin in this process (`worker.reattach`)."""
        self._broken = "left to re-form as the next generation"
        self._reforming = True
        held = self._store.newest() if self._store is not None else None  # (a failed step's update never landed)
        worker.say(f"leaving at step {self.step}: {why}; this process rejoins generation {generation} without "
                     f"restarting (its host store holds step {held})")
        self.event("reform", self.step, generation=generation, **fields)
        raise worker.Reform(generation, self.step) from cause

    def _shrink(self, m: dict, entry: int, upto: int, t_err: float) -> dict:
        t0 = time.perf_counter()
        alive_p = set(m["alive"])
        worker.shrunk(m)
        failed = [i for i in self._alive if any(d.process_index not in alive_p for d in self._domains[i])]
        for i in failed:
            self._dead |= set(self._domains[i])
        survivors = [i for i in self._alive if i not in failed]
        if not survivors:
            self._broken = "every failure domain is lost"
            raise StateLostError(f"resilax: processes {m['dead']} died and no failure domain is left")
        own = self._store.newest()
        target = worker.agree_min(min(upto, -1 if own is None else own), "in_place/step")
        t_agree = time.perf_counter()
        for k in [k for k in self._ahead if not set(k) <= set(survivors)]:
            self._ahead.pop(k).cancel()
        prog, ahead = self._program_for(survivors)
        prog.grad(False)
        prog.update(None)
        t_compile = time.perf_counter()
        tree = (prog.abstract_state(), self._abstract_guard(prog.mesh))
        abstract, treedef = jax.tree.flatten(tree)
        got = None if target < 0 else self._store.restore(target, abstract, [a.sharding for a in abstract])
        if not worker.agree(got is not None, f"in_place/restore/{target}"):
            self._broken = "in-place shrink: no host copy"
            raise StateLostError(
                f"resilax: processes {m['dead']} died; going on in place needs step {target} from every live "
                f"process's own host store, and some process could not read a verified copy; {self._newest_ckpt()} "
                f"(the supervisor restarts the job from there)")
        leaves, meta, source = got
        state, guard = jax.tree.unflatten(treedef, leaves)
        t_restore = time.perf_counter()
        self.program, self.mesh, self._alive = prog, prog.mesh, survivors
        self._programs = {k: v for k, v in self._programs.items() if set(k) <= set(survivors)}
        self.live, self.guard, self.step, self._data_pos = state, guard, target, meta.get("data_state")
        self._keep_input = False
        for p in self._protections:
            p.shrunk(self, state, sorted(alive_p))
        worker.say(f"agreed on step {target} (own newest {own}, at most {upto}); restored it; at the barrier")
        worker.barrier("in_place")  # nobody enters the new mesh's first collective alone
        worker.say(f"past the barrier; mesh {dict(prog.mesh.shape)}")
        worker.resumed(target)
        return {"in_place": True, "failed_domains": failed, "dead_processes": m["dead"], "epoch": m["epoch"],
                "source": "host_store", "copy": source, "restored_step": target, "target_step": upto,
                "steps_recomputed": max(0, entry - target), "lost_steps": max(0, entry - target),
                "mesh": dict(prog.mesh.shape),
                "compiled_ahead": ahead,
                "seconds": {"detect": t0 - t_err, "agree": t_agree - t0, "compile": t_compile - t_agree,
                            "restore": t_restore - t_compile, "total": time.perf_counter() - t_err}}

    def _broken_if_lost(self):
        leaves = [x for x in jax.tree.leaves(self.live) if isinstance(x, jax.Array)]
        if any(x.is_deleted() for x in leaves):
            self._broken = "the live state's buffers are gone"

    def _call(self, batch):
        abstract_batch = _sh.abstract(batch)
        if self.program is None:
            self.program = self._first_program(abstract_batch)
            self._start_protections(self.live)
            self._compile_ahead()
            worker.offer_in_place(self._in_place)
            worker.barrier("compiled")  # no worker enters the first collective while another still compiles
        elif jax.tree.structure(abstract_batch) != jax.tree.structure(self.program.spec.abstract_batch) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in
                zip(jax.tree.leaves(abstract_batch), jax.tree.leaves(self.program.spec.abstract_batch))):
            raise WrapError(
                f"resilax.ResilientStep: every batch must have the first batch's structure, shapes and dtypes "
                f"(the compiled step and the record log depend on them), but got {abstract_batch} after "
                f"{self.program.spec.abstract_batch}")
        worker.step_started(self.step + 1)  # the supervisor tells a hung worker from the ones waiting on it
        lv = self._liveness
        if lv is not None:
            lv.call_begin()
        self._fire("before_step")
        recovered = self._health_boundary()
        for p in self._protections:
            p.before_step(self, self.live, self.step)
        if self._failures:  # a health check found a bad domain: recover before anything reads it
            self._recover()
        k = self.step
        prog = self.program
        copy = next((c for c in (p.copy_variant(self, k + 1) for p in self._protections) if c), None)
        log_ring = any(p.wants_log_ring(self, copy) for p in self._protections)
        before = self._data_pos
        after = encode_data_state(self.data.get_state()) if self.data is not None else None
        t0 = time.perf_counter()
        dev_batch = prog.put_batch(batch)
        # kept, not popped: a step computed again from its batch (`_go_on_in_place`) gets the
        # fault it had, so its verdict is the one it was given the first time
        gout = prog.grad(log_ring, self._grad_faults.get(k))(self.live, self.guard, dev_batch, np.uint32(k))
        for p in self._protections:
            p.before_update(self, self.live, batch, k, gout, prog)
        keep, self._keep_input = self._keep_input, False  # a checkpoint's persister still reads this state
        new_state, ring, local = prog.update(copy, keep_input=keep)(self.live, gout.rec, gout.ok, np.uint32(k))
        self.live, self.guard, self.step, self._data_pos = new_state, gout.guard, k + 1, after
        timers = [p for p in self._protections if p.blocks()]
        if timers:  # a calibration sample (peer copy or replica check cadence): the whole step, waited on
            jax.block_until_ready(new_state)
            for p in timers:
                p.timed(self, time.perf_counter() - t0)
        rec = _base.StepRecord(k, batch, gout, copy, new_state, ring, local, before, after, prog)
        with self.goodput_recorder.span("protection"):
            for p in self._protections:
                p.after_step(self, rec)
        # ``mid_step@N``: N steps completed, step N+1 (index k = N) in flight
        self._copy_in_flight = copy is not None
        self._fire("mid_step", k)
        self._fire("during_peer_copy", k)  # the step in flight makes the peer copy
        self._copy_in_flight = False
        self.step_seconds(time.perf_counter() - t0)
        worker.progress(self.step, self._step_s)  # the supervisor's step deadline (no-op outside a launch)
        self._finished = (self.step, gout.metrics)
        self._fire("after_step")
        saved = self._ckpt is not None and self._ckpt.due(self.step)
        if saved:
            self.save(self.live)
        if worker.preemption_point(self.step):  # SIGTERM reached some worker: every one stops after this step
            self._preempt(saved)
        if lv is not None:
            lv.call_end(record=not recovered and not self._failures)
        return self.live, gout.metrics

    def _preempt(self, saved: bool) -> None:
        """Every worker reached the same preemption point (`worker.preemption_point`):
        checkpoint this step (all processes take part in the save) and wait until it is
        committed; the next call raises `Preempted`."""
        if self._ckpt is not None:
            if not saved:
                self.save(self.live)
            self._ckpt.store.wait()
        self.preempted = True
        self.event("preempted", self.step, checkpoint=self._ckpt is not None,
                   detail="every worker stopped after this step; the next call raises resilax.Preempted")

    def step_seconds(self, dt):
        self._step_s = dt if self._step_s is None else 0.9 * self._step_s + 0.1 * dt
        # the step's own time, except a program's first step (it compiled, or waited for a
        # compile): budgets paid per step must not be paid by a compile
        first, self._timed_prog = self._timed_prog is not self.program, self.program
        self._steady_dt = None if first else dt

    def _health_boundary(self) -> bool:
        """Before anything is dispatched to the live domains: waits for them to answer (a
        hung one is declared so by the liveness watchdog: `HealthConfig.hang_detect_s`),
        fails the hung ones (and stragglers when `HealthConfig.remove_stragglers`) and
        recovers. Returns whether it recovered."""
        lv = self._liveness
        if lv is None:
            return False
        recovered = False
        while True:
            tg = time.perf_counter()
            hung = lv.gate(self._alive)
            if hung:  # the wait for the watchdog's verdict was detection, not training
                self.goodput_recorder.add("detection", time.perf_counter() - tg)
            self._publish_health()
            cut = []
            for d in hung:
                info = lv.failed(d)
                since = info.pop("since", None)
                self.event("hang", self.step, domain=d, **{k: v for k, v in info.items() if k != "domain"})
                cut.append((d, "hang", since))
            for d, info in lv.take_stragglers().items():
                if d not in self._alive:
                    continue
                remove = self.config.health.remove_stragglers
                self.event("straggler", self.step, removed=remove, **info)
                if remove:
                    lv.failed(d)
                    cut.append((d, "straggler", None))
            if not cut:
                break
            for d, why, since in cut:
                self.fail_domain(d, why, at=since)
            self._recover()
            recovered = True
            lv.call_begin()  # the step's deadline counts from here: recovery time is not step time
        for d, info in sorted(lv.take_back().items()):  # a failed domain answers again
            if d in self._alive:
                continue
            if self.config.health.rejoin_answering:
                self.rejoin_domain(d, "before_step", **info)
                recovered = True
                lv.call_begin()
            else:
                self.event("domain_answering", self.step, domain=d, rejoined=False, **info)
        return recovered

    def _publish_health(self):
        for kind, fields in self._liveness.take_events():
            self.event(kind, self.step, **fields)

    def hang_domain(self, domain: int, phase: str = "after_step") -> None:
        """Fault ``hang_slice``: failure domain ``domain`` stops answering (emulated, see
        ``runtime/health.py``); its memory stays until the watchdog declares it hung."""
        if self._watchdog_takes("hang_slice", domain, phase):
            self._liveness.stall(domain)
            self.event("hang_slice", self.step, domain=domain, phase=phase)

    def slow_domain(self, domain: int, phase: str = "after_step") -> None:
        """Fault ``slow_slice``: failure domain ``domain`` becomes a straggler (emulated)."""
        from resilax._src.runtime.health import SLOW_SLICE_S

        if self._watchdog_takes("slow_slice", domain, phase):
            self._liveness.slow(domain, SLOW_SLICE_S)
            self.event("slow_slice", self.step, domain=domain, phase=phase, late_s=SLOW_SLICE_S)

    def _watchdog_takes(self, fault: str, domain: int, phase: str) -> bool:
        """Whether an emulated liveness fault can apply (else an event says why not)."""
        if domain in self._alive and self._liveness is not None:
            return True
        self.event("fault_ignored", self.step, fault=fault, domain=domain, phase=phase,
                   reason="the domain is dead" if self._liveness is not None else "no liveness watchdog")
        return False

    # ---------------------------------------------------------------- hooks protections call
    def event(self, kind: str, step: int, **fields) -> Event:
        """Records an event in ``self.events`` and on the goodput timeline."""
        ev = event(kind, step, **fields)
        self.events.append(ev)
        self.goodput_recorder.event(kind, step=int(step), **fields)
        return ev

    _event = event

    def goodput_lost_step(self):
        """A step whose result was thrown away (an anomalous step) counts as lost time."""
        if self._step_s:
            self.goodput_recorder.add("lost", self._step_s)

    def host_replica(self, x):
        """Host copy of a replicated device array, from a surviving device's buffer."""
        return _host_replica(x, self._bufmaps)

    def log_covered(self, step: int):
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

    def peer_log_entries(self) -> bool:
        """Whether the step in flight keeps its record-log device entry (`PeersConfig.every`)."""
        return self._peers is None or self._peers.log_entries()

    def log_over_cap(self) -> bool:
        return self._log is not None and self._log.over_cap()

    # ---------------------------------------------------------------- faults
    def _fire(self, phase, at=None):
        if self.faults:
            self.faults.fire(phase, self.step if at is None else at, self)
        if self._failures:
            self._recover()

    def inject(self, kind: str, step: int):
        """``nan``/``spike`` faults: step ``step``'s recorded values are NaN, or its watched
        metric is multiplied (a spike), inside the grad part where real ones appear."""
        # several at one step all apply (a NaN and a spike together: the NaN decides)
        self._grad_faults[step] = tuple(sorted(set(self._grad_faults.get(step, ())) | {kind}))

    def fail_domain(self, domain: int, phase: str, at: float | None = None) -> dict | None:
        """Emulates losing failure domain ``domain`` (original index): its memory is gone.

        Blocks on in-flight work first (the surviving domains finish the step; deleting a
        buffer a running computation reads can crash the process), then deletes every
        buffer resilax holds on the domain's devices and marks them dead; nothing is
        dispatched to them again. A domain that is already dead: nothing happens (an event
        says so). ``at``: when the failure began (``time.perf_counter()``), given by a caller
        that waited for its detection and booked that wait in the goodput record itself
        (a hang); default now.
        """
        if not 0 <= domain < len(self._domains):
            raise WrapError(f"resilax fail_slice: target must be a failure domain index in [0, {len(self._domains)}), "
                            f"but got {domain}")
        devs = set(self._domains[domain])
        if self._ckpt is not None:  # a snapshot being handed to Orbax reads device buffers: let it finish
            self._ckpt.store.settle()
        if devs <= self._dead:
            self.event("fault_ignored", self.step, fault="fail_slice", domain=domain, phase=phase,
                       reason="the domain is already dead")
            return None
        if not self._failures:  # first failure since the last recovery: map what we hold
            held = [x for x in jax.tree.leaves((self.live, self.guard)) if isinstance(x, jax.Array)]
            if self._log is not None:
                if phase in ("mid_step", "during_peer_copy"):
                    held += self._log.drop_pending()  # the step in flight: its entry dies with the domain
                else:
                    self._log.settle()  # the step completed: its entry is durable
                if self._log.disk is not None:
                    self._log.disk.wait(max_pending=0)  # host copies already started land first
            for p in self._protections:
                held += p.held()
            jax.block_until_ready(held)
            self._bufmaps = {id(a): _ring.buffers(a) for a in held}
            self._held = held  # keeps ids stable while the maps are in use
        freed = _ring.delete_on(self._bufmaps.values(), devs)
        self._dead |= devs
        if self._liveness is not None:
            self._liveness.lost(domain)
        info = {"domain": domain, "phase": phase, "devices": sorted(d.id for d in devs), "bytes_deleted": freed,
                "copy_in_flight": bool(self._copy_in_flight), "at": time.perf_counter() if at is None else at,
                "detection_booked": at is not None}
        self._failures.append(info)
        return info

    @functools.cached_property
    def leaf_names(self) -> list[str]:
        """The state's leaves as ``keystr`` paths, in tree order (for errors and events)."""
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self._abstract_state)[0]]

    @property
    def step_deadline_s(self) -> float | None:
        """The liveness watchdog's step deadline now (None: no watchdog, or too few calls
        measured yet)."""
        return None if self._liveness is None else self._liveness.deadline()

    @property
    def alive_domains(self) -> list[int]:
        """The live failure domains (original indices), in mesh order."""
        return list(self._alive)

    def corrupt_domain(self, domain: int, phase: str = "after_step") -> dict | None:
        """Emulates silent data corruption on failure domain ``domain``: one bit of the live
        state's largest floating leaf flips in the buffer of the domain's first device (the
        other domains' replicas keep the right value). Nothing else notices; the replica
        check (`HealthConfig`) must. Returns where it flipped (None: the domain is dead)."""
        if not 0 <= domain < len(self._domains):
            raise WrapError(f"resilax bitflip: target must be a failure domain index in [0, {len(self._domains)}), "
                            f"but got {domain}")
        if domain not in self._alive:
            self.event("fault_ignored", self.step, fault="bitflip", domain=domain, phase=phase,
                       reason="the domain is dead")
            return None
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.live)
        floats = [i for i, (_, x) in enumerate(flat) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and x.size]
        i = max(floats, key=lambda j: flat[j][1].size)
        x = flat[i][1]
        dev = self._domains[domain][0]
        shards = []
        for sh in x.addressable_shards:
            if sh.device == dev:
                host = np.array(sh.data, copy=True)
                word = host.reshape(-1).view(np.uint16 if host.itemsize == 2 else np.uint32)
                word[0] ^= 1 << (4 if host.itemsize == 2 else 20)  # a mantissa bit: wrong, but not a NaN
                shards.append(jax.device_put(host, dev))
            else:
                shards.append(sh.data)
        leaves = [v for _, v in flat]
        leaves[i] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
        self.live = jax.tree.unflatten(treedef, leaves)
        info = dict(domain=domain, phase=phase, leaf=jax.tree_util.keystr(flat[i][0]), device=dev.id)
        self.event("bitflip", self.step, **info)
        return info

    def repair_domain(self, domain: int, phase: str = "after_step") -> None:
        """Fault ``repair_slice``: failed domain ``domain``'s hardware is back (emulated);
        the liveness watchdog must see it answer before it rejoins."""
        if domain in self._alive or self._liveness is None:
            self.event("fault_ignored", self.step, fault="repair_slice", domain=domain, phase=phase,
                       reason="the domain is alive" if self._liveness is not None else "no liveness watchdog")
            return
        self._liveness.repair(domain)
        self.event("repair_slice", self.step, domain=domain, phase=phase)

    def rejoin_domain(self, domain: int, phase: str = "after_step", **found) -> dict | None:
        """Failure domain ``domain`` (original index) is back (repaired, or a replacement
        with fresh memory): the mesh grows to include it, at a step boundary, with no restart
        and no checkpoint read. The state is copied to it from the live domains (bitwise),
        the grown mesh's programs are built (the full mesh's again: no microbatches), and
        every protection starts again on it. A domain that is alive already: nothing happens
        (an event says so). Failures still pending are recovered first. ``found``: how the
        monitor found it back (``found_by``, ``down_s``, ...), kept in the event.

        Returns the ``rejoin`` event's fields (None when nothing happened).
        """
        if not 0 <= domain < len(self._domains):
            raise WrapError(f"resilax rejoin: target must be a failure domain index in [0, {len(self._domains)}), "
                            f"but got {domain}")
        if self._failures:
            self._recover()
        if domain in self._alive:
            self.event("fault_ignored", self.step, fault="rejoin", domain=domain, phase=phase,
                       reason="the domain is alive")
            return None
        t0 = time.perf_counter()
        with self.goodput_recorder.span("recovery"):
            if self._ckpt is not None:  # a snapshot being handed to Orbax reads the live buffers
                self._ckpt.store.settle()
            if self._log is not None:
                self._log.settle()
            alive = sorted(self._alive + [domain])
            prog, ahead = self._program_for(alive)
            prog.grad(False)
            prog.update(None)
            t_compile = time.perf_counter() - t0
            # device to device, from the live domains' buffers (the new domain's old ones are gone)
            state = jax.device_put(self.live, prog.state_sh)
            guard = None if self.guard is None else jax.device_put(self.guard, NamedSharding(prog.mesh, P()))
            jax.block_until_ready((state, guard))
            self._dead -= set(self._domains[domain])
            self.program, self.mesh, self._alive = prog, prog.mesh, alive
            if self._liveness is not None:
                self._liveness.failed(domain)  # whatever was known of its old self
                self._liveness.rejoined(domain)
                self._liveness.set_alive(alive)
            self.live, self.guard = state, guard
            for p in self._protections:
                p.restart(self, state)
        fields = dict(domain=domain, phase=phase, mesh=dict(prog.mesh.shape), microbatches=prog.m,
                      bytes_moved=int(sum(x.nbytes for x in jax.tree.leaves(state))), compiled_ahead=ahead,
                      seconds={"compile": t_compile, "total": time.perf_counter() - t0}, **found)
        self.event("rejoin", self.step, **fields)
        self._compile_ahead()
        return fields

    # ================================================================ recovery
    def _recover(self):
        with self.goodput_recorder.span("recovery"):
            self._do_recover()

    def _newest_ckpt(self) -> str:
        if self._ckpt is None:
            return "no checkpoints are kept (Config.checkpoint is None)"
        steps = self._ckpt.store.steps()
        return (f"the newest checkpoint is step {steps[-1]} in {str(self._ckpt.store.directory)!r}" if steps
                else f"no checkpoint was committed yet in {str(self._ckpt.store.directory)!r}")

    def _do_recover(self):
        failures, self._failures = self._failures, []
        t_fail = min(f["at"] for f in failures)
        t0 = time.perf_counter()
        failed = [i for i in self._alive if set(self._domains[i]) & self._dead]
        survivors = [i for i in self._alive if i not in failed]
        unbooked = [f["at"] for f in failures if not f["detection_booked"]]
        self.goodput_recorder.add("detection", max(0.0, t0 - min(unbooked, default=t0)))
        target = self.step
        if not survivors:
            self._broken = "every failure domain is lost"
            raise StateLostError(
                f"resilax: every failure domain is lost ({[f['domain'] for f in failures]}); nothing survives to "
                f"continue the state of step {target}; {self._newest_ckpt()}")
        # -- plan (pure): live state, peer snapshot, checkpoint; and how to redo each step
        prog = self.program
        shapes = [x.shape for x in jax.tree.leaves(self._abstract_state)]
        live = _planner.Candidate("live", target, _base.leaf_shards(
            jax.tree.leaves(self.live), jax.tree.leaves(prog.state_sh), shapes))
        cands = [live]
        log_steps: dict = {}
        for p in self._protections:
            cands += p.candidates(self)
            log_steps.update(p.log_steps(self))
        plan = _planner.plan(target, self._dead, cands, log_steps, self.leaf_names)
        t_plan = time.perf_counter()
        if isinstance(plan, _planner.Lost):
            self._broken = "state lost"
            raise StateLostError(
                f"resilax: state lost after failure of domain(s) {failed} at step {target}: leaves "
                f"{list(plan.leaves)[:8]} have no surviving copy that can reach step {target} "
                f"({'; '.join(f'{n}: {w}' for n, w in plan.why)}); {self._newest_ckpt()}")
        # -- the new mesh's program
        for k in [k for k in self._ahead if not set(k) <= set(survivors)]:
            self._ahead.pop(k).cancel()  # meshes with a dead domain are never needed
        t_compile0 = time.perf_counter()
        new_prog, ahead = self._program_for(survivors)
        new_prog.grad(False)
        new_prog.update(None)
        t_compile = time.perf_counter() - t_compile0
        # -- restore the start state and the detector state
        src = next(c for c in cands if c.name == plan.source)
        state, guard, moved = self._restore(plan, src, new_prog)
        t_restore = time.perf_counter()
        # -- redo steps start..target-1 (device entries bitwise, batches recomputed)
        old_prog = self.program
        self.program, self.mesh, self._alive = new_prog, new_prog.mesh, survivors
        if self._liveness is not None:
            self._liveness.set_alive(survivors)
        counts = {"device": 0, "disk": 0, "batch": 0}
        with self.goodput_recorder.span("replay"):
            for s, kind, picks in plan.replay:
                state, guard = self._redo(state, guard, s, kind, picks)
                counts[kind] += 1
            jax.block_until_ready(state)
        t_replay = time.perf_counter()
        self.live, self.guard = state, guard
        for p in self._protections:
            p.restart(self, state)
        self._bufmaps, self._held = {}, []  # drop every reference to the dead arrays
        del old_prog
        self._programs = {k: v for k, v in self._programs.items() if set(k) <= set(survivors)}
        if not new_prog.protects and new_prog.mesh.shape[self.topology.elastic_axis] == 1:
            warnings.warn(
                f"resilax: after losing domain(s) {failed} only one failure domain is left; there are no peers to "
                f"hold copies, so a further failure is recoverable only from checkpoints", RuntimeWarning, stacklevel=4)
        self.event(
            "recovery", target, failed_domains=failed, failed_devices=sorted(d.id for d in self._dead),
            phases_failed=[f["phase"] for f in failures],
            copy_in_flight=[f["copy_in_flight"] for f in failures], source=plan.source, restored_step=plan.start,
            target_step=target, rejected=[list(r) for r in plan.rejected], bytes_moved=moved,
            detected_s=t0 - t_fail,
            seconds={"detect": t0 - t_fail, "plan": t_plan - t0, "compile": t_compile,
                     "restore": t_restore - t_plan - t_compile, "replay": t_replay - t_restore},
            steps_replayed=counts["device"] + counts["disk"], steps_recomputed=counts["batch"],
            lost_steps=counts["batch"], mesh=dict(new_prog.mesh.shape), microbatches=new_prog.m,
            replicated_across_domains_now=new_prog.respecified, compiled_ahead=ahead)
        self._compile_ahead()  # for the next loss, on the new mesh

    def rebuilt_state(self, step: int, trusted_through: int):
        """The state at ``step`` rebuilt from the newest checkpoint and the record log (disk
        entries or retained batches, never a live buffer), on the current mesh: the witness
        that tells which of two disagreeing replicas is right (`protect/sdc.py`). Steps after
        ``trusted_through`` (whose recorded values may have been computed from a corrupted
        state) are recomputed from their batches, never taken from the log. Returns
        ``(state, anomaly guard)``; None when no checkpoint at or before ``step`` exists or a
        step after it cannot be redone so."""
        if self._ckpt is None:
            return None
        cands = [c for c in self._ckpt.candidates(self) if c.step <= step]
        if not cands:
            return None
        log_steps = {}
        for p in self._protections:
            for s, e in p.log_steps(self).items():  # device entries are live buffers: not a witness
                ok = ("disk", "batch") if s <= trusted_through else ("batch",)
                log_steps[s] = _planner.LogStep(s, tuple(src for src in e.sources if src[0] in ok))
        plan = _planner.plan(step, self._dead, cands, log_steps, self.leaf_names)
        if isinstance(plan, _planner.Lost):
            return None
        with self.goodput_recorder.span("recovery"):
            state, guard, _ = self._restore(plan, cands[0], self.program)
            for s, kind, picks in plan.replay:
                state, guard = self._redo(state, guard, s, kind, picks)
            jax.block_until_ready(state)
        self.event("rebuilt", step, source="checkpoint", restored_step=plan.start,
                   steps_redone=len(plan.replay), why="witness for the replica check")
        return state, guard

    def adopt(self, state, guard, since: int) -> None:
        """The live state becomes ``state`` (with the anomaly detector's ``guard``), rebuilt
        at this step from trusted sources (`rebuilt_state`) because every replica of the live
        one holds corrupted values. What the protections derived from the live state after
        step ``since`` (log entries, peer copies) is dropped: it may hold them too."""
        self.live, self.guard = state, guard
        for p in self._protections:
            p.adopted(self, state, since)

    def _restore(self, plan, cand, prog):
        shapes = [x.shape for x in jax.tree.leaves(self._abstract_state)]
        dtypes = [x.dtype for x in jax.tree.leaves(self._abstract_state)]
        treedef = jax.tree.structure(self._abstract_state)
        rep = NamedSharding(prog.mesh, P())
        if plan.source == "checkpoint":
            self._ckpt.store.wait()
            abstract = self._ckpt.tree(prog.abstract_state(), self._abstract_guard(prog.mesh))
            with self.goodput_recorder.span("checkpoint_restore"):
                restored = self._ckpt.store.restore_newest(abstract)
            if restored is None or restored.step != plan.start:
                raise StateLostError(f"resilax: the checkpoint the plan relied on (step {plan.start}) could not be "
                                     f"restored; {self._newest_ckpt()}")
            guard = restored.state.get("guard")
            return restored.state["state"], guard, sum(x.nbytes for x in jax.tree.leaves(restored.state))
        host, moved = _base.assemble(plan.picks, shapes, dtypes, self._bufmaps)
        state = jax.tree.unflatten(treedef, jax.device_put(host, jax.tree.leaves(prog.state_sh)))
        guard = None
        if self.guard is not None:
            source_guard = self.guard if plan.source == "live" else self._peers.snap.guard
            guard = jax.device_put(jax.tree.map(lambda g: _host_replica(g, self._bufmaps), source_guard), rep)
        return state, guard, moved

    def _redo(self, state, guard, s, kind, picks):
        """Step ``s`` again on the current program: from a logged entry (update only, the
        logged verdict) or from its retained batch (grad + update)."""
        prog = self.program
        if kind == "batch":
            gout = prog.grad(False)(state, guard, prog.put_batch(self._log.batches[s]), np.uint32(s))
            recorded = self._log.verdict(s, self._bufmaps)  # the step's own verdict, never a recomputed one
            if recorded is None:
                new, _, _ = prog.update(None)(state, gout.rec, gout.ok, np.uint32(s))
                return new, gout.guard
            return self._gated(state, guard, s, gout.rec, *recorded)
        if kind == "device":
            host = self._log.device_values(s, picks, self._bufmaps)
            verdict, value = self._log.verdict(s, self._bufmaps)
        else:
            entry = self._log.disk.read(s, "grads")
            host = entry.recorded
            verdict = entry.scalars.get("verdict")
            value = scalar_value(entry.scalars.get("value"))
        return self._apply_logged(state, guard, s, host, verdict, value)

    def _apply_logged(self, state, guard, s, host_rec, verdict, value):
        return self._gated(state, guard, s, self.program.put_rec(host_rec), verdict, value)

    def _gated(self, state, guard, s, rec, verdict, value):
        """Step ``s``'s update on recorded values ``rec``, gated by its recorded ``verdict``
        (the update executable takes it as an input: a skipped step stays skipped), and the
        anomaly window advanced as the grad part advanced it (`anomaly.advance`: exact)."""
        v = _anomaly.recorded_verdict(verdict, s)
        new, _, _ = self.program.update(None)(state, rec, np.int32(v), np.uint32(s))
        if guard is not None and self._window_advances():
            if value is None:
                raise ReplayLogError(f"resilax replay: step {s} has a recorded verdict but no recorded "
                                     f"{self.config.anomaly.metric!r} value to advance the spike window with")
            guard = _advance(guard, np.float32(np.asarray(value)), v == _anomaly.OK)
        return new, guard

    def _window_advances(self) -> bool:
        """Whether the grad part pushes the watched value into the spike window (`make_check`)."""
        a = self.config.anomaly
        met = self.program.abstract_metrics if self.program is not None else None
        return a is not None and a.spike_zscore is not None and isinstance(met, dict) and a.metric in met

    # ================================================================ crash resume
    def _resume_from_disk(self, state):
        """Replays the disk log after the restored step, as far as it has good entries."""
        log = self._log.disk if self._log is not None else None
        if log is None:
            return state
        start = self.step
        steps = set(log.steps())
        if start in steps:  # a foreign log is refused before anything in it is touched
            try:
                first = log.read(start, "grads") if start in set(log.steps("grads")) else log.read(start, "inputs")
            except ReplayLogError:
                first = None  # damaged: handled (and named) below
            if first is not None:
                self._start_mismatch(first, state)
        log.truncate_before(start)
        if start not in steps:
            log.discard_from(start, f"resumed at step {start}; later entries will be recomputed")
            return state
        t0 = time.perf_counter()
        s, failed, modes = start, [], []
        with self.goodput_recorder.span("replay"):
            while s in steps:
                try:
                    entry = log.read(s, "grads") if s in set(log.steps("grads")) else log.read(s, "inputs")
                except ReplayLogError as e:
                    entry = None
                    if self.data is not None and s in set(log.steps("inputs")):
                        try:  # a damaged grads entry: the step is recomputed from its inputs entry
                            entry = log.read(s, "inputs")
                        except ReplayLogError:
                            pass
                    if entry is None:
                        failed.append((s, str(e)))
                        break
                if s == start:  # raises for a foreign log (the ReplayLogError below is for damage)
                    why = self._start_mismatch(entry, state)
                    if why:
                        failed.append((s, why))
                        break
                if self.program is None:
                    if entry.batch_sig is None:
                        failed.append((s, "the entry has no batch signature"))
                        break
                    self.program = self._first_program(batch_template(entry.batch_sig))
                if entry.kind == "grads":
                    state, self.guard = self._apply_logged(state, self.guard, s, entry.recorded,
                                                           entry.scalars.get("verdict"),
                                                           scalar_value(entry.scalars.get("value")))
                else:
                    if self.data is None:
                        failed.append((s, "an inputs entry needs the data iterator (init(state, data=...))"))
                        break
                    self.data.set_state(decode_data_state(entry.data_state))
                    prog = self.program
                    gout = prog.grad(False)(state, self.guard, prog.put_batch(next(self.data)), np.uint32(s))
                    # recomputed from the data, gated by the verdict the step had (a fault, a
                    # spike judged on a window, anything outside the step is not recomputed)
                    state, self.guard = self._gated(state, self.guard, s, gout.rec, entry.scalars.get("verdict"),
                                                    scalar_value(entry.scalars.get("value")))
                if self.data is not None and entry.data_next is not None:
                    self.data.set_state(decode_data_state(entry.data_next))
                    self._data_pos = entry.data_next
                if self._watch is not None:
                    self._watch.replayed(self, s, entry.scalars.get("verdict"))
                modes.append(entry.kind)
                s += 1
        self.step = s
        self.event("replay", s, source="record_log", from_step=start, steps=s - start,
                   grads_steps=modes.count("grads"), inputs_steps=modes.count("inputs"),
                   seconds=time.perf_counter() - t0, unreplayable=[{"step": a, "reason": b} for a, b in failed])
        log.discard_from(s, f"resumed at step {s}; later entries will be recomputed")
        return state

    def _start_mismatch(self, entry, state) -> str | None:
        """Why the log's first entry may not be replayed onto ``state`` (None: it may)."""
        if entry.state_sums is None:
            return "the entry does not record the state it started from, so it cannot be checked against this one"
        got = np.asarray(tree_checksums((state, self.guard)))
        if got.shape != entry.state_sums.shape or not np.array_equal(got, entry.state_sums):
            raise ReplayLogError(
                f"resilax: the record log in {str(self._log.disk.directory)!r} was recorded from another state at "
                f"step {entry.step} than the one init() has (checksums differ): it belongs to another run or initial "
                f"state. Nothing was changed; move the log away or give this run another LogConfig.directory")
        return None

    # ================================================================ checkpoints, close
    def save(self, state=None) -> float:
        """Checkpoints the live state as step ``self.step`` (async); returns seconds blocked."""
        if self._ckpt is None:
            raise WrapError("resilax.ResilientStep.save: Config.checkpoint is None (no checkpoint directory)")
        if self._ckpt.paused:
            raise StorageError(f"resilax.ResilientStep.save: checkpoints are paused: {self._ckpt.paused}")
        state = self.live if state is None else state
        if self._ckpt.store.in_flight():  # the previous save is still writing: the one wait a save may make
            t_wait, prev = time.perf_counter(), self._ckpt.store.last_step
            with self.goodput_recorder.span("checkpoint_save", step=self.step, phase="previous save still writing"):
                self._ckpt.store.settle()
            self.event("checkpoint_wait", self.step, seconds=time.perf_counter() - t_wait, previous=prev)
        if self._liveness is not None and state is self.live and self._health_boundary():
            state = self.live  # a hung domain was failed first: the same step, from the others
        if self._sdc is not None and state is self.live:  # never persist a corrupted replica
            self._sdc.before_save(self, state, self.step)
            if self._failures:
                self._recover()
            state = self.live  # a recovery, or the rebuilt state adopted in place of corrupted replicas
        after = (lambda: self.faults.fire("during_save", self.step, self)) if self.faults else None
        # The live state needs no copy when the next step keeps its input (the variant was
        # compiled ahead at start): the persister reads these very buffers, and `settle`
        # (before any failure deletes buffers, before a recovery) waits for it.
        prog = self.program
        variants = [None] if self._peers is None else [None, *self._peers.variants()]
        uncopied = (state is self.live and prog is not None and
                    (not self.config.donate_state or all(prog.has_update(v, keep_input=True) for v in variants)))
        with self.goodput_recorder.span("checkpoint_save", step=self.step):
            dt = self._ckpt.save(self, state, after_dispatch=after, copy=not uncopied)
        self._keep_input = uncopied and self.config.donate_state
        if self._log is not None:
            self._log.checkpointed(self.step)
            if self._log.disk is not None:
                # entries behind the newest committed checkpoint are not needed (the one just
                # started is in flight on the persister: it may still fail); unlinking a few
                # hundred MB of grads files took ~0.6 s on the loop, so the persister does it
                prev = [s for s in self._ckpt.store.steps() if s < self.step]
                if prev:
                    disk, floor = self._log.disk, prev[-1]
                    self._ckpt.store.after_commit(lambda: disk.truncate_before(floor))
        if self.run_dir:
            self._ckpt.store.after_commit(self._save_goodput)
        if self._failures:  # a domain was lost while the save was in flight
            self._recover()  # nothing may read the state before this: some of its buffers are gone
            state = self.live  # the same step, rebuilt bitwise
        if self._log is not None:  # uncopied: the buffers stay valid, the log's writer checksums them
            self._log.anchor(self.step, state, self.guard, defer=self._keep_input or not self.config.donate_state)
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
        return self.goodput_recorder.totals()

    def _save_goodput(self) -> None:
        if not self.run_dir:
            return
        try:
            self.goodput_recorder.save(self.run_dir)
        except OSError as e:
            if not self._goodput_warned:
                self._goodput_warned = True
                warnings.warn(f"resilax: could not write goodput.json to {self.run_dir!r}: {e}", RuntimeWarning, stacklevel=3)

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
                    if self._ckpt is not None:
                        with self.goodput_recorder.span("checkpoint_save", phase="final wait"):
                            self._ckpt.close()
                finally:
                    if self._liveness is not None:
                        self._liveness.close()
                    if self._ahead_pool is not None:  # re-forming drops the backend: no compile may run then
                        self._ahead_pool.shutdown(wait=self._reforming, cancel_futures=True)
                    self._loop_span.close()
                    self._save_goodput()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _build_ahead(spec, mesh, variants) -> Program:
    """A degraded mesh's program with the executables a recovery and the steps after it run
    (``variants``: the peer-copy variants the run uses)."""
    prog = _program.make(spec, mesh, full_mesh=False)
    prog.fits_global_batch()
    prog.grad(False)
    prog.update(None)
    if prog.protects:
        if "ring+local" in variants:
            prog.grad(True)
        for v in variants:
            prog.update(v)
    return prog


@jax.jit
def _advance(guard, value, ok):
    return _anomaly.advance(guard, value, ok)


def _host_replica(x, bufmaps):
    """Host copy of a replicated array from any surviving device's buffer."""
    for b in bufmaps.get(id(x), {}).values():
        if not b.is_deleted():
            return np.array(b, copy=True)
    return np.array(x, copy=True)
