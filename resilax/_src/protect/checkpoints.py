"""Checkpoint protection: the persistent tier (`checkpoint.CheckpointStore`, Orbax async)
as a part of the pipeline. Saves every ``CheckpointConfig.every`` steps (state, the anomaly
detector's state, data position, seed), offers the newest good checkpoint to the planner,
and tells the record log where its host and disk entries may be truncated."""

from __future__ import annotations

import jax

from resilax._src.protect import base
from resilax._src.protect.checkpoint import CheckpointStore, encode_data_state
from resilax._src.protect.planner import Candidate, Copy


class Checkpoints(base.Protection):
    name = "checkpoint"

    def __init__(self, cfg):
        self.cfg = cfg
        self.store = CheckpointStore(cfg.directory, keep=cfg.keep, async_save=cfg.async_save)

    def tree(self, state, guard):
        return {"state": state} if guard is None else {"state": state, "guard": guard}

    def start(self, run, state):
        """Warms the snapshot program and Orbax off the loop (see `CheckpointStore.warm`)."""
        self.store.warm(self.tree(state, run.guard))

    def restart(self, run, state):
        self.start(run, state)

    def due(self, step_after: int) -> bool:
        return bool(self.cfg.every) and step_after % self.cfg.every == 0

    def save(self, run, state, *, after_dispatch=None) -> float:
        meta = {"seed": run.config.seed, "topology": run.topology.name}
        if run.data is not None:
            meta["data_state"] = encode_data_state(run.data.get_state())
        return self.store.save(run.step, self.tree(state, run.guard), meta, after_dispatch=after_dispatch)

    def candidates(self, run):
        steps = self.store.steps()
        if not steps:
            return []
        shapes = [x.shape for x in jax.tree.leaves(run.program.spec.abstract_state)]
        storage = tuple(((("all",), (Copy(None, ("checkpoint",)),)),) for _ in shapes)
        return [Candidate("checkpoint", steps[-1], storage)]

    def close(self):
        self.store.close()
