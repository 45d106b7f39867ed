"""Orbax's replica-parallel saving: off on CPU (`item_handlers`), and where it is on, what a
layout's first save would compile on the persister thread, compiled ahead (`plan`, `run`);
on a GPU, the pinned host memory a save copies into, allocated ahead (`warm_pinned`).

On CPU every device is the host's memory: cutting a replicated shard into slices on the
"device" only adds a program per slice shape and a dispatch per slice and save (a 60-step
`resilax train` on cpu-2x4, a save every 5 steps: 20.3 -> 17.0 CPU-s), and writes the same
bytes. Orbax itself turns it off on GPU (``JAX_PLATFORMS``); resilax's CheckpointStore turns
it off where the devices are CPU, through its own handlers (the user's Orbax is untouched).

Where it is on, Orbax saves a shard that several devices hold (replicated) cooperatively by default
(replica-parallel): each replica writes a slice of it, cut on the device by
`lax.slice_in_dim`, which JAX compiles once per shape on first use. On the tiny GPT over 8
CPU devices that is 16 programs, 0.55 s of a first save's 2.0 s on the persister (later saves
0.6 s), during which the loop ran slower and the next save waited for it. `plan` asks
Orbax's own planner which slices its array handler will cut (no device work; it reads the
live arrays' shardings, so it runs where they are alive); `run` cuts each distinct one from
zeros of the shard's shape on its device (one leaf's shard at a time), off the loop. It uses
Orbax's private serialization module: where that has moved or changed, `plan` returns []
and the first save compiles them, as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def cpu_only() -> bool:
    """JAX's backends are up and its devices are CPU (never starts a backend: a
    CheckpointStore may be built before ``jax.distributed.initialize``)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized()) and jax.devices()[0].platform == "cpu"
    except Exception:  # another JAX: Orbax's default
        return False


def item_handlers(names, pinned: bool | None = None, compress: bool = True) -> tuple[dict, object] | None:
    """``({name: handler}, the ArrayHandler they save arrays with)`` for a CheckpointManager
    whose ``StandardSave`` items are saved without replica-parallel slicing (on CPU), where
    ``pinned`` is not None with Orbax's pinned-host transfer on or off (its default: on where
    the backend is a GPU), and with zstd compression only if ``compress`` (Orbax's default:
    on); None for Orbax's defaults (nothing of these differs from them, or Orbax's internals
    moved). The handler is Orbax's own StandardCheckpointHandler (same on-disk format, same
    handler name in the checkpoint's metadata; a restore reads compressed and uncompressed
    arrays alike) over a PyTreeCheckpointHandler whose type registry holds Orbax's
    registered handlers, its ArrayHandler copied with replica-parallel off on CPU (the rest
    of its setup kept: the array metadata that brings a PRNG key back typed)."""
    cpu = cpu_only()
    if not cpu and pinned is None and compress:
        return None
    try:
        import copy

        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.serialization import type_handler_registry as reg

        arrays = copy.copy(reg.get_type_handler(jax.Array))
        if cpu:
            arrays._use_replica_parallel = False
        kw = {"use_compression": bool(compress)}
        if pinned is not None:
            kw["enable_pinned_host_transfer"] = bool(pinned)

        def standard():
            pairs = [(ty, arrays if ty is jax.Array else reg.get_type_handler(ty)) for ty in reg.supported_types()]
            h = ocp.StandardCheckpointHandler()
            h._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=reg.create_type_handler_registry(*pairs), **kw)
            return h

        return {n: ocp.JsonCheckpointHandler() if n == "meta" else standard() for n in names}, arrays
    except Exception:  # Orbax's private API moved: its defaults (replica-parallel on, compressed)
        return None


def manager(directory, options, names, pinned: bool | None = None, compress: bool = True):
    """``(CheckpointManager, the ArrayHandler its "state" item saves with)``: on CPU with
    replica-parallel slicing off, ``pinned`` and ``compress`` as in `item_handlers`, else
    Orbax's defaults."""
    import orbax.checkpoint as ocp

    got = item_handlers(names, pinned, compress)
    if got is None:
        mgr = ocp.CheckpointManager(directory, options=options, item_names=names)
        return mgr, ocp.type_handlers.get_type_handler(jax.Array)
    handlers, arrays = got
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers), arrays


def plan(tree, handler=None) -> list:
    """``(index, slice args, shape, dtype, device)`` per distinct slice program Orbax's save of
    ``tree`` would compile (``tree``'s arrays must be alive). [] in a multi-process job: there
    a compile may wait for another process's binary (``JAX_SHARE_BINARY_BETWEEN_HOSTS``), and
    a warm-up still waiting for a process that died held up the survivors' in-place re-form
    past its deadline (a CI run of test_launch's in-place test); the first save compiles them
    on the caller's thread, as before."""
    if jax.process_count() > 1:
        return []
    try:
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.serialization import replica_slices as rs

        h = handler if handler is not None else ocp.type_handlers.get_type_handler(jax.Array)
        if not h._use_replica_parallel:  # whole shards: nothing is cut
            return []
        args = (h._replica_id, h._use_replica_parallel, h._min_slice_bytes_for_replica_parallel,
                h._max_replicas_for_replica_parallel)
        out, seen = [], set()
        for x in jax.tree.leaves(tree):
            if not isinstance(x, jax.Array) or x.is_deleted():
                continue
            for r in rs.get_replica_slices(x, *args).replica_slices:
                if r.slice_args is None or r.is_on_host:
                    continue
                a, dev = r.unsliced_data, next(iter(r.unsliced_data.devices()))
                s = r.slice_args
                key = (tuple(a.shape), str(a.dtype), s.start_index, s.limit_index, s.axis, dev)
                if key not in seen:
                    seen.add(key)
                    out.append((r.index, s, tuple(a.shape), a.dtype, dev))
        return out
    except Exception:  # Orbax's private API moved: the first save compiles them
        return []


def run(planned) -> None:
    """Cuts each planned slice once (compiling it into JAX's cache), from zeros on its device."""
    if not planned:
        return
    from orbax.checkpoint._src.serialization import replica_slices as rs

    for index, sargs, shape, dtype, dev in planned:
        z = jnp.zeros(shape, dtype, device=dev)
        jax.block_until_ready(rs.ReplicaSlice(index, z, sargs).data())
        del z


def pinned_sharding(device):
    """``device``'s pinned host memory (where a save's copy to host goes), or None where it
    has none."""
    from jax.sharding import SingleDeviceSharding

    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return None
    return SingleDeviceSharding(device, memory_kind="pinned_host")


def pinned_bytes(tree) -> dict:
    """``{device: bytes}`` that a save of ``tree`` (arrays or ShapeDtypeStructs with
    shardings) copies into each device's pinned host memory: per leaf, the shards of
    replica 0 (the copy Orbax writes), on this process's devices."""
    from jax._src.sharding_impls import device_replica_id_map

    out: dict = {}
    for x in jax.tree.leaves(tree):
        sh = getattr(x, "sharding", None)
        if sh is None or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        shape = tuple(x.shape)
        nbytes = int(np.prod(sh.shard_shape(shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        rid = device_replica_id_map(sh, shape)
        for d in sh.addressable_devices:
            if rid[d] == 0:
                out[d] = out.get(d, 0) + nbytes
    return out


def warm_pinned(tree, on: bool = True, platforms=("gpu",)) -> dict:
    """Where the devices' platform is in ``platforms`` and ``on`` (Orbax copies to host through
    pinned memory there: its GPU default), grows each device's pinned host memory pool to what
    a save of ``tree`` (packed or not: the same bytes per device) copies there, ahead of the
    first save: allocating pinned host memory (``cudaHostAlloc``) is slow and
    synchronizes the device, so on an H100 the first save's copy to host stalled the loop
    1.2-1.8 s where later saves, reusing the pool, did not (docs/performance.md; not yet
    measured with this warm-up). A host-to-host copy of an untouched buffer into the pinned
    memory kind, then freed: no device memory, no device work. Returns the bytes per device
    ({} where the platform has no pinned host memory kind or the allocation failed: the
    first save allocates, as before)."""
    done = {}
    if not on or jax.devices()[0].platform not in platforms:
        return done
    try:
        for d, nbytes in pinned_bytes(tree).items():
            pinned = pinned_sharding(d)
            if pinned is None:
                continue
            buf = jax.device_put(np.empty(nbytes, np.uint8), pinned)
            jax.block_until_ready(buf)
            buf.delete()
            done[d] = nbytes
    except Exception:  # out of pinned memory, another JAX: the first save allocates
        return done
    return done
