"""Packed checkpoints (docs/packed_checkpoints.md; experimental, off by default:
`CheckpointStore.PACK`): the leaves that share a dtype and a sharding saved as one array.

Orbax's save costs ~2-5 ms of Python per array (benchmarks/orbax_save_cost.py), on threads
beside the step loop; a packed save hands it a few arrays instead of one per leaf. A group
is the leaves with one dtype, one mesh and a ``PartitionSpec`` that shards at most the first
dimension, over axes ``A`` (R = their sizes' product, 1 when replicated) dividing it. Each
leaf is reshaped to ``(R, -1)`` (row r is shard r: it stays on its devices) and the group's
leaves are concatenated along axis 1 into one ``(R, C)`` array sharded ``P(A, None)``: one
program, no communication. Other leaves (typed PRNG keys, scalars, other shardings) are
saved as they are. The manifest (JSON, in the checkpoint's meta) says where each leaf is;
a restore reads the packed arrays, slices and reshapes them back on the device, and the
store verifies the unpacked state with the per-leaf checksums taken at the save.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

FORMAT = 2  # the checkpoint meta's "format" of a packed checkpoint (per leaf: `checkpoints.FORMAT`)
CHUNK_BYTES = 64 << 20  # a packed array's storage chunks (`save_args`)
PIECE_BYTES = 256 << 20  # a group's size per device at most (`manifest`): what a save holds on a device at once


def _axes(entry) -> tuple:
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def _group_key(x):
    """``(dtype name, mesh, axes, rows)`` for a leaf that can be packed, else None."""
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding) or len(x.shape) == 0 or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return None
    spec = tuple(sh.spec)
    if any(s is not None for s in spec[1:]):
        return None
    axes = _axes(spec[0] if spec else None)
    rows = int(np.prod([sh.mesh.shape[a] for a in axes])) if axes else 1
    if x.shape[0] % rows:
        return None
    return (np.dtype(x.dtype).name, sh.mesh, axes, rows)


def manifest(tree) -> dict:
    """The packing of ``tree``'s leaves (arrays or ShapeDtypeStructs with shardings):
    ``{"groups": [{"dtype", "axes", "rows", "members": [[leaf index, columns], ...]}],
    "singles": [leaf index, ...]}``, JSON-able. The leaves of one key are cut, at leaf
    boundaries, into groups of at most `PIECE_BYTES` per device (a leaf larger than that is
    a group of its own): a save packs one group at a time."""
    groups: dict = {}
    singles = []
    for i, x in enumerate(jax.tree.leaves(tree)):
        key = _group_key(x)
        if key is None:
            singles.append(i)
            continue
        groups.setdefault(key, []).append([i, int(np.prod(x.shape)) // key[3]])
    out = []
    for k, members in groups.items():
        itemsize, piece, size = np.dtype(k[0]).itemsize, [], 0
        for m in members:
            if piece and (size + m[1]) * itemsize > PIECE_BYTES:
                out.append({"dtype": k[0], "axes": list(k[2]), "rows": k[3], "members": piece})
                piece, size = [], 0
            piece.append(m)
            size += m[1]
        out.append({"dtype": k[0], "axes": list(k[2]), "rows": k[3], "members": piece})
    return {"groups": out, "singles": singles}


def pack_program(tree):
    """``(manifest(tree), [a compiled program per group: its members' leaves -> (R, C)])``
    for ``tree``'s shapes and shardings; each output a new buffer, sharded ``P(A, None)`` on
    the group's mesh (no communication: row r is shard r of every member)."""
    leaves = jax.tree.leaves(tree)
    man = manifest(tree)
    progs = []
    for grp in man["groups"]:
        members = [leaves[i] for i, _ in grp["members"]]
        out_sh = NamedSharding(members[0].sharding.mesh, P(tuple(grp["axes"]) or None, None))
        fn = functools.partial(lambda rows, *xs: jnp.concatenate([x.reshape(rows, -1) for x in xs], axis=1),
                               grp["rows"])
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in members]
        progs.append(jax.jit(fn, out_shardings=out_sh).lower(*abstract).compile())
    return man, progs


def _to_host(x) -> np.ndarray:
    """Packed group ``x`` as a host array, its device buffers freed before this returns (so a
    save holds one group at a time on the devices): each shard of replica 0 copied through
    pinned host memory where its device has it, as Orbax copies."""
    from resilax._src.protect.orbax_warm import pinned_sharding

    parts = []  # every copy started before the first is waited for
    for s in x.addressable_shards:
        if s.replica_id == 0:
            pinned = pinned_sharding(s.device)
            parts.append((s.index, s.data if pinned is None else jax.device_put(s.data, pinned)))
    if len(parts) == 1 and tuple(parts[0][1].shape) == tuple(x.shape):
        out = np.asarray(parts[0][1])
    else:
        out = np.empty(x.shape, x.dtype)
        for index, d in parts:
            out[index] = np.asarray(d)
    x.delete()
    return out


class Packers:
    """The compiled pack programs per layout (`pack_program`), made once: by the store's
    warm-up (off the loop) or, if a save comes first, by the persister. Two threads asking
    at once for a new layout may both compile them; one set is kept."""

    def __init__(self):
        self._progs: dict = {}

    def get(self, key, tree):
        """``(manifest, [compiled per group])`` for ``tree`` (arrays or ShapeDtypeStructs with
        shardings), whose layout is ``key``."""
        got = self._progs.get(key)
        return got if got is not None else self._progs.setdefault(key, pack_program(tree))

    def pack(self, key, tree, meta: dict, *, host: bool):
        """``(tree packed, meta with the format and manifest, Orbax's save args)``. The single
        leaves are ``tree``'s own (Orbax copies them to host). ``host`` (one process): each
        group is packed, copied to host and freed on the device before the next is packed, so
        a save holds at most one group (`PIECE_BYTES` per device) beyond the state; else
        (several processes: a global array cannot be a host array) the packed groups stay on
        the devices until Orbax copied them (the programs are collective launches, issued in
        the same order on every process, as the checksums are)."""
        man, progs = self.get(key, tree)
        leaves = jax.tree.leaves(tree)
        out: dict = {}
        for g, (grp, prog) in enumerate(zip(man["groups"], progs)):
            x = prog(*[leaves[i] for i, _ in grp["members"]])
            out.setdefault("packed", {})[str(g)] = _to_host(x) if host else x
        if man["singles"]:
            out["single"] = {str(i): leaves[i] for i in man["singles"]}
        return out, dict(meta, format=FORMAT, packing=man), save_args(out)


def save_args(packed: dict) -> dict:
    """Orbax ``SaveArgs`` for a packed item: the packed arrays written in chunks of at most
    `CHUNK_BYTES` (one chunk per array is compressed and written by one thread: on an H100
    host a 1.3 GB packed state took 4-7 s to commit, against 2 s for its 170 leaves), the
    single leaves as Orbax chooses."""
    import orbax.checkpoint as ocp

    out = {}
    if "packed" in packed:
        out["packed"] = {g: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES) for g in packed["packed"]}
    if "single" in packed:
        out["single"] = {i: ocp.SaveArgs() for i in packed["single"]}
    return out


def _spread(mesh, rows: int, cols: int) -> NamedSharding:
    """A packed ``(rows, cols)`` array read onto a mesh that does not hold its members as they
    were saved (an elastic restore): its rows, else its columns, over all of the mesh's
    devices or its largest axis that divides them; replicated (each device reads the whole
    group: transient memory) only where none does. The unpack program then moves each leaf
    into its target sharding on the devices."""
    names = tuple(mesh.axis_names)
    for axes in [names] + [(a,) for a in sorted(names, key=lambda a: -mesh.shape[a])]:
        n = int(np.prod([mesh.shape[a] for a in axes]))
        for dim, size in ((0, rows), (1, cols)):
            if n > 1 and size % n == 0:
                return NamedSharding(mesh, P(axes, None) if dim == 0 else P(None, axes))
    return NamedSharding(mesh, P())


def packed_abstract(abstract_state, man: dict) -> dict:
    """What to ask Orbax for: the packed arrays laid out on the target's mesh (``P(A, None)``
    where the target shards each member of the group as saved, else spread over the
    devices, `_spread`), the single leaves as the target has them."""
    leaves = jax.tree.leaves(abstract_state)
    out = {}
    if man["groups"]:
        packed = {}
        for g, grp in enumerate(man["groups"]):
            first = leaves[grp["members"][0][0]]
            sh = first.sharding
            cols = sum(c for _, c in grp["members"])
            axes = tuple(grp["axes"])
            keys = [_group_key(leaves[i]) for i, _ in grp["members"]]
            same = all(k is not None and k[1:] == (sh.mesh, axes, grp["rows"]) for k in keys)
            target = (NamedSharding(sh.mesh, P(axes or None, None)) if same else
                      _spread(sh.mesh, grp["rows"], cols) if isinstance(sh, NamedSharding) else
                      jax.sharding.SingleDeviceSharding(next(iter(sh.device_set))))
            packed[str(g)] = jax.ShapeDtypeStruct((grp["rows"], cols), np.dtype(grp["dtype"]), sharding=target)
        out["packed"] = packed
    if man["singles"]:
        out["single"] = {str(i): leaves[i] for i in man["singles"]}
    return out


def unpack(restored: dict, abstract_state, man: dict):
    """``abstract_state``'s tree from a restored packed item, in the target's shardings."""
    leaves, treedef = jax.tree.flatten(abstract_state)
    where = {}
    for g, grp in enumerate(man["groups"]):
        c0 = 0
        for i, cols in grp["members"]:
            where[i] = (str(g), c0, cols)
            c0 += cols

    @functools.partial(jax.jit, out_shardings=[x.sharding for x in leaves])
    def fn(packed, single):
        out = []
        for i, x in enumerate(leaves):
            if i in where:
                g, c0, cols = where[i]
                out.append(packed[g][:, c0:c0 + cols].reshape(x.shape))
            else:
                out.append(jnp.copy(single[str(i)]))
        return out

    return jax.tree.unflatten(treedef, fn(restored.get("packed", {}), restored.get("single", {})))
