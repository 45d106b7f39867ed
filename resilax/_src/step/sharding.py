"""Shardings: from what the user wrote (PartitionSpecs, or flax logical axis names plus
rules) to a ``NamedSharding`` per leaf on the current mesh, and how specs change when the
mesh shrinks.

Specs name mesh axes, not devices, so they stay valid when a failure removes devices; only
divisibility can break (64 rows over 4x2 devices fit, over 3x2 they do not): `fit_specs`
then drops the elastic axis from such a leaf (it stays sharded inside each domain and is
replicated across domains).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.errors import WrapError


def is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def spec_axes(spec: P) -> set[str]:
    out = set()
    for entry in spec:
        for ax in (entry if isinstance(entry, tuple) else (entry,)):
            if ax is not None:
                out.add(ax)
    return out


def from_logical(specs, rules: Sequence[tuple[str, Any]] | None):
    """Maps flax logical axis names to mesh axes.

    ``specs`` may hold ``PartitionSpec``s of logical names (``nn.get_partition_spec`` of a
    state built with ``nn.with_logical_partitioning``), or flax ``LogicallyPartitioned`` /
    ``Partitioned`` boxes (their ``names``). ``rules`` is flax's ``[(logical, mesh axis or
    None), ...]``. Without rules the specs are taken as mesh axes already.
    """
    import flax.linen as nn
    from flax.core import meta

    def boxed(x):
        return isinstance(x, meta.Partitioned)

    if any(boxed(x) for x in jax.tree.leaves(specs, is_leaf=boxed)):
        specs = nn.get_partition_spec(specs)
    if rules is None:
        return specs
    try:
        rules = tuple((str(a), b) for a, b in rules)
    except (TypeError, ValueError) as e:
        raise WrapError(f"resilax.wrap: logical_axis_rules must be a sequence of (logical name, mesh axis) pairs, "
                        f"but got {rules!r}") from e
    known = {a for a, _ in rules}

    def one(spec):
        if spec is None:
            return None
        names = [n for e in spec for n in (e if isinstance(e, tuple) else (e,)) if n is not None]
        missing = sorted(set(names) - known)
        if missing:
            raise WrapError(f"resilax.wrap: state_sharding uses logical axis name(s) {missing} that "
                            f"logical_axis_rules does not map; the rules name {sorted(known)}")
        return nn.logical_to_mesh_axes(spec, rules)

    return jax.tree.map(one, specs, is_leaf=is_spec)


def check_axes(specs, axis_names, argname: str, topo_name: str) -> None:
    for spec in jax.tree.leaves(specs, is_leaf=is_spec):
        if spec is None:
            continue
        if not isinstance(spec, P):
            raise WrapError(
                f"resilax.wrap: {argname} must be a jax.sharding.PartitionSpec or a pytree of them, "
                f"but got a leaf of type {type(spec).__name__}: {spec!r}"
            )
        for ax in spec_axes(spec):
            if ax not in axis_names:
                raise WrapError(
                    f"resilax.wrap: {argname} uses mesh axis {ax!r}, but topology {topo_name!r} has axes "
                    f"{list(axis_names)} (flax logical names need logical_axis_rules)"
                )


def full_specs(specs, tree, argname: str):
    """A spec per leaf of ``tree`` from a prefix tree of specs."""
    specs = jax.tree.map(lambda s: P() if s is None else s, specs, is_leaf=is_spec)
    try:
        return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree, is_leaf=is_spec)
    except (ValueError, TypeError) as e:
        raise WrapError(
            f"resilax: {argname} must be one PartitionSpec or a pytree prefix of the value it shards, "
            f"but its structure does not match: {e}"
        ) from None


def axis_size(mesh, entry) -> int:
    axes = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[a] for a in axes if a is not None)


def resolve(specs, tree, mesh, argname: str):
    """Prefix tree of specs + concrete tree -> NamedSharding per leaf, divisibility checked."""
    full = full_specs(specs, tree, argname)

    def one(path, spec, x):
        shape = np.shape(x)
        if len(spec) > len(shape):
            raise WrapError(
                f"resilax: {argname}{jax.tree_util.keystr(path)} is {spec} ({len(spec)} dims) but the value has shape {shape}"
            )
        for i, entry in enumerate(spec):
            if shape[i] % axis_size(mesh, entry):
                raise WrapError(
                    f"resilax: {argname}{jax.tree_util.keystr(path)}: dimension {i} of shape {shape} is not divisible "
                    f"by mesh axes {entry} of total size {axis_size(mesh, entry)} (mesh {dict(mesh.shape)})"
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, full, tree, is_leaf=is_spec)


def fit_specs(specs, tree, mesh, axis: str):
    """Per-leaf specs that fit ``mesh``; returns ``(specs, changed_paths)``: a leaf whose
    dimension no longer divides drops ``axis`` (the elastic one) from its spec."""
    full = full_specs(specs, tree, "state_sharding")
    changed = []

    def one(path, spec, x):
        shape = np.shape(x)
        if all(shape[i] % axis_size(mesh, e) == 0 for i, e in enumerate(spec)):
            return spec
        entries = []
        for e in spec:
            axes = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a is not None and a != axis)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        changed.append(jax.tree_util.keystr(path))
        return P(*entries)

    return jax.tree_util.tree_map_with_path(one, full, tree, is_leaf=is_spec), changed


def place_copy(tree, shardings):
    """A real copy of ``tree`` laid out as ``shardings``.

    ``jax.device_put(x, s, may_alias=False)`` still shares the source's buffer on the device
    it already lives on (seen with jax 0.10.2 on CPU), and a later donation would delete the
    caller's array; a jitted copy always writes fresh buffers.
    """
    if jax.process_count() > 1:
        tree = put(jax.tree.map(np.asarray, tree), shardings)
    # one module-level function: JAX's caches then serve a second `init` on a layout (a new
    # lambda per call traced, lowered and compiled its copy again)
    return jax.jit(copy_tree, out_shardings=shardings)(tree)


def copy_tree(t):
    """Traced: a copy of every leaf (jit this module-level function, never a lambda per call:
    JAX's caches are keyed by the function)."""
    return jax.tree.map(jnp.copy, t)


def put(tree, shardings):
    """Host values -> device arrays laid out as ``shardings`` (a matching tree or one sharding).

    One process: ``jax.device_put``. Several (``jax.distributed``): every process holds the
    same global host value and builds only its addressable shards from it, with no
    collective. ``jax.device_put`` would run an all-gather per call to assert the values
    agree (per batch), and that check calls two NaN values different.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    shs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    if len(shs) == 1 and len(leaves) != 1:
        shs = shs * len(leaves)

    def one(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.unflatten(treedef, [one(x, s) for x, s in zip(leaves, shs, strict=True)])


def local_shards(x) -> tuple[list, bool]:
    """This process's shards of the array ``x``, one per distinct index (a leaf replicated over
    local devices has several copies of each), and whether they cover every element."""
    out, covered = {}, 0
    for s in x.addressable_shards:
        key = tuple(sl.indices(n)[:2] for sl, n in zip(s.index, x.shape))
        if key not in out:
            out[key] = s
            covered += s.data.size
    return list(out.values()), covered == x.size


def as_array(x):
    """Host values get the dtype JAX will give them (int64 -> int32 unless x64 is on)."""
    if isinstance(x, jax.Array):
        return x
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def batch_key(batch):
    """``(treedef, shapes and dtypes)`` of a batch of host or device arrays (None when a leaf
    is anything else): equal keys need no second `check_batch`. Cheaper than `abstract`."""
    leaves, tdef = jax.tree.flatten(batch)
    if not all(isinstance(x, (np.ndarray, jax.Array)) for x in leaves):
        return None
    return tdef, tuple((x.shape, x.dtype) for x in leaves)


def check_batch(batch, expected) -> None:
    """Raises WrapError unless ``batch`` has ``expected``'s structure, shapes and dtypes."""
    got = abstract(batch)
    if jax.tree.structure(got) != jax.tree.structure(expected) or any(
            a.shape != b.shape or a.dtype != b.dtype for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))):
        raise WrapError(f"resilax.ResilientStep: every batch must have the first batch's structure, shapes and dtypes "
                        f"(the compiled step and the record log depend on them), but got {got} after {expected}")


def abstract(tree, shardings=None):
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=s), tree, shardings)


def same_abstract(a, b) -> bool:
    """Whether two abstract batches have the same tree, shapes and dtypes."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(la, lb))


def replicated(abstract_tree, mesh):
    """``abstract_tree``'s leaves as abstract arrays replicated on ``mesh``."""
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), abstract_tree)
