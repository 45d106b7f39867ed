"""`Checkpoints`: the persistent tier as one of the step's protections (when a save is due,
what it saves, its warm-up, and pausing it after an in-place shrink); the store itself is
`checkpoints.CheckpointStore`."""

from __future__ import annotations

import os

import jax

from resilax._src import dirlock
from resilax._src.errors import CheckpointError
from resilax._src.protect import base
from resilax._src.protect import checkpoints as _store
from resilax._src.protect.checkpoints import CheckpointStore
from resilax._src.protect.checksum import anchor_tree
from resilax._src.protect.data_state import encode_data_state
from resilax._src.protect.planner import Candidate, Copy
from resilax._src.runtime import fence, worker


class Checkpoints(base.Protection):
    name = "checkpoint"

    def __init__(self, cfg):
        self.cfg = cfg
        self._dir_lock = _lock_directory(cfg.directory)
        try:
            self.store = CheckpointStore(cfg.directory, keep=cfg.keep, async_save=cfg.async_save, pack=cfg.pack,
                                         compress=cfg.compress)
        except BaseException:
            dirlock.release(self._dir_lock)
            raise
        self.paused: str | None = None  # why no checkpoint can be saved now (an in-place shrink)

    def tree(self, state, guard):
        return anchor_tree(state, guard)

    def start(self, run, state):
        """Warms, off the loop, the programs a save needs: the checksums, the snapshot copy
        (for a state the caller still donates), and the update variants that keep their
        input (the step after a save runs one: the persister reads that state, uncopied)."""
        prog = run._program
        variants = {None}
        if run._peers is not None and prog.protects:
            variants.update(run._peers.variants())

        def keep_variants():
            for v in variants:
                prog.update(v, keep_input=True)

        self.store.warm(self.tree(state, run._guard), also=keep_variants if prog.spec.donate else None)

    def restart(self, run, state):
        self.start(run, state)

    def shrunk(self, run, state, alive):
        """Processes outside ``alive`` died and the others went on in place: checkpoints pause
        until the next generation. Orbax's manager counts every process of the job (a save
        in flight waits on barriers the dead never reach, and it is never committed), and one
        over the live processes only (``MultiprocessingOptions(active_processes=...)``) was
        measured to hang or break the step's collectives under jax 0.10.2: some of its
        synchronisation runs as device collectives over every process. The host stores keep
        every step meanwhile."""
        self.store.abandon()
        self.paused = (f"processes outside {sorted(alive)} died and the others went on in place; Orbax cannot save "
                       f"without them, so checkpoints resume with the next generation (the host stores keep every "
                       f"step meanwhile)")
        run._event("checkpoints_paused", run.step, why=self.paused)

    def due(self, step_after: int) -> bool:
        return bool(self.cfg.every) and step_after % self.cfg.every == 0 and self.paused is None

    def save(self, run, state, *, after_dispatch=None, copy=True) -> float:
        meta = {"seed": run.config.seed, "topology": run.topology.name, "collectives": _store.collectives(),
                **fence.stamp(worker.env())}  # the generation that wrote it (across hosts: fenced by it)
        if run._data is not None:
            meta["data_state"] = encode_data_state(run._data.get_state())
        if run._watch is not None:  # the steps skipped so far (reads the newest verdict: the snapshot waits for it anyway)
            meta["verdicts"] = run._watch.record(run)
        return self.store.save(run.step, self.tree(state, run._guard), meta, after_dispatch=after_dispatch, copy=copy)

    def candidates(self, run):
        steps = self.store.steps()
        if not steps:
            return []
        shapes = [x.shape for x in jax.tree.leaves(run._program.spec.abstract_state)]
        storage = tuple(((("all",), (Copy(None, ("checkpoint",)),)),) for _ in shapes)
        return [Candidate("checkpoint", steps[-1], storage)]

    def close(self):
        try:
            self.store.close()
        finally:
            dirlock.release(self._dir_lock)
            self._dir_lock = None


def _lock_directory(directory) -> str | None:
    """A single-process run holds its checkpoint directory (`dirlock`): a second run there
    would delete this one's checkpoints (Orbax keeps the newest of whatever it finds) and a
    resume could read the other's. The processes of one multi-process job share it (under
    `resilax launch` the supervisor holds the run directory). Remote paths (``gs://``) and
    directories that cannot be created are left to the store's own errors."""
    if jax.process_count() > 1 or worker.env() is not None or "://" in str(directory):
        return None
    try:
        os.makedirs(directory, exist_ok=True)
        return dirlock.hold(directory, what="resilax checkpoints")
    except dirlock.DirectoryInUse as e:
        raise CheckpointError(
            f"resilax checkpoints: the checkpoint directory {str(directory)!r} is in use by another run "
            f"({e.holder}); two runs in one directory delete each other's checkpoints. Wait for it to end, stop "
            f"it, or use another directory") from None
    except OSError:
        return None
