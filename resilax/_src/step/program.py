"""One step program per mesh: the grad part and the update part, and what protections
add to them.

- ``grad(state, guard, batch, step_no) -> GradOut``: the user's step up to `resilax.record`
  (recorded values, their weight, metrics), plus the anomaly verdict (``ok``: recorded
  values finite and no loss spike) and the anomaly detector's next state (``guard``), plus,
  when the record log keeps device entries, the packed ring copy of the recorded values
  (their shards that live in one failure domain, held by the next domain).
- ``update(state, recorded, ok, step_no) -> (state, ring, local)``: the user's step after
  `record`, applied only when ``ok`` (else the state is returned as it was: a NaN or a
  spike skips the update inside the program by a select, no conditional, no host sync and
  no rollback), plus, on a
  peer-copy step, the packed ring copy of the new state (and a local copy when copies are
  not made every step).

Where recorded leaves are small (`Program.rec_layout`), ``GradOut.rec`` is not the pytree
but ``(buffers, large leaves)``: the small leaves as one buffer per dtype, each device's
buffer its own blocks concatenated (`ring.local_pack`), the others as they are. The update
part slices the buffers back, and the host hands over a few arrays a step instead of one
per small leaf. `Program.rec_tree` unpacks it for what reads the values (a
grads log entry, the cross-check), `Program.put_rec` packs host values for a replay.

Training runs grad then update, back to back with no host round-trip; replay runs the very
same update executable (same variant, logged per step) on logged values, so a replayed
step is bitwise the original by construction.

On a smaller mesh (after a failure) the grad part runs on the **global batch shapes**
whenever its compiled program fits in device memory (`Program.memory_ok`): with
``jax_threefry_partitionable`` every example draws the random bits it drew on the full
mesh, BatchNorm sees the whole batch, and the maths is the full mesh's up to reduction
order. Only when it does not fit is the batch cut into ``m`` microbatches, each with its
own random stream (``fold_in(key, i)``): then dropout masks differ from the full mesh's
(the same distribution, not the same bits), batch statistics are per microbatch, and the
recorded values are combined by their `record` weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.errors import WrapError
from resilax._src.protect import ring as _ring
from resilax._src.step import sharding as _sh
from resilax._src.step.gating import gated_update
from resilax._src.step.split import Split

REDUCTIONS = ("mean", "sum", "max", "min", "last")


class GradOut(NamedTuple):
    rec: Any  # recorded values (pytree), each leaf in its parameter's sharding
    metrics: Any
    ok: Any  # int32 verdict: 0 applies the update (anomaly.OK), else anomaly.NONFINITE / SPIKE
    guard: Any  # the anomaly detector's state after this step (None without anomaly)
    loss: Any  # float32 scalar the detector looked at (None without anomaly)
    rec_ring: Any  # packed ring copy of the recorded values, or None
    weight: Any  # the record weight (None when not given)


def recorded_shardings(abstract_state, state_sh, rec, mesh):
    """Each recorded leaf gets the sharding of the first state leaf of its shape (the param
    it is the gradient of), else replicated: no all-gather between the two parts under FSDP.
    A pure function of shapes and the state's shardings, so the original step and a replay
    feed the update identically laid-out values."""
    table = {}
    for x, sh in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(state_sh)):
        table.setdefault(tuple(np.shape(x)), sh.spec)
    return jax.tree.map(lambda r: NamedSharding(mesh, table.get(tuple(r.shape), P())), rec)


def combine(values, weights):
    """``(sum(w_i * v_i) / sum(w_i), sum(w_i))`` accumulated left to right over pytrees
    (equal weights: ``(the plain mean, None)``). The fixed order is what makes the bit-exact
    mode's combine independent of where each value was computed."""
    if weights is None:
        acc = values[0]
        for v in values[1:]:
            acc = jax.tree.map(jnp.add, acc, v)
        n = len(values)
        return (jax.tree.map(lambda a: a / n, acc) if n > 1 else acc), None
    total = weights[0]
    acc = jax.tree.map(lambda v: v * weights[0].astype(v.dtype), values[0])
    for v, w in zip(values[1:], weights[1:]):
        acc = jax.tree.map(lambda a, x: a + x * w.astype(x.dtype), acc, v)
        total = total + w
    return jax.tree.map(lambda a: a / total.astype(a.dtype), acc), total


def combine_metrics(mets, weights, reductions: dict):
    """Metrics of ``m`` microbatches -> the full batch's, by declared reduction: ``mean``
    (weighted by the record weights when given), ``sum``, ``max``, ``min``, ``last``.
    Undeclared: floating metrics ``mean``, integer ones ``sum``, booleans ``all``."""
    flat = [jax.tree_util.tree_flatten_with_path(m)[0] for m in mets]
    treedef = jax.tree.structure(mets[0])
    out = []
    for i, (path, x0) in enumerate(flat[0]):
        xs = [f[i][1] for f in flat]
        name = _metric_name(path)
        how = reductions.get(name) or reductions.get(jax.tree_util.keystr(path))
        dt = jnp.result_type(x0)
        if how is None:
            how = "mean" if jnp.issubdtype(dt, jnp.inexact) else ("all" if dt == jnp.bool_ else "sum")
        if how == "mean":
            out.append(combine(xs, weights if jnp.issubdtype(dt, jnp.inexact) else None)[0])
        elif how == "sum":
            out.append(sum(xs[1:], xs[0]))
        elif how == "max":
            out.append(jnp.max(jnp.stack(xs), 0))
        elif how == "min":
            out.append(jnp.min(jnp.stack(xs), 0))
        elif how == "all":
            out.append(jnp.all(jnp.stack(xs), 0))
        else:
            out.append(xs[-1])
    return jax.tree.unflatten(treedef, out)


def _metric_name(path):
    k = path[0] if path else None
    return getattr(k, "key", getattr(k, "name", None))


@dataclasses.dataclass
class ProgramSpec:
    """What every mesh's program is built from (fixed for a run)."""

    split: Split
    state_specs: Any  # prefix tree of PartitionSpecs (mesh axes)
    batch_specs: Any
    abstract_state: Any  # ShapeDtypeStructs, no shardings
    abstract_batch: Any
    abstract_guard: Any  # anomaly detector state (None without anomaly)
    elastic_axis: str
    donate: bool
    metric_reductions: dict
    anomaly_check: Callable | None  # (guard, rec, metrics) -> (ok, loss, guard) traced; None: always ok
    memory_limit: int | None  # bytes per device the grad part may use on a smaller mesh
    watched_metric: str = "loss"  # the metric a `spike` fault multiplies
    replicas: int | None = None  # the bit-exact mode's virtual replicas (None: the default mode)
    cache: dict = dataclasses.field(default_factory=dict)  # the bit-exact mode's per-domain executables


class Program:
    """The executables of one mesh (see the module docstring). Variants are compiled on
    first use: ``grad(log_ring)``, ``update(copy)`` with copy in (None, "ring", "ring+local")."""

    deterministic = False  # the bit-exact mode's subclass says True
    packs_rec = True  # the recorded values may cross between the parts packed (`rec_layout`)
    # a recorded leaf of fewer bytes per device is packed: for it the host's per-array cost of
    # passing it between the two executables (~10-20 us to make, hand over and free)
    # outweighs the device's copy into the buffer (1 MiB: ~1 us of HBM traffic on a GPU, but
    # on the device's clock, where it is not hidden); a larger one crosses as it is
    PACK_LEAF_BYTES = 1 << 20

    def __init__(self, spec: ProgramSpec, mesh, *, full_mesh: bool):
        self.spec = spec
        self.mesh = mesh
        axis = spec.elastic_axis
        specs, self.respecified = _sh.fit_specs(spec.state_specs, spec.abstract_state, mesh, axis)
        self.state_sh = _sh.resolve(specs, spec.abstract_state, mesh, "state_sharding")
        self.places = _ring.placement(self.state_sh, axis)
        self.rep = NamedSharding(mesh, P())
        # Ring copies are needed only for leaves that live in one domain: state replicated
        # across the elastic axis is its own backup, at no per-step cost.
        self.protects = mesh.shape[axis] > 1 and _ring.RING in jax.tree.leaves(self.places)
        if full_mesh:  # the user's layout must fit the full mesh as given: a clear error, not a silent change
            _sh.resolve(spec.batch_specs, spec.abstract_batch, mesh, "batch_sharding")
        # a smaller mesh keeps the global batch; where it no longer divides, that leaf drops the elastic axis
        bspecs, _ = _sh.fit_specs(spec.batch_specs, spec.abstract_batch, mesh, axis)
        self.batch_specs = bspecs
        u32 = jax.ShapeDtypeStruct((), np.uint32)
        self._u32 = u32
        with spec.split.on(mesh):
            closed, (rec, weight, metrics) = jax.make_jaxpr(spec.split.grad, return_shape=True)(
                spec.abstract_state, spec.abstract_batch, u32)
        self.grad_parts = _read_parts(closed, spec.abstract_state, self.state_sh)
        self.abstract_rec = rec
        self.has_weight = weight is not None
        self.abstract_metrics = metrics
        self.rec_sh = recorded_shardings(spec.abstract_state, self.state_sh, rec, mesh)
        rec_leaves = jax.tree.leaves(rec)
        rec_shs = jax.tree.leaves(self.rec_sh)
        self.rec_pack = _ring.ring_pack_layout(
            [x.shape for x in rec_leaves], [x.dtype for x in rec_leaves], rec_shs,
            jax.tree.leaves(_ring.placement(rec_shs, axis)), axis) if self.protects else None
        self.rec_layout = None
        per_device = [math.prod(sh.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
                      for x, sh in zip(rec_leaves, rec_shs)]
        small = [_ring.RING if b < self.PACK_LEAF_BYTES else None for b in per_device]
        if self.packs_rec and small.count(_ring.RING) > 1:
            self.rec_layout = _ring.ring_pack_layout([x.shape for x in rec_leaves], [x.dtype for x in rec_leaves],
                                                     rec_shs, small, axis)
        if self.rec_layout is None:
            self.rec_in_sh = self.rec_sh
            self.abstract_rec_in = _sh.abstract(rec, self.rec_sh)
        else:  # (buffers, the large leaves as they are)
            every = NamedSharding(mesh, P(tuple(mesh.axis_names)))
            big = [i for i, s in enumerate(small) if s is None]
            self.rec_in_sh = (tuple(every for _ in self.rec_layout.groups), tuple(rec_shs[i] for i in big))
            self.abstract_rec_in = (
                tuple(jax.ShapeDtypeStruct((mesh.size * n,), jnp.dtype(g), sharding=every)
                      for g, n in zip(self.rec_layout.groups, self.rec_layout.lengths)),
                tuple(jax.ShapeDtypeStruct(rec_leaves[i].shape, rec_leaves[i].dtype, sharding=rec_shs[i]) for i in big))
        st_leaves = jax.tree.leaves(spec.abstract_state)
        self.state_pack = _ring.ring_pack_layout(
            [x.shape for x in st_leaves], [x.dtype for x in st_leaves], jax.tree.leaves(self.state_sh),
            jax.tree.leaves(self.places), axis) if self.protects else None
        self.m = 1
        self.full_mesh = full_mesh
        self._grad: dict = {}
        self._update: dict = {}
        self.batch_sh = None
        self.memory: dict = {}

    # ----------------------------------------------------------------- abstract values
    def abstract_state(self):
        return _sh.abstract(self.spec.abstract_state, self.state_sh)

    def _host_batch_abstract(self):
        b = self.spec.abstract_batch
        if self.m == 1:
            return b
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.m, x.shape[0] // self.m) + x.shape[1:], x.dtype), b)

    def _batch_shardings(self, m):
        specs = self.batch_specs if m == 1 else jax.tree.map(lambda s: P(None, *s), _sh.full_specs(
            self.batch_specs, self.spec.abstract_batch, "batch_sharding"), is_leaf=_sh.is_spec)
        b = self.spec.abstract_batch if m == 1 else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((m, x.shape[0] // m) + x.shape[1:], x.dtype), self.spec.abstract_batch)
        return _sh.resolve(specs, b, self.mesh, "batch_sharding")

    # ----------------------------------------------------------------- grad part
    def _grad_fn(self, m: int, log_ring: bool, fault: tuple | None = None):
        spec, split = self.spec, self.spec.split
        rec_sh, pack = self.rec_sh, self.rec_pack

        def core(state, batch, step_no):
            if m == 1:
                return split.grad(state, batch, step_no)
            # m microbatches in a lax.scan: one microbatch's activations live at a time (the
            # point of microbatching), the recorded values accumulate as sum(w_i * r_i) left
            # to right, per-microbatch metrics and weights are stacked (scalars) and combined
            # by their declared reductions afterwards.
            key = split.key(step_no) if split.rng else None
            zero_rec = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.abstract_rec)
            zero_rec = jax.lax.with_sharding_constraint(zero_rec, rec_sh)

            def body(acc, xs):
                i, mb = xs
                r, w, met = split.grad(state, mb, step_no, None if key is None else jax.random.fold_in(key, i))
                if w is None:
                    acc = jax.tree.map(lambda a, x: a + x, acc, r)
                else:
                    acc = jax.tree.map(lambda a, x: a + x * w.astype(x.dtype), acc, r)
                acc = jax.lax.with_sharding_constraint(acc, rec_sh)
                return acc, (w, met)

            acc, (ws, mets) = jax.lax.scan(body, zero_rec, (jnp.arange(m, dtype=jnp.uint32), batch))
            if ws is None:
                rec = jax.tree.map(lambda a: a / m, acc)
                weights, weight = None, None
            else:
                weight = jnp.sum(ws)
                rec = jax.tree.map(lambda a: a / weight.astype(a.dtype), acc)
                weights = [ws[i] for i in range(m)]
            metrics = combine_metrics([jax.tree.map(lambda x: x[i], mets) for i in range(m)], weights,
                                      spec.metric_reductions)
            return rec, weight, metrics

        def fn(state, guard, batch, step_no):
            if self.grad_parts is not None:  # the parts the grad part never reads: zeros, dead code
                state = _whole_state(state, self.grad_parts, spec.abstract_state)
            rec, weight, metrics = core(state, batch, step_no)
            faults = () if fault is None else fault
            if "nan" in faults:  # chaos: NaN where real ones appear
                rec = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else x, rec)
            if "spike" in faults and isinstance(metrics, dict):
                metrics = {k: (v * 1000.0 if k == watched_metric(spec) else v) for k, v in metrics.items()}
            rec = jax.lax.with_sharding_constraint(rec, rec_sh)
            if spec.anomaly_check is not None:
                ok, loss, guard = spec.anomaly_check(guard, rec, metrics, rec_sh)
            else:
                ok, loss = jnp.zeros((), jnp.int32), None
            ring = _ring.ring_pack(jax.tree.leaves(rec), pack) if log_ring and pack is not None else None
            if self.rec_layout is not None:  # what crosses to the update part: a buffer per dtype
                rec = _ring.local_pack(jax.tree.leaves(rec), self.rec_layout)
            return GradOut(rec, metrics, ok, guard, loss, ring, weight)

        return fn

    def grad(self, log_ring: bool = False, fault: tuple | None = None):
        """``fault``: chaos kinds injected into this step (``("nan",)``, ``("spike",)``, both)."""
        key = (self.m, log_ring, fault)
        if key not in self._grad:
            self.batch_sh = self._batch_shardings(self.m)
            metrics_sh = jax.tree.map(lambda _: self.rep, self.abstract_metrics)
            out_sh = GradOut(self.rec_in_sh, metrics_sh, self.rep, jax.tree.map(lambda _: self.rep, self.spec.abstract_guard),
                             self.rep if self.spec.anomaly_check is not None else None, None,
                             self.rep if self.has_weight else None)
            keep = self.grad_parts
            state_sh, abstract = self.state_sh, self.abstract_state()
            if keep is not None:
                state_sh, abstract = _parts(state_sh, keep), _parts(abstract, keep)
            jitted = jax.jit(self._grad_fn(self.m, log_ring, fault),
                             in_shardings=(state_sh, jax.tree.map(lambda _: self.rep, self.spec.abstract_guard),
                                           self.batch_sh, self.rep),
                             out_shardings=out_sh)
            with self.spec.split.on(self.mesh):
                lowered = jitted.lower(abstract, self.spec.abstract_guard,
                                       _sh.abstract(self._host_batch_abstract(), self.batch_sh), self._u32)
            exe = lowered.compile()
            self._grad[key] = exe if keep is None else _ReadsParts(exe, keep)
        return self._grad[key]

    def fits_global_batch(self) -> bool:
        """Whether the grad part on the global batch fits ``memory_limit`` on this mesh
        (from the compiled program's memory analysis); decides ``m`` (1, or the smallest
        number of microbatches that fits and divides the batch)."""
        limit = self.spec.memory_limit
        if limit is None and not self.full_mesh:
            limit = _device_limit(self.mesh)
        if self.full_mesh or limit is None:
            return True
        for m in _microbatch_candidates(self.spec.abstract_batch, self.mesh, self.batch_specs):
            self.m = m
            need = _footprint(self.grad())
            self.memory[m] = need
            if need <= limit:
                return m == 1
        raise WrapError(
            f"resilax: on the degraded mesh {dict(self.mesh.shape)} the gradient part does not fit in "
            f"{limit} bytes per device even in {self.m} microbatches (needs {self.memory[self.m]}); "
            f"raise PeersConfig.device_memory_bytes or use a global batch with more divisors")

    # ----------------------------------------------------------------- update part
    def _update_fn(self, copy):
        split, pack, state_sh = self.spec.split, self.state_pack, self.state_sh
        template = self.spec.abstract_batch

        def fn(state, rec, ok, step_no):
            if self.rec_layout is not None:
                rec = jax.tree.unflatten(jax.tree.structure(self.abstract_rec), _ring.local_unpack(rec, self.rec_layout))
            zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), template)  # dead code: read via record only
            new = gated_update(ok, split.update, state, zeros, step_no, rec)
            new = jax.lax.with_sharding_constraint(new, state_sh)
            ring = local = None
            if copy is not None and pack is not None:
                ring = _ring.ring_pack(jax.tree.leaves(new), pack)
                if copy == "ring+local":  # the whole step survives while the live state moves on
                    local = jax.tree.map(jnp.copy, new)
            return new, ring, local

        return fn

    def update(self, copy: str | None = None, keep_input: bool = False):
        """The update executable of variant ``copy``. ``keep_input``: the input state is not
        donated (the step after a checkpoint: the persister still reads it), else as
        ``ProgramSpec.donate`` says."""
        if copy is not None and not self.protects:
            copy = None
        donate = self.spec.donate and not keep_input
        key = copy if donate == self.spec.donate else (copy, "keep")
        if key not in self._update:
            jitted = jax.jit(self._update_fn(copy),
                             in_shardings=(self.state_sh, self.rec_in_sh, self.rep, self.rep),
                             out_shardings=(self.state_sh, None, None),
                             donate_argnums=(0,) if donate else ())
            with self.spec.split.on(self.mesh):
                lowered = jitted.lower(self.abstract_state(), self.abstract_rec_in, jax.ShapeDtypeStruct((), jnp.int32),
                                       self._u32)
            self._update[key] = lowered.compile()
        return self._update[key]

    def has_update(self, copy: str | None = None, keep_input: bool = False) -> bool:
        if copy is not None and not self.protects:
            copy = None
        donate = self.spec.donate and not keep_input
        return (copy if donate == self.spec.donate else (copy, "keep")) in self._update

    def snapshot(self, local: bool):
        """``state -> (packed ring copy, local copy or None)``: a peer copy outside a step
        (at init and after a recovery)."""
        key = ("snapshot", local)
        if key not in self._update:
            pack = self.state_pack

            def fn(state):
                ring = _ring.ring_pack(jax.tree.leaves(state), pack) if pack is not None else None
                return ring, (jax.tree.map(jnp.copy, state) if local else None)

            self._update[key] = jax.jit(fn, in_shardings=(self.state_sh,)).lower(self.abstract_state()).compile()
        return self._update[key]

    # ----------------------------------------------------------------- host side
    def put_batch(self, batch):
        """The host batch on this mesh (cut into microbatches when ``m > 1``)."""
        if self.batch_sh is None:
            self.grad()
        if self.m > 1:
            batch = jax.tree.map(lambda x: np.reshape(np.asarray(x), (self.m, np.shape(x)[0] // self.m) + np.shape(x)[1:]),
                                 batch)
        return _sh.put(batch, self.batch_sh)

    def put_rec(self, host_leaves):
        """Host copies of recorded leaves -> device, in the form the update part takes (the
        recorded values' shardings; packed where `rec_layout` says)."""
        treedef = jax.tree.structure(self.abstract_rec)
        tree = jax.tree.unflatten(treedef, jax.device_put(list(host_leaves), jax.tree.leaves(self.rec_sh)))
        return tree if self.rec_layout is None else self._repack("pack")(tree)

    def rec_tree(self, rec):
        """The recorded values as the user's pytree (``GradOut.rec`` is packed where
        `rec_layout` says: unpacked here, only for what reads the leaves)."""
        return rec if self.rec_layout is None else self._repack("unpack")(rec)

    def _repack(self, way: str):
        key = ("repack", way)
        if key not in self._update:
            layout, treedef = self.rec_layout, jax.tree.structure(self.abstract_rec)
            abs_tree = _sh.abstract(self.abstract_rec, self.rec_sh)
            if way == "pack":
                j = jax.jit(lambda t: _ring.local_pack(jax.tree.leaves(t), layout),
                            in_shardings=(self.rec_sh,), out_shardings=self.rec_in_sh)
                self._update[key] = j.lower(abs_tree).compile()
            else:
                j = jax.jit(lambda b: jax.tree.unflatten(treedef, _ring.local_unpack(b, layout)),
                            in_shardings=(self.rec_in_sh,), out_shardings=self.rec_sh)
                self._update[key] = j.lower(self.abstract_rec_in).compile()
        return self._update[key]

    def compile_all(self, variants) -> None:
        """Compiles the given update variants and the grad part now (compile ahead)."""
        self.fits_global_batch()
        self.grad(bool(self.protects))
        self.grad(False)
        for v in variants:
            self.update(v)
        if self.rec_layout is not None:  # what a log entry, a replay or a recovery needs
            self._repack("pack")
            self._repack("unpack")


# ----------------------------------------------------------------- the parts the grad part reads
def _top(tree):
    """``(parts, treedef)``: ``tree`` split one level down (a TrainState: step, params, opt_state)."""
    return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)


def _read_parts(closed, abstract_state, state_sh) -> tuple | None:
    """Indices of the state's top-level parts the grad part reads, from its jaxpr after
    dead-code removal (what ``jax.jit`` itself prunes), or None where it reads every part.

    The optimizer's moments (two thirds of an Adam state's leaves) are never read by the
    gradient part, yet a call of its executable with the whole state hands over and checks
    every leaf: ~0.4-0.6 us of host time each, per step (6.5 vs 2.0 ms for a 10,001-leaf
    TrainState and its params on CPU). Given only the parts it reads, it pays for those."""
    try:
        from jax._src.interpreters import partial_eval as pe
    except ImportError:  # pragma: no cover - a JAX without it: the whole state, as before
        return None
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    parts, _ = _top(abstract_state)
    if len(_top(state_sh)[0]) != len(parts):
        return None
    keep, at, dropped = [], 0, 0
    for i, part in enumerate(parts):
        leaves = jax.tree.leaves(part)
        if any(used[at:at + len(leaves)]):
            keep.append(i)
        elif any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) for x in leaves):
            return None  # (a typed PRNG key has no zeros to stand in for it)
        else:
            dropped += len(leaves)
        at += len(leaves)
    return tuple(keep) if dropped else None


def _parts(tree, keep):
    parts, _ = _top(tree)
    return tuple(parts[i] for i in keep)


def _whole_state(kept, keep, abstract_state):
    """The state the user's step sees in the grad part: the parts it reads, zeros (dead code,
    removed by XLA) for the rest."""
    parts, top = _top(abstract_state)
    given = dict(zip(keep, kept))
    return jax.tree.unflatten(top, [given[i] if i in given else jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), p)
                                    for i, p in enumerate(parts)])


class _ReadsParts:
    """A grad executable that takes only the state's parts its program reads (`_read_parts`);
    called, like the others, with the whole state. Everything else is the executable's."""

    __slots__ = ("exe", "keep")

    def __init__(self, exe, keep):
        self.exe, self.keep = exe, keep

    def __call__(self, state, *rest):
        return self.exe(_parts(state, self.keep), *rest)

    def __getattr__(self, name):
        return getattr(self.exe, name)


def watched_metric(spec) -> str:
    return getattr(spec, "watched_metric", "loss")


def temp_bytes(compiled) -> int | None:
    """A compiled program's temporary device memory per device (XLA's memory analysis); None
    on a backend without one."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:
        return None


def _footprint(compiled) -> int:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # a backend without memory analysis: assume it fits
        return 0


def _device_limit(mesh) -> int | None:
    try:
        stats = mesh.devices.flat[0].memory_stats()
    except Exception:
        return None
    return None if not stats else stats.get("bytes_limit")


def _microbatch_candidates(abstract_batch, mesh, batch_specs):
    """m = 1, 2, ... that divide the global batch with each microbatch still shardable."""
    leaves = jax.tree.leaves(abstract_batch)
    if not leaves:
        return [1]
    bsz = leaves[0].shape[0]
    specs = jax.tree.leaves(_sh.full_specs(batch_specs, abstract_batch, "batch_sharding"), is_leaf=_sh.is_spec)
    size = 1
    for s in specs:
        if len(s):
            size = math.lcm(size, _sh.axis_size(mesh, s[0]))
    return [m for m in range(1, bsz + 1) if bsz % m == 0 and (bsz // m) % size == 0]
