"""Where `ResilientStep.init` resumes: the newest copy of the state, then the disk log.

The newest copy of the state (the hosts' copies under `resilax launch`, else the newest good
checkpoint, else the given state placed), then the disk record log's entries after it
replayed (crash resume).

Functions of the step (`ResilientStep`), read through its public attributes and read-only
properties; they set the run's public state (``step``, ``guard``, ``data_position``,
``program``).
"""

from __future__ import annotations

import time
import warnings

import jax
import numpy as np

from resilax._src.errors import ReplayLogError
from resilax._src.protect import hoststore as _hoststore
from resilax._src.protect import checkpoints as _checkpoints
from resilax._src.protect.data_state import decode_data_state
from resilax._src.protect.checksum import anchor_tree, legacy_anchor_order
from resilax._src.protect.disk_log import batch_template, scalar_value
from resilax._src.protect.record_log import local
from resilax._src.runtime import fence, membership
from resilax._src.step import sharding as _sh
from resilax._src.step.recovery import apply_logged, gated


def newest_state(run, state, state_sh, job):
    """The state to start from, placed with ``state_sh``: the host store's step ``job``
    names (under `resilax launch`, when no checkpoint is newer), else the newest good
    checkpoint, else ``state`` itself. Sets ``run.step`` (and guard, data position) to it."""
    store, ckpt, data = run._host_store, run._checkpointer, run._data
    from_store = restored = None
    want = job.host_store_step if store is not None and job.host_store_step >= 0 else None
    if job is not None and job.host_store_steps:  # across hosts: every worker votes, store on or off
        agreed = _agreed_store_step(run, job.host_store_steps)
        want = agreed if store is not None else None
    if want is not None and not (ckpt is not None and max(ckpt.store.steps(), default=-1) > want):
        # under `resilax launch`: the hosts' copies first (newer than any checkpoint, which
        # would only be read to be thrown away); every process takes the same branch
        placed = _hoststore.resume(run, store, _sh.place_copy(state, state_sh), want,
                                   lambda ok: membership.agree(ok, f"host_store/{want}"))
        if run.step == want:
            state, from_store = placed, True
    if ckpt is not None and not from_store:
        t0 = time.perf_counter()
        abstract = ckpt.tree(_sh.abstract(state, state_sh), run._abstract_guard(run.mesh))
        with run._goodput_recorder.span("checkpoint_restore"):
            # across hosts: never a checkpoint a fenced side wrote (`runtime.fence`)
            reject = (lambda step, meta: fence.rejected(job.run_dir, meta, step)) if fence.stamp(job) else None
            restored = ckpt.store.restore_newest(abstract, reject)
        if restored is not None:
            run.step = restored.step
            if data is not None and restored.meta.get("data_state") is not None:
                data.set_state(decode_data_state(restored.meta["data_state"]))
            run._event("restore", restored.step, source="checkpoint", seconds=time.perf_counter() - t0,
                      skipped=[{"step": s, "reason": r} for s, r in restored.skipped],
                      directory=str(ckpt.store.directory), quarantined=list(restored.quarantined))
            state = restored.state["state"]
            run._guard = restored.state.get("guard")
            if run._record_log is not None:
                run._record_log.checkpointed(restored.step)
            if run._watch is not None:
                run._watch.restored(restored.meta.get("verdicts"))
            _check_collectives(run, restored)
    if restored is None and not from_store:
        state = _sh.place_copy(state, state_sh)
    return state


def _check_collectives(run, restored) -> None:
    """The bit-exact mode promises the bits of the run that wrote the checkpoint only where
    both add alike: on CPU a run under `resilax launch` (a `jax.distributed` client: gloo for
    every collective) and one without it sum a failure domain of more than 2 devices in
    another order. A resume across that line goes on correctly but bitwise equal to a run of
    this kind, not to the one that wrote the checkpoint: said, not silent."""
    # (read through the module: a test that labels a run's checkpoints patches it there, and this
    # module may first be imported while that patch is on)
    was, now = restored.meta.get("collectives"), _checkpoints.collectives()
    widest = max(len(d) for d in run._domains)
    if (run.config.deterministic is None or was is None or was == now or "unknown" in (was, now)
            or not now.startswith("cpu:") or widest <= 2):
        return
    msg = (f"resilax: checkpoint {restored.step} was written with {was} collectives and this run has {now}: on CPU "
           f"they add a failure domain's {widest} device values in another order, so the "
           f"bit-exact mode goes on bitwise equal to a run like this one, not to the run that wrote the checkpoint "
           f"(docs/multiprocess.md, 'Which reduction order'); resume it the way it was started (with or without "
           f"`resilax launch`) to keep its bits")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    run._event("collectives_changed", restored.step, written=was, now=now)


def _agreed_store_step(run, steps: str) -> int | None:
    """Across hosts: the newest step in every host's list (`LaunchEnv.host_store_steps`),
    by a key-value vote every worker takes part in, so all of them get the same answer:
    a host that holds no such step (a replacement's empty store) sends all of them to
    the checkpoint, never some."""
    mine = [] if steps == "none" else [int(x) for x in steps.split(",")]
    got = membership.agree_newest(mine, "host_store_steps")
    if got is None and mine:
        run._event("host_store_skipped", run.step, wanted_step=mine[-1],
                  reason="another host's store holds none of this host's steps (a replacement host, or copies "
                         "lost with a host); using the checkpoint")
    return got


def replay_disk_log(run, state, first_program):
    """Replays the disk log after the restored step, as far as it has good entries.

    ``first_program(abstract_batch)``: builds the run's first program (from an entry's batch
    signature when no step ran yet). Returns the state of the step reached (``run.step``)."""
    log = run._record_log.disk if run._record_log is not None else None
    if log is None:
        return state
    start = run.step
    files = set(log.files())
    steps = {s for s, _ in files}
    limit = None
    if jax.process_count() > 1:
        # a job of several processes (`resilax launch`): every one replays the same steps (each
        # a collective), so they agree on how many entries every one of them can read
        mine = start
        while mine in steps and _entry(log, mine, files, run._data)[0] is not None:
            mine += 1
        limit = start + membership.agree_min(mine - start, f"record_log/replayable/{start}")
        if limit == start:
            steps = set()
    if start in steps:  # a foreign log is refused before anything in it is touched
        try:
            first = log.read(start, "grads") if (start, "grads") in files else log.read(start, "inputs")
        except ReplayLogError:
            first = None  # damaged: handled (and named) below
        if first is not None:
            _start_mismatch(run, first, state)
    # entries before a checkpoint (or the start) are not needed again; before a host store's
    # step they are: a later relaunch (the stores die with their hosts) replays them from
    # the checkpoint
    if not any(e.kind == "restore" and e.step == start and e.fields.get("source") == "host_store"
               for e in run.events):
        log.truncate_before(start)
    if start not in steps:
        log.discard_from(start, f"a resume at step {start}: later entries will be recomputed")
        return state
    t0 = time.perf_counter()
    s, failed, modes = start, [], []
    data = run._data
    with run._goodput_recorder.span("replay"):
        while s in steps and (limit is None or s < limit):
            entry, why = _entry(log, s, files, data)
            if entry is None:
                failed.append((s, why))
                break
            if s == start:  # raises for a foreign log (the ReplayLogError below is for damage)
                why = _start_mismatch(run, entry, state)
                if why:
                    failed.append((s, why))
                    break
            if run._program is None:
                if entry.batch_sig is None:
                    failed.append((s, "the entry has no batch signature"))
                    break
                run._program = first_program(batch_template(entry.batch_sig))
            if entry.kind == "grads":
                state, run._guard = apply_logged(run, state, run._guard, s, entry.recorded,
                                                entry.scalars.get("verdict"),
                                                scalar_value(entry.scalars.get("value")))
            else:
                if entry.batch is None:
                    data.set_state(decode_data_state(entry.data_state))
                prog = run._program
                batch = entry.batch if entry.batch is not None else next(data)
                gout = prog.grad(False)(state, run._guard, prog.put_batch(batch), np.uint32(s))
                # recomputed from the batch, gated by the verdict the step had (a fault, a
                # spike judged on a window, anything outside the step is not recomputed)
                state, run._guard = gated(run, state, run._guard, s, gout.rec, entry.scalars.get("verdict"),
                                         scalar_value(entry.scalars.get("value")))
            if data is not None and entry.data_next is not None:
                data.set_state(decode_data_state(entry.data_next))
                run._data_position = entry.data_next
            if run._watch is not None:
                run._watch.replayed(run, s, entry.scalars.get("verdict"))
            modes.append(entry.kind)
            s += 1
    run.step = s
    # the entries from the first unusable one on are moved aside (they would be recomputed
    # anyway); when one was unusable the replay event says so, in its one line
    moved = log.discard_from(s, f"a resume at step {s}: later entries will be recomputed", warn=not failed)
    run._event("replay", s, source="record_log", from_step=start, steps=s - start,
              grads_steps=modes.count("grads"), inputs_steps=modes.count("inputs"),
              seconds=time.perf_counter() - t0, unreplayable=[{"step": a, "reason": b} for a, b in failed],
              quarantined=len(moved))
    return state


def _entry(log, s: int, files: set, data):
    """Step ``s``'s entry as this process replays it, and None, or None and why not: the grads
    entry, else (a damaged one included) the inputs entry when it carries its batch or the
    data iterator yields it. The first reason met is the one given."""
    why = None
    for kind in ("grads", "inputs"):
        if (s, kind) not in files:
            continue
        try:
            entry = log.read(s, kind)
        except ReplayLogError as e:
            why = why or str(e)
            continue
        if entry.batch is None and kind == "inputs" and data is None:
            why = why or "an inputs entry without its batch needs the data iterator (init(state, data=...))"
            continue
        return entry, None
    return None, why


def _start_mismatch(run, entry, state) -> str | None:
    """Why the log's first entry may not be replayed onto ``state`` (None: it may)."""
    if entry.state_sums is None:
        return "the entry does not record the state it started from, so it cannot be checked against this one"
    got = np.asarray(local(run._record_log.sums(anchor_tree(state, run._guard))))
    want = entry.state_sums
    if got.shape != want.shape or not (np.array_equal(got, want) or
                                       np.array_equal(legacy_anchor_order(got, run._guard), want)):
        raise ReplayLogError(
            f"resilax: the record log in {str(run._record_log.disk.directory)!r} was recorded from another state at "
            f"step {entry.step} than the one init() has (checksums differ): it belongs to another run or initial "
            f"state. Nothing was changed; move the log away or give this run another LogConfig.directory")
    return None
