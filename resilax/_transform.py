"""`resilax.wrap`: the train-step transform and `ResilientStep`, the object it returns."""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ._checkpoint import CheckpointStore, decode_data_state, encode_data_state
from ._config import Config
from ._errors import WrapError
from ._events import Event, event
from ._faults import FaultPlan
from ._recovery import Guard
from ._split import Split
from ._topology import Topology


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
        self.step = 0
        self.mesh = None
        self.events: list[Event] = []
        self._ckpt: CheckpointStore | None = None
        self._data = None
        self._jitted = None
        self._state_sh = None
        self._batch_sh = None
        self._closed = False
        self._guard: Guard | None = None
        if config.peers and topology.num_domains == 1:
            import warnings

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
        self._domains = self.topology.domains()
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
            restored = self._ckpt.restore_newest(abstract)
            if restored is not None:
                self.step = restored.step
                if data is not None and restored.meta.get("data_state") is not None:
                    data.set_state(decode_data_state(restored.meta["data_state"]))
                self.events.append(event(
                    "restore", restored.step, source="checkpoint", seconds=time.perf_counter() - t0,
                    skipped=[{"step": s, "reason": r} for s, r in restored.skipped],
                ))
                return self._protect(restored.state)
        # A real copy: the caller's arrays stay valid even though the step donates its input.
        return self._protect(jax.tree.map(lambda x, s: jax.device_put(x, s, may_alias=False), state, self._state_sh))

    def _protect(self, state):
        if self.config.peers and self.topology.num_domains > 1:
            self._guard = Guard(self, state)
            return self._guard.attach(state)
        return state

    def _fire(self, phase, state):
        """Fires ``phase``'s faults; if one lost a domain, returns the recovered state."""
        if self.faults:
            self.faults.fire(phase, self.step, self)
        if self._guard is not None and self._guard.pending:
            state = self._guard.recover(state)
        return state

    def _build(self, state, batch):
        self._batch_sh = resolve_shardings(self._batch_spec, batch, self.mesh, "batch_sharding")
        step_sh = NamedSharding(self.mesh, P())
        abstract_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
        abstract_batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype), batch)
        fn = self._step_fn
        try:
            out = jax.eval_shape(fn, abstract_state, abstract_batch, jax.ShapeDtypeStruct((), np.uint32))
        except WrapError:
            raise
        new_state, metrics = out
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
        self._jitted = jax.jit(
            fn,
            in_shardings=(self._state_sh, self._batch_sh, step_sh),
            out_shardings=(self._state_sh, metrics_sh),
            donate_argnums=(0,) if self.config.donate_state else (),
        )

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
        if self._jitted is None:  # validates the step on the mesh it was wrapped for
            self._build(state, batch)
        if self._guard is not None:
            self._guard.before_call()
        state = self._fire("before_step", state)
        if self._guard is not None:
            state, metrics = self._guard.step(state, batch)
        else:
            batch = jax.device_put(batch, self._batch_sh)
            state, metrics = self._jitted(state, batch, np.uint32(self.step))
        self.step += 1
        state = self._fire("after_step", state)
        every = self.config.checkpoint_every
        if self._ckpt is not None and every and self.step % every == 0:
            self.save(state)
            if self._guard is not None and self._guard.pending:  # a domain was lost while the save was in flight
                state = self._guard.recover(state)
        return state, metrics

    def save(self, state) -> float:
        """Checkpoints ``state`` as step ``self.step`` (async); returns seconds blocked."""
        if self._ckpt is None:
            raise WrapError("resilax.ResilientStep.save: Config.checkpoint_dir is not set")
        meta = {"seed": self.config.seed, "topology": self.topology.name}
        if self._data is not None:
            meta["data_state"] = encode_data_state(self._data.get_state())
        after = (lambda: self.faults.fire("during_save", self.step, self)) if self.faults else None
        blocked = self._ckpt.save(self.step, state, meta, after_dispatch=after)
        if self._guard is not None:
            self._guard.note_checkpoint(self.step)
        return blocked

    @property
    def checkpoints(self) -> CheckpointStore | None:
        return self._ckpt

    def close(self) -> None:
        """Waits for pending checkpoint writes and releases resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.close()
        if self._ckpt is not None:
            self._ckpt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
