"""The per-stage programs of `executor.PipelineExecutor` (forward, backward, accumulation,
update, verdict), compiled once per stage shape, and the executor's module-level helpers:
fault-plan checks, the separable-optimizer check, and the checkpoint writer the bubbles
share."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from resilax._src.errors import PipelineError
from resilax._src.protect.checksum import tree_checksums

_FAULT_KINDS = {"fail_slice": ("before_step", "after_step", "mid_step", "during_save"),
                "rejoin": ("before_step", "after_step"), "nan": None, "spike": None,
                "kill_process": ("after_step", "mid_step")}


def _check_faults(faults, domains) -> list:
    from resilax._src.runtime.faults import Fault, FaultPlan

    plan = faults.pending if isinstance(faults, FaultPlan) else [f if isinstance(f, Fault) else Fault.parse(f)
                                                                  for f in faults]
    for f in plan:
        where = f"resilax.PipelineExecutor: fault {f.spec()!r}"
        if f.kind not in _FAULT_KINDS:
            raise PipelineError(f"{where}: the executor injects {sorted(_FAULT_KINDS)}, not {f.kind}")
        if _FAULT_KINDS[f.kind] is not None and f.phase not in _FAULT_KINDS[f.kind]:
            raise PipelineError(f"{where}: {f.kind} happens at {_FAULT_KINDS[f.kind]}, not {f.phase}")
        if f.kind in ("fail_slice", "rejoin") and not (f.target is not None and 0 <= f.target < domains):
            raise PipelineError(f"{where}: needs a target domain K = replica * stages + stage in [0, {domains})")
    return list(plan)


def _device_of(tree):
    return next(iter(jax.tree.leaves(tree)[0].devices()))


def _abstract(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


@jax.jit
def _sums(tree):
    return tree_checksums(tree)


def write_checkpoint(mgr, step: int, tree) -> None:
    """Saves ``tree`` (``{"stage_000": (params, opt), ..., "guard": ...}``, device or host
    arrays) as checkpoint ``step`` with its checksums (taken in sorted key order, the order
    Orbax hands the tree back in), as `PipelineExecutor.restore` verifies them."""
    import orbax.checkpoint as ocp

    sums = np.concatenate(jax.device_get([_sums(tree[k]) for k in sorted(tree)]))
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                           meta=ocp.args.JsonSave({"step": step, "sums": sums.tolist()})))


_PROGRAMS: dict = {}


def _programs(model, tx, L, k, S, anomaly) -> "_Programs":
    """One set of programs per (model, optimizer, layer layout, anomaly config) in this
    process: a second executor of the same job (a reference run, a restart in place)
    compiles nothing."""
    key = (model, tx, L, k, S, anomaly)
    try:
        if key not in _PROGRAMS:
            if len(_PROGRAMS) >= 8:
                _PROGRAMS.pop(next(iter(_PROGRAMS)))
            _PROGRAMS[key] = _Programs(model, tx, L, k, S, anomaly)
        return _PROGRAMS[key]
    except TypeError:  # an unhashable optimizer or model
        return _Programs(model, tx, L, k, S, anomaly)


class _Programs:
    """The per-stage programs, jitted once per stage shape (JAX compiles each for the device
    it is called on; a compilation cache that leaves out the device, as the test suite's,
    shares one binary)."""

    def __init__(self, model, tx, L, k, S, anomaly):
        self.model, self.tx, self.L, self.k, self.S = model, tx, L, k, S
        self._fwd = {}
        self.bwd_x = jax.jit(lambda vjp, ct: vjp(ct)[1])
        self.bwd_w = jax.jit(lambda vjp, ct: vjp(ct)[0])
        self.bwd = jax.jit(lambda vjp, ct: vjp(ct))
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        self.combine = jax.jit(_combine)
        self.verdict = jax.jit(functools.partial(_verdict, anomaly))
        self.update = jax.jit(self._update)
        self.commit = jax.jit(lambda verdict, new, old: jax.tree.map(lambda a, b: jnp.where(verdict == 0, a, b), new, old))
        self.loss = jax.jit(lambda ls, ws: _ordered_sum(ls) / _ordered_sum(ws))

    def fwd(self, s):
        kind = (s == 0, s == self.S - 1)
        if kind not in self._fwd:
            self._fwd[kind] = jax.jit(self._make_fwd(*kind))
        return self._fwd[kind]

    def _make_fwd(self, first, last):
        model, L, k = self.model, self.L, self.k

        def fwd(p, x, batch, key, layer0):
            def f(p, x):
                h = model.first(p["first"], batch, jax.random.fold_in(key, L)) if first else x
                for j in range(k):
                    h = model.layer(jax.tree.map(lambda a: a[j], p["blocks"]), h, jax.random.fold_in(key, layer0 + j))
                if last:
                    loss_sum, weight = model.last(p["last"], h, batch, jax.random.fold_in(key, L + 1))
                    return loss_sum, weight
                return h

            if last:
                loss_sum, vjp, weight = jax.vjp(f, p, x, has_aux=True)
                return (loss_sum, jnp.asarray(weight, jnp.float32)), vjp
            return jax.vjp(f, p, x)

        return fwd

    def _update(self, p, o, g):
        updates, o2 = self.tx.update(g, o, p)
        return optax.apply_updates(p, updates), o2


def _verdict(cfg, flags, loss, guard):
    """``(verdict, guard)``: 0 applies the step; 1 (NaN/Inf in a gradient or the loss) or 2
    (the loss spikes against the window of good steps, `AnomalyConfig`) skip it. The window
    moves only on applied steps, as in `resilax.wrap`'s programs."""
    from resilax._src.protect import anomaly as _anomaly

    finite = jnp.all(jnp.stack(flags)) & jnp.isfinite(loss)
    if cfg is None or cfg.spike_zscore is None:
        spike = jnp.zeros((), bool)
    else:
        spike = (guard["count"] >= cfg.min_history) & (_anomaly.zscore(guard, loss) > cfg.spike_zscore)
    verdict = jnp.where(finite, jnp.where(spike, _anomaly.SPIKE, _anomaly.OK), _anomaly.NONFINITE).astype(jnp.int32)
    return verdict, _anomaly.advance(guard, loss.astype(jnp.float32), verdict == _anomaly.OK)


def _ordered_sum(xs):
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


def _combine(accs, weights):
    """``(sum_v acc_v / sum w, all finite)``, each sum in index order."""
    total = _ordered_sum([w.astype(jnp.float32) for w in weights])
    g = jax.tree.map(lambda *a: _ordered_sum(list(a)) / total.astype(a[0].dtype), *accs)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)]))
    return g, finite


def _check_separable(tx, params, stages, k) -> None:
    """Refuses an optimizer whose update of a stage depends on another stage's gradients
    (``clip_by_global_norm``, a global learning-rate scale): applied per stage it would
    silently be another optimizer. One update of random gradients, whole vs per stage."""
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: (rng.standard_normal(np.shape(x)) * 10).astype(np.asarray(x).dtype), params)
    upd_whole, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for s, p in enumerate(stages):
        g = {"first": grads["first"] if p["first"] is not None else None,
             "blocks": jax.tree.map(lambda a: a[s * k:(s + 1) * k], grads["blocks"]),
             "last": grads["last"] if p["last"] is not None else None}
        upd, _ = jax.jit(tx.update)(g, tx.init(p), p)
        want = jax.tree.map(lambda a: a[s * k:(s + 1) * k], upd_whole["blocks"])
        for a, b in zip(jax.tree.leaves(upd["blocks"]), jax.tree.leaves(want)):
            if not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6):
                raise PipelineError(
                    "resilax.PipelineExecutor: the optimizer is not separable by stage: stage "
                    f"{s}'s update from its own gradients differs from the whole model's (an optimizer that reduces "
                    "over every parameter, e.g. optax.clip_by_global_norm, would silently become another one); use "
                    "an elementwise optimizer (sgd, adam, adamw)")
