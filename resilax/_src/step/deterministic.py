"""The bit-exact elastic mode (`DeterministicConfig`): the same trajectory, bit for bit,
whatever number of failure domains is alive.

Why the default mode cannot promise that: on a smaller mesh the gradient part is the same
maths in another reduction order (an all-reduce over 1 domain instead of 2, a batch
sharded over 4 devices instead of 8), so values differ in the last bit; Adam turns such
differences into a drift that grows with the steps (1e-7 after a shrink, 1e-2 two hundred
steps later on the CLI's MLP).

What this mode does instead:

- The global batch is cut into ``V`` **virtual replicas** (``V`` fixed for the run: by
  default the topology's number of failure domains), each of ``B / V`` examples with its
  own random stream ``fold_in(key(step), v)``.
- Each replica's gradient part runs as **one domain's executable**: the user's step
  compiled for a single failure domain's devices (the inner mesh axes, the same on every
  mesh), dispatched to the domain the replica is assigned to (``v mod live domains``).
  Executables compiled from the same program for same-shaped device sets compute the same
  bits, so a replica's values do not depend on how many domains are alive or which one
  ran it.
- The ``V`` results are brought to every live domain (pure data movement) and combined
  there in the fixed order ``v = 0 .. V-1`` (``sum(w_v * r_v) / sum(w_v)`` with `record`
  weights, else the plain mean), metrics by their declared reductions; then the anomaly
  verdict and the update run, again as one domain's executable on each live domain.
- So the state is **replicated across failure domains** (the elastic axis is dropped
  from ``state_sharding``; sharding inside a domain is kept): losing domains loses no
  state, and there are no peer copies to make.

Semantics differ from the default mode in two places, documented in docs/recovery.md:
batch statistics (BatchNorm) are per virtual replica (like per-device BatchNorm in data
parallelism), and dropout masks come from the replicas' streams. Both are the same on
every mesh, which is the point.

Cost: the gradient work is the default mode's (each domain computes the replicas it
would have computed anyway); the combine moves ``V - 1`` recorded copies to every domain
instead of one all-reduce, and every domain holds the whole state (FSDP only inside a
domain). ``resilax bench health`` reports ``deterministic_overhead_ratio``.

Executables are per domain and shared by every mesh that domain is part of, so a
recovery onto fewer domains compiles nothing. In one process the combine's inputs move
between domains with ``device_put``; with several (``resilax launch``) each process runs the
replicas of its own domains, stacks their results per domain and one all-gather over the
elastic axis brings them to every domain (pure data movement: the same bits). A domain must
then lie within one process.

Which reduction order a domain's executable has depends on the job's CPU collectives, not on
its process layout. A domain's own executables may hold cross-device float sums over its
devices (with ``--layout sharded`` the forward matmuls' contracting dimension is sharded over
the domain's axis: an all-reduce over its 4 devices on ``cpu-2x4``). Under ``resilax launch``
every process, also a generation of one process, has a distributed client and so gloo CPU
collectives for every collective, local ones included: gloo's ring all-reduce sums each chunk
in another (fixed) rotation of the ranks than XLA's in-process all-reduce (ranks 0, 1, 2, ...).
Every domain has the same ranks in every layout, so within a launched job the trajectory is
still the same bits whatever processes and domains are alive (``tests/test_launch.py``: 2
processes x 4 devices re-formed as 1 process == ``launch -n 1`` x 8 devices). Across jobs it
is not: with more than 2 devices in a domain, a launched run is not bitwise a run without
``launch`` (1.4e-2 in Adam's moment after 8 steps on ``cpu-2x4``), and a checkpoint moved
between the two continues in the other order. With 2 devices ``a + b == b + a``, so both
orders give the same bits. ``benchmarks/collective_order_probe.py`` measures it without
resilax.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilax._src.errors import WrapError
from resilax._src.protect import ring as _ring
from resilax._src.step import sharding as _sh
from resilax._src.step.gating import gated_update
from resilax._src.step.program import GradOut, Program, combine, combine_metrics, watched_metric


def strip_axis(specs, axis: str):
    """The prefix tree of specs with ``axis`` dropped from every entry."""

    def one(spec):
        if spec is None:
            return spec
        entries = []
        for e in spec:
            axes = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a is not None and a != axis)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries)

    return jax.tree.map(one, specs, is_leaf=_sh.is_spec)


class _Domain:
    """One live failure domain: its devices as a one-domain mesh and its shardings."""

    def __init__(self, prog: "DeterministicProgram", index: int):
        mesh = prog.mesh
        self.devices = list(mesh.devices[index].flat)
        self.devset = set(self.devices)
        self.key = tuple(d.id for d in self.devices)
        self.mesh = Mesh(mesh.devices[index : index + 1], mesh.axis_names)
        self.rep = NamedSharding(self.mesh, P())
        self.state_sh = jax.tree.map(lambda s: NamedSharding(self.mesh, s.spec), prog.state_sh)
        self.rec_sh = jax.tree.map(lambda s: NamedSharding(self.mesh, s.spec), prog.rec_sh)
        self.batch_sh = _sh.resolve(prog.replica_batch_specs, prog.replica_batch, self.mesh, "batch_sharding")
        here = jax.process_index()
        self.local = all(d.process_index == here for d in self.devices)  # this process dispatches to it
        self.partly_local = any(d.process_index == here for d in self.devices)


class _PackedRec(NamedTuple):
    """A replica's recorded values as they crossed: ``dom.xfer``'s buffers on domain ``dom``."""

    dom: _Domain
    bufs: tuple


class DeterministicProgram(Program):
    """`Program` of the bit-exact mode (see the module docstring). Same interface: ``grad``
    and ``update`` return callables with the default program's signatures; ``put_batch``
    returns the replicas' batches, each on the domain that computes it."""

    deterministic = True
    packs_rec = False  # each domain's parts hand over the tree (the mode assembles and views it per leaf)
    packs_transfer = True  # one process: the replicas' recorded values reach the other domains packed (`xfer`)

    def __init__(self, spec, mesh, *, full_mesh: bool):
        super().__init__(spec, mesh, full_mesh=full_mesh)
        if self.protects:  # strip_axis at wrap time makes every state leaf replicated across domains
            raise WrapError("resilax: deterministic mode needs the state replicated across failure domains")
        axis = spec.elastic_axis
        self.V = spec.replicas
        leaves = jax.tree.leaves(spec.abstract_batch)
        bsz = leaves[0].shape[0] if leaves else 0
        if not leaves or bsz % self.V:
            raise WrapError(f"resilax: DeterministicConfig.replicas={self.V} must divide the global batch ({bsz} "
                            f"examples along the first dimension of every batch leaf)")
        self.replica_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // self.V,) + x.shape[1:], x.dtype), spec.abstract_batch)
        self.replica_batch_specs = strip_axis(spec.batch_specs, axis)
        self.live = mesh.shape[axis]
        self.doms = [_Domain(self, i) for i in range(self.live)]
        self.cache = spec.cache  # executables per domain, shared by every mesh the domain is part of
        self._ready: set = set()  # variants whose executables this program has for every domain
        # Several processes (`resilax launch`): each runs the replicas of its own domains and
        # the replicas' results reach every domain through one all-gather over the elastic
        # axis (pure data movement, so the bits are those of the one-process run).
        self.multi = jax.process_count() > 1
        split_doms = [d.key for d in self.doms if d.partly_local and not d.local]
        if split_doms:
            raise WrapError(
                f"resilax: the bit-exact mode runs each failure domain's executables in the process that owns its "
                f"devices, but domain(s) with devices {split_doms} span several processes; use a topology whose "
                f"failure domains are whole processes (e.g. cpu-4x2 with 4 processes x 2 devices)")
        self.mine = [d for d in self.doms if d.local]
        self.slots = -(-self.V // self.live)  # replicas per domain (v -> domain v % live, slot v // live)
        # One process: each replica's recorded values reach every domain packed, one buffer per
        # dtype (`ring.local_pack` in its gradient executable, unpacked inside each combine):
        # a transfer per buffer instead of one per leaf (per-leaf transfers were most of this
        # mode's per-step Python). Every domain's mesh has the same shape, so device k's block
        # of a buffer lands on device k of the other domain, where that domain's layout reads it.
        self.xfer = self.packs_transfer and not self.multi and len(jax.tree.leaves(self.abstract_rec)) > 1
        if self.xfer:
            rec_leaves = jax.tree.leaves(self.abstract_rec)
            for d in self.doms:
                shs = jax.tree.leaves(d.rec_sh)
                d.xfer = _ring.ring_pack_layout([x.shape for x in rec_leaves], [x.dtype for x in rec_leaves], shs,
                                                [_ring.RING] * len(shs), axis)
                d.every = NamedSharding(d.mesh, P(tuple(d.mesh.axis_names)))
        self._last0 = None

    @property
    def last_replica0(self):
        """Replica 0's recorded values of the newest step, as the tree (the cross-check reads
        them); unpacked here, on replica 0's domain, when they crossed packed."""
        if isinstance(self._last0, _PackedRec):
            self._last0 = self._unpack_exe(self._last0.dom)(self._last0.bufs)
        return self._last0

    @last_replica0.setter
    def last_replica0(self, value):
        self._last0 = value

    def _unpack_exe(self, dom: _Domain):
        treedef = jax.tree.structure(self.abstract_rec)

        def build():
            abstract, shs = self._xfer_abstract(dom)
            j = jax.jit(lambda b: jax.tree.unflatten(treedef, _ring.local_unpack((b, ()), dom.xfer)),
                        in_shardings=(shs,), out_shardings=dom.rec_sh)
            return j.lower(abstract).compile()

        return self._exe(("unpack_rec", dom.key), build)

    def _xfer_abstract(self, dom: _Domain):
        """(abstract packed buffers, their shardings) of ``dom``'s layout."""
        shs = tuple(dom.every for _ in dom.xfer.groups)
        return (tuple(jax.ShapeDtypeStruct((dom.mesh.size * n,), jnp.dtype(g), sharding=dom.every)
                      for g, n in zip(dom.xfer.groups, dom.xfer.lengths)), shs)

    # ----------------------------------------------------------------- executables
    def _replicas(self, dom: _Domain) -> range:
        """The virtual replicas domain ``dom`` computes (replica v -> domain v % live)."""
        return range(self.doms.index(dom), self.V, self.live)

    def _exe(self, key, build):
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def _grad_exe(self, dom: _Domain, packed: bool = False):
        """``packed``: the recorded values come out packed in ``dom.xfer``'s layout."""
        split = self.spec.split

        def fn(state, batch, step_no, v):
            if not split.rng:  # called as the crosscheck and the default mode call it: one trace
                out = split.grad(state, batch, step_no)
            else:
                out = split.grad(state, batch, step_no, jax.random.fold_in(split.key(step_no), v))
            if packed:
                out = (_ring.local_pack(jax.tree.leaves(out[0]), dom.xfer)[0],) + tuple(out[1:])  # (every leaf has a slot)
            return out

        def build():
            out_sh = (self._xfer_abstract(dom)[1] if packed else dom.rec_sh, dom.rep if self.has_weight else None,
                      jax.tree.map(lambda _: dom.rep, self.abstract_metrics))
            j = jax.jit(fn, in_shardings=(dom.state_sh, dom.batch_sh, dom.rep, dom.rep), out_shardings=out_sh)
            with split.on(dom.mesh):
                lowered = j.lower(_sh.abstract(self.spec.abstract_state, dom.state_sh),
                                  _sh.abstract(self.replica_batch, dom.batch_sh), self._u32, self._u32)
            return lowered.compile()

        return self._exe(("grad_packed" if packed else "grad", dom.key), build)

    def _combine_fn(self, fault):
        spec = self.spec

        def fn(recs, ws, mets, guard):
            rec, weight = combine(recs, ws)
            metrics = combine_metrics(mets, ws, spec.metric_reductions)
            faults = () if fault is None else fault
            if "nan" in faults:
                rec = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else x, rec)
            if "spike" in faults and isinstance(metrics, dict):
                metrics = {k: (v * 1000.0 if k == watched_metric(spec) else v) for k, v in metrics.items()}
            if spec.anomaly_check is not None:
                ok, loss, guard = spec.anomaly_check(guard, rec, metrics)
            else:
                ok, loss = jnp.zeros((), jnp.int32), None
            return rec, weight, metrics, ok, loss, guard

        return fn

    def _combine_exe(self, dom: _Domain, fault, packed: bool = False):
        """``packed``: each replica's recorded values come in packed (``dom.xfer``), unpacked here."""
        spec = self.spec
        V = self.V
        inner = self._combine_fn(fault)
        treedef = jax.tree.structure(self.abstract_rec)

        def fn(recs, ws, mets, guard):
            if packed:
                recs = [jax.tree.unflatten(treedef, _ring.local_unpack((r, ()), dom.xfer)) for r in recs]
            return inner(recs, ws, mets, guard)

        def build():
            rep = dom.rep
            guard_sh = jax.tree.map(lambda _: rep, spec.abstract_guard)
            met_sh = jax.tree.map(lambda _: rep, self.abstract_metrics)
            w_sh = [rep] * V if self.has_weight else None
            out_sh = (dom.rec_sh, rep if self.has_weight else None, met_sh, rep,
                      rep if spec.anomaly_check is not None else None, guard_sh)
            rec_in, rec_in_sh = (self._xfer_abstract(dom) if packed
                                 else (_sh.abstract(self.abstract_rec, dom.rec_sh), dom.rec_sh))
            j = jax.jit(fn, in_shardings=([rec_in_sh] * V, w_sh, [met_sh] * V, guard_sh), out_shardings=out_sh)
            f32 = jax.ShapeDtypeStruct((), jnp.float32)
            return j.lower([rec_in] * V, [f32] * V if self.has_weight else None,
                           [self.abstract_metrics] * V, spec.abstract_guard).compile()

        return self._exe(("combine_packed" if packed else "combine", dom.key, fault), build)

    def _update_exe(self, dom: _Domain, donate: bool):
        split = self.spec.split
        template = self.spec.abstract_batch

        def fn(state, rec, ok, step_no):
            zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), template)  # dead code: read via record only
            new = gated_update(ok, split.update, state, zeros, step_no, rec)
            return jax.lax.with_sharding_constraint(new, dom.state_sh)

        def build():
            j = jax.jit(fn, in_shardings=(dom.state_sh, dom.rec_sh, dom.rep, dom.rep), out_shardings=dom.state_sh,
                        donate_argnums=(0,) if donate else ())
            with split.on(dom.mesh):
                lowered = j.lower(_sh.abstract(self.spec.abstract_state, dom.state_sh),
                                  _sh.abstract(self.abstract_rec, dom.rec_sh), jax.ShapeDtypeStruct((), jnp.int32),
                                  self._u32)
            return lowered.compile()

        return self._exe(("update", dom.key, donate), build)

    # ----------------------------------------------------------------- the parts
    def assignment(self):
        """``[(replica v, live domain index)]`` in the fixed replica order."""
        return [(v, v % self.live) for v in range(self.V)]

    def put_batch(self, batch):
        leaves, treedef = jax.tree.flatten(batch)
        n = np.shape(leaves[0])[0] // self.V if leaves else 0
        out = []
        for v, j in self.assignment():
            if not self.doms[j].local:  # another process's replica: it places its own
                out.append(None)
                continue
            part = jax.tree.unflatten(treedef, [np.asarray(x)[v * n : (v + 1) * n] for x in leaves])
            out.append(_sh.put(part, self.doms[j].batch_sh))
        return out

    def grad(self, log_ring: bool = False, fault: tuple | None = None):
        doms = self.doms
        if ("grad", fault) not in self._ready:  # once per program: the per-step path builds nothing
            xfer = self.xfer
            combine = (lambda d: self._combine_multi_exe(d, fault)) if self.multi else (
                lambda d: self._combine_exe(d, fault, xfer))
            builders = [functools.partial(f, d) for d in self.mine
                        for f in (functools.partial(self._grad_exe, packed=xfer), combine)]
            if self.multi:
                # the exchange's executables too: built lazily in the first step, a worker still
                # compiling them made the others' all-gather time out (the first step after an
                # in-place shrink; ``--in-place`` in docs/multiprocess.md)
                builders += [functools.partial(self._pack_exe, d, len(self._replicas(d)))
                             for d in self.mine] + [self._gather_exe]
            build_all(builders, first=2)
            self._ready.add(("grad", fault))

        if self.multi:
            return self._grad_multi(fault)

        xfer = self.xfer

        def run(state, guard, batches, step_no):
            views = [_view(state, d.state_sh, d) for d in doms]
            outs = []
            for (v, j), b in zip(self.assignment(), batches):
                outs.append(self._grad_exe(doms[j], xfer)(views[j], b, step_no, np.uint32(v)))
            # the cross-check compares it with one device's result (unpacked only if it reads it);
            # replica 0 runs on domain 0 (`assignment`)
            self.last_replica0 = _PackedRec(doms[0], outs[0][0]) if xfer else outs[0][0]
            results = []
            for d in doms:
                recs = [jax.device_put(o[0], d.every if xfer else d.rec_sh) for o in outs]
                ws = [jax.device_put(o[1], d.rep) for o in outs] if self.has_weight else None
                mets = [jax.device_put(o[2], d.rep) for o in outs]
                g = None if guard is None else _view(guard, jax.tree.map(lambda _: d.rep, guard), d)
                results.append(self._combine_exe(d, fault, xfer)(recs, ws, mets, g))
            rec, weight, metrics, ok, loss, new_guard = (
                _assemble([r[i] for r in results], sh, doms) for i, sh in enumerate(
                    (self.rec_sh, self.rep, self.rep, self.rep, self.rep, self.rep)))
            return GradOut(rec, metrics, ok, new_guard, loss, None, weight)

        return run

    def update(self, copy: str | None = None, keep_input: bool = False):
        donate = self.spec.donate and not keep_input
        doms = self.mine
        if ("update", donate) not in self._ready:
            build_all([functools.partial(self._update_exe, d, donate) for d in doms], first=1)
            self._ready.add(("update", donate))

        def run(state, rec, ok, step_no):
            # every view first: a donation deletes the donated buffers in the global arrays too
            args = [(_view(state, d.state_sh, d), _view(rec, d.rec_sh, d), _view(ok, d.rep, d))
                    for d in doms]
            parts = [self._update_exe(d, donate)(*a, step_no) for d, a in zip(doms, args)]
            return _assemble(parts, self.state_sh, doms), None, None

        return run

    def has_update(self, copy: str | None = None, keep_input: bool = False) -> bool:
        donate = self.spec.donate and not keep_input
        return all(("update", d.key, donate) in self.cache for d in self.mine)

    def fits_global_batch(self) -> bool:
        return True  # each domain runs B / V examples per call, as on the full mesh

    # ----------------------------------------------------------------- several processes
    def _pack_exe(self, dom: _Domain, present: int):
        """One domain's ``present`` replica results -> each leaf stacked as ``[1, slots, ...]``
        (zeros in the unused slots), laid out as a block of the global exchange array."""
        S, axis = self.slots, self.spec.elastic_axis

        def fn(recs, ws, mets):
            def stack(xs):
                xs = list(xs) + [jnp.zeros_like(xs[0])] * (S - len(xs))
                return jnp.stack(xs)[None]

            rec = jax.tree.map(lambda *xs: stack(xs), *recs)
            w = None if ws is None else stack(ws)
            met = jax.tree.map(lambda *xs: stack(xs), *mets)
            return rec, w, met

        def build():
            rep = dom.rep
            met_sh = jax.tree.map(lambda _: rep, self.abstract_metrics)
            out_sh = jax.tree.map(lambda sh: NamedSharding(dom.mesh, P(axis, None, *sh.spec)),
                                  (dom.rec_sh, rep if self.has_weight else None, met_sh))
            j = jax.jit(fn, in_shardings=([dom.rec_sh] * present, [rep] * present if self.has_weight else None,
                                          [met_sh] * present), out_shardings=out_sh)
            f32 = jax.ShapeDtypeStruct((), jnp.float32)
            return j.lower([_sh.abstract(self.abstract_rec, dom.rec_sh)] * present,
                           [f32] * present if self.has_weight else None,
                           [self.abstract_metrics] * present).compile()

        return self._exe(("pack", dom.key, present, S), build)

    def _exchange_shardings(self, gathered: bool):
        """Shardings (on the whole mesh) of the stacked ``(rec, w, metrics)``: split over the
        elastic axis (each domain's block), or ``gathered`` on every domain."""
        axis, mesh = self.spec.elastic_axis, self.mesh
        lead = (None, None) if gathered else (axis, None)
        rep = NamedSharding(mesh, P())
        return jax.tree.map(lambda sh: NamedSharding(mesh, P(*lead, *sh.spec)),
                            (self.rec_sh, rep if self.has_weight else None,
                             jax.tree.map(lambda _: rep, self.abstract_metrics)))

    def _exchange_abstract(self):
        """The stacked ``(rec, w, metrics)`` as ``[live, slots, ...]`` ShapeDtypeStructs."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((self.live, self.slots) + tuple(a.shape), a.dtype),
            (self.abstract_rec, jax.ShapeDtypeStruct((), jnp.float32) if self.has_weight else None,
             self.abstract_metrics))

    def _gather_exe(self):
        """The all-gather over the elastic axis (every process runs it: one collective)."""

        def build():
            src, dst = self._exchange_shardings(False), self._exchange_shardings(True)
            j = jax.jit(lambda t: t, in_shardings=(src,), out_shardings=dst)
            return j.lower(_sh.abstract(self._exchange_abstract(), src)).compile()

        return self._exe(("gather", tuple(d.id for d in self.mesh.devices.flat), self.slots), build)

    def _combine_multi_exe(self, dom: _Domain, fault):
        """`_combine_exe` on the gathered ``[live, slots, ...]`` arrays: replica ``v`` is at
        ``[v % live, v // live]``; combined in the order ``v = 0 .. V-1`` as in one process."""
        spec, V, live = self.spec, self.V, self.live
        inner = self._combine_fn(fault)

        def fn(rec_st, w_st, met_st, guard):
            pick = lambda t, v: jax.tree.map(lambda x: x[v % live, v // live], t)  # noqa: E731
            recs = [pick(rec_st, v) for v in range(V)]
            ws = None if w_st is None else [w_st[v % live, v // live] for v in range(V)]
            mets = [pick(met_st, v) for v in range(V)]
            return inner(recs, ws, mets, guard)

        def build():
            rep = dom.rep
            guard_sh = jax.tree.map(lambda _: rep, spec.abstract_guard)
            met_sh = jax.tree.map(lambda _: rep, self.abstract_metrics)
            st_sh = jax.tree.map(lambda sh: NamedSharding(dom.mesh, P(None, None, *sh.spec)),
                                 (dom.rec_sh, rep if self.has_weight else None, met_sh))
            out_sh = (dom.rec_sh, rep if self.has_weight else None, met_sh, rep,
                      rep if spec.anomaly_check is not None else None, guard_sh)
            j = jax.jit(fn, in_shardings=(*st_sh, guard_sh), out_shardings=out_sh)
            return j.lower(*_sh.abstract(self._exchange_abstract(), st_sh), spec.abstract_guard).compile()

        return self._exe(("combine_multi", dom.key, fault, live, self.slots), build)

    def _grad_multi(self, fault):
        # fixed for the program: computed once, not per step
        reps = {d.key: list(self._replicas(d)) for d in self.mine}
        src = self._exchange_shardings(False)
        flat_src, treedef = jax.tree.flatten(src)
        flat_shapes = [a.shape for a in jax.tree.leaves(self._exchange_abstract())]
        dst = self._exchange_shardings(True)
        dsh = {d.key: jax.tree.map(lambda sh: NamedSharding(d.mesh, sh.spec), dst) for d in self.mine}

        def run(state, guard, batches, step_no):
            outs = {}
            for d in self.mine:
                view = _view(state, d.state_sh, d)
                for v in reps[d.key]:
                    outs[v] = self._grad_exe(d)(view, batches[v], step_no, np.uint32(v))
            self.last_replica0 = outs[0][0] if 0 in outs else None
            # each domain's results stacked, then one all-gather over the elastic axis
            blocks = []
            for d in self.mine:
                vs = reps[d.key]
                rec, w, met = self._pack_exe(d, len(vs))(
                    [outs[v][0] for v in vs], [outs[v][1] for v in vs] if self.has_weight else None,
                    [outs[v][2] for v in vs])
                blocks.append((rec, w, met))
            flat_blocks = [jax.tree.leaves(b) for b in blocks]
            stacked = jax.tree.unflatten(treedef, [
                jax.make_array_from_single_device_arrays(
                    flat_shapes[i], flat_src[i], [sh.data for fb in flat_blocks for sh in fb[i].addressable_shards])
                for i in range(len(flat_src))])
            gathered = self._gather_exe()(stacked)
            results = []
            for d in self.mine:
                parts = _view(gathered, dsh[d.key], d)
                g = None if guard is None else _view(guard, jax.tree.map(lambda _: d.rep, guard), d)
                results.append(self._combine_multi_exe(d, fault)(*parts, g))
            rec, weight, metrics, ok, loss, new_guard = (
                _assemble([r[i] for r in results], sh, self.mine) for i, sh in enumerate(
                    (self.rec_sh, self.rep, self.rep, self.rep, self.rep, self.rep)))
            return GradOut(rec, metrics, ok, new_guard, loss, None, weight)

        return run

    def compile_all(self, variants) -> None:
        self.grad(False)
        self.update(None)
        self.update(None, keep_input=True)


def build_all(builders, first: int = 0) -> None:
    """Runs the builders of missing executables in parallel (XLA compiles without the GIL).

    With a persistent compilation cache the ``first`` builders (one domain's programs) run
    before the rest: the other domains' executables are the same programs on other devices,
    and where the cache key leaves out the device assignment (JAX's on GPU) they are then
    loaded from the cache, one compile per program instead of one per domain."""
    if first and jax.config.jax_compilation_cache_dir:
        build_all(builders[:first])
        builders = builders[first:]
    if len(builders) < 2:
        for b in builders:
            b()
        return
    with concurrent.futures.ThreadPoolExecutor(min(len(builders), os.cpu_count() or 1)) as pool:
        for f in [pool.submit(b) for b in builders]:
            f.result()


def _view(tree, shardings, dom):
    """The part of each (domain-replicated) global array held by domain ``dom``, as an array
    on that domain's mesh: no copy. An array `_assemble` made from per-domain arrays gives
    back the one of ``dom`` (the step's outputs, read by the next part: state, records,
    verdict, guard) instead of a new array per leaf built from its buffers: that was a third
    of this mode's per-step Python on the demo's MLP."""
    devset, key = dom.devset, dom.key

    def one(x, sh):
        if not isinstance(x, jax.Array):  # a host value (a logged verdict): placed on the domain
            return jax.device_put(x, sh)
        parts = getattr(x, _PARTS, None)
        if parts is not None:
            p = parts.get(key)
            if p is not None and p.sharding == sh and not p.is_deleted():
                x._check_if_deleted()  # as domain_buffers does: a donated global array is an error
                return p
        return _make(x.shape, sh, domain_buffers(x, devset))

    return jax.tree.map(one, tree, shardings)


#: attribute `_assemble` sets on a global array: ``{domain key: that domain's array}``
_PARTS = "_resilax_domain_parts"


_DEVICE_ORDER: dict = {}


def _make(shape, sharding, arrays):
    """``jax.make_array_from_single_device_arrays`` for buffers already in the sharding's
    device order (a mesh's row-major device order, which a domain's rows keep): that public
    call re-derives shardings and re-checks every buffer, two thirds of this mode's per-step
    Python time on a small model. Falls back to it where JAX's internals differ."""
    if sharding not in _CHECKED:  # once per sharding: the public call, and the order it keeps
        out = jax.make_array_from_single_device_arrays(tuple(shape), sharding, list(arrays))
        mine = [next(iter(a.devices())) for a in arrays]
        _CHECKED[sharding] = [sh.device for sh in out.addressable_shards] == mine
        return out
    if _CHECKED[sharding]:
        try:
            from jax._src import array as _array, core as _core

            return _array.ArrayImpl(_core.ShapedArray(tuple(shape), arrays[0].dtype), sharding, list(arrays),
                                    committed=True, _skip_checks=True)
        except Exception:  # another JAX version: the public, checked way below
            pass
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, list(arrays))


_CHECKED: dict = {}  # sharding -> whether buffers in mesh order are in its order


def domain_buffers(x, devset) -> list:
    """``x``'s single-device arrays on the devices ``devset``, each its own buffer (also for a
    fully replicated array). ``Array.addressable_shards`` builds a Shard object per device
    and per call (a third of a small model's step in this mode), so the device order of a
    sharding is computed once and the buffers are read by position."""
    arrays = getattr(x, "_arrays", None)
    if arrays is None:  # not an ArrayImpl: the public, slower way
        return [s.data for s in x.addressable_shards if s.device in devset]
    x._check_if_deleted()
    order = _DEVICE_ORDER.get(x.sharding)
    if order is None:
        order = _DEVICE_ORDER[x.sharding] = [s.device for s in x.addressable_shards]
    return [a for a, d in zip(arrays, order) if d in devset]


def _assemble(parts, sharding, doms):
    """Per-domain arrays (one tree per domain of ``doms``, equal values) -> global arrays laid
    out as ``sharding`` (a tree, or one sharding for every leaf): no copy. Each global array
    keeps its domains' arrays (`_view` hands them back)."""
    if parts[0] is None:
        return None
    treedef = jax.tree.structure(parts[0])
    leaves = [jax.tree.leaves(p) for p in parts]
    shs = jax.tree.leaves(sharding) if not isinstance(sharding, jax.sharding.Sharding) else [sharding] * len(leaves[0])
    out = []
    for i, sh in enumerate(shs):
        x0 = leaves[0][i]
        mine = [p[i] for p in leaves]
        shards = [a for x in mine for a in x._arrays]  # each part is one domain's: all its buffers
        g = _make(x0.shape, sh, shards)
        try:
            setattr(g, _PARTS, {d.key: x for d, x in zip(doms, mine)})
        except AttributeError:  # an array type without attributes of its own: _view builds views
            pass
        out.append(g)
    return jax.tree.unflatten(treedef, out)
