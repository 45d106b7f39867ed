"""Elastic steps: the same global batch and the same maths on fewer failure domains.

After a domain is lost the elastic mesh axis shrinks from ``D`` to ``D'`` entries. The
global batch stays the same; it is cut into ``m`` equal microbatches (``m * D' >= D``, so
the per-device batch never grows), `Split.grad` runs once per microbatch, the recorded
values are combined as the mean of the microbatch means, and `Split.update` runs once.

Contract on the user's step: the values passed to `resilax.record` are **batch means**
(e.g. gradients of a mean loss). Then the mean of ``m`` equal-size microbatch means is the
full-batch mean, and the update is the one the full mesh would apply, up to floating
point reassociation of the sum (not bitwise). A step whose recorded value is a batch
*sum* would be scaled by ``1/m`` here: do not do that.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from resilax._src.errors import WrapError


def microbatch_count(batch_size: int, full_domains: int, mesh, batch_axes_size: int) -> int:
    """Smallest ``m`` with ``m * D' >= D`` that splits the global batch evenly and shardably.

    Args:
      batch_size: global batch size (leading dim of every batch leaf).
      full_domains: ``D``, domains of the failure-free mesh.
      mesh: the current (smaller) mesh.
      batch_axes_size: product of the mesh axes the batch's leading dim is sharded over.

    Raises:
      WrapError: no such ``m`` exists; the message names the sizes.
    """
    d_now = mesh.shape[mesh.axis_names[0]]
    lo = max(1, math.ceil(full_domains / d_now))
    for m in range(lo, batch_size + 1):
        if batch_size % m == 0 and (batch_size // m) % batch_axes_size == 0:
            return m
    raise WrapError(
        f"resilax elastic step: the global batch of {batch_size} cannot be cut into m >= {lo} equal microbatches "
        f"each divisible by the {batch_axes_size} devices its leading dim is sharded over on the degraded mesh "
        f"{dict(mesh.shape)} (failure-free mesh had {full_domains} domains); use a global batch divisible by "
        f"{lo} * {batch_axes_size}"
    )


def microbatch_specs(batch_specs):
    """``P(a, ...)`` -> ``P(None, a, ...)``: the microbatch index is the new leading dim."""
    return jax.tree.map(lambda s: P(None, *s), batch_specs, is_leaf=lambda x: isinstance(x, P))


def split_batch(batch, m: int):
    """Host batch ``[B, ...]`` -> ``[m, B/m, ...]`` (contiguous equal microbatches)."""
    return jax.tree.map(lambda x: np.reshape(np.asarray(x), (m, np.shape(x)[0] // m) + np.shape(x)[1:]), batch)


def accumulate(split, m: int):
    """``(state, mbatch, step_no) -> (state, metrics, recorded)``, gradient-accumulated.

    ``mbatch`` leaves are ``[m, B/m, ...]``. Microbatches run in order (unrolled), the
    recorded means are summed left to right and divided by ``m``; metrics are averaged the
    same way (floating metrics) or taken from the last microbatch (others).
    """

    def fn(state, mbatch, step_no):
        recs, mets = [], []
        for i in range(m):
            mb = jax.tree.map(lambda x: x[i], mbatch)
            r, met = split.grad(state, mb, step_no)
            recs.append(r)
            mets.append(met)
        rec = jax.tree.map(lambda *xs: _mean(xs), *recs)
        metrics = jax.tree.map(
            lambda *xs: _mean(xs) if jax.numpy.issubdtype(xs[0].dtype, jax.numpy.inexact) else xs[-1], *mets
        )
        first = jax.tree.map(lambda x: x[0], mbatch)
        new_state = split.update(state, first, step_no, rec)
        return new_state, metrics, rec

    return fn


def _mean(xs):
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc / len(xs) if len(xs) > 1 else acc


def fit_specs(specs, tree, mesh, axis: str):
    """Per-leaf specs that fit ``mesh``; returns ``(specs, changed_paths)``.

    A leaf sharded over the elastic axis may stop dividing when that axis shrinks (64 rows
    over 4x2 devices fit, over 3x2 they do not). Such a leaf drops the elastic axis from its
    spec: it stays sharded inside each domain and is replicated across domains (more memory
    per device, and no peer copy needed). Leaves that still divide keep their spec.
    """
    is_p = lambda x: x is None or isinstance(x, P)  # noqa: E731
    specs = jax.tree.map(lambda s: P() if s is None else s, specs, is_leaf=is_p)
    full = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree, is_leaf=is_p)
    changed = []

    def size(entry):
        axes = entry if isinstance(entry, tuple) else (entry,)
        return math.prod(mesh.shape[a] for a in axes if a is not None)

    def one(path, spec, x):
        shape = np.shape(x)
        if all(shape[i] % size(e) == 0 for i, e in enumerate(spec)):
            return spec
        entries = []
        for e in spec:
            axes = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a is not None and a != axis)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        changed.append(jax.tree_util.keystr(path))
        return P(*entries)

    out = jax.tree_util.tree_map_with_path(one, full, tree, is_leaf=is_p)
    return out, changed
