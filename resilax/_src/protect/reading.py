"""`resilax.read_checkpoint`: a resilax checkpoint's train state, read without a wrapped step
(evaluation, export, inspection), through a read-only `CheckpointStore`."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp

from resilax._src.errors import CheckpointError
from resilax._src.protect.checkpoints import CheckpointStore
from resilax._src.protect.checksum import anchor_tree


def read_checkpoint(directory: str | os.PathLike, target, *, step: int | None = None):
    """``(step, state)``: the train state of a resilax checkpoint, read without a wrapped step
    (to evaluate, export or inspect it). Either layout (packed, the default, or one array
    per leaf) is read and verified against the checksums saved with it; the newest good
    checkpoint unless ``step`` says which. Nothing in ``directory`` is created, cleaned up or
    moved (a training job may be writing there).

    Args:
      directory: the `CheckpointConfig.directory` of the run.
      target: a pytree shaped like the saved state (the state ``init`` returned, or
        `jax.eval_shape` of it): arrays or ``jax.ShapeDtypeStruct``; each leaf is read onto
        its ``sharding``, or onto the first device where it has none.
      step: read this checkpoint only.

    Raises:
      CheckpointError: no such directory or checkpoint, none in it, or ``target`` is not the
        saved state's shape (the message names the first leaf that differs).
      CorruptCheckpointError: no checkpoint reads back with matching checksums.
    """
    first = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None) or first),
                            target)
    store = CheckpointStore(directory, read_only=True)
    try:
        steps = sorted(store.steps(), reverse=True) if step is None else [step]
        if not steps:
            raise CheckpointError(f"resilax: no checkpoint in {str(store.directory)!r}")
        guard = None  # the anomaly detector's window, saved beside the state: its shapes from a meta
        for s in steps:
            try:
                with store._orbax_call():
                    sig = store._mgr.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]["signature"]
                guard = _guard_abstract(sig, _replicated_on(abstract, first))
                break
            except Exception:  # unreadable meta: `restore_newest` says so for that step
                continue
        got = store.restore_newest(anchor_tree(abstract, guard), step=step)
    finally:
        store.close()
    if got is None:
        raise CheckpointError(f"resilax: no checkpoint in {str(store.directory)!r}")
    return got.step, got.state["state"]


def _replicated_on(abstract, default):
    """Replicated over the devices of ``abstract``'s first leaf with a sharding (the guard
    goes where the state is: the checksums are one program over both)."""
    for x in jax.tree.leaves(abstract):
        sh = getattr(x, "sharding", None)
        if sh is not None:
            devs = sorted(sh.device_set, key=lambda d: d.id)
            return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devs), ("d",)), jax.sharding.PartitionSpec())
    return default


def _guard_abstract(signature, sharding):
    """The saved anomaly guard's ``{name: ShapeDtypeStruct}`` from a checkpoint's signature
    (its ``['guard']['name']`` leaves), or None when it has none."""
    out = {}
    for path, shape, dtype in signature:
        if path.startswith("['guard']"):
            m = re.fullmatch(r"\['guard'\]\['(\w+)'\]", path)
            if m is None:
                raise CheckpointError(f"resilax: a checkpoint's anomaly guard has a leaf this resilax cannot read: {path}")
            out[m.group(1)] = jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)
    return out or None
