"""Peer copies: which state leaves need one, the ring copy itself, and snapshots.

Placement rule, per leaf, from its ``NamedSharding`` and the topology:

- the spec does not mention the elastic axis: every failure domain holds the whole leaf
  (sharded or not inside the domain), so any surviving domain is a backup at zero cost
  (``"replicated"``);
- the spec mentions the elastic axis: each shard lives in one domain only, so a copy is
  kept one step along the elastic axis (``"ring"``): domain ``d``'s shards are also held by
  domain ``d+1 mod D``, on the device with the same coordinates on the other mesh axes.

The ring copy is made *inside* the compiled step (`ring_shift`, a ``shard_map`` +
``lax.ppermute`` over the elastic axis, i.e. one collective-permute that XLA schedules
alongside the step's compute), so a live leaf and its peer copy are always outputs of the
same program: the same step, and never a half-written copy of a donated buffer.

Peer copies stay in device memory. Host memory was measured too (``resilax bench
recovery`` reports both): a host copy needs a device-to-host transfer of every protected
byte plus a host-side transfer to the neighbour, off the compiled program, so it cannot be
overlapped by XLA and on every platform we measured cost more than the in-step permute.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

REPLICATED = "replicated"
RING = "ring"


def spec_axes(spec: P) -> set[str]:
    out = set()
    for entry in spec:
        for ax in (entry if isinstance(entry, tuple) else (entry,)):
            if ax is not None:
                out.add(ax)
    return out


def placement(shardings, elastic_axis: str):
    """Pytree of ``"replicated"`` / ``"ring"`` per leaf of a pytree of NamedShardings."""
    return jax.tree.map(lambda s: RING if elastic_axis in spec_axes(s.spec) else REPLICATED, shardings)


def ring_shift(x, sharding: NamedSharding, axis: str):
    """Moves every shard one step along ``axis`` (domain ``d`` -> ``d+1 mod D``). Jit-able.

    The result has ``x``'s sharding; as a global value it is a permutation of ``x`` that
    only makes sense shard by shard (`shard_source` says where each shard came from).
    """
    mesh = sharding.mesh
    n = mesh.shape[axis]
    if n == 1:
        return jnp.copy(x)
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.shard_map(
        lambda b: jax.lax.ppermute(b, axis, perm), mesh=mesh, in_specs=sharding.spec, out_specs=sharding.spec
    )(x)


def make_copies(state, shardings, places, axis: str, with_local: bool):
    """Inside a jitted step: ``(local, ring)`` copies of ``state``.

    ``ring`` has the ring copy of each ``"ring"`` leaf (None elsewhere). ``local`` (only if
    ``with_local``) is a copy of every leaf in its own layout: needed when the live state
    moves on before the next copy (cadence k > 1), so that a whole consistent step survives.
    """
    ring = jax.tree.map(
        lambda x, s, p: ring_shift(x, s, axis) if p == RING else None, state, shardings, places
    )
    local = jax.tree.map(jnp.copy, state) if with_local else None
    return local, ring


@dataclasses.dataclass
class Snapshot:
    """A consistent step of the state spread over the domains.

    ``local is None`` means "the live state is this step's local part" (cadence 1): valid
    only while the live state is still at ``step``.
    """

    step: int
    mesh: Any
    shardings: Any  # NamedSharding per leaf, on ``mesh``
    local: Any  # pytree of arrays, or None
    ring: Any  # pytree: array for "ring" leaves, None elsewhere


def device_coords(mesh) -> dict:
    return {d: idx for idx, d in np.ndenumerate(mesh.devices)}


def ring_holder(mesh, device, axis: str):
    """The device that holds ``device``'s ring copy: next along ``axis``, same other coords."""
    coords = device_coords(mesh)[device]
    ai = mesh.axis_names.index(axis)
    nxt = list(coords)
    nxt[ai] = (nxt[ai] + 1) % mesh.devices.shape[ai]
    return mesh.devices[tuple(nxt)]


def tree_arrays(*trees):
    """Every jax.Array in the given pytrees (None leaves skipped)."""
    out = []
    for t in trees:
        out.extend(x for x in jax.tree.leaves(t) if isinstance(x, jax.Array))
    return out


def buffers(a) -> dict:
    """``{device: single-device buffer}`` of a jax.Array (not yet partially deleted).

    Take this map *before* deleting anything: once one buffer of an array is deleted,
    ``a.is_deleted()`` is true and ``a.addressable_shards`` refuses, although the other
    devices' buffers are intact. The map's buffers are the array's own (not copies).
    """
    return {s.device: s.data for s in a.addressable_shards}


def delete_on(bufmaps, dead: set) -> int:
    """Deletes every buffer (of ``{device: buffer}`` maps) on a ``dead`` device; returns bytes.

    Nothing may read these buffers afterwards (reading a deleted buffer can crash the
    process), so callers drop their references to the arrays, not just the buffers.
    """
    freed = 0
    for bufs in bufmaps:
        for dev, b in bufs.items():
            if dev in dead and not b.is_deleted():
                freed += b.nbytes
                b.delete()
    return freed


@dataclasses.dataclass(frozen=True)
class RingPack:
    """Layout of a *packed* ring copy: the local blocks of many leaves in one buffer.

    One collective-permute per dtype instead of one per leaf: on XLA:CPU a collective is a
    thread rendezvous, so its fixed cost dominates (21 leaves, 1.8 MB: 4.1 ms per leaf,
    0.95 ms packed). ``slots[i]`` is ``(group, offset, block_shape)`` for leaf ``i`` of the
    flattened tree (``None``: not a ring leaf); ``groups`` are the dtypes, in buffer order.
    Every device's buffer of group ``g`` holds, at ``offset``, the block of leaf ``i`` that
    its ring predecessor (previous along the elastic axis, same other coordinates) holds.
    """

    mesh: Any
    axis: str
    specs: tuple  # PartitionSpec per leaf
    slots: tuple
    groups: tuple  # dtype names
    lengths: tuple  # per-device buffer length per group


def ring_pack_layout(shapes, dtypes, shardings, places, axis: str) -> RingPack | None:
    """`RingPack` for flat lists of leaf shapes/dtypes/NamedShardings/placements, or None."""
    slots, groups, lengths = [], [], []
    mesh = None
    for shape, dtype, sh, place in zip(shapes, dtypes, shardings, places):
        if place != RING:
            slots.append(None)
            continue
        mesh = sh.mesh
        name = np.dtype(dtype).name
        if name not in groups:
            groups.append(name)
            lengths.append(0)
        g = groups.index(name)
        block = tuple(sh.shard_shape(tuple(shape)))
        slots.append((g, lengths[g], block))
        lengths[g] += int(np.prod(block, dtype=np.int64))
    if mesh is None:
        return None
    return RingPack(mesh, axis, tuple(s.spec for s in shardings), tuple(slots), tuple(groups), tuple(lengths))


def ring_pack(xs, pack: RingPack):
    """Inside a jitted program: the packed ring copy of the flat list ``xs`` (a tuple of
    one 1-D array per dtype group, each sharded over every mesh axis: device-local)."""
    mesh, n = pack.mesh, pack.mesh.shape[pack.axis]
    idx = [i for i, s in enumerate(pack.slots) if s is not None]
    perm = [(i, (i + 1) % n) for i in range(n)]

    def body(*blocks):
        return tuple(jax.lax.ppermute(flat, pack.axis, perm) if n > 1 else jnp.copy(flat)
                     for flat in _concat_groups(pack, idx, blocks))

    every = P(tuple(mesh.axis_names))
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(pack.specs[i] for i in idx),
                         out_specs=tuple(every for _ in pack.groups))(*[xs[i] for i in idx])


def ring_block(pack: RingPack, buffers_of_group, i: int, device):
    """Host copy of leaf ``i``'s block that ``device`` held, read from its ring holder's
    packed buffer (``buffers_of_group[g]`` is a ``{device: buffer}`` map). None if the
    holder's buffer is gone."""
    g = pack.slots[i][0]
    holder = ring_holder(pack.mesh, device, pack.axis)
    buf = buffers_of_group[g].get(holder)
    if buf is None or buf.is_deleted():
        return None
    return local_block(pack, buffers_of_group, i, holder)


def local_block(pack: RingPack, buffers_of_group, i: int, device):
    """Host copy of leaf ``i``'s block on ``device``, read from that device's `local_pack`
    buffer (``buffers_of_group[g]``: a ``{device: buffer}`` map)."""
    g, off, block = pack.slots[i]
    buf = buffers_of_group[g][device]
    return np.array(np.asarray(buf)[off:off + math.prod(block)], copy=True).reshape(block)


def _concat_groups(pack: RingPack, idx, blocks) -> list:
    """Inside a ``shard_map`` body: per dtype group, the local ``blocks`` of the leaves ``idx``
    (those with a slot) flattened and concatenated in slot order."""
    out = []
    for g in range(len(pack.groups)):
        parts = [b.reshape(-1) for i, b in zip(idx, blocks) if pack.slots[i][0] == g]
        out.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
    return out


def local_pack(xs, pack: RingPack):
    """Inside a jitted program: ``(buffers, others)``. ``buffers``: the leaves of the flat list
    ``xs`` that ``pack`` (`ring_pack_layout`) has a slot for, as one 1-D buffer per dtype
    group, each device's buffer its own blocks concatenated (sharded over every mesh axis: no
    data moves between devices); ``others``: the other leaves, as they are."""
    idx = [i for i, s in enumerate(pack.slots) if s is not None]

    def body(*blocks):
        return tuple(_concat_groups(pack, idx, blocks))

    every = P(tuple(pack.mesh.axis_names))
    bufs = jax.shard_map(body, mesh=pack.mesh, in_specs=tuple(pack.specs[i] for i in idx),
                         out_specs=tuple(every for _ in pack.groups))(*[xs[i] for i in idx])
    return bufs, tuple(x for x, s in zip(xs, pack.slots) if s is None)


def local_unpack(packed, pack: RingPack) -> list:
    """Inside a jitted program: the inverse of `local_pack`, the flat list of leaves in their
    shardings (a replicated leaf from any device's block: every device holds the same)."""
    bufs, others = packed
    idx = [i for i, s in enumerate(pack.slots) if s is not None]

    def body(*flat):
        return tuple(jax.lax.slice(flat[g], (off,), (off + math.prod(block),)).reshape(block)
                     for g, off, block in (pack.slots[i] for i in idx))

    every = P(tuple(pack.mesh.axis_names))
    cut = jax.shard_map(body, mesh=pack.mesh, in_specs=tuple(every for _ in pack.groups),
                        out_specs=tuple(pack.specs[i] for i in idx), check_vma=False)(*bufs)
    cut, others = iter(cut), iter(others)
    return [next(others) if s is None else next(cut) for s in pack.slots]
