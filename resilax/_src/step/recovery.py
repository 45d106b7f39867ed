"""Recovery from a lost, corrupted, hung or returning failure domain (`Recovery`).

It holds the failure bookkeeping (dead devices, pending failures, the buffers held at the
failure), the emulated domain faults, the liveness watchdog's step boundary, the
plan-restore-redo recovery on the survivors' mesh, rejoining a domain, and the rebuilt
witness state of the replica check.

`Recovery` holds a reference to the step (`ResilientStep`) and reads it through its public
attributes and read-only properties; it changes the run only through the step's public state
(``live``, ``guard``) and its hooks (``moved``, ``mark_broken``, ``compile_ahead``).
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilax._src.errors import ReplayLogError, StateLostError, WrapError
from resilax._src.protect import anomaly as _anomaly
from resilax._src.protect import base as _base
from resilax._src.protect import planner as _planner
from resilax._src.protect import ring as _ring
from resilax._src.protect.disk_log import scalar_value


def newest_checkpoint(ckpt) -> str:
    """Where the newest good checkpoint is, for an error message (``ckpt``: the run's
    `Checkpoints`, or None)."""
    if ckpt is None:
        return "no checkpoints are kept (Config.checkpoint is None)"
    steps = ckpt.store.steps()
    return (f"the newest checkpoint is step {steps[-1]} in {str(ckpt.store.directory)!r}" if steps
            else f"no checkpoint was committed yet in {str(ckpt.store.directory)!r}")


class Recovery:
    """What a run does about a lost, corrupted, hung or returning failure domain.

    ``recover()``: the step's recovery of the pending failures (a goodput span around
    `recover_pending`); called when a health check fails domains or before a rejoin."""

    def __init__(self, run, recover: Callable[[], None]):
        self.run = run
        self._recover = recover
        self.dead: set = set()  # devices lost so far
        self.failures: list[dict] = []  # domains failed since the last recovery
        self.bufmaps: dict = {}  # id(array) -> {device: buffer}, mapped at the first failure
        self.held: list = []  # keeps ids stable while the maps are in use

    @property
    def pending(self) -> bool:
        """Whether a failed domain waits for a recovery."""
        return bool(self.failures)

    def mark_dead(self, devices) -> None:
        """``devices`` are lost (their process died: an in-place shrink)."""
        self.dead |= set(devices)

    def host_replica(self, x):
        """Host copy of a replicated array from any surviving device's buffer."""
        return host_replica(x, self.bufmaps)

    # ---------------------------------------------------------------- faults on a domain
    def _check_domain(self, domain: int, what: str) -> None:
        n = len(self.run._domains)
        if not 0 <= domain < n:
            raise WrapError(f"resilax {what}: target must be a failure domain index in [0, {n}), but got {domain}")

    def fail_domain(self, domain: int, phase: str, at: float | None = None) -> dict | None:
        """Emulates losing failure domain ``domain`` (original index): its memory is gone.

        Blocks on in-flight work first (the surviving domains finish the step; deleting a
        buffer a running computation reads can crash the process), then deletes every
        buffer resilax holds on the domain's devices and marks them dead; nothing is
        dispatched to them again. A domain that is already dead: nothing happens (an event
        says so). ``at``: when the failure began (``time.perf_counter()``), given by a caller
        that waited for its detection and booked that wait in the goodput record itself
        (a hang); default now. The next step boundary recovers.
        """
        run = self.run
        self._check_domain(domain, "fail_slice")
        devs = set(run._domains[domain])
        ckpt, log = run._checkpointer, run._record_log
        if ckpt is not None:  # a snapshot being handed to Orbax reads device buffers: let it finish
            ckpt.store.settle()
        if devs <= self.dead:
            run._event("fault_ignored", run.step, fault="fail_slice", domain=domain, phase=phase,
                      reason="the domain is already dead")
            return None
        if not self.failures:  # first failure since the last recovery: map what we hold
            held = [x for x in jax.tree.leaves((run._live, run._guard)) if isinstance(x, jax.Array)]
            if log is not None:
                if phase in ("mid_step", "during_peer_copy"):
                    held += log.drop_pending()  # the step in flight: its entry dies with the domain
                else:
                    log.settle()  # the step completed: its entry is durable
                if log.disk is not None:
                    log.disk.wait(max_pending=0)  # host copies already started land first
            for p in run._protections:
                held += p.held()
            jax.block_until_ready(held)
            self.bufmaps = {id(a): _ring.buffers(a) for a in held}
            self.held = held
        freed = _ring.delete_on(self.bufmaps.values(), devs)
        self.dead |= devs
        if run._liveness is not None:
            run._liveness.lost(domain)
        info = {"domain": domain, "phase": phase, "devices": sorted(d.id for d in devs), "bytes_deleted": freed,
                "copy_in_flight": bool(run._copy_in_flight), "at": time.perf_counter() if at is None else at,
                "detection_booked": at is not None}
        self.failures.append(info)
        return info

    def corrupt_domain(self, domain: int, phase: str) -> dict | None:
        """Emulates silent data corruption on failure domain ``domain``: one bit of the live
        state's largest floating leaf flips in the buffer of the domain's first device (the
        other domains' replicas keep the right value). Nothing else notices; the replica
        check (`HealthConfig`) must. Returns where it flipped (None: the domain is dead)."""
        run = self.run
        self._check_domain(domain, "bitflip")
        if domain not in run.alive_domains:
            run._event("fault_ignored", run.step, fault="bitflip", domain=domain, phase=phase,
                      reason="the domain is dead")
            return None
        flat, treedef = jax.tree_util.tree_flatten_with_path(run._live)
        floats = [i for i, (_, x) in enumerate(flat) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) and x.size]
        i = max(floats, key=lambda j: flat[j][1].size)
        x = flat[i][1]
        dev = run._domains[domain][0]
        shards = []
        for sh in x.addressable_shards:
            if sh.device == dev:
                host = np.array(sh.data, copy=True)
                word = host.reshape(-1).view(np.uint16 if host.itemsize == 2 else np.uint32)
                word[0] ^= 1 << (4 if host.itemsize == 2 else 20)  # a mantissa bit: wrong, but not a NaN
                shards.append(jax.device_put(host, dev))
            else:
                shards.append(sh.data)
        leaves = [v for _, v in flat]
        leaves[i] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
        run._live = jax.tree.unflatten(treedef, leaves)
        info = dict(domain=domain, phase=phase, leaf=jax.tree_util.keystr(flat[i][0]), device=dev.id)
        run._event("bitflip", run.step, **info)
        return info

    def _watchdog_takes(self, fault: str, domain: int, phase: str) -> bool:
        """Whether an emulated liveness fault can apply (else an event says why not)."""
        run = self.run
        if domain in run.alive_domains and run._liveness is not None:
            return True
        run._event("fault_ignored", run.step, fault=fault, domain=domain, phase=phase,
                  reason="the domain is dead" if run._liveness is not None else "no liveness watchdog")
        return False

    def hang_domain(self, domain: int, phase: str) -> None:
        """Fault ``hang_slice``: failure domain ``domain`` stops answering (emulated, see
        ``runtime/health.py``); its memory stays until the watchdog declares it hung."""
        if self._watchdog_takes("hang_slice", domain, phase):
            self.run._liveness.stall(domain)
            self.run._event("hang_slice", self.run.step, domain=domain, phase=phase)

    def slow_domain(self, domain: int, phase: str) -> None:
        """Fault ``slow_slice``: failure domain ``domain`` becomes a straggler (emulated)."""
        from resilax._src.runtime.health import SLOW_SLICE_S

        if self._watchdog_takes("slow_slice", domain, phase):
            self.run._liveness.slow(domain, SLOW_SLICE_S)
            self.run._event("slow_slice", self.run.step, domain=domain, phase=phase, late_s=SLOW_SLICE_S)

    def repair_domain(self, domain: int, phase: str) -> None:
        """Fault ``repair_slice``: failed domain ``domain``'s hardware is back (emulated);
        the liveness watchdog must see it answer before it rejoins."""
        run = self.run
        if domain in run.alive_domains or run._liveness is None:
            run._event("fault_ignored", run.step, fault="repair_slice", domain=domain, phase=phase,
                      reason="the domain is alive" if run._liveness is not None else "no liveness watchdog")
            return
        run._liveness.repair(domain)
        run._event("repair_slice", run.step, domain=domain, phase=phase)

    # ---------------------------------------------------------------- the liveness watchdog
    def health_boundary(self) -> bool:
        """Before anything is dispatched to the live domains: waits for them to answer (a
        hung one is declared so by the liveness watchdog: `HealthConfig.hang_detect_s`),
        fails the hung ones (and stragglers when `HealthConfig.remove_stragglers`) and
        recovers. Returns whether it recovered."""
        run = self.run
        lv = run._liveness
        if lv is None:
            return False
        recovered = False
        while True:
            tg = time.perf_counter()
            hung = lv.gate(run.alive_domains)
            if hung:  # the wait for the watchdog's verdict was detection, not training
                run._goodput_recorder.add("detection", time.perf_counter() - tg)
            self.publish_health()
            cut = []
            for d in hung:
                info = lv.failed(d)
                since = info.pop("since", None)
                run._event("hang", run.step, domain=d, **{k: v for k, v in info.items() if k != "domain"})
                cut.append((d, "hang", since))
            for d, info in lv.take_stragglers().items():
                if d not in run.alive_domains:
                    continue
                remove = run.config.health.remove_stragglers
                run._event("straggler", run.step, removed=remove, **info)
                if remove:
                    lv.failed(d)
                    cut.append((d, "straggler", None))
            if not cut:
                break
            for d, why, since in cut:
                run._fail_domain(d, why, at=since)
            self._recover()
            recovered = True
            lv.call_begin()  # the step's deadline counts from here: recovery time is not step time
        for d, info in sorted(lv.take_back().items()):  # a failed domain answers again
            if d in run.alive_domains:
                continue
            if run.config.health.rejoin_answering:
                run._rejoin_domain(d, "before_step", **info)
                recovered = True
                lv.call_begin()
            else:
                run._event("domain_answering", run.step, domain=d, rejoined=False, **info)
        return recovered

    def publish_health(self) -> None:
        for kind, fields in self.run._liveness.take_events():
            self.run._event(kind, self.run.step, **fields)

    # ---------------------------------------------------------------- a domain comes back
    def rejoin_domain(self, domain: int, phase: str, **found) -> dict | None:
        """Failure domain ``domain`` (original index) is back (repaired, or a replacement
        with fresh memory): the mesh grows to include it, at a step boundary, with no restart
        and no checkpoint read. The state is copied to it from the live domains (bitwise),
        the grown mesh's programs are built (the full mesh's again: no microbatches), and
        every protection starts again on it. A domain that is alive already: nothing happens
        (an event says so). Failures still pending are recovered first. ``found``: how the
        monitor found it back (``found_by``, ``down_s``, ...), kept in the event.

        Returns the ``rejoin`` event's fields (None when nothing happened).
        """
        run = self.run
        self._check_domain(domain, "rejoin")
        if self.failures:
            self._recover()
        if domain in run.alive_domains:
            run._event("fault_ignored", run.step, fault="rejoin", domain=domain, phase=phase,
                      reason="the domain is alive")
            return None
        t0 = time.perf_counter()
        with run._goodput_recorder.span("recovery"):
            if run._checkpointer is not None:  # a snapshot being handed to Orbax reads the live buffers
                run._checkpointer.store.settle()
            if run._record_log is not None:
                run._record_log.settle()
            alive = sorted(run.alive_domains + [domain])
            prog, ahead = run._programs.get(alive, run._program.spec)
            prog.grad(False)
            prog.update(None)
            t_compile = time.perf_counter() - t0
            # device to device, from the live domains' buffers (the new domain's old ones are gone)
            state = jax.device_put(run._live, prog.state_sh)
            guard = None if run._guard is None else jax.device_put(run._guard, NamedSharding(prog.mesh, P()))
            jax.block_until_ready((state, guard))
            self.dead -= set(run._domains[domain])
            run._moved(prog, alive)
            lv = run._liveness
            if lv is not None:
                lv.failed(domain)  # whatever was known of its old self
                lv.rejoined(domain)
                lv.set_alive(alive)
            run._live, run._guard = state, guard
            for p in run._protections:
                p.restart(run, state)
        fields = dict(domain=domain, phase=phase, mesh=dict(prog.mesh.shape), microbatches=prog.m,
                      bytes_moved=int(sum(x.nbytes for x in jax.tree.leaves(state))), compiled_ahead=ahead,
                      seconds={"compile": t_compile, "total": time.perf_counter() - t0}, **found)
        run._event("rejoin", run.step, **fields)
        run.compile_ahead()
        return fields

    # ---------------------------------------------------------------- recovery
    def recover_pending(self) -> None:
        """Recovers the pending failures: plans from what the protections hold (pure:
        `protect.planner`), builds the survivors' program, restores the plan's start state,
        redoes the steps after it up to the current one, and restarts every protection."""
        run = self.run
        failures, self.failures = self.failures, []
        t_fail = min(f["at"] for f in failures)
        t0 = time.perf_counter()
        domains = run._domains
        failed = [i for i in run.alive_domains if set(domains[i]) & self.dead]
        survivors = [i for i in run.alive_domains if i not in failed]
        unbooked = [f["at"] for f in failures if not f["detection_booked"]]
        run._goodput_recorder.add("detection", max(0.0, t0 - min(unbooked, default=t0)))
        target = run.step
        if not survivors:
            run._mark_broken("every failure domain is lost")
            raise StateLostError(
                f"resilax: every failure domain is lost ({[f['domain'] for f in failures]}); nothing survives to "
                f"continue the state of step {target}; {newest_checkpoint(run._checkpointer)}")
        # -- plan (pure): live state, peer snapshot, checkpoint; and how to redo each step
        prog = run._program
        shapes = [x.shape for x in jax.tree.leaves(run._abstract_state)]
        live = _planner.Candidate("live", target, _base.leaf_shards(
            jax.tree.leaves(run._live), jax.tree.leaves(prog.state_sh), shapes))
        cands = [live]
        log_steps: dict = {}
        for p in run._protections:
            cands += p.candidates(run)
            log_steps.update(p.log_steps(run))
        plan = _planner.plan(target, self.dead, cands, log_steps, run._leaf_names)
        t_plan = time.perf_counter()
        if isinstance(plan, _planner.Lost):
            run._mark_broken("state lost")
            raise StateLostError(
                f"resilax: state lost after failure of domain(s) {failed} at step {target}: leaves "
                f"{list(plan.leaves)[:8]} have no surviving copy that can reach step {target} "
                f"({'; '.join(f'{n}: {w}' for n, w in plan.why)}); {newest_checkpoint(run._checkpointer)}")
        # -- the new mesh's program
        run._programs.cancel_outside(survivors)  # meshes with a dead domain are never needed
        t_compile0 = time.perf_counter()
        new_prog, ahead = run._programs.get(survivors, prog.spec)
        new_prog.grad(False)
        new_prog.update(None)
        t_compile = time.perf_counter() - t_compile0
        # -- restore the start state and the detector state
        src = next(c for c in cands if c.name == plan.source)
        state, guard, moved = self._restore(plan, src, new_prog)
        t_restore = time.perf_counter()
        # -- redo steps start..target-1 (device entries bitwise, batches recomputed)
        del prog
        run._moved(new_prog, survivors)
        if run._liveness is not None:
            run._liveness.set_alive(survivors)
        counts = {"device": 0, "disk": 0, "batch": 0}
        with run._goodput_recorder.span("replay"):
            for s, kind, picks in plan.replay:
                state, guard = self._redo(state, guard, s, kind, picks)
                counts[kind] += 1
            jax.block_until_ready(state)
        t_replay = time.perf_counter()
        run._live, run._guard = state, guard
        for p in run._protections:
            p.restart(run, state)
        self.bufmaps, self.held = {}, []  # drop every reference to the dead arrays
        run._programs.keep_within(survivors)
        if not new_prog.protects and new_prog.mesh.shape[run.topology.elastic_axis] == 1:
            warnings.warn(
                f"resilax: after losing domain(s) {failed} only one failure domain is left; there are no peers to "
                f"hold copies, so a further failure is recoverable only from checkpoints", RuntimeWarning, stacklevel=5)
        run._event(
            "recovery", target, failed_domains=failed, failed_devices=sorted(d.id for d in self.dead),
            phases_failed=[f["phase"] for f in failures],
            copy_in_flight=[f["copy_in_flight"] for f in failures], source=plan.source, restored_step=plan.start,
            target_step=target, rejected=[list(r) for r in plan.rejected], bytes_moved=moved,
            detected_s=t0 - t_fail,
            seconds={"detect": t0 - t_fail, "plan": t_plan - t0, "compile": t_compile,
                     "restore": t_restore - t_plan - t_compile, "replay": t_replay - t_restore},
            steps_replayed=counts["device"] + counts["disk"], steps_recomputed=counts["batch"],
            lost_steps=counts["batch"], mesh=dict(new_prog.mesh.shape), microbatches=new_prog.m,
            replicated_across_domains_now=new_prog.respecified, compiled_ahead=ahead)
        run.compile_ahead()  # for the next loss, on the new mesh

    def rebuilt_state(self, step: int, trusted_through: int):
        """The state at ``step`` rebuilt from the newest checkpoint and the record log (disk
        entries or retained batches, never a live buffer), on the current mesh: the witness
        that tells which of two disagreeing replicas is right (`protect/sdc.py`). Steps after
        ``trusted_through`` (whose recorded values may have been computed from a corrupted
        state) are recomputed from their batches, never taken from the log. Returns
        ``(state, anomaly guard)``; None when no checkpoint at or before ``step`` exists or a
        step after it cannot be redone so."""
        run = self.run
        if run._checkpointer is None:
            return None
        cands = [c for c in run._checkpointer.candidates(run) if c.step <= step]
        if not cands:
            return None
        log_steps = {}
        for p in run._protections:
            for s, e in p.log_steps(run).items():  # device entries are live buffers: not a witness
                ok = ("disk", "batch") if s <= trusted_through else ("batch",)
                log_steps[s] = _planner.LogStep(s, tuple(src for src in e.sources if src[0] in ok))
        plan = _planner.plan(step, self.dead, cands, log_steps, run._leaf_names)
        if isinstance(plan, _planner.Lost):
            return None
        with run._goodput_recorder.span("recovery"):
            state, guard, _ = self._restore(plan, cands[0], run._program)
            for s, kind, picks in plan.replay:
                state, guard = self._redo(state, guard, s, kind, picks)
            jax.block_until_ready(state)
        run._event("rebuilt", step, source="checkpoint", restored_step=plan.start,
                  steps_redone=len(plan.replay), why="witness for the replica check")
        return state, guard

    def adopt(self, state, guard, since: int) -> None:
        """The live state becomes ``state`` (with the anomaly detector's ``guard``), rebuilt
        at this step from trusted sources (`rebuilt_state`) because every replica of the live
        one holds corrupted values. What the protections derived from the live state after
        step ``since`` (log entries, peer copies) is dropped: it may hold them too."""
        run = self.run
        run._live, run._guard = state, guard
        for p in run._protections:
            p.adopted(run, state, since)

    def _restore(self, plan, cand, prog):
        run = self.run
        abstract_state = run._abstract_state
        shapes = [x.shape for x in jax.tree.leaves(abstract_state)]
        dtypes = [x.dtype for x in jax.tree.leaves(abstract_state)]
        treedef = jax.tree.structure(abstract_state)
        rep = NamedSharding(prog.mesh, P())
        if plan.source == "checkpoint":
            ckpt = run._checkpointer
            ckpt.store.wait()
            abstract = ckpt.tree(prog.abstract_state(), run._abstract_guard(prog.mesh))
            with run._goodput_recorder.span("checkpoint_restore"):
                restored = ckpt.store.restore_newest(abstract)
            if restored is None or restored.step != plan.start:
                raise StateLostError(f"resilax: the checkpoint the plan relied on (step {plan.start}) could not be "
                                     f"restored; {newest_checkpoint(ckpt)}")
            guard = restored.state.get("guard")
            return restored.state["state"], guard, sum(x.nbytes for x in jax.tree.leaves(restored.state))
        host, moved = _base.assemble(plan.picks, shapes, dtypes, self.bufmaps)
        state = jax.tree.unflatten(treedef, jax.device_put(host, jax.tree.leaves(prog.state_sh)))
        guard = None
        if run._guard is not None:
            source_guard = run._guard if plan.source == "live" else run._peers.snap.guard
            guard = jax.device_put(jax.tree.map(lambda g: host_replica(g, self.bufmaps), source_guard), rep)
        return state, guard, moved

    def _redo(self, state, guard, s, kind, picks):
        """Step ``s`` again on the current program: from a logged entry (update only, the
        logged verdict) or from its retained batch (grad + update)."""
        run = self.run
        prog, log = run._program, run._record_log
        if kind == "batch":
            gout = prog.grad(False)(state, guard, prog.put_batch(log.batches[s]), np.uint32(s))
            recorded = log.verdict(s, self.bufmaps)  # the step's own verdict, never a recomputed one
            if recorded is None:
                new, _, _ = prog.update(None)(state, gout.rec, gout.ok, np.uint32(s))
                return new, gout.guard
            return gated(run, state, guard, s, gout.rec, *recorded)
        if kind == "device":
            host = log.device_values(s, picks, self.bufmaps)
            verdict, value = log.verdict(s, self.bufmaps)
        else:
            entry = log.disk.read(s, "grads")
            host = entry.recorded
            verdict = entry.scalars.get("verdict")
            value = scalar_value(entry.scalars.get("value"))
        return apply_logged(run, state, guard, s, host, verdict, value)


# ==================================================================== redoing a step
def apply_logged(run, state, guard, s, host_rec, verdict, value):
    """Step ``s``'s update on host recorded values ``host_rec`` (see `gated`)."""
    return gated(run, state, guard, s, run._program.put_rec(host_rec), verdict, value)


def gated(run, state, guard, s, rec, verdict, value):
    """Step ``s``'s update on recorded values ``rec``, gated by its recorded ``verdict``
    (the update executable takes it as an input: a skipped step stays skipped), and the
    anomaly window advanced as the grad part advanced it (`anomaly.advance`: exact)."""
    v = _anomaly.recorded_verdict(verdict, s)
    new, _, _ = run._program.update(None)(state, rec, np.int32(v), np.uint32(s))
    if guard is not None and _window_advances(run):
        if value is None:
            raise ReplayLogError(f"resilax replay: step {s} has a recorded verdict but no recorded "
                                 f"{run.config.anomaly.metric!r} value to advance the spike window with")
        guard = _advance(guard, np.float32(np.asarray(value)), v == _anomaly.OK)
    return new, guard


def _window_advances(run) -> bool:
    """Whether the grad part pushes the watched value into the spike window (`make_check`)."""
    a = run.config.anomaly
    met = run._program.abstract_metrics if run._program is not None else None
    return a is not None and a.spike_zscore is not None and isinstance(met, dict) and a.metric in met


@jax.jit
def _advance(guard, value, ok):
    return _anomaly.advance(guard, value, ok)


def host_replica(x, bufmaps):
    """Host copy of a replicated array from any surviving device's buffer."""
    for b in bufmaps.get(id(x), {}).values():
        if not b.is_deleted():
            return np.array(b, copy=True)
    return np.array(x, copy=True)
