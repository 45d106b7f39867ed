"""Protection and recovery: peer copies at a cadence, slice failure, rebuild, continue.

`Guard` is what `ResilientStep` delegates to when peer protection is on. It owns:

- the compiled step variants for the current mesh: plain, and with the peer copy as
  extra outputs (`_peers.make_copies`), gradient-accumulated (`_elastic`) once the mesh
  has shrunk;
- the newest `Snapshot` (one consistent step held across domains), the replay log of
  recorded optimizer inputs since that snapshot (`DeviceLog`: on device, ring-copied), and
  the host batches since the older of snapshot and checkpoint (for recompute);
- the cadence: a peer copy every step when its measured cost fits
  ``Config.overhead_budget``, otherwise every ``k`` steps (``Config.peer_every`` forces k);
- recovery: detect, plan (per leaf: live replica -> peer copy -> checkpoint), restore
  onto the mesh without the failed domains, compile, replay/recompute forward, and an
  `Event` (kind ``recovery``) with what failed, sources, bytes and seconds per phase.

Consistency. A live leaf and its peer copy are outputs of one program, so they are of the
same step; the input state is donated, but nothing needs it: a failure during step
``n+1`` is handled after the in-flight step finished on the survivors (emulating "the
others finished it"), so recovery targets step ``n+1`` from the survivors' outputs. The
log entry of a step (on device, ring-copied: `DeviceLog`) becomes durable when the next
call starts; an entry still in flight when a domain dies is lost with it, and that step
is recomputed from its retained batch (counted in ``steps_recomputed``; not bitwise).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.step import elastic as _elastic
from resilax._src.protect import ring as _peers
from resilax._src.errors import StateLostError, WrapError
from resilax._src.runtime.faults import register_kind
from resilax._src.runtime.health import Liveness

CALIBRATION_STEPS = 8  # timed steps (half with, half without the copy) when Config.peer_every == 0


class LogEntry(NamedTuple):
    """One step's recorded optimizer inputs, on device: the values in their parameter's
    sharding (``rec``, flat leaves) and their packed ring copy (``packed``, held by the next
    domain; see `_peers.RingPack`)."""

    rec: list
    packed: tuple
    pack: Any  # _peers.RingPack or None (nothing lives in one domain only)
    shardings: list
    treedef: Any


class DeviceLog:
    """Recorded optimizer inputs per step since the last peer copy, kept in device memory.

    Each entry is an output of the step program itself: the recorded values stay where
    the step put them, and a packed ring copy (one collective-permute per dtype, inside
    the program, overlapped by XLA) puts every shard that lives in one domain on the next
    domain too, exactly like the state's peer copy. No device-to-host copy, no host thread:
    the previous stand-in (numpy copies in the controller) cost 2.2-4.6 ms per step here.

    ``append`` holds a step's entry as pending; ``settle`` (when the next call starts:
    the step finished) makes it durable. ``drop_pending`` (on a failure) gives up the entry
    of the step in flight: it is recomputed from its batch, as before. Durable entries die
    shard by shard with their domain (`Guard.fail_domain` deletes them like everything
    else); recovery reads a lost shard from its ring holder (`Guard._log_values`).
    """

    def __init__(self):
        self.entries: dict[int, LogEntry] = {}
        self.pending: dict[int, LogEntry] = {}

    def append(self, step: int, entry: LogEntry) -> None:
        self.pending[step] = entry

    def settle(self) -> None:
        if self.pending:
            self.entries.update(self.pending)
            self.pending.clear()

    def drop_pending(self) -> list:
        arrays = _peers.tree_arrays(*[(e.rec, e.packed) for e in self.pending.values()])
        self.pending.clear()
        return arrays

    def arrays(self) -> list:
        return _peers.tree_arrays(*[(e.rec, e.packed) for e in self.entries.values()])

    def drop_through(self, step: int) -> None:
        for s in [s for s in self.entries if s <= step]:
            del self.entries[s]

    def durable_run(self, start: int) -> list[int]:
        """Steps ``start+1, start+2, ...`` with durable entries, up to the first gap."""
        out, s = [], start + 1
        while s in self.entries:
            out.append(s)
            s += 1
        return out

    def clear(self) -> None:
        self.entries.clear()
        self.pending.clear()

    def close(self) -> None:
        self.clear()


class Guard:
    """Peer protection and recovery for one `ResilientStep` (created by its ``init``)."""

    def __init__(self, rs, state):
        self.rs = rs
        topo = rs.topology
        self.axis = topo.elastic_axis
        self.all_domains = [list(d) for d in rs._domains]
        self.alive = list(range(len(self.all_domains)))  # original domain indices still alive
        self.full_domains = len(self.all_domains)
        self.liveness = Liveness()
        self.log = DeviceLog()
        self.batches: dict[int, Any] = {}
        self.last_ckpt_step = rs.step
        self.snap: _peers.Snapshot | None = None
        self.live = None
        self.live_step = rs.step
        self.k = rs.config.peer_every if rs.config.peer_every > 0 else None
        self._calib: dict[str, list[float]] = {"base": [], "log": [], "copy": []}
        self._calib_i = 0
        self._failures: list[dict] = []
        self._bufs: dict = {}
        self._held: list = []
        self._ahead: dict = {}  # survivors tuple -> mesh attributes with compiled executables
        self._ahead_done = not rs.config.compile_ahead
        self._recovering = False
        self._zero_batch = None  # zeros shaped like a batch: compile ahead, replay's unused batch argument
        self._abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
        self._set_mesh(rs.mesh, m=1)

    # ------------------------------------------------------------------ mesh-dependent parts
    def _set_mesh(self, mesh, m: int):
        from resilax._src.step.driver import resolve_shardings

        self.mesh = mesh
        self.m = m
        specs, self.respecified = _elastic.fit_specs(self.rs._state_spec, self._abstract, mesh, self.axis)
        self.shardings = resolve_shardings(specs, self._abstract, mesh, "state_sharding")
        self.places = _peers.placement(self.shardings, self.axis)
        # Copies (and the log between them) are needed only for leaves that live in one domain:
        # state replicated across the elastic axis is its own backup, at no per-step cost.
        self.protect = mesh.shape[self.axis] > 1 and _peers.RING in jax.tree.leaves(self.places)
        self.replicas_only = mesh.shape[self.axis] > 1 and not self.protect
        self._fns: dict = {}
        self._batch_sh = None
        self._upd = None
        self._recmeta = None
        self._copy_only = jax.jit(
            lambda s: _peers.make_copies(s, self.shardings, self.places, self.axis, True),
            in_shardings=(self.shardings,),
        )

    _MESH_ATTRS = ("mesh", "m", "shardings", "places", "protect", "replicas_only", "_fns", "_batch_sh", "_upd", "_copy_only",
                   "respecified", "_recmeta")

    def _compile_mesh(self, with_update: bool) -> None:
        """Compiles the current mesh's executables: plain, with copy, copy-only, update."""
        self._batch_sh = self._batch_shardings(self._zero_batch)
        for key in self._variants():
            self._fn(*key)
        abs_s = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                             self._abstract, self.shardings)
        if self.protect and not hasattr(self._copy_only, "input_shardings"):
            self._copy_only = self._copy_only.lower(abs_s).compile()
        if with_update and self._upd is None:
            abs_b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._zero_batch)
            u32 = jax.ShapeDtypeStruct((), np.uint32)
            abs_rec = jax.eval_shape(self.rs._split.grad, self._abstract, abs_b, u32)[0]
            rep = NamedSharding(self.mesh, P())
            abs_rec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), abs_rec)
            self._upd = jax.jit(self.rs._split.update, in_shardings=(self.shardings, None, None, rep)).lower(
                abs_s, abs_b, u32, abs_rec).compile()

    def compile_ahead(self) -> float:
        """Compiles the executables of every mesh one more domain loss would leave.

        Costs one set of compiles per surviving domain, now, instead of during recovery.
        Returns the seconds spent.
        """
        t0 = time.perf_counter()
        saved = {a: getattr(self, a) for a in self._MESH_ATTRS}
        try:
            for lost in self.alive:
                survivors = tuple(i for i in self.alive if i != lost)
                if not survivors or survivors in self._ahead:
                    continue
                mesh = self.rs.topology.mesh([self.all_domains[i] for i in survivors])
                self._set_mesh(mesh, self._microbatches(self._zero_batch, mesh))
                self._compile_mesh(with_update=True)
                self._ahead[survivors] = {a: getattr(self, a) for a in self._MESH_ATTRS}
        finally:
            for a, v in saved.items():
                setattr(self, a, v)
        return time.perf_counter() - t0

    @property
    def ring_leaves(self) -> list[str]:
        flat = jax.tree_util.tree_flatten_with_path(self.places)[0]
        return [jax.tree_util.keystr(p) for p, v in flat if v == _peers.RING]

    def _batch_shardings(self, batch):
        from resilax._src.step.driver import resolve_shardings

        if self.m == 1:
            return resolve_shardings(self.rs._batch_spec, batch, self.mesh, "batch_sharding")
        mb = _elastic.split_batch(batch, self.m)
        return resolve_shardings(_elastic.microbatch_specs(self.rs._batch_spec), mb, self.mesh, "batch_sharding")

    @property
    def _log_on(self) -> bool:
        """Recorded values are logged between copies (cadence k > 1, or not chosen yet).
        At k == 1 every step is copied: there is nothing between copies to replay."""
        return self.protect and (self.k is None or self.k > 1)

    def _variants(self) -> list[tuple[bool, bool, bool]]:
        """The (copy, local, log) step programs the current cadence runs (and recovery's
        recompute: the log step, its entry unused)."""
        if not self.protect:
            return [(False, False, False)]
        if self.k == 1:
            return [(False, False, False), (True, False, False)]
        return [(False, False, True), (True, True, False)]

    def _rec_meta(self):
        """(treedef, shardings, ring pack) of the recorded values on the current mesh: each
        leaf in its parameter's sharding (`_guard.recorded_shardings`), ring-copied packed."""
        if self._recmeta is None:
            from resilax._src.protect.legacy_guard import recorded_shardings

            abs_b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._zero_batch)
            abs_rec = jax.eval_shape(self.rs._split.grad, self._abstract, abs_b,
                                     jax.ShapeDtypeStruct((), np.uint32))[0]
            leaves, treedef = jax.tree.flatten(abs_rec)
            shs = jax.tree.leaves(recorded_shardings(self._abstract, self.shardings, abs_rec, self.mesh))
            pack = _peers.ring_pack_layout([x.shape for x in leaves], [x.dtype for x in leaves], shs,
                                           jax.tree.leaves(_peers.placement(shs, self.axis)), self.axis)
            self._recmeta = (treedef, shs, pack)
        return self._recmeta

    def _fn(self, copy: bool, local: bool, log: bool, donate: bool = True):
        key = (copy, local, log, donate)
        if key not in self._fns:
            split, m = self.rs._split, self.m
            core = _elastic.accumulate(split, m) if m > 1 else split.full
            shardings, places, axis = self.shardings, self.places, self.axis
            # The log entry: the recorded values in their parameter's sharding plus their
            # packed ring copy. State replicated across domains is its own backup and needs
            # neither them nor the batches; copy steps need no entry (the copy covers them).
            treedef, rec_sh, pack = self._rec_meta() if log else (None, None, None)

            def fn(state, batch, step_no):
                new_state, metrics, rec = core(state, batch, step_no)
                new_state = jax.lax.with_sharding_constraint(new_state, shardings)
                loc, ring = _peers.make_copies(new_state, shardings, places, axis, local) if copy else (None, None)
                entry = None
                if log:
                    leaves = jax.lax.with_sharding_constraint(jax.tree.leaves(rec), rec_sh)
                    entry = (leaves, _peers.ring_pack(leaves, pack) if pack is not None else ())
                return new_state, metrics, entry, loc, ring

            rep = NamedSharding(self.mesh, P())
            jitted = jax.jit(
                fn,
                in_shardings=(self.shardings, self._batch_sh, rep),
                donate_argnums=(0,) if self.rs.config.donate_state and donate else (),
            )
            # Compiled once, called directly: recovery compiles ahead and the step reuses it.
            mb = _elastic.split_batch(self._zero_batch, m) if m > 1 else self._zero_batch
            abs_b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mb)
            abs_s = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                 self._abstract, self.shardings)
            # outside recovery a compile is goodput's `compile`; inside, recovery's compile phase
            span = contextlib.nullcontext() if self._recovering else self.rs.goodput_recorder.span("compile")
            with span:
                self._fns[key] = jitted.lower(abs_s, abs_b, jax.ShapeDtypeStruct((), np.uint32)).compile()
        return self._fns[key]

    # ------------------------------------------------------------------ failure-free path
    def attach(self, state):
        """Takes the placed initial state; makes the first snapshot (so step 0 is covered)."""
        self.live, self.live_step = state, self.rs.step
        self._snapshot_now(state)
        return state

    def _live_snapshot(self, step):
        """The live state itself is the consistent copy (every leaf is on every domain)."""
        return _peers.Snapshot(step, self.mesh, self.shardings, None, jax.tree.map(lambda _: None, self.shardings))

    def _snapshot_now(self, state):
        if not self.protect:
            self.snap = self._live_snapshot(self.live_step) if self.replicas_only else None
            return
        local, ring = self._copy_only(state)
        self.snap = _peers.Snapshot(self.live_step, self.mesh, self.shardings, local, ring)
        self.log.drop_through(self.live_step)

    def before_call(self):
        """Start of a call: earlier log entries become durable (their transfers are done)."""
        self.log.settle()

    def note_checkpoint(self, step: int):
        self.last_ckpt_step = step
        self._trim_batches()

    def _trim_batches(self):
        """Keeps the batches since the older of the last copy and the last checkpoint."""
        floor = self.snap.step if self.snap is not None else self.live_step
        if self.rs._ckpt is not None:
            floor = min(floor, self.last_ckpt_step)
        for s in [s for s in self.batches if s <= floor]:
            del self.batches[s]

    def _plan_copy(self, n_after: int) -> tuple[bool, bool, bool]:
        """(copy, local, timed) for the step that produces state ``n_after``."""
        if not self.protect:
            return False, False, False
        if self.k is None:
            i = self._calib_i
            self._calib_i += 1
            if i < 2 + CALIBRATION_STEPS:  # two warm-up steps (compiles), then alternate
                return i % 2 == 1, True, i >= 2
            self._choose_k()
        if self.k == 1:
            return True, False, False
        return n_after % self.k == 0, True, False

    def _choose_k(self):
        """The cadence from the calibration: ``base`` (no copy, no log), ``log`` (the log
        entry, every step between copies) and ``copy`` (copy + local copy) step times.

        Overhead at cadence k: ``copy`` at k == 1 (no log), else ``(log (k-1) + copy) / k``
        where ``log`` and ``copy`` are the extra seconds over ``base``. The smallest k that
        fits the budget; when the log alone exceeds it no k does, and k keeps the copy's
        share within the budget (the log's cost is then the floor; the event says so).
        """
        base = statistics.median(self._calib["base"])
        log = max(0.0, statistics.median(self._calib["log"]) - base)
        copy = max(0.0, statistics.median(self._calib["copy"]) - base)
        budget = self.rs.config.overhead_budget * base
        if copy <= budget or copy <= log:
            self.k = 1
        elif log < budget:
            self.k = min(10_000, math.ceil((copy - log) / max(budget - log, 1e-12)))
        else:
            self.k = min(10_000, math.ceil((copy - log) / max(budget, 1e-12)))
        self.k = max(self.k, 1)
        over = copy if self.k == 1 else (log * (self.k - 1) + copy) / self.k
        _, rec_sh, pack = self._rec_meta()
        self.rs._event(
            "peer_cadence", self.rs.step, every=self.k, step_s=base, copy_cost_s=copy, log_cost_s=log,
            expected_overhead=over / base if base else None, meets_budget=over <= budget * (1 + 1e-9),
            budget=self.rs.config.overhead_budget, ring_leaves=self.ring_leaves,
        )

    def step(self, state, batch):
        """Dispatches one step; may fire ``mid_step``/``during_peer_copy`` and recover."""
        rs = self.rs
        n_after = rs.step + 1
        if self._zero_batch is None:
            self._zero_batch = jax.tree.map(lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), batch)
        if not self._ahead_done and (self.k is not None or self.rs.config.peer_every) and self.protect:
            self._ahead_done = True
            rs._event("compile_ahead", rs.step, seconds=self.compile_ahead(),
                                   meshes=[list(k) for k in self._ahead])
        copy, local, timed = self._plan_copy(n_after)
        if self._batch_sh is None:
            self._batch_sh = self._batch_shardings(batch)
        host_batch = batch
        dev_batch = _elastic.split_batch(batch, self.m) if self.m > 1 else batch
        dev_batch = jax.device_put(dev_batch, self._batch_sh)
        if self.protect:
            self.batches[n_after] = host_batch
        t0 = time.perf_counter()
        log = self._log_on and not copy
        if timed and not copy:  # calibration: the same step without the log (a throwaway run, not donated)
            t0 = time.perf_counter()
            jax.block_until_ready(self._fn(False, False, False, donate=False)(state, dev_batch, np.uint32(rs.step)))
            self._calib["base"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        new_state, metrics, rec, loc, ring = self._fn(copy, local, log)(state, dev_batch, np.uint32(rs.step))
        if timed:
            jax.block_until_ready((new_state, rec, loc, ring))
            self._calib["copy" if copy else "log"].append(time.perf_counter() - t0)
        self.live, self.live_step = new_state, n_after
        if self.replicas_only:
            self.snap = self._live_snapshot(n_after)
        elif copy:
            self.snap = _peers.Snapshot(n_after, self.mesh, self.shardings, loc, ring)
            self.log.drop_through(n_after)
            self._trim_batches()
        elif rec is not None and self.protect:
            treedef, shs, pack = self._rec_meta()
            self.log.append(n_after, LogEntry(rec[0], rec[1], pack, shs, treedef))
        if rs.faults:
            rs.faults.fire("mid_step", rs.step, rs)
            if copy:
                rs.faults.fire("during_peer_copy", rs.step, rs)
        if self.pending:
            new_state = self.recover(new_state)
        return new_state, metrics

    # ------------------------------------------------------------------ failure
    @property
    def pending(self) -> bool:
        return bool(self._failures)

    def fail_domain(self, domain: int, phase: str) -> dict:
        """Emulates losing failure domain ``domain`` (original index): its buffers die.

        Blocks on in-flight work first (the surviving domains finish the step; deleting a
        buffer a running computation reads can crash the process), then deletes every
        buffer resilax holds on the domain's devices (live state, snapshot, peer copies,
        log entries still in flight) and marks the devices dead. Nothing is dispatched to
        them again: the next mesh excludes them.
        """
        if not 0 <= domain < len(self.all_domains):
            raise WrapError(
                f"resilax fail_slice: target must be a failure domain index in [0, {len(self.all_domains)}), "
                f"but got {domain}"
            )
        if not self._failures:  # first failure since the last recovery: map what we hold
            held = _peers.tree_arrays(self.live)
            if self.snap is not None:
                held += _peers.tree_arrays(self.snap.local, self.snap.ring)
            held += self.log.arrays() + self.log.drop_pending()
            jax.block_until_ready(held)
            self._bufs = {id(a): _peers.buffers(a) for a in held}
            self._held = held  # keeps ids stable while the maps are in use
        dead = set(self.all_domains[domain])
        freed = _peers.delete_on(self._bufs.values(), dead)
        self.liveness.mark_dead(domain, dead)
        info = {"domain": domain, "phase": phase, "devices": sorted(d.id for d in dead), "bytes_deleted": freed,
                "at": time.perf_counter()}
        self._failures.append(info)
        return info

    def recover(self, state_arg=None):
        """Rebuilds the state after a domain loss (see `_recover`); its time is goodput's `recovery`."""
        self._recovering = True
        try:
            with self.rs.goodput_recorder.span("recovery"):
                return self._recover(state_arg)
        finally:
            self._recovering = False

    def _recover(self, state_arg=None):
        """Rebuilds the state at the newest step a survivor completed, on the smaller mesh.

        Returns the rebuilt state (at ``self.rs.step`` after the caller's bookkeeping).

        Raises:
          StateLostError: some leaf has no surviving copy and no checkpoint (plus retained
            batches) can restore it; or no domain survives.
        """
        rs = self.rs
        failures, self._failures = self._failures, []
        t_fail = min(f["at"] for f in failures)
        t0 = time.perf_counter()
        # -- detect
        cur = [self.all_domains[i] for i in self.alive]
        dead_pos = self.liveness.probe(cur)
        failed = [self.alive[i] for i in dead_pos]
        survivors = [i for i in self.alive if i not in failed]
        t_detect = time.perf_counter()
        dead = self.liveness.dead
        if not survivors:
            raise StateLostError(
                f"resilax: every failure domain is lost ({[f['domain'] for f in failures]}); nothing survives to "
                f"restore the state of step {self.live_step}"
                + (f"; the newest checkpoint is {rs._ckpt.steps()[-1]} in {str(rs._ckpt.directory)!r}"
                   if rs._ckpt is not None and rs._ckpt.steps() else "")
            )
        # -- plan
        snap = self.snap
        picks, lost, kinds = self._plan(snap, dead) if snap is not None else (None, ["<all: no snapshot>"], {})
        t_plan = time.perf_counter()
        # -- restore (onto the mesh without the failed domains)
        new_mesh = rs.topology.mesh([self.all_domains[i] for i in survivors])
        batch_example = self._zero_batch
        m = self._microbatches(batch_example, new_mesh) if batch_example is not None else max(
            1, math.ceil(self.full_domains / len(survivors)))
        old_live_step = self.live_step
        self.alive = survivors
        ahead = self._ahead.pop(tuple(survivors), None)
        self._ahead.clear()  # compiled for the old set of survivors
        if ahead is not None:
            for a, v in ahead.items():
                setattr(self, a, v)
            new_mesh, m = self.mesh, self.m
        else:
            self._set_mesh(new_mesh, m)
        bytes_moved = 0
        source = "peer"
        if not lost:
            new_state, bytes_moved, bytes_peer = self._restore(snap, picks)
            start = snap.step
        else:
            source = "checkpoint"
            new_state, start = self._restore_checkpoint(lost, failed)
            bytes_peer = 0
            kinds = {p: "checkpoint" for p in kinds} if kinds else {"<state>": "checkpoint"}
        t_restore = time.perf_counter()
        # -- compile the degraded mesh's executables (plain, with copy)
        log_run = self.log.durable_run(start) if source == "peer" else []
        if batch_example is not None:
            self._compile_mesh(with_update=bool(log_run))
        upd = self._upd if log_run else None
        t_compile = time.perf_counter()
        # -- replay logged steps (bitwise), then recompute steps without a durable entry
        replayed = recomputed = 0
        if upd is not None:
            for s in log_run:
                if s > old_live_step:
                    break
                host = self._log_values(self.log.entries[s], dead)
                if host is None:  # a shard and its ring copy both lost: recompute from here
                    break
                rec = jax.device_put(host, NamedSharding(new_mesh, P()))
                new_state = upd(new_state, batch_example, np.uint32(s - 1), rec)
                start = s
                replayed += 1
        for s in range(start + 1, old_live_step + 1):
            if s not in self.batches:
                raise StateLostError(
                    f"resilax: recovered state of step {start} but cannot reach step {old_live_step}: the batch of "
                    f"step {s} is no longer retained and its replay-log entry was lost with the failed domain"
                )
            mb = _elastic.split_batch(self.batches[s], m) if m > 1 else self.batches[s]
            new_state, _, _, _, _ = self._fn(False, False, self._log_on)(new_state, jax.device_put(mb, self._batch_sh),
                                                           np.uint32(s - 1))
            recomputed += 1
        jax.block_until_ready(new_state)
        t_replay = time.perf_counter()
        self.live, self.live_step = new_state, old_live_step
        self._bufs, self._held = {}, []  # drop every reference to the dead arrays
        self.snap = None
        self.log.clear()
        self._snapshot_now(new_state)
        if not self.protect:
            warnings.warn(
                f"resilax: after losing domain(s) {failed} only one failure domain is left; there are no peers to "
                f"hold copies, so a further failure is recoverable only from checkpoints",
                RuntimeWarning, stacklevel=3,
            )
        rs.mesh = new_mesh
        rs._state_sh = self.shardings
        rs._event(
            "recovery", old_live_step,
            failed_domains=failed, failed_devices=sorted(d.id for d in dead),
            phases_failed=[f["phase"] for f in failures], source=source,
            detected_s=t_detect - t_fail, restored_step=old_live_step - replayed - recomputed,
            target_step=old_live_step,
            sources=_group(kinds), bytes_moved=bytes_moved, bytes_from_peers=bytes_peer,
            seconds={"detect": t_detect - t0, "plan": t_plan - t_detect, "restore": t_restore - t_plan,
                     "compile": t_compile - t_restore, "replay": t_replay - t_compile},
            steps_replayed=replayed, steps_recomputed=recomputed, lost_steps=recomputed,
            mesh=dict(new_mesh.shape), microbatches=m, replicated_across_domains_now=self.respecified,
            compiled_ahead=ahead is not None,
        )
        return new_state

    def close(self) -> None:
        self.log.close()

    def _microbatches(self, batch, mesh) -> int:
        from resilax._src.step.driver import resolve_shardings

        shs = resolve_shardings(self.rs._batch_spec, batch, mesh, "batch_sharding")
        size = 1
        for sh in jax.tree.leaves(shs):
            spec = sh.spec
            first = spec[0] if len(spec) else None
            axes = first if isinstance(first, tuple) else (first,)
            size = math.lcm(size, math.prod(mesh.shape[a] for a in axes if a is not None))
        bsz = np.shape(jax.tree.leaves(batch)[0])[0]
        return _elastic.microbatch_count(bsz, self.full_domains, mesh, size)

    def _plan(self, snap, dead):
        """Per leaf, per distinct shard index: a surviving source. Returns (picks, lost, kinds)."""
        local = snap.local if snap.local is not None else self.live
        if snap.local is None and snap.step != self.live_step:
            return None, ["<all: stale snapshot>"], {}
        flat_l, treedef = jax.tree_util.tree_flatten_with_path(local)
        flat_r = treedef.flatten_up_to(snap.ring)
        flat_s = treedef.flatten_up_to(snap.shardings)
        flat_p = treedef.flatten_up_to(self.places if snap.mesh is self.mesh else _peers.placement(snap.shardings, self.axis))
        picks, lost, kinds = [], [], {}
        for (path, arr), ring, sh, place in zip(flat_l, flat_r, flat_s, flat_p):
            name = jax.tree_util.keystr(path)
            by_index: dict = {}
            for dev, idx in sh.devices_indices_map(arr.shape).items():
                by_index.setdefault(_key(idx), (idx, []))[1].append(dev)
            leaf, used = [], set()
            for idx, devs in by_index.values():
                alive = [d for d in devs if d not in dead]
                if alive:
                    kind = "live" if snap.local is None else "snapshot"
                    leaf.append((idx, arr, alive[0], kind))
                    used.add(kind)
                    continue
                holders = [_peers.ring_holder(snap.mesh, d, self.axis) for d in devs] if place == _peers.RING else []
                alive_h = [h for h in holders if h not in dead]
                if alive_h:
                    leaf.append((idx, ring, alive_h[0], "peer"))
                    used.add("peer")
                    continue
                lost.append(name)
                break
            picks.append(leaf)
            kinds[name] = "+".join(sorted(used))
        return picks, lost, kinds

    def _log_values(self, entry: LogEntry, dead):
        """Host copy of one step's recorded values from the survivors: each shard from a
        live holder, else from its ring holder's packed buffer. None if some shard is gone."""
        groups = [self._bufs[id(a)] for a in entry.packed]
        out = []
        for i, (x, sh) in enumerate(zip(entry.rec, entry.shardings)):
            bufs = self._bufs[id(x)]
            host = np.empty(x.shape, x.dtype)
            by_index: dict = {}
            for dev, idx in sh.devices_indices_map(x.shape).items():
                by_index.setdefault(_key(idx), (idx, []))[1].append(dev)
            for idx, devs in by_index.values():
                alive = [d for d in devs if d not in dead]
                if alive:
                    host[idx] = np.array(bufs[alive[0]], copy=True)
                    continue
                if entry.pack is None or entry.pack.slots[i] is None:
                    return None
                blk = next((b for b in (_peers.ring_block(entry.pack, groups, i, d) for d in devs) if b is not None),
                           None)
                if blk is None:
                    return None
                host[idx] = blk
            out.append(host)
        return jax.tree.unflatten(entry.treedef, out)

    def _restore(self, snap, picks):
        """Copies each picked surviving shard to host and places the leaf on the new mesh."""
        leaves, treedef = jax.tree.flatten(self._abstract)
        shs = treedef.flatten_up_to(self.shardings)
        out, moved, from_peer = [], 0, 0
        for ab, sh, leaf in zip(leaves, shs, picks):
            host = np.empty(ab.shape, ab.dtype)
            for idx, arr, dev, kind in leaf:
                data = np.array(self._bufs[id(arr)][dev], copy=True)  # a real copy: np.asarray can alias the buffer
                host[idx] = data
                moved += data.nbytes
                if kind == "peer":
                    from_peer += data.nbytes
            out.append(jax.device_put(host, sh))
        return jax.tree.unflatten(treedef, out), moved, from_peer

    def _restore_checkpoint(self, lost, failed):
        rs = self.rs
        where = (f"leaves {lost[:8]}{' ...' if len(lost) > 8 else ''} had every shard on the failed domain(s) "
                 f"{failed} and their peer copies were held by failed domains too")
        if rs._ckpt is None:
            raise StateLostError(
                f"resilax: state lost: {where}; no checkpoint can restore them (Config.checkpoint_dir is not set)"
            )
        rs._ckpt.wait()
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                self._abstract, self.shardings)
        restored = rs._ckpt.restore_newest(abstract)
        if restored is None:
            raise StateLostError(f"resilax: state lost: {where}; the checkpoint directory "
                                 f"{str(rs._ckpt.directory)!r} holds no checkpoint")
        missing = [s for s in range(restored.step + 1, self.live_step + 1) if s not in self.batches]
        if missing:
            raise StateLostError(
                f"resilax: state lost: {where}; the newest good checkpoint is step {restored.step} in "
                f"{str(rs._ckpt.directory)!r} but the batches of steps {missing[:5]} to replay from it are gone"
            )
        return restored.state, restored.step


def _key(idx):
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in idx)


def _group(kinds: dict) -> dict:
    out: dict = {}
    for leaf, kind in kinds.items():
        out.setdefault(kind or "none", []).append(leaf)
    return out


def _fail_slice(fault, ctx):
    guard = getattr(ctx, "_peers", None)
    if guard is None:
        raise WrapError(
            "resilax fault fail_slice: the step has no peer protection (Config.peers=False or init() not called); "
            "failing a slice needs resilax's own bookkeeping of what lives where"
        )
    if fault.target is None:
        raise WrapError("resilax fault fail_slice needs a target slice: fail_slice@STEP[:phase]/SLICE")
    guard.fail_domain(fault.target, fault.phase)


register_kind("fail_slice", _fail_slice)
