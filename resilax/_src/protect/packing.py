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
    "singles": [leaf index, ...]}``, JSON-able."""
    groups: dict = {}
    singles = []
    for i, x in enumerate(jax.tree.leaves(tree)):
        key = _group_key(x)
        if key is None:
            singles.append(i)
            continue
        groups.setdefault(key, []).append([i, int(np.prod(x.shape)) // key[3]])
    out = [{"dtype": k[0], "axes": list(k[2]), "rows": k[3], "members": m} for k, m in groups.items()]
    return {"groups": out, "singles": singles}


def pack_program(tree):
    """``(manifest(tree), a compiled program: tree's leaves -> {"packed": {g: (R, C)},
    "single": {i: leaf}})``, every output a new buffer, for ``tree``'s shapes and shardings."""
    leaves = jax.tree.leaves(tree)
    man = manifest(tree)

    def fn(xs):
        out = {}
        packed = {str(g): jnp.concatenate([xs[i].reshape(grp["rows"], -1) for i, _ in grp["members"]], axis=1)
                  for g, grp in enumerate(man["groups"])}
        if packed:
            out["packed"] = packed
        if man["singles"]:
            out["single"] = {str(i): jnp.copy(xs[i]) for i in man["singles"]}
        return out

    out_sh = {}
    if man["groups"]:
        out_sh["packed"] = {str(g): NamedSharding(leaves[grp["members"][0][0]].sharding.mesh,  # the group's mesh
                                                  P(tuple(grp["axes"]) or None, None))
                            for g, grp in enumerate(man["groups"])}
    if man["singles"]:
        out_sh["single"] = {str(i): leaves[i].sharding for i in man["singles"]}
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    return man, jax.jit(fn, out_shardings=out_sh).lower(abstract).compile()


class Packers:
    """The compiled pack program per layout (`pack_program`), made once: by the store's
    warm-up (off the loop) or, if a save comes first, by the persister. Two threads asking
    at once for a new layout may both compile it; one is kept."""

    def __init__(self):
        self._progs: dict = {}

    def get(self, key, tree):
        """``(manifest, compiled)`` for ``tree`` (arrays or ShapeDtypeStructs with shardings),
        whose layout is ``key``."""
        got = self._progs.get(key)
        return got if got is not None else self._progs.setdefault(key, pack_program(tree))

    def pack(self, key, tree, meta: dict):
        """``(tree packed, meta with the format and manifest, Orbax's save args)``: a new
        device copy of ``tree`` (one program: on several processes a collective launch,
        issued in the same order on each, as the checksums are)."""
        man, prog = self.get(key, tree)
        packed = prog(jax.tree.leaves(tree))
        return packed, dict(meta, format=FORMAT, packing=man), save_args(packed)


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


def out_abstract(compiled) -> dict:
    """The packed item a compiled pack program makes, as ShapeDtypeStructs with shardings
    (what the warm-up plans Orbax's slices of, with no device memory)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding), compiled.out_info)


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
