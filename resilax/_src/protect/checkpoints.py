"""Checkpoints: the persistent tier. `CheckpointStore` (Orbax async checkpoints with checksums, and
newest-good restore) and `Checkpoints`, the protection that puts it in the pipeline: it saves every
``CheckpointConfig.every`` steps (state, anomaly detector state, data position, seed), offers the
newest good checkpoint to the planner, and tells the record log where it may be truncated.

Each checkpoint is one Orbax step directory (committed atomically: a temporary name, then
renamed) of three items: ``state`` (tensorstore arrays, sharded as they are), ``checksums``
(per leaf, computed on device) and ``meta`` (JSON: step, seed, data state, the state's
signature). A restore reads the newest, recomputes its checksums; one that cannot be read or
does not match is moved into ``quarantine/`` (never deleted) and the next older one tried,
with a warning that names both.

Saving is snapshot-then-persist (CheckFreq's split): the loop dispatches an on-device copy
(or hands the live state when the next step keeps its input); a persister thread computes
the checksums and hands the copy to Orbax, which copies it to host and writes it (its waits
are the persister's), then drops the device copy. Orbax's start-up and the programs'
compilation happen off the loop (`warm`; a save due earlier copies with the runtime's
buffer copy). The loop waits for a save only when it still writes as the next is due
(`in_flight`; booked and reported). ``PACK`` (the default): `packing`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import queue
import threading
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from resilax._src.protect.checksum import tree_checksums
from resilax._src import messages, quiet
from resilax._src.gil import shorter_switch_interval
from resilax._src.errors import CheckpointError, CorruptCheckpointError, StorageError, storage_error
from resilax._src.protect import orbax_warm, packing
from resilax._src.runtime import membership
from resilax._src.timings import Timings

FORMAT = 1
QUARANTINE = "quarantine"


def state_signature(tree) -> list[list]:
    """``[[path, shape, dtype], ...]`` of a pytree of arrays or ShapeDtypeStructs."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append([jax.tree_util.keystr(path), list(np.shape(x)), str(x.dtype)])
    return out


def _shards_built(tree):
    """``tree``, with every array's list of per-device shards built on this thread.

    jaxlib 0.10.2 builds an array's per-device buffers (``Array._arrays``, which
    ``addressable_shards`` reads) lazily, on first use; two threads doing that at once can
    see a part-built list, and ``addressable_shards`` then caches it for good. Orbax reads
    ``addressable_shards`` on the persister thread, and an uncopied save hands it the live
    state, which the loop reads at the same time (after a rejoin the cross-check's
    ``device_put`` of a fresh state raised "safe_zip() argument 1 has length 8 but argument
    0 has length 5": 5 of 8 shards cached). Built here, before the hand-off, both threads
    only read the finished lists. Costs one shard object per device and leaf, once.
    """
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            x.addressable_shards  # noqa: B018  built and cached on the array
    return tree


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict
    skipped: tuple[tuple[int, str], ...]  # (step, reason) of newer checkpoints that failed
    quarantined: tuple[str, ...] = ()  # where the failed ones were moved (never deleted)


# Orbax saves one checkpoint at a time per process: its operation id, which names the keys a
# save's threads signal each other with, is class-wide (`OperationIdGenerator`), so two saves
# overlapping from two threads raced in Orbax's directory creation ("100.orbax-checkpoint-tmp/
# meta.orbax-checkpoint-tmp/metadata: No such file or directory") or waited on each other's
# keys until Orbax's 300 s timeout ("Timeout waiting for key 'awaitable_signals_contract_2/
# step_directory_creation'": a bench's plain Orbax manager saving beside resilax's persister).
# Every Orbax call of every store holds this lock, for a save until it is committed; other
# Orbax saves in the process must too (`exclusive_orbax_save`).
ORBAX_LOCK = threading.RLock()
orbax_lock = ORBAX_LOCK  # public: `resilax.orbax_lock` (hold it around your own Orbax saves, to their commit)


def exclusive_orbax_save(mgr, step: int, args) -> tuple[float, float]:
    """``mgr.save(step, args=args)`` for a CheckpointManager of the caller's own beside
    resilax's checkpoints in one process (public: `resilax.exclusive_orbax_save`; the
    benches' plain Orbax baselines use it): holds
    `ORBAX_LOCK` from the save until it is committed. Returns ``(blocked, waited)``: the
    seconds ``save`` blocked the caller (what a plain Orbax user's loop pays) and the seconds
    spent waiting for the lock and the commit (not part of that; a caller timing its loop
    leaves them out)."""
    t0 = time.perf_counter()
    with ORBAX_LOCK:
        t1 = time.perf_counter()
        mgr.save(step, args=args)
        t2 = time.perf_counter()
        mgr.wait_until_finished()
    return t2 - t1, (t1 - t0) + (time.perf_counter() - t2)


def _snapshot_fn(tree):
    # jnp.copy of a non-donated input is a new buffer (XLA never aliases an output to an
    # input that was not donated), so the snapshot survives the next step's donation.
    return jax.tree.map(jnp.copy, tree)


_snapshot_jit = jax.jit(_snapshot_fn)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


abstract_of = _abstract  # (arrays or abstract arrays with shardings -> abstract arrays)


def _layout(sharding):
    """``sharding`` up to equivalence a compiled program accepts: a step's outputs carry
    ``P('fsdp', None)`` where the state it started from had ``P('fsdp')`` (unequal objects,
    the same layout), so a program compiled for one serves the other."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = list(sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        return ("named", sharding.mesh, tuple(spec), sharding.memory_kind)
    return sharding


def _layout_key(abstract):
    """The key of a program compiled for ``abstract`` (a tree of arrays or their abstract
    values): its structure and each leaf's shape, dtype and layout."""
    leaves, treedef = jax.tree.flatten(abstract)
    return treedef, tuple((x.shape, x.dtype, _layout(x.sharding)) for x in leaves)


class CheckpointStore:
    """Orbax ``CheckpointManager`` with checksums, newest-good restore, and saves that block
    the caller only for dispatching an on-device snapshot.

    Args:
      directory: checkpoint root (created if missing).
      keep: complete checkpoints kept by Orbax.
      async_save: persist in the background (the caller blocks only to dispatch the
        snapshot); ``False``: `save` returns once the checkpoint is committed.
      pack: packed saves (`packing`; None: ``PACK``, from ``RESILAX_PACK_CHECKPOINTS``).
      compress: zstd-compress the arrays written (Orbax's default).

    Thread-safety: every Orbax call runs under one process-wide lock; the persister thread makes
    the saves, the caller's thread everything else (after waiting for queued saves)."""

    #: the interpreter's switch interval while the persister saves (`gil.shorter_switch_interval`)
    SAVE_SWITCH_INTERVAL_S: float | None = 0.0005
    PINNED_HOST_TRANSFER: bool | None = None  #: Orbax's copy to host via pinned memory (None: Orbax's; on for GPU)
    #: packed saves (`packing`): on unless ``RESILAX_PACK_CHECKPOINTS=0``
    PACK: bool = os.environ.get("RESILAX_PACK_CHECKPOINTS", "1") != "0"

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
                 pack: bool | None = None, compress: bool = True, read_only: bool = False):
        self.directory = pathlib.Path(directory).absolute()
        self._compress = bool(compress)
        self._keep = keep
        self._async = async_save
        self._abandoned = False
        self._read_only = read_only  # `read_checkpoint`: nothing created, cleaned up or moved
        if read_only:
            if not self.directory.is_dir():
                raise CheckpointError(f"resilax: no checkpoint directory {str(self.directory)!r}")
        else:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StorageError(f"resilax checkpoints: cannot create checkpoint_dir {str(self.directory)!r}: {e}") from e
        self._mgr = self._open()
        quiet.own_directory(self.directory)  # Orbax's errors here reach the caller as resilax's own, once
        self.blocking_s = Timings()  # seconds the caller blocked per save
        self.persist_s = Timings()  # seconds from handing a snapshot to Orbax to its commit (persister thread)
        self.handoff_s = Timings()  # of which Orbax's save call: its copy to host (persister thread)
        self._lock = ORBAX_LOCK
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._handed = threading.Event()  # the queued snapshot is in Orbax's hands (or failed)
        self._compiled = None  # (`_layout_key`, compiled snapshot program)
        self._sums: dict = {}  # (tree structure, leaf layouts) -> compiled checksum program
        self._packers = packing.Packers()  # the same -> (manifest, compiled pack programs)
        self._pack = self.PACK if pack is None else pack  # (PACK read when the store is made)
        self._warming: threading.Thread | None = None
        self._warmers: list[threading.Thread] = []  # warm-ups not known to be finished
        self._deferred: list[Callable[[], None]] = []  # multi-process: after_commit chores
        self.last_step: int | None = None  # the newest save handed to the persister

    @contextlib.contextmanager
    def _orbax_call(self):
        """Around every Orbax call of the store: the process-wide lock, and Orbax's ERROR logs
        meanwhile to the debug log (`quiet.reporting`: what fails here, the store raises or
        reports itself, once)."""
        with self._lock, quiet.reporting():
            yield

    def _open(self):
        if self._read_only:  # a save in flight (another process's) keeps its temporary directory
            import logging

            opts = ocp.CheckpointManagerOptions(read_only=True, create=False, cleanup_tmp_directories=False,
                                                enable_async_checkpointing=False, save_interval_steps=0)
            notes = _ReadOnlyNotes()  # Orbax warns that a read-only manager is read-only: asked for here
            logging.getLogger("absl").addFilter(notes)
            try:
                mgr, self._array_handler = orbax_warm.manager(self.directory, opts, ("state", "checksums", "meta"),
                                                              self.PINNED_HOST_TRANSFER, compress=self._compress)
            finally:
                logging.getLogger("absl").removeFilter(notes)
            return mgr
        else:
            opts = ocp.CheckpointManagerOptions(
                max_to_keep=self._keep,
                enable_async_checkpointing=self._async,
                cleanup_tmp_directories=True,
                create=True,
            )
        mgr, self._array_handler = orbax_warm.manager(self.directory, opts, ("state", "checksums", "meta"), self.PINNED_HOST_TRANSFER,
                                                      compress=self._compress)
        return mgr

    # ------------------------------------------------------------------ warm-up
    def warm(self, tree, also: Callable[[], None] | None = None) -> None:
        """Compiles the snapshot and checksum programs for ``tree``'s shapes and shardings on a
        background thread (lowering and compiling are thread-safe), then ``also`` (the
        caller's own warm-up), so no save compiles on the loop."""
        abstract = _abstract(tree)
        if self._compiled is not None and self._compiled[0] == _layout_key(abstract) and also is None:
            return
        slices = orbax_warm.plan(tree, self._array_handler)  # (reads the live arrays: here, before the next step donates them)

        def compile_it():
            # the loop's own program first (a save due before it is ready copies without it), the
            # persister's checksums, the caller's (the update that keeps its input: until it is
            # ready a save copies instead), then what only the persister runs
            try:
                orbax_warm.warm_pinned(abstract, self.PINNED_HOST_TRANSFER is not False and self._async)  # (GPU)
                self._compiled = (_layout_key(abstract), _snapshot_jit.lower(abstract).compile())
                self._sums_program(abstract)  # (a start's anchor may have compiled it)
                if also is not None:
                    also()
                if self._pack:  # the pack programs (the leaves' slices above cover the single leaves)
                    self._packers.get(_layout_key(abstract), abstract)
                orbax_warm.run(slices)  # Orbax's own slice programs (replica-parallel saving)
            except Exception:  # a save copies without the program; the persister compiles the rest
                pass

        # Not a daemon, and `close` joins it: a daemon thread still compiling when the interpreter
        # finalizes is killed (pthread_exit) as XLA's compile wait re-takes the GIL, which unwinds
        # through a noexcept jaxlib frame: SIGABRT at exit ("FATAL: exception not rethrown"; seen
        # under `resilax launch` with a cold compilation cache).
        self._warming = threading.Thread(target=compile_it, name="resilax-ckpt-warm")
        self._warming.start()
        self._warmers = [t for t in self._warmers if t.is_alive()] + [self._warming]
        self._start_thread()

    def _join_warming(self, *, every: bool = False):
        """Waits for the newest warm-up (``every``: for all, an older one may still run after
        a restart warmed again)."""
        t, self._warming = self._warming, None
        for w in (self._warmers if every else [t] if t is not None else []):
            w.join()
        if every:
            self._warmers = []

    def _snapshot(self, tree):
        """An on-device copy of ``tree`` that survives the next step's donation. Never compiles
        and never waits for the warm-up (issue 26: joining it stalled a GPU's first save for
        29 s): the compiled copy when it is ready, else the runtime's buffer copy
        (``device_put(..., may_alias=False)``: no XLA program, the same shardings; on a GPU a
        device-to-device copy, on CPU a memcpy, about the host copy's time). A step's outputs
        match the program compiled for the placed state by layout (`_layout`)."""
        compiled = self._compiled
        if compiled is not None and _layout_key(tree) == compiled[0]:
            return compiled[1](tree)
        return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, tree), may_alias=False)

    def in_flight(self) -> bool:
        """A save (or a chore after it) is still on the persister: a `save` now waits for it."""
        return self._thread is not None and self._q.unfinished_tasks > 0

    def checksums(self, tree):
        """``tree_checksums(tree)`` with the program for ``tree``'s shapes and shardings, compiled
        here if `warm` has not yet (then `warm` does not compile it again). One program per
        layout serves the saves, the record log's anchors (the start's is taken before the
        warm-up: it compiles it), a restore's verification and a resume's check of the log."""
        return self._sums_program(_abstract(tree))(tree)

    def adopt_checksums(self, abstract, compiled) -> None:
        """Takes ``compiled``, `tree_checksums` compiled for ``abstract`` before this store
        existed (a standby process builds it while it waits: `ResilientStep.init`), as the
        checksum program of that layout."""
        self._sums.setdefault(_layout_key(abstract), compiled)

    def _sums_program(self, abstract):
        """The compiled checksum program for ``abstract``. Never waits for another thread's
        compile (the loop must not wait for the warm-up): two threads asking at once for a
        new layout may both compile it, the same program."""
        key = _layout_key(abstract)
        prog = self._sums.get(key)
        if prog is None:  # (setdefault is atomic: a program compiled twice is kept once)
            prog = self._sums.setdefault(key, tree_checksums.lower(abstract).compile())
        return prog

    # ------------------------------------------------------------------ save
    def save(self, step: int, state, meta: dict, *, after_dispatch: Callable[[], None] | None = None,
             copy: bool = True) -> float:
        """Starts saving ``state`` as checkpoint ``step``; returns the seconds the caller blocked
        (with ``copy``: dispatching the on-device snapshot; with ``async_save=False``, the whole
        commit).

        ``copy=False`` is the caller's promise that ``state``'s buffers stay untouched (not
        donated, not deleted) until `settle` returns: then nothing is copied on device and
        the caller blocks for nothing but the hand-off (the driver runs the next step
        without donating its input). The checksums are computed on the persister thread,
        from the very buffers Orbax writes.

        Raises:
          StorageError: an earlier background save failed (full disk, permissions), or this
            one failed with ``async_save=False``. Checkpoints already committed are untouched.
        """
        t0 = time.perf_counter()
        if jax.process_count() > 1:
            return self._save_collectively(t0, step, state, meta, after_dispatch)
        # One checkpoint in flight at a time, as with Orbax alone (at a usual cadence the previous one
        # committed long ago): at most one snapshot on the device, the newest checkpoint one save behind.
        self.settle()
        self._raise_error()
        snap = self._snapshot(state) if copy else _shards_built(state)  # uncopied: the loop reads it too
        meta = dict(meta, format=FORMAT, step=int(step), signature=state_signature(state))
        self._start_thread()
        self._handed.clear()
        self._q.put((int(step), snap, meta))
        self.last_step = int(step)
        del snap
        if not self._async:
            self.wait()
        dt = time.perf_counter() - t0
        self.blocking_s.append(dt)
        if after_dispatch is not None:
            # chaos hook ("during_save"): fire once Orbax's write is really in flight (its
            # temporary directory exists), not while the snapshot is still queued
            self._handed.wait()
            after_dispatch()
        return dt

    def _save_collectively(self, t0, step, state, meta, after_dispatch) -> float:
        """A multi-process save, on the caller's thread. The checksums are a collective over
        every process's devices, and every process must issue its collectives in the same
        order: from a persister thread they interleaved with the training step's own (under
        `resilax launch`: gloo mismatches, then Orbax timing out on 'step_directory_creation').
        Orbax's ``save`` copies the local shards to host before it returns and commits in its
        own background threads, as it does for plain Orbax users.

        It first waits for the store's warm-up: under `jax.distributed`, JAX shares a program
        compiled on process 0 with the others through the coordination service's key-value
        store, under the program's cache key, once; the warm-up's compile of a checksum or
        pack program racing this thread's compile of the same program set that key twice
        (``ALREADY_EXISTS``: a CI run's in-place launch test lost its first save to it)."""
        try:  # (under `launch --in-place` a dead process named meanwhile ends the wait)
            membership.wait_unless_a_verdict(lambda: self._join_warming(every=True), "the checkpoint warm-up was compiling")
        except Exception as e:
            raise storage_error(f"waiting for the compiles before checkpoint {step}", self.directory, e) from e
        self.settle()
        self._raise_error()
        meta = dict(meta, format=FORMAT, step=int(step), signature=state_signature(state))
        with self._orbax_call():
            try:
                # one save in flight, as on one process; under `launch --in-place` a dead process
                # named meanwhile ends the wait (Orbax's commit barrier waits for it 20 min)
                membership.wait_unless_a_verdict(self._mgr.wait_until_finished, "the previous checkpoint was committing")
            except Exception as e:
                self._deferred = []
                raise storage_error(f"finishing the checkpoint before {step}", self.directory, e) from e
        self._run_deferred()
        with self._orbax_call():
            try:
                sums = self.checksums(state)
                snap, meta, save_args = self._packed(state, meta)
                self._mgr.save(int(step), args=ocp.args.Composite(
                    state=ocp.args.StandardSave(snap, save_args=save_args),
                    checksums=ocp.args.StandardSave({"sums": sums}),
                    meta=ocp.args.JsonSave(meta)))
                del snap  # Orbax copied the local shards to host in `save`
            except Exception as e:  # Orbax re-raises a failed background commit here too
                raise storage_error(f"saving checkpoint {step}", self.directory, e) from e
        if not self._async:
            self.wait()
        dt = time.perf_counter() - t0
        self.blocking_s.append(dt)
        if after_dispatch is not None:
            after_dispatch()
        return dt

    def _start_thread(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._persist, name="resilax-ckpt-persist", daemon=True)
            self._thread.start()

    def _persist(self):
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                if job[0] == "call":
                    try:
                        job[1]()
                    except BaseException as e:
                        self._error = e if isinstance(e, StorageError) else StorageError(
                            f"resilax checkpoints: a chore after a save failed: {type(e).__name__}: {e}")
                    continue
                step, snap, meta = job
                job = None
                if self._error is not None:
                    self._handed.set()
                    continue  # a failed save stops the later ones: the caller is told at its next call
                t0 = time.perf_counter()
                with self._orbax_call(), shorter_switch_interval(self.SAVE_SWITCH_INTERVAL_S):
                    try:
                        sums = self.checksums(snap)
                        snap, meta, save_args = self._packed(snap, meta)  # (the checksums: of the leaves)
                        self._mgr.save(step, args=ocp.args.Composite(
                            state=ocp.args.StandardSave(snap, save_args=save_args),
                            checksums=ocp.args.StandardSave({"sums": sums}),
                            meta=ocp.args.JsonSave(meta)))
                        del snap, sums  # Orbax holds its host copy now: the device copy can go
                        self.handoff_s.append(time.perf_counter() - t0)
                        self._handed.set()
                        self._mgr.wait_until_finished()  # committed (tmp dir renamed) before the next save
                    except BaseException as e:  # Orbax re-raises a failed background commit here too
                        self._error = storage_error(f"saving checkpoint {step}", self.directory, e)
                    finally:
                        self._handed.set()
                self.persist_s.append(time.perf_counter() - t0)
            finally:
                self._q.task_done()

    def _packed(self, snap, meta):  # ``(snap, meta, Orbax's save args)``, packed where the store packs
        return (self._packers.pack(_layout_key(_abstract(snap)), snap, meta, host=jax.process_count() == 1)
                if self._pack else (snap, meta, None))

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` on the persister thread once the save in flight is committed (host-side
        chores that need not block the loop: log truncation, goodput files). An exception
        from it is reported like a failed save. In a multi-process run (the save is Orbax's
        own async commit) it runs once that commit is known: at the next save or `wait`."""
        if jax.process_count() > 1:
            self._deferred.append(fn)
            return
        self._start_thread()
        self._q.put(("call", fn))

    def _run_deferred(self):
        chores, self._deferred = self._deferred, []
        for fn in chores:
            try:
                fn()
            except Exception as e:
                raise StorageError(f"resilax checkpoints: a chore after a save failed: {type(e).__name__}: {e}") from e

    def _raise_error(self):
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def settle(self) -> None:
        """Blocks until the save in flight (if any) is committed or failed: after this no
        resilax thread reads a device buffer of a snapshot."""
        if self._thread is not None:
            self._q.join()

    def wait(self):
        """Blocks until the background save (if any) is committed.

        Raises:
          StorageError: a background save failed (the message says why; a full disk says so).
        """
        self.settle()
        try:
            with self._orbax_call():  # (under `launch --in-place` a dead process named meanwhile ends the wait)
                membership.wait_unless_a_verdict(self._mgr.wait_until_finished, "a checkpoint was committing")
        except Exception as e:
            self._error = None
            self._deferred = []  # the save they followed did not commit
            raise storage_error("finishing a checkpoint save", self.directory, e) from e
        self._raise_error()
        self._run_deferred()

    def abandon(self) -> None:
        """Nothing more goes through this store, and nothing waits for it: a process of the
        job died (an in-place shrink under `resilax launch`), so a save in flight waits on
        barriers it never reaches and never commits. `close` returns at once."""
        self._abandoned = True
        if self._thread is not None:
            self._q.put(None)
            self._thread = None

    def close(self):
        """Waits for the last save, stops the persister, waits for a warm-up still compiling
        (its thread must not outlive the store: see `warm`), closes Orbax."""
        if self._abandoned:
            self._join_warming(every=True)  # compiling only: it ends
            return
        try:
            self.wait()
        except StorageError as e:
            if isinstance(e.__cause__, membership.DeadProcessVerdict):  # the save waits on a dead process:
                self.abandon()  # nothing waits for it any more (`launch --in-place`)
            raise
        finally:
            if self._thread is not None:
                self._q.put(None)
                self._thread.join()
                self._thread = None
            self._join_warming(every=True)
            if not self._abandoned:
                with self._orbax_call():
                    try:
                        self._mgr.close()
                    except Exception as e:  # Orbax re-raises a failed background write here too (a full disk)
                        raise storage_error("closing the checkpoint manager", self.directory, e) from e
                    finally:
                        quiet.release_directory(self.directory)

    def steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    # ------------------------------------------------------------------ restore
    def restore_newest(self, abstract_state, reject=None, *, step: int | None = None) -> Restored | None:
        """Restores the newest checkpoint that reads back and matches its checksums.

        Args:
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` with shardings (the target layout).
          reject: ``(step, meta) -> str | None``: why a checkpoint must not be restored (a
            fenced side's, `runtime.fence.rejected`); it is skipped and moved aside like a
            corrupt one, never deleted.
          step: that checkpoint only (`CheckpointError` if the directory has none of it).

        Returns:
          ``Restored`` or ``None`` when the directory holds no checkpoint.

        Raises:
          CheckpointError: a checkpoint was written for a differently shaped state (nothing
            is moved; the caller passed the wrong state).
          CorruptCheckpointError: checkpoints exist but none is good (all were quarantined).
        """
        self.settle()
        with self._orbax_call(), quiet.draining_loops():  # a corrupt checkpoint's other reads end before Orbax's loop closes
            return self._restore_newest(abstract_state, reject, step)

    def _restore_newest(self, abstract_state, reject=None, only: int | None = None):
        self._mgr.reload()
        want_sig = state_signature(abstract_state)
        skipped: list[tuple[int, str]] = []
        steps = sorted(self._mgr.all_steps(), reverse=True)
        if only is not None:
            if only not in steps:
                raise CheckpointError(f"resilax: no checkpoint {only} in {str(self.directory)!r} "
                                      f"(it holds {sorted(steps) or 'none'})")
            steps = [only]
        for step in steps:
            try:
                meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                if not isinstance(meta, dict) or meta.get("format") not in (FORMAT, packing.FORMAT) or meta.get("step") != step:
                    raise CorruptCheckpointError(f"meta of checkpoint {step} is malformed")
            except Exception as e:
                skipped.append((step, _reason(e)))
                continue
            why = reject(step, meta) if reject is not None else None
            if why is not None:
                skipped.append((step, why))
                continue
            if meta["signature"] != want_sig:
                raise CheckpointError(messages.signature_mismatch(self.directory, step, meta["signature"], want_sig))
            try:
                leaves = len(want_sig)
                abs_sums = jax.ShapeDtypeStruct((leaves, 2), np.uint32, sharding=_sums_sharding())
                man = meta.get("packing") if meta["format"] == packing.FORMAT else None
                out = self._mgr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state if man is None else
                                                   packing.packed_abstract(abstract_state, man)),
                    checksums=ocp.args.StandardRestore({"sums": abs_sums})))
                state = out["state"] if man is None else packing.unpack(out["state"], abstract_state, man)
                got = np.asarray(self.checksums(state))
                saved = np.asarray(out["checksums"]["sums"])
                if got.shape != saved.shape or not np.array_equal(got, saved):
                    bad = [want_sig[i][0] for i in range(min(len(got), len(saved))) if not np.array_equal(got[i], saved[i])]
                    raise CorruptCheckpointError(f"checksum mismatch in leaves {bad[:5]}")
            except Exception as e:
                skipped.append((step, _reason(e)))
                continue
            moved = []
            if skipped:
                moved = self._quarantine(skipped)
                warnings.warn("resilax: " + messages.checkpoints_skipped(skipped, step, self.directory, moved,
                                                                         read_only=self._read_only),
                              RuntimeWarning, stacklevel=3)
            return Restored(step, state, meta, tuple(skipped), tuple(moved))
        if skipped:
            moved = self._quarantine(skipped)
            raise CorruptCheckpointError(
                f"resilax: no good checkpoint in {str(self.directory)!r}: "
                f"{'; '.join(f'{s}: {messages.short_reason(r)}' for s, r in skipped)}. "
                + ("They were left where they are (read only)." if self._read_only else f"They were moved to {moved}, not deleted.")
            )
        return None

    def _quarantine(self, skipped) -> list[str]:
        """Moves failed step directories aside so new saves never collide with them (a
        read-only store moves nothing)."""
        if self._read_only:
            return []
        qdir = self.directory / QUARANTINE
        qdir.mkdir(exist_ok=True)
        moved = []
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for step, _ in skipped:
            src = self.directory / str(step)
            if not src.exists():
                continue
            dst = qdir / f"{step}.{stamp}"
            n = 0
            while dst.exists():
                n += 1
                dst = qdir / f"{step}.{stamp}.{n}"
            os.rename(src, dst)
            moved.append(str(dst))
        self._mgr.close()
        self._mgr = self._open()
        return moved


def _sums_sharding():
    """Where restored checksums go: one device, or replicated over every process's devices
    in a multi-process run (another process's device is not addressable here)."""
    if jax.process_count() == 1:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _reason(e: BaseException) -> str:
    """Why a checkpoint failed, for its event (a warning shortens it: `messages.short_reason`):
    the error's first line without tensorstore's spec dumps, up to 1000 characters."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return messages.short_reason(f"{type(e).__name__}: {msg}", 1000)


def collectives() -> str:
    """How this process's collectives add, as recorded in each checkpoint's meta: ``"cpu:
    distributed"`` under a `jax.distributed` client (`resilax launch`: on CPU, gloo then runs
    every collective, a failure domain's own all-reduces too, in another order than XLA's
    in-process all-reduce; docs/multiprocess.md, "Which reduction order"), ``"<platform>:
    local"`` without one, ``"unknown"`` where JAX's internals differ."""
    try:
        from jax._src import distributed

        kind = "distributed" if distributed.global_state.client is not None else "local"
        return f"{jax.devices()[0].platform}:{kind}"
    except Exception:  # another JAX version
        return "unknown"


class _ReadOnlyNotes:
    def filter(self, record) -> bool:
        return "read only" not in record.getMessage() and "read_only" not in record.getMessage()
