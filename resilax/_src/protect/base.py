"""What a protection is, and the host bookkeeping they share.

A protection is a small part with one interface (below), composed in a list like optax
transforms; the driver (`ResilientStep`) only loops over them and owns no protection logic.
Each one may:

- ask the step program for outputs (``log_ring``: the packed ring copy of the recorded
  values; ``copy``: the ring copy of the new state) — traced into the two executables;
- act after a step (`after_step`: keep a snapshot, log an entry, save a checkpoint, read a
  verdict);
- say which device arrays it holds (`held`: an emulated failure deletes their buffers on
  the dead devices);
- offer the planner sources for lost state (`candidates`, `log_steps`);
- start again on a new mesh after a recovery (`restart`).

`Copy` refs used here: ``("buf", id(array), device)`` reads that device's buffer of an array;
``("ring", pack, (id(group_0), ...), leaf, device)`` reads the block ``device`` held of
``leaf`` out of its ring holder's packed buffer (`ring.ring_block`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from resilax._src.protect import ring as _ring
from resilax._src.protect.planner import Copy


@dataclasses.dataclass
class StepRecord:
    """What one step produced (``step``: the step from state ``step`` to ``step + 1``)."""

    step: int
    batch: Any  # host batch
    gout: Any  # program.GradOut
    copy: str | None  # update variant that ran
    new_state: Any
    ring: Any  # packed ring copy of new_state (copy steps)
    local: Any  # local copy of new_state (copy steps with every > 1)
    data_before: Any
    data_after: Any
    program: Any


class Protection:
    """Interface (every method optional; the defaults do nothing)."""

    name = "protection"

    def start(self, run, state) -> None:
        """The state is placed (or restored) at ``run.step`` on ``run._program``'s mesh."""

    def copy_variant(self, run, step_after: int) -> str | None:
        return None

    def wants_log_ring(self, run, copy: str | None) -> bool:
        return False

    def before_step(self, run, state, step: int) -> None:
        """Step ``step + 1`` is about to run on ``state`` (``step`` steps completed)."""

    def before_update(self, run, state, batch, step_no: int, gout, program) -> None:
        """The grad part of step ``step_no`` ran (``gout``); the update has not: ``state``
        is still the step's input (a check that raises here leaves it untouched)."""

    def after_step(self, run, rec: StepRecord) -> None:
        pass

    def blocks(self) -> bool:
        """Whether the step in flight is a calibration sample: the driver waits for it to
        finish and reports its time to `timed`."""
        return False

    def timed(self, run, seconds: float) -> None:
        pass

    def adopted(self, run, state, since: int) -> None:
        """The live state was replaced by ``state``, rebuilt at ``run.step`` from trusted
        sources (`ResilientStep.adopt`): whatever this protection derived from the live state
        after step ``since`` (log entries, copies) may hold corrupted values and is dropped."""

    def held(self) -> list:
        return []

    def candidates(self, run) -> list:
        return []

    def log_steps(self, run) -> dict:
        return {}

    def restart(self, run, state) -> None:
        """After a recovery: the state is at ``run.step`` on the new mesh."""
        self.start(run, state)

    def shrunk(self, run, state, alive: list[int]) -> None:
        """Under `resilax launch`, processes outside ``alive`` died and this one goes on in
        place: the state was restored at ``run.step`` from the host store onto the mesh of
        the live processes' devices. What this protection held of the step that failed is
        gone (its collectives broke)."""
        self.start(run, state)

    def close(self) -> None:
        pass


def _key(idx):
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in idx)


def shard_groups(sharding, shape):
    """``[(shard key, index, [devices holding it])]`` of one leaf."""
    by: dict = {}
    for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
        by.setdefault(_key(idx), (idx, []))[1].append(dev)
    return [(k, idx, devs) for k, (idx, devs) in by.items()]


def leaf_shards(arrays, shardings, shapes, ring=None, packed=None):
    """Planner shards of a tree of device arrays (flat lists): each shard's copies are the
    devices holding it, then (``ring=(pack, group arrays)``) the ring holders of those.
    ``packed=(layout, group arrays)``: the leaves the layout has a slot for are not arrays
    of their own but blocks of `ring.local_pack` buffers, each device holding its own."""
    out = []
    pgids = tuple(id(g) for g in packed[1]) if packed is not None else None
    for i, (a, sh, shape) in enumerate(zip(arrays, shardings, shapes)):
        leaf = []
        for key, idx, devs in shard_groups(sh, shape):
            if packed is not None and packed[0].slots[i] is not None:
                copies = [Copy(d, ("packed", packed[0], pgids, i, d, idx)) for d in devs]
            else:
                copies = [Copy(d, ("buf", id(a), d, idx)) for d in devs] if a is not None else []
            if ring is not None and ring[0] is not None and ring[0].slots[i] is not None:
                pack, groups = ring
                gids = tuple(id(g) for g in groups)
                copies += [Copy(_ring.ring_holder(pack.mesh, d, pack.axis), ("ring", pack, gids, i, d, idx)) for d in devs]
            leaf.append((key, tuple(copies)))
        out.append(tuple(leaf))
    return tuple(out)


def read_copy(copy: Copy, bufmaps: dict) -> tuple[Any, np.ndarray]:
    """``(index, host array)`` of one picked copy (a real copy: never a view of the buffer)."""
    ref = copy.ref
    if ref[0] == "buf":
        _, aid, dev, idx = ref
        return idx, np.array(bufmaps[aid][dev], copy=True)
    if ref[0] == "packed":
        _, layout, gids, i, dev, idx = ref
        return idx, _ring.local_block(layout, [bufmaps[g] for g in gids], i, dev)
    _, pack, gids, i, dev, idx = ref
    return idx, _ring.ring_block(pack, [bufmaps[g] for g in gids], i, dev)


def assemble(picks, shapes, dtypes, bufmaps) -> tuple[list[np.ndarray], int]:
    """Host arrays of every leaf from the picked copies; returns (arrays, bytes moved)."""
    out, moved = [], 0
    for leaf, shape, dtype in zip(picks, shapes, dtypes):
        host = np.empty(tuple(shape), dtype)
        for _, c in leaf:
            idx, data = read_copy(c, bufmaps)
            host[idx] = data
            moved += data.nbytes
        out.append(host)
    return out, moved
