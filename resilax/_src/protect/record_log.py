"""The record log: one entry per step, ``(step, recorded values or data position, verdict,
checksum)``, with three sinks.

- **device**: between peer copies, each step's recorded values stay where the grad part
  put them and their packed ring copy is on the next domain (both outputs of the grad
  executable): a domain loss leaves every shard somewhere. Dropped when a peer copy covers
  the step; capped by ``LogConfig.device_bytes`` (past it the next step makes a copy).
- **host**: the batches since the newest checkpoint or peer copy (whichever is older), so
  a step whose device entry died can be recomputed, whatever the layout; and each step's
  verdict and watched value (replicated device scalars; host copies after a recovery):
  every redo of a step, from any source, is gated by its recorded verdict.
- **disk** (`disk_log.DiskLog`, when a directory is known): grads or inputs entries
  written in the background and checksummed (sha256); a restart replays them. In a job of
  several processes (`resilax launch`) process 0 writes it (inputs entries only: no process
  holds every shard of the recorded values) and every process replays it. Without a
  data iterator an inputs entry carries the step's batch (when it is no larger than the
  recorded values; else every step gets a grads entry), so that every step stays
  replayable while most steps pay for a batch, not for their gradients.

One replay (`ResilientStep._redo`) serves slice recovery and crash resume.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import numpy as np

from resilax._src.protect import base
from resilax._src.protect.planner import LogStep
from resilax._src.protect.checksum import anchor_tree, tree_checksums
from resilax._src.protect.disk_log import DiskLog, SelectivePolicy, batch_signature, packed_layout


@dataclasses.dataclass
class DeviceEntry:
    rec: list  # recorded leaves (device arrays), or the `Program.rec_layout` buffers holding them
    ring: Any  # tuple of packed buffers, or None
    program: Any
    nbytes: int


def _writes() -> bool:
    """Whether this process writes the disk log: the only one, or process 0 of a job."""
    return jax.process_count() == 1 or jax.process_index() == 0


def local(x):
    """A replicated device value as one that this process can read (its first shard); others
    as they are."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


class RecordLog(base.Protection):
    name = "log"

    def __init__(self, cfg, directory: str | None, *, peers: bool, checksums=None):
        """``checksums``: the checkpoint store's (`CheckpointStore.checksums`: anchors then use
        its program, compiled once for the tree a checkpoint saves, which is the anchor's);
        None without checkpoints."""
        self.cfg = cfg
        self.peers = peers
        self.checkpoints = checksums is not None
        self.device: dict[int, DeviceEntry] = {}
        self.pending: dict[int, DeviceEntry] = {}  # in flight: dies with a failure during its step
        self.verdicts: dict[int, tuple] = {}  # step -> (verdict, value) device scalars
        self._entry_bytes = weakref.WeakKeyDictionary()  # program -> bytes of one device entry
        self._carry = weakref.WeakKeyDictionary()  # program -> whether inputs entries carry the batch
        self._layouts = weakref.WeakKeyDictionary()  # program -> a packed grads entry's layout (JSON)
        self.batches: dict[int, Any] = {}
        self.covered = 0  # newest step a peer copy holds
        self.ckpt_step = None  # newest checkpoint step
        self.now = 0  # steps completed
        self.disk = DiskLog(directory, policy=SelectivePolicy(cfg.budget_bytes), max_lag=cfg.max_lag,
                            writes=_writes) if directory else None
        self._batch_sig = None
        self._anchor = None  # (step, device checksums of anchor_tree(state, guard) at that step)
        self.sums = checksums or tree_checksums  # how anchors are checksummed: tree -> [n, 2]
        self._credit = 0.0  # grads_budget's token bucket (seconds of writer time)
        self.grads_entries = 0  # steps given a grads entry / only an inputs entry (grads mode)
        self.inputs_only = 0
        self._step_time = 0.0  # summed step times seen by the bucket
        self._probe_charged = False

    # ---------------------------------------------------------------- failure-free
    def anchor(self, step: int, state, guard, *, defer: bool = False) -> None:
        """Step ``step`` is where a restart may resume (the start, or a checkpoint): its disk
        entry carries the checksums of the state it starts from, so a resume onto any other
        state is refused instead of replaying the log onto it. ``defer``: the caller promises
        these buffers are not donated, so the log's writer thread computes the checksums
        (off the loop) instead of this one."""
        if self.disk is not None:
            tree = anchor_tree(state, guard)
            # several processes: every one runs the checksum program (a collective), now
            defer = defer and jax.process_count() == 1
            self._anchor = (step, tree if defer else self.sums(tree))

    def start(self, run, state):
        self.anchor(run.step, state, run._guard)
        self.device.clear()
        self.pending.clear()
        self.now = run.step
        self.covered = run.step if self.peers and run._program.protects else self.covered
        self._trim()

    def wants_log_ring(self, run, copy):
        return self.peers and copy is None and run._program.protects and run._peer_log_entries()

    def device_bytes(self) -> int:
        return sum(e.nbytes for e in self.device.values())

    def retained(self) -> dict:
        """What the log holds now: device entries (bytes) and host batches (steps, bytes)."""
        host = sum(np.asarray(x).nbytes for b in self.batches.values() for x in jax.tree.leaves(b))
        return {"device_log_bytes": self.device_bytes(), "host_batch_steps": sorted(self.batches),
                "host_batch_bytes": int(host)}

    def over_cap(self) -> bool:
        return self.cfg.device_bytes is not None and self.device_bytes() > self.cfg.device_bytes

    def settle(self) -> None:
        """The step in flight finished: its device entry is durable."""
        self.device.update(self.pending)
        self.pending.clear()

    def after_step(self, run, rec):
        self.settle()  # the previous step finished
        self.now = rec.step + 1
        if not rec.program.protects:
            # nothing lives in one domain only: the live state is its own copy on every
            # domain, so no step before this one is needed to rebuild it
            self.covered = self.now
        g = rec.gout
        self.verdicts[rec.step] = (g.ok, g.loss)
        # the log's own copy: the caller may reuse its buffers once the call returned, and a
        # recompute or a replay must run on the batch the step ran on (`LogConfig.copy_batches`)
        batch = rec.batch if not self.cfg.copy_batches else jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else np.array(x, copy=True), rec.batch)
        self.batches[rec.step] = batch
        if rec.copy is None and self.peers and rec.program.protects and run._peer_log_entries():
            leaves = [*g.rec[0], *g.rec[1]] if rec.program.rec_layout is not None else jax.tree.leaves(g.rec)
            nbytes = self._entry_bytes.get(rec.program)
            if nbytes is None:  # per program, not per step: the same shapes every step
                nbytes = sum(x.nbytes for x in leaves) + sum(x.nbytes for x in (g.rec_ring or ()))
                self._entry_bytes[rec.program] = nbytes
            self.pending[rec.step] = DeviceEntry(leaves, g.rec_ring, rec.program, nbytes)
        if self.disk is not None:
            if self._batch_sig is None:
                self._batch_sig = batch_signature(rec.batch)
            sums = None
            if self._anchor is not None and self._anchor[0] == rec.step:
                sums, self._anchor = self._anchor[1], None
            multi = jax.process_count() > 1  # no grads entries: no process holds every shard
            carry = run._data is None and (multi or self._carries_batch(rec.program))
            grads = not multi and self._take_grads(run, replayable=run._data is not None or carry)
            if self.disk.writes():
                recorded = packed = None
                if grads and rec.program.rec_layout is not None:  # as the values crossed: a few buffers
                    # the layout is made on the writer thread, once per program
                    packed = (lambda p=rec.program: self._layout(p), [*g.rec[0], *g.rec[1]])
                elif grads:
                    recorded = g.rec
                self.disk.append(rec.step, recorded=recorded, packed=packed, state_sums=local(sums),
                                 data_state=rec.data_before, data_next=rec.data_after, batch_sig=self._batch_sig,
                                 scalars={"verdict": local(g.ok), "value": local(g.loss), "copy": rec.copy},
                                 batch=jax.tree.leaves(batch) if carry else None)
        self._trim()

    def _layout(self, program) -> str:
        """A packed grads entry's layout (`disk_log.packed_layout`), made once per program."""
        got = self._layouts.get(program)
        if got is None:
            leaves = jax.tree_util.tree_flatten_with_path(program.abstract_rec)[0]
            got = packed_layout([jax.tree_util.keystr(p) for p, _ in leaves], [x.shape for _, x in leaves],
                                [x.dtype for _, x in leaves], jax.tree.leaves(program.rec_sh), program.rec_layout)
            self._layouts[program] = got
        return got

    def _carries_batch(self, program) -> bool:
        """Without a data iterator: whether this program's inputs entries carry the batch
        (``"inputs"`` mode: always; ``"grads"`` mode: when the batch is no larger than the
        recorded values, else a grads entry every step is the smaller replayable record)."""
        got = self._carry.get(program)
        if got is None:
            if self.cfg.mode == "inputs":
                got = True
            else:
                nbytes = lambda tree: sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
                                          for x in jax.tree.leaves(tree))
                got = nbytes(program.spec.abstract_batch) <= nbytes(program.abstract_rec)
            self._carry[program] = got
        return got

    def _take_grads(self, run, replayable: bool) -> bool:
        """Whether this step's disk entry carries its recorded values (`LogConfig.grads_budget`):
        a token bucket filled with ``budget x step time`` per step and drained by the
        measured cost of each grads entry. The first entry is written to measure that cost;
        until it is measured no other is. When its inputs entry cannot be replayed (no data
        iterator, and a batch larger than the recorded values) every step keeps its grads."""
        if self.cfg.mode != "grads":
            return False
        budget = self.cfg.grads_budget
        if budget is None or not replayable:
            self.grads_entries += 1
            return True
        # the last step's own time: a smoothed one still held the first step's compile many
        # steps later, and at 1% of a compile-inflated step every entry seemed paid for
        step_s = run._steady_dt or 0.0
        self._step_time += step_s
        cost = self.disk.grads_cost_s
        take = False
        if cost is None:
            take = self.grads_entries == 0  # the probe entry; the next ones wait for its cost
        else:
            if not self._probe_charged:  # the probe was taken on credit: pay it back first
                self._probe_charged, self._credit = True, -cost
            self._credit = min(self._credit + budget * step_s, max(cost, budget * step_s))
            if self._credit >= cost:
                self._credit -= cost
                take = True
        if take:
            self.grads_entries += 1
        else:
            self.inputs_only += 1
        return take

    def cadence(self) -> dict | None:
        """How the disk log kept to its budget: grads entries, inputs-only entries, the
        measured cost of one grads entry, and the share of step time they cost."""
        if self.disk is None or self.cfg.mode != "grads":
            return None
        cost = self.disk.grads_cost_s
        spent = self.disk.grads_cost_total_s
        share = spent / self._step_time if cost is not None and self._step_time else None
        return {"grads_entries": self.grads_entries, "inputs_only_entries": self.inputs_only,
                "grads_cost_s": cost, "budget": self.cfg.grads_budget, "share": share,
                "meets_budget": None if share is None or self.cfg.grads_budget is None
                else share <= self.cfg.grads_budget}

    def covered_through(self, step: int) -> None:
        """A peer copy holds state ``step``: device entries before it are not needed."""
        self.covered = step
        for s in [s for s in self.device if s < step]:
            del self.device[s]
        self._trim()

    def adopted(self, run, state, since: int) -> None:
        """Entries of steps after ``since`` were recorded from corrupted replicas: device
        entries and verdicts are dropped, disk entries quarantined (a resume from disk then
        stops at ``since`` and redoes the rest from the data, never replaying them). Batches
        stay: they are inputs, not results."""
        self.settle()
        for d in (self.device, self.verdicts):
            for s in [s for s in d if s > since]:
                del d[s]
        if self.disk is not None:  # waits for the entries in flight first
            self.disk.discard_from(since + 1, f"recorded from corrupted replicas after step {since}; the state was "
                                              f"rebuilt at step {run.step}")
        if self.peers and run._program.protects:
            self.covered = run.step  # the peers snapshot the adopted state (`Peers.adopted`)

    def checkpointed(self, step: int) -> None:
        self.ckpt_step = step
        self._trim()

    def _trim(self):
        """Batches and verdicts are kept from the oldest start a recovery may need: the
        newest checkpoint when there is one (the fallback when copies die), else the newest
        peer copy, else (no copies at all) only the live state's step. Bounded: at most the
        steps since the newest checkpoint or peer copy are held."""
        floors = [self.now]
        if self.peers:
            floors.append(self.covered)
        if self.checkpoints and self.ckpt_step is not None:
            floors.append(self.ckpt_step)
        floor = min(floors)
        for d in (self.batches, self.verdicts):
            for s in [s for s in d if s < floor]:
                del d[s]

    # ---------------------------------------------------------------- failure
    def held(self):
        out = []
        for e in list(self.device.values()) + list(self.pending.values()):
            out += [x for x in e.rec + list(e.ring or ()) if isinstance(x, jax.Array)]
        out += [x for v in self.verdicts.values() for x in v if isinstance(x, jax.Array)]
        return out

    def drop_pending(self) -> list:
        """The entry of the step in flight dies with the failure (its step is recomputed)."""
        dropped = [x for e in self.pending.values() for x in e.rec + list(e.ring or ())]
        self.pending.clear()
        return dropped

    def log_steps(self, run):
        out = {}
        steps = set(self.device) | set(self.batches)
        disk = set(self.disk.steps("grads")) | set(self.disk.steps("inputs")) if self.disk is not None else set()
        for s in sorted(steps):
            sources = []
            e = self.device.get(s)
            if e is not None:
                p = e.program
                shapes = [x.shape for x in jax.tree.leaves(p.abstract_rec)]
                arrays, packed = e.rec, None
                if p.rec_layout is not None:  # e.rec: the buffers, then the large leaves
                    ng = len(p.rec_layout.groups)
                    packed, big = (p.rec_layout, e.rec[:ng]), iter(e.rec[ng:])
                    arrays = [next(big) if s is None else None for s in p.rec_layout.slots]
                sources.append(("device", base.leaf_shards(arrays, jax.tree.leaves(p.rec_sh), shapes,
                                                          ring=(p.rec_pack, list(e.ring or [])), packed=packed)))
            if s in self.batches:
                sources.append(("batch", ()))
            elif s in disk:
                sources.append(("disk", ()))
            out[s] = LogStep(s, tuple(sources))
        return out

    def device_values(self, s: int, picks, bufmaps):
        e = self.device[s]
        leaves = jax.tree.leaves(e.program.abstract_rec)
        host, _ = base.assemble(picks, [x.shape for x in leaves], [x.dtype for x in leaves], bufmaps)
        return host

    def verdict(self, s: int, bufmaps):
        """Host ``(verdict, value)`` of step ``s`` from a surviving replica."""
        v = self.verdicts.get(s)
        if v is None:
            return None
        return tuple(None if x is None else _host_scalar(x, bufmaps) for x in v)

    def restart(self, run, state):
        """Device entries lived on the old mesh (partly deleted): dropped; the retained
        batches recompute any step a later recovery needs before the new start, gated by
        the verdicts, which are kept as host values (read from a surviving replica: they are
        replicated scalars, so any live domain has them)."""
        self.device.clear()
        self.pending.clear()
        self.verdicts = {s: tuple(None if x is None else np.array(run._host_replica(x), copy=True) for x in v)
                         for s, v in self.verdicts.items()}
        self.now = self.covered = run.step
        if self._anchor is not None:
            # an anchor deferred at a save still holds the old mesh's arrays, some of whose
            # buffers the failure deleted: checksumming them on the writer thread crashed the
            # process (campaign trial 172 of seed 0). The rebuilt state is bitwise the same,
            # so the anchor is taken again from it; one for another step cannot be.
            step = self._anchor[0]
            self._anchor = None
            if step == run.step:
                self.anchor(step, state, run._guard)
        self._trim()

    def close(self):
        if self.disk is not None:
            self.disk.close()


def _host_scalar(x, bufmaps):
    bufs = bufmaps.get(id(x))
    if bufs is None:
        return np.asarray(x)
    for b in bufs.values():
        if not b.is_deleted():
            return np.asarray(b)
    raise RuntimeError("every replica of a logged verdict is gone")
