"""The run's step programs: one per mesh, built when needed or compiled ahead.

The first one (with the checks of the user's step), the degraded meshes' built on demand or
ahead of need on a background thread, and `make`, which picks the default mode's `Program`
or the bit-exact mode's `DeterministicProgram`.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Callable

import jax
import numpy as np

from resilax._src.errors import WrapError
from resilax._src.protect import anomaly as _anomaly
from resilax._src.step.deterministic import DeterministicProgram
from resilax._src.step.program import Program, ProgramSpec
from resilax._src.step.split import update_reads_batch
from resilax._src.step import sharding as _sh
from resilax._src.runtime import worker


def make(spec: ProgramSpec, mesh, *, full_mesh: bool) -> Program:
    """The program of ``mesh``: the default mode's, or the bit-exact mode's
    (`resilax._src.step.deterministic`) when ``spec.replicas`` is set."""
    if spec.replicas is not None:
        return DeterministicProgram(spec, mesh, full_mesh=full_mesh)
    return Program(spec, mesh, full_mesh=full_mesh)


def program_spec(cfg, topology, split, state_specs, batch_specs, abstract_state, abstract_batch,
                 reductions) -> ProgramSpec:
    """What every program of the run is built from (`Config` ``cfg``, the topology, the
    user's step split at `resilax.record`, the shardings, the state's and first batch's
    shapes, the metric reductions)."""
    return ProgramSpec(
        split=split, state_specs=state_specs, batch_specs=batch_specs,
        abstract_state=abstract_state, abstract_batch=abstract_batch,
        abstract_guard=None if cfg.anomaly is None else _anomaly.abstract_guard(cfg.anomaly),
        elastic_axis=topology.elastic_axis, donate=cfg.donate_state,
        metric_reductions=reductions,
        anomaly_check=None if cfg.anomaly is None else _anomaly.make_check(cfg.anomaly),
        memory_limit=None if cfg.peers is None else cfg.peers.device_memory_bytes,
        watched_metric=cfg.anomaly.metric if cfg.anomaly is not None else "loss",
        replicas=None if cfg.deterministic is None else (cfg.deterministic.replicas or topology.num_domains))


def check_step(split, abstract_state, abstract_batch, mesh=None) -> None:
    """Validates the user's step against the state and the first batch (shapes only). A step
    that reads the mesh in context (`resilax.pipeline`) is found here and checked under
    ``mesh`` (the full mesh).

    Raises:
      WrapError: the step changes the state's structure, shapes or dtypes, or its update
        part (after `resilax.record`) still reads the batch.
    """
    key = split.shapes_key(abstract_state, abstract_batch)
    if key is not None and key in split.checked:  # another wrap of this step checked these shapes
        return
    from resilax._src.pipeline import spmd

    if not split.reads_mesh:
        try:
            with spmd.detecting():
                _check_step(split, abstract_state, abstract_batch)
        except spmd.NeedsMesh:
            split.mark_reads_mesh()
    if split.reads_mesh:
        with split.on(mesh):
            _check_step(split, abstract_state, abstract_batch)
    if key is not None:
        split.checked.add(key)


def _check_step(split, abstract_state, abstract_batch) -> None:
    u32 = jax.ShapeDtypeStruct((), np.uint32)
    try:
        rec, _, _ = jax.eval_shape(split.grad, abstract_state, abstract_batch, u32)
    except WrapError:  # (no or a second `record`): a changed state, if also wrong, is named first
        _check_state(jax.eval_shape(split.full, abstract_state, abstract_batch, u32)[0], abstract_state)
        raise
    # the state the update part returns is the state the whole step returns (`record` hands
    # the update the very values it recorded); `update_reads_batch` reuses this trace
    _check_state(jax.eval_shape(split.update, abstract_state, abstract_batch, u32, rec), abstract_state)
    reads = update_reads_batch(split, abstract_state, abstract_batch, rec)
    if reads:
        raise WrapError(
            f"resilax.wrap: the update part of train_step (after resilax.record) still reads batch"
            f"{', batch'.join(reads)}; replay and recovery redo the update from the recorded values only. Record "
            f"everything the update needs, e.g. resilax.record((grads, new_batch_stats))")


def _check_state(new_state, abstract_state) -> None:
    if jax.tree.structure(new_state) != jax.tree.structure(abstract_state):
        raise WrapError(
            "resilax.wrap: train_step must return (state, metrics) with the state's structure unchanged, but the "
            f"returned state has structure {jax.tree.structure(new_state)} vs {jax.tree.structure(abstract_state)}")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(abstract_state)[0], jax.tree.leaves(new_state)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise WrapError(
                f"resilax.wrap: train_step changed state{jax.tree_util.keystr(path)} from {a.shape} {a.dtype} to "
                f"{b.shape} {b.dtype}; the state must keep its shapes and dtypes")


class Programs:
    """The programs built so far, keyed by the live domains of their mesh (original indices,
    in mesh order), and the ones being compiled ahead of need on the one background thread.

    ``mesh_of(alive)``: the mesh of the domains ``alive``."""

    def __init__(self, mesh_of: Callable):
        self._mesh_of = mesh_of
        self._built: dict = {}
        self._ahead: dict = {}  # mesh key -> Future of a Program compiled in the background
        self._pool = None
        self._done = None  # the future that reports when the last batch of compiles ahead is done

    def add(self, alive, prog: Program) -> None:
        self._built[tuple(alive)] = prog

    def get(self, alive, spec: ProgramSpec) -> tuple[Program, bool]:
        """The program of the mesh of domains ``alive``, and whether it was compiled ahead.

        A compile ahead still in flight is waited for (never compiled twice); one that has
        not started yet is cancelled and built here."""
        key = tuple(alive)
        if key in self._built:
            return self._built[key], True
        fut = self._ahead.pop(key, None)
        if fut is not None and not fut.cancel():
            try:
                prog = fut.result()
            except Exception:  # built again below: a real error repeats there, on this thread
                prog = None
            if prog is not None:
                self._built[key] = prog
                return prog, True
        prog = make(spec, self._mesh_of(alive), full_mesh=False)
        prog.fits_global_batch()
        self._built[key] = prog
        return prog, False

    def cancel_outside(self, alive) -> None:
        """Compiles ahead of meshes with a domain outside ``alive`` are never needed: cancelled."""
        for k in [k for k in self._ahead if not set(k) <= set(alive)]:
            self._ahead.pop(k).cancel()

    def keep_within(self, alive) -> None:
        """Forgets the programs of meshes with a domain outside ``alive``."""
        self._built = {k: v for k, v in self._built.items() if set(k) <= set(alive)}

    def compile_ahead(self, alive, spec: ProgramSpec, variants, report: Callable) -> None:
        """Compiles, on the background thread, the programs of every mesh one more loss among
        ``alive`` would leave (with the executables a recovery and the steps after it run:
        ``variants`` are the peer-copy variants). A recovery that comes first waits for the
        one it needs, or builds it itself if it has not started (`get`). Compiling reads only
        shapes and shardings, never a buffer, so it cannot touch a dead device's memory.
        When all are built, ``report(meshes, seconds)`` is called there (it must not raise)."""
        keys = [tuple(j for j in alive if j != i) for i in alive]
        keys = [k for k in keys if k not in self._built and k not in self._ahead]
        if not keys:
            return
        pool = self._compile_pool()
        t0 = time.perf_counter()
        futs = []
        for k in keys:
            futs.append(pool.submit(_build_ahead, spec, self._mesh_of(k), variants))
            self._ahead[k] = futs[-1]

        def done():
            meshes = []
            for f in futs:
                if f.cancelled() or f.exception() is not None:
                    continue
                meshes.append(dict(f.result().mesh.shape))
            report(meshes, time.perf_counter() - t0)

        self._done = pool.submit(done)

    def _compile_pool(self):
        """The one background thread every compile ahead of need runs on."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resilax-compile-ahead")
        return self._pool

    def in_background(self, prog: Program, variants):
        """A future that compiles ``prog``'s update ``variants`` and its grad part
        (`Program.compile_all`) on the background thread."""
        return self._compile_pool().submit(prog.compile_all, variants)

    def idle(self) -> bool:
        """Whether no compile ahead of a degraded mesh is in flight."""
        return self._done is None or self._done.done()

    def wait(self, timeout: float | None, *more) -> bool:
        """Blocks until the compiles ahead (and the futures ``more``) are done; returns
        whether they are."""
        for fut in (self._done, *more):
            if fut is None:
                continue
            try:
                fut.result(timeout)
            except concurrent.futures.TimeoutError:
                return False
            except concurrent.futures.CancelledError:
                pass
        return True

    def close(self, wait: bool) -> None:
        """Stops the background thread (``wait``: for the compile in flight), dropping the rest."""
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)


def _build_ahead(spec, mesh, variants) -> Program:
    """A degraded mesh's program with the executables a recovery and the steps after it run
    (``variants``: the peer-copy variants the run uses)."""
    prog = make(spec, mesh, full_mesh=False)
    prog.fits_global_batch()
    prog.grad(False)
    prog.update(None)
    if prog.protects:
        if "ring+local" in variants:
            prog.grad(True)
        for v in variants:
            prog.update(v)
    return prog


def build_standby(run, state, data):
    """A standby process's programs, built before it is told to go: ``(program, (abstract,
    checksum program) or None)``. The first batch's shapes come from ``data`` (one batch
    read, then its position set back; the restore sets it again anyway); without
    ``data`` no step program is built (the first call builds it, as in a fresh process).
    Also compiles the update that keeps its input (the first save after the resume uses
    it) and, with checkpoints, the checksum program of the state (the record log's
    anchor at the start and every save use it)."""
    sums = None
    if run.config.checkpoint is not None:
        from resilax._src.protect.checkpoints import abstract_of
        from resilax._src.protect.checksum import anchor_tree, tree_checksums

        abstract = abstract_of(anchor_tree(_sh.abstract(state, run._state_sh), run._guard))
        sums = (abstract, tree_checksums.lower(abstract).compile())
    prog = None
    if data is not None:
        pos = data.get_state()
        batch = next(data)
        data.set_state(pos)
        prog = run._first_program(_sh.abstract(batch))
        prog.update(None, keep_input=True)
    worker.mark("programs")
    return prog, sums
