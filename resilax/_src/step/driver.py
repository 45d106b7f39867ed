"""`resilax.wrap`: the train-step transform and `ResilientStep`, the object it returns."""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.protect.checkpoint import CheckpointStore, decode_data_state, encode_data_state
from resilax._src.config import Config
from resilax._src.errors import WrapError
from resilax._src.events import Event, event
from resilax._src.runtime.faults import FaultPlan
from resilax._src.runtime.goodput import GoodputRecorder
from resilax._src.protect.legacy_guard import Guard as ReplayGuard
from resilax._src.protect.legacy_recovery import Guard as PeerGuard
from resilax._src.step.split import Split
from resilax._src.runtime.topology import Topology


def wrap(
    train_step: Callable | None = None,
    /,
    *,
    topology: Topology,
    state_sharding: Any = None,
    batch_sharding: Any = None,
    config: Config | None = None,
    faults: FaultPlan | None = None,
):
    """Makes ``train_step`` resilient: placed on the topology's mesh, checkpointed, resumable.

    Args:
      train_step: ``train_step(state, batch) -> (state, metrics)`` or
        ``train_step(state, batch, rng)``; global-view, pure, jit-able. Call
        ``resilax.record(grads)`` once inside it on the optimizer inputs (batch means).
      topology: failure domains and mesh axes (`Topology.emulated` or `Topology.load`).
      state_sharding: ``PartitionSpec`` (or a pytree prefix of the state of them) over the
        topology's axis names; default replicated. Specs name axes, not devices, so they
        stay valid when the mesh changes after a failure.
      batch_sharding: same for the batch; default ``PartitionSpec(<elastic axis>)``.
      config: `resilax.Config`; default ``Config()``.
      faults: optional `FaultPlan` (chaos testing).

    Returns:
      A `ResilientStep`. Without ``train_step``, a decorator.

    Raises:
      WrapError: an argument has the wrong type or names a mesh axis the topology lacks.
    """
    if train_step is None:
        return functools.partial(
            wrap, topology=topology, state_sharding=state_sharding, batch_sharding=batch_sharding,
            config=config, faults=faults,
        )
    return ResilientStep(train_step, topology=topology, state_sharding=state_sharding,
                         batch_sharding=batch_sharding, config=config, faults=faults)


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def _check_spec_axes(specs, topology: Topology, argname: str) -> None:
    for spec in jax.tree.leaves(specs, is_leaf=_is_spec):
        if spec is None:
            continue
        if not isinstance(spec, P):
            raise WrapError(
                f"resilax.wrap: {argname} must be a jax.sharding.PartitionSpec or a pytree of them, "
                f"but got a leaf of type {type(spec).__name__}: {spec!r}"
            )
        for entry in spec:
            for ax in (entry if isinstance(entry, tuple) else (entry,)):
                if ax is not None and ax not in topology.axis_names:
                    raise WrapError(
                        f"resilax.wrap: {argname} uses mesh axis {ax!r}, but topology {topology.name!r} has axes "
                        f"{list(topology.axis_names)}"
                    )


def resolve_shardings(specs, tree, mesh, argname: str):
    """PartitionSpec prefix-tree + concrete tree -> NamedSharding per leaf, divisibility checked."""
    specs = jax.tree.map(lambda s: P() if s is None else s, specs, is_leaf=_is_spec)
    try:
        full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree, is_leaf=_is_spec)
    except (ValueError, TypeError) as e:
        raise WrapError(
            f"resilax: {argname} must be one PartitionSpec or a pytree prefix of the value it shards, "
            f"but its structure does not match: {e}"
        ) from None

    def one(path, spec, x):
        shape = np.shape(x)
        if len(spec) > len(shape):
            raise WrapError(
                f"resilax: {argname}{jax.tree_util.keystr(path)} is {spec} ({len(spec)} dims) but the value has shape {shape}"
            )
        for i, entry in enumerate(spec):
            axes = entry if isinstance(entry, tuple) else (entry,)
            size = math.prod(mesh.shape[a] for a in axes if a is not None)
            if shape[i] % size:
                raise WrapError(
                    f"resilax: {argname}{jax.tree_util.keystr(path)}: dimension {i} of shape {shape} is not divisible "
                    f"by mesh axes {axes} of total size {size} (mesh {dict(mesh.shape)})"
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, full, tree)


def place_copy(tree, shardings):
    """A real copy of ``tree`` laid out as ``shardings``.

    ``jax.device_put(x, s, may_alias=False)`` still shares the source's buffer on the device
    it already lives on (seen with jax 0.10.2 on CPU), and a later donation would delete the
    caller's array; a jitted copy always writes fresh buffers.
    """
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)(tree)


def _as_array(x):
    """Host values get the dtype JAX will give them (int64 -> int32 unless x64 is on)."""
    if isinstance(x, jax.Array):
        return x
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


class ResilientStep:
    """A train step that survives failures. Create it with `resilax.wrap`.

    Contract: ``state = step.init(state)`` once, then ``state, metrics = step(state, batch)``
    per global batch (a host-side numpy pytree), then ``step.close()``. ``step.step`` counts
    completed steps (restored ones included); ``step.mesh`` is the current mesh;
    ``step.events`` lists what happened.

    The state passed to ``__call__`` is donated (``Config.donate_state``): use the returned one.
    """

    def __init__(self, train_step, *, topology, state_sharding, batch_sharding, config, faults):
        if not callable(train_step):
            raise WrapError(f"resilax.wrap requires a callable train_step as its first argument, but got {type(train_step).__name__}")
        if not isinstance(topology, Topology):
            raise WrapError(
                f"resilax.wrap: topology must be a resilax.Topology (Topology.emulated(...) or Topology.load(...)), "
                f"but got {type(topology).__name__}"
            )
        config = Config() if config is None else config
        if not isinstance(config, Config):
            raise WrapError(f"resilax.wrap: config must be a resilax.Config, but got {type(config).__name__}")
        if faults is not None and not isinstance(faults, FaultPlan):
            raise WrapError(f"resilax.wrap: faults must be a resilax.FaultPlan, but got {type(faults).__name__}")
        _check_spec_axes(state_sharding, topology, "state_sharding")
        _check_spec_axes(batch_sharding, topology, "batch_sharding")
        functools.update_wrapper(self, train_step, updated=())
        self.train_step = train_step
        self.topology = topology
        self.config = config
        self.faults = faults if faults is not None else FaultPlan()
        self._state_spec = state_sharding
        self._batch_spec = P(topology.elastic_axis) if batch_sharding is None else batch_sharding
        self._split = Split(train_step, config.seed)
        self._replay = ReplayGuard(config, self._split) if config.replay_log != "off" else None
        self.step = 0
        self.mesh = None
        self.events: list[Event] = []
        self._ckpt: CheckpointStore | None = None
        self._data = None
        self._jitted = None
        self._state_sh = None
        self._batch_sh = None
        self._closed = False
        # Time accounting from wrap to close; the training loop's time is `productive`
        # unless a nested span (compile, checkpoint save, recovery...) claims it.
        self.goodput_recorder = GoodputRecorder()
        self._loop_span = contextlib.ExitStack()
        self._loop_open = False
        self._goodput_warned = False
        self._peers: PeerGuard | None = None
        if self._peers_wanted() and topology.num_domains == 1:
            warnings.warn(
                f"resilax.wrap: topology {topology.name!r} has one failure domain, so there are no peers to hold "
                f"copies of the state; losing it is recoverable only from checkpoints (+ replay)",
                RuntimeWarning, stacklevel=3,
            )

    # --------------------------------------------------------------- set-up
    def init(self, state, *, data=None):
        """Places ``state`` on the mesh, or restores the newest good checkpoint if there is one.

        Args:
          state: the initial train state (a pytree of arrays); its shapes and dtypes are the
            template a checkpoint is restored into.
          data: optional data iterator with ``get_state()``/``set_state()`` (grain's do); its
            position is saved with every checkpoint and restored here.

        Returns:
          The placed (or restored) state. ``self.step`` is the restored step (0 if fresh).

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
                f"but got {type(data).__name__}"
            )
        # Python scalars (TrainState.step starts as an int) become arrays, as the step returns them.
        state = jax.tree.map(_as_array, state)
        self._domains = self.topology.domains()  # the peer guard maps devices to domains from it
        self.mesh = self.topology.mesh(self._domains)
        self._state_sh = resolve_shardings(self._state_spec, state, self.mesh, "state_sharding")
        self._data = data
        restored = None
        if self.config.checkpoint_dir:
            self._ckpt = CheckpointStore(
                self.config.checkpoint_dir, keep=self.config.checkpoint_keep, async_save=self.config.async_checkpointing
            )
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), state, self._state_sh
            )
            t0 = time.perf_counter()
            with self.goodput_recorder.span("checkpoint_restore"):
                restored = self._ckpt.restore_newest(abstract)
            if restored is not None:
                self.step = restored.step
                if data is not None and restored.meta.get("data_state") is not None:
                    data.set_state(decode_data_state(restored.meta["data_state"]))
                self._event(
                    "restore", restored.step, source="checkpoint", seconds=time.perf_counter() - t0,
                    skipped=[{"step": s, "reason": r} for s, r in restored.skipped],
                )
                return self._protect(restored.state)
        return self._protect(place_copy(state, self._state_sh))

    def _peers_wanted(self) -> bool:
        # None = auto: peer copies unless the replay log owns the step (see Config.peers)
        return self.config.peers if self.config.peers is not None else self.config.replay_log == "off"

    def _protect(self, state):
        """Hands the placed state to the protection that owns the step: the replay log, or peers."""
        if self._replay is not None:
            return self._replay.on_init(self, state)
        if self._peers_wanted() and self.topology.num_domains > 1:
            self._peers = PeerGuard(self, state)
            return self._peers.attach(state)
        return state

    def _fire(self, phase, state):
        """Fires ``phase``'s faults; if one lost a domain, returns the recovered state."""
        if self.faults:
            self.faults.fire(phase, self.step, self)
        if self._peers is not None and self._peers.pending:
            state = self._peers.recover(state)
        return state

    def _start_loop(self):
        """From the first step on, loop time is productive unless a nested span claims it."""
        self._loop_span.close()
        self._loop_span.enter_context(self.goodput_recorder.span("productive"))
        self._loop_open = True

    def _event(self, kind: str, step: int, **fields) -> Event:
        """Records an event in ``self.events`` and on the goodput timeline."""
        ev = event(kind, step, **fields)
        self.events.append(ev)
        self.goodput_recorder.event(kind, step=int(step), **fields)
        return ev

    def goodput(self) -> dict[str, float]:
        """Seconds of wall time (since `wrap`) per bucket; they sum to the wall time.

        ``productive`` is time in the training loop not claimed by another bucket (compile,
        checkpoint_save, checkpoint_restore, protection, detection, recovery, replay, lost).
        ``goodput_recorder.goodput()`` is productive / wall.
        """
        return self.goodput_recorder.totals()

    @property
    def run_dir(self) -> str | None:
        return self.config.run_dir or self.config.checkpoint_dir

    def _save_goodput(self) -> None:
        """Writes goodput.json; accounting must never stop training, so a failed write warns."""
        if not self.run_dir:
            return
        try:
            self.goodput_recorder.save(self.run_dir)
        except OSError as e:
            if not self._goodput_warned:
                self._goodput_warned = True
                warnings.warn(f"resilax: could not write goodput.json to {self.run_dir!r}: {e}", RuntimeWarning, stacklevel=3)

    def _build(self, state, batch):
        self._batch_sh = resolve_shardings(self._batch_spec, batch, self.mesh, "batch_sharding")
        step_sh = NamedSharding(self.mesh, P())
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
        abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.result_type(x)), batch)
        fn = self._step_fn if self._replay is None else self._replay.step_fn
        out = jax.eval_shape(fn, abstract_state, abstract_batch, jax.ShapeDtypeStruct((), np.uint32))
        new_state, metrics = out[:2]
        if jax.tree.structure(new_state) != jax.tree.structure(abstract_state):
            raise WrapError(
                "resilax.wrap: train_step must return (state, metrics) with the state's structure unchanged, but the "
                f"returned state has structure {jax.tree.structure(new_state)} vs {jax.tree.structure(abstract_state)}"
            )
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(abstract_state)[0], jax.tree.leaves(new_state)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise WrapError(
                    f"resilax.wrap: train_step changed state{jax.tree_util.keystr(path)} from {a.shape} {a.dtype} to "
                    f"{b.shape} {b.dtype}; the state must keep its shapes and dtypes"
                )
        metrics_sh = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), metrics)
        # Lazy: the guards may run programs of their own instead (peers, grads-mode replay).
        self._jitted = jax.jit(
            fn,
            in_shardings=(self._state_sh, self._batch_sh, step_sh),
            out_shardings=(self._state_sh, metrics_sh) + ((None,) if self._replay is not None else ()),
            donate_argnums=(0,) if self.config.donate_state else (),
        )

    def _compile(self, state, batch):
        """Compiles ``self._jitted`` now, so its time lands in goodput's ``compile`` bucket."""
        with self.goodput_recorder.span("compile"):
            self._jitted = self._jitted.lower(state, batch, np.uint32(self.step)).compile()

    def _step_fn(self, state, batch, step_no):
        new_state, metrics, _ = self._split.full(state, batch, step_no)
        return new_state, metrics

    # --------------------------------------------------------------- the step
    def __call__(self, state, batch):
        """Runs one step on the global ``batch``; returns ``(state, metrics)``.

        Raises:
          WrapError: called before `init` or after `close`, or a batch that does not fit.
          StorageError: a checkpoint save failed (committed checkpoints are untouched).
        """
        if self.mesh is None or self._closed:
            raise WrapError(
                "resilax.ResilientStep: call step.init(state) before step(state, batch)" if not self._closed
                else "resilax.ResilientStep: this step was closed"
            )
        if not self._loop_open:
            self._start_loop()
        if self._replay is not None:  # replay log and anomaly rollback (see _guard)
            state = self._fire("before_step", state)
            state, metrics = self._replay.run(self, state, batch)
        else:
            if self._jitted is None:  # validates the step on the mesh it was wrapped for
                self._build(state, batch)
                if self._peers is None:  # the peer guard compiles step variants of its own
                    self._compile(state, batch)
            if self._peers is not None:
                self._peers.before_call()
            state = self._fire("before_step", state)
            if self._peers is not None:
                state, metrics = self._peers.step(state, batch)
            else:
                batch = jax.device_put(batch, self._batch_sh)
                state, metrics = self._jitted(state, batch, np.uint32(self.step))
            self.step += 1
        state = self._fire("after_step", state)
        every = self.config.checkpoint_every
        if self._ckpt is not None and every and self.step % every == 0:
            self.save(state)
            if self._peers is not None and self._peers.pending:  # a domain was lost while the save was in flight
                state = self._peers.recover(state)
        return state, metrics

    def save(self, state) -> float:
        """Checkpoints ``state`` as step ``self.step`` (async); returns seconds blocked."""
        if self._ckpt is None:
            raise WrapError("resilax.ResilientStep.save: Config.checkpoint_dir is not set")
        if self._replay is not None:
            self._replay.on_save(self, state)
        meta = {"seed": self.config.seed, "topology": self.topology.name}
        if self._data is not None:
            meta["data_state"] = encode_data_state(self._data.get_state())
        after = (lambda: self.faults.fire("during_save", self.step, self)) if self.faults else None
        with self.goodput_recorder.span("checkpoint_save", step=self.step):
            dt = self._ckpt.save(self.step, state, meta, after_dispatch=after)
        if self._peers is not None:
            self._peers.note_checkpoint(self.step)
        self._save_goodput()
        return dt

    @property
    def checkpoints(self) -> CheckpointStore | None:
        return self._ckpt

    def close(self) -> None:
        """Waits for pending checkpoint writes and releases resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for guard in (self._replay, self._peers):
                if guard is not None:
                    guard.close()
        finally:
            try:
                if self._ckpt is not None:
                    with self.goodput_recorder.span("checkpoint_save", phase="final wait"):
                        self._ckpt.close()
            finally:
                self._loop_span.close()
                self._save_goodput()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
