"""The per-step hooks that give a `ResilientStep` its replay log and anomaly rollback.

`ResilientStep` calls four hooks when ``Config.replay_log != "off"``: `Guard.step_fn`
(the compiled program), `Guard.on_init` (restore = checkpoint + replay), `Guard.run`
(dispatch, log, lagged anomaly check, rollback) and `Guard.on_save`. The log and replay
live in `_replay`, detection in `_anomaly`; this module only wires them to the step.
"""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.protect.anomaly import AnomalyError, SpikeDetector, Verdict, finite_flag, poison_batch
from resilax._src.protect.checkpoint import decode_data_state, encode_data_state
from resilax._src.protect.checksum import tree_checksums
from resilax._src.errors import ReplayLogError, WrapError
from resilax._src.protect.replay_log import ReplayLog, SelectivePolicy, batch_signature, batch_template, replay
from resilax._src.step.split import update_reads_batch


def _copy(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def recorded_shardings(state, state_sh, recorded, mesh):
    """Where the recorded values live between the two programs (and in replay): each leaf
    gets the sharding of the first state leaf of its shape (the param it is the gradient
    of), else replicated. Replicating them all cost an all-gather per step under FSDP.
    A pure function of shapes and the state's shardings, so the original step and a replay
    feed the update executable identically laid-out inputs."""
    table = {}
    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(state_sh)):
        table.setdefault(tuple(np.shape(x)), sh)
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda r: table.get(tuple(r.shape), rep), recorded)


class Guard:
    """Replay log + anomaly rollback for one `ResilientStep` (see the module docstring)."""

    def __init__(self, config, split):
        self.config = config
        self.split = split
        self.mode = config.replay_log
        self.spikes = SpikeDetector(config.spike_zscore, config.spike_window) if config.anomaly else None
        self.log: ReplayLog | None = None
        self.poison_next = False
        self._pending: Verdict | None = None
        self._base = None  # (step, device copy of the state) rollback starts from
        self._data_pos = None  # encoded iterator position before the next batch
        self._batch_sig = None
        self._updates: dict = {}
        self._last_save = None
        self._sum_steps: set[int] = set()  # steps whose entry carries the input state's checksums

    # ---------------------------------------------------------- compiled step
    def step_fn(self, state, batch, step_no):
        """The whole step in one program, returning ``(state, metrics, extras)``; extras
        hold the recorded values (grads mode) and the finite flag and loss for the lagged
        anomaly check. The input state's checksums are not computed here: see `_sums`."""
        new_state, metrics, rec = self.split.full(state, batch, step_no)
        extras = {"rec": rec if self.mode == "grads" else None, "finite": None, "loss": None}
        if self.config.anomaly:
            extras["finite"] = finite_flag(rec, metrics)
            if isinstance(metrics, dict) and self.config.anomaly_metric in metrics:
                extras["loss"] = jnp.asarray(metrics[self.config.anomaly_metric], jnp.float32)
        return new_state, metrics, extras

    # ---------------------------------------------------------- init
    def on_init(self, rs, state):
        """Opens the log, replays it from the restored step (``rs.step``) as far as it has
        good entries, and returns the state there (``rs.step`` updated)."""
        cfg = self.config
        directory = cfg.replay_log_dir or (
            f"{cfg.checkpoint_dir}/replay_log" if cfg.checkpoint_dir else tempfile.mkdtemp(prefix="resilax-log-")
        )
        if self.log is None:
            self.log = ReplayLog(directory, policy=SelectivePolicy(cfg.log_budget_bytes), max_lag=cfg.replay_max_lag)
        data = rs._data
        self._data_pos = encode_data_state(data.get_state()) if data is not None else None
        start = rs.step
        self.log.truncate_before(start)
        if start in self.log.steps():
            r = replay(state, self.log, start, None, update=self._update_fn(rs), full=self._full_fn(rs), data=data,
                       decode_data_state=decode_data_state, checksums=tree_checksums, strict=False)
            state = r.state
            if data is not None and r.data_next is not None:
                data.set_state(decode_data_state(r.data_next))
                self._data_pos = r.data_next
            rs.step = r.step
            rs._event(
                "replay", r.step, source="replay_log", from_step=start, steps=r.step - start,
                grads_steps=r.modes.count("grads"), inputs_steps=r.modes.count("inputs"), seconds=r.seconds,
                unreplayable=[{"step": s, "reason": why} for s, why in r.failed],
            )
        # Entries from here on (corrupt, beyond a gap, or simply stale) will be written again.
        self.log.discard_from(rs.step, f"resumed at step {rs.step}; later entries will be recomputed")
        if cfg.anomaly:
            self._base = (rs.step, _copy(state))
        self._last_save = rs.step if rs._ckpt is not None and rs._ckpt.steps() else None
        self._sum_steps = {rs.step}
        return state

    def _sums(self, state, k):
        """Checksums of the state step ``k`` starts from, only where a replay can start:
        the step after init/resume and after each checkpoint (`on_save`); those are the
        only start states `replay` checks. Every other step skips them: hashing the whole
        state each step cost ~25% of a CPU step. Dispatched before the step, which
        donates ``state`` afterwards (the runtime orders the two)."""
        if k not in self._sum_steps:
            return None
        self._sum_steps.discard(k)
        return tree_checksums(state)

    def _full_fn(self, rs):
        def full(state, batch, step):
            if rs._jitted is None:
                self._first_batch(rs, state, batch)
            new_state, _, _ = rs._jitted(state, jax.device_put(batch, rs._batch_sh), np.uint32(step))
            return new_state
        return full

    def _update_fn(self, rs):
        """``(state, step, recorded_leaves, batch_sig) -> state``: only `Split.update`, jitted
        per batch signature; the batch is a zero template that is dead code."""
        def update(state, step, leaves, sig):
            key = repr(sig)
            if key not in self._updates:
                template = batch_template(sig)
                abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
                rec_shape = jax.eval_shape(lambda s, b: self.split.full(s, b, jnp.uint32(0))[2], abstract, template)
                treedef = jax.tree.structure(rec_shape)

                def fn(s, n, r):
                    zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), template)
                    return self.split.update(s, zeros, n, r)

                jitted = jax.jit(fn, out_shardings=rs._state_sh, donate_argnums=(0,))
                self._updates[key] = (jitted, treedef, jax.tree.leaves(rec_shape))
            jitted, treedef, shapes = self._updates[key]
            flat = leaves if isinstance(leaves, list) else jax.tree.leaves(leaves)
            if len(flat) != len(shapes) or any(a.shape != s.shape for a, s in zip(flat, shapes)):
                raise ReplayLogError(f"resilax replay: the grads entry for step {step} does not fit what the step records")
            if isinstance(leaves, list):  # host arrays from the log
                where = jax.tree.leaves(recorded_shardings(state, rs._state_sh, shapes, rs.mesh))
                leaves = jax.tree.unflatten(treedef, jax.device_put(leaves, where))
            return jitted(state, np.uint32(step), leaves)
        return update

    def _grads_step(self, rs):
        """Grads mode: the step as the gradient part then the update part, dispatched back
        to back (recorded values stay on device, no host round-trip). The update part is
        the very executable replay runs, so a replayed step is bitwise the original by
        construction: as one program, XLA may fuse cheap gradient ops into the optimizer's
        fusions and round differently (seen with BatchNorm scales on CPU)."""
        rep = NamedSharding(rs.mesh, P())

        def grad_part(state, batch, step_no):
            rec, metrics = self.split.grad(state, batch, step_no)
            extras = {"finite": None, "loss": None}
            if self.config.anomaly:
                extras["finite"] = finite_flag(rec, metrics)
                if isinstance(metrics, dict) and self.config.anomaly_metric in metrics:
                    extras["loss"] = jnp.asarray(metrics[self.config.anomaly_metric], jnp.float32)
            return rec, metrics, extras

        rec_shape, metrics_shape, _ = jax.eval_shape(
            grad_part, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), rs._abstract_args))
        metrics_sh = jax.tree.map(lambda _: rep, metrics_shape)
        rec_sh = recorded_shardings(rs._abstract_args[0], rs._state_sh, rec_shape, rs.mesh)
        gj = jax.jit(grad_part, in_shardings=(rs._state_sh, rs._batch_sh, rep), out_shardings=(rec_sh, metrics_sh, None))
        update = self._update_fn(rs)

        def step(state, batch, step_no):
            rec, metrics, extras = gj(state, batch, step_no)
            new_state = update(state, int(step_no), rec, self._batch_sig)
            return new_state, metrics, dict(extras, rec=rec)

        return step

    def _first_batch(self, rs, state, batch):
        rs._build(state, batch)
        if self.mode != "grads":  # inputs mode runs the one fused program: compile it now
            rs._compile(state, batch)
            return
        self._batch_sig = batch_signature(batch)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
        ab = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
        rec = jax.eval_shape(lambda s, b: self.split.full(s, b, jnp.uint32(0))[2], abstract, ab)
        if rec is None:
            raise WrapError("resilax.wrap: replay_log='grads' needs train_step to call resilax.record(...) on the optimizer inputs")
        reads = update_reads_batch(self.split, abstract, ab, rec)
        if reads:
            raise WrapError(
                f"resilax.wrap: replay_log='grads' replays only the update from the recorded values, but the update "
                f"part of train_step still reads batch{', batch'.join(reads)} (not through resilax.record). Record "
                f"everything the update needs, e.g. resilax.record((grads, new_batch_stats)), or use replay_log='inputs'"
            )
        rs._abstract_args = (state, batch, np.uint32(0))
        rs._jitted = self._grads_step(rs)

    # ---------------------------------------------------------- the step
    def run(self, rs, state, batch):
        """Dispatches one step, queues its log entry, checks the previous step (lagged) and
        rolls back on an anomaly. Advances ``rs.step``; returns ``(state, metrics)``."""
        k = rs.step
        if self.poison_next:
            self.poison_next = False
            batch = poison_batch(batch)
        if rs._jitted is None:
            self._first_batch(rs, state, batch)
        before = self._data_pos
        after = encode_data_state(rs._data.get_state()) if rs._data is not None else None
        sums = self._sums(state, k)
        new_state, metrics, ex = rs._jitted(state, jax.device_put(batch, rs._batch_sh), np.uint32(k))
        self._data_pos = after
        self.log.append(k, recorded=ex["rec"], state_sums=sums, data_state=before, data_next=after,
                        batch_sig=self._batch_sig)
        rs.step = k + 1
        if not self.config.anomaly:
            return new_state, metrics
        verdict = Verdict(k, ex["finite"], ex["loss"])
        prev, self._pending = self._pending, verdict
        if prev is not None:
            bad = prev.cause(self.spikes)
            if bad:
                return self._rollback(rs, prev.step, bad, rerun=(batch, before, after), metrics=metrics)
        every = self.config.checkpoint_every
        if rs._ckpt is not None and every and rs.step % every == 0:
            # About to be checkpointed: check now (the save synchronises anyway).
            self._pending = None
            bad = verdict.cause(self.spikes)
            if bad:
                return self._rollback(rs, k, bad, rerun=None, metrics=metrics)
        return new_state, metrics

    def _rollback(self, rs, j, bad, *, rerun, metrics):
        cause, detail = bad
        base_step, base = self._base
        if self.config.on_anomaly == "stop":
            raise AnomalyError(
                f"resilax: step {j} is anomalous ({detail}); Config.on_anomaly='stop'. The good state at step {j} "
                f"can be rebuilt from step {base_step} and the replay log (init resumes there).",
                step=j, cause=cause,
            )
        t0 = time.perf_counter()
        self.log.wait()
        try:
            skipped_pos = self.log.read(j, "inputs").data_state
            skipped_pos = None if skipped_pos is None else decode_data_state(skipped_pos)
        except ReplayLogError:
            skipped_pos = None
        self.log.discard_from(j, f"rollback: step {j} {cause}")
        try:
            r = replay(_copy(base), self.log, base_step, j, update=self._update_fn(rs), full=self._full_fn(rs),
                       data=rs._data, decode_data_state=decode_data_state, strict=True)
        except ReplayLogError as e:
            raise AnomalyError(
                f"resilax: step {j} is anomalous ({detail}) and the good state before it cannot be rebuilt: {e}",
                step=j, cause=cause,
            ) from e
        self._pending = None
        rs.step = j
        rs._event(
            "rollback", j, cause=cause, detail=detail, source="checkpoint" if base_step and rs._ckpt else "retained",
            from_step=base_step, replayed_steps=j - base_step, seconds=time.perf_counter() - t0,
            batches_skipped=[{"step": j, "data_state": skipped_pos}],
        )
        state = r.state
        if rerun is None:
            if rs._data is not None and self._data_pos is not None:
                rs._data.set_state(decode_data_state(self._data_pos))
            return state, metrics
        batch, before, after = rerun
        if rs._data is not None and after is not None:
            rs._data.set_state(decode_data_state(after))
        self._data_pos = before
        return self.run(rs, state, batch)

    # ---------------------------------------------------------- checkpoints
    def on_save(self, rs, state):
        """Before a checkpoint of ``state`` at ``rs.step``: refuse an anomalous state, move
        the rollback base here, and truncate the log before the previous checkpoint (which
        Orbax has committed by the time a new save starts)."""
        if self._pending is not None:
            v, self._pending = self._pending, None
            bad = v.cause(self.spikes)
            if bad:
                raise AnomalyError(
                    f"resilax: not saving checkpoint {rs.step}: step {v.step} is anomalous ({bad[1]})",
                    step=v.step, cause=bad[0],
                )
        if self.config.anomaly:
            self._base = (rs.step, _copy(state))
        if self._last_save is not None:
            self.log.truncate_before(self._last_save)
        self._last_save = rs.step
        self._sum_steps.add(rs.step)

    def close(self):
        if self.log is not None:
            self.log.close()
