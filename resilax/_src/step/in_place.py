"""Going on in place, and leaving to re-form, under `resilax launch --in-place`.

Going on when another process of the job dies, and leaving a step object for the job to
re-form as its next generation (`membership.Reform`).

Functions of the step (`ResilientStep`): they read it through its public attributes and
read-only properties and change it through its hooks (``moved``, ``resume_at``,
``mark_broken``, ``compile_ahead``).
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import jax

from resilax._src.errors import StateLostError
from resilax._src.protect.data_state import decode_data_state
from resilax._src.runtime import membership, worker
from resilax._src.step.recovery import newest_checkpoint


class Lookahead:
    """Under `resilax launch --in-place` the host runs at most `STEPS` steps ahead of the
    devices: a step's dispatch waits until the grad part `STEPS` steps before it completed
    (its verdict, ``GradOut.ok``, is ready; nothing is read). Steps queued behind a collective
    that a dead process broke each wait XLA's collective timeout before they fail: a survivor
    6 steps ahead took about 30 s to reach its verdict, longer than the re-form across hosts
    waits for it (it was then restarted). This bounds that to `STEPS` timeouts and costs
    nothing while the host is slower than the devices. Outside ``--in-place``: nothing."""

    STEPS = 2

    def __init__(self):
        self._q: collections.deque = collections.deque()

    def push(self, done) -> None:
        e = worker.env()
        if e is None or e.in_place_wait_s <= 0:
            return
        self._q.append(done)
        if len(self._q) > self.STEPS:
            self._q.popleft().block_until_ready()  # (a broken collective's step raises here)

    def clear(self) -> None:
        """Forgets the steps in flight (they ran on a backend the job went on without)."""
        self._q.clear()


def possible(run) -> bool:
    """Whether this worker can go on in place when another process of the job dies: under
    `resilax launch --in-place`, in the bit-exact mode (every process holds the whole state:
    nothing of it lives only on the dead one), each failure domain within one process,
    with the host store (the step the survivors agree on is read back from it) and no
    protection that holds device copies across processes (record log, peers, replica
    checks)."""
    e = worker.env()
    return (e is not None and e.in_place_wait_s > 0 and run.config.deterministic is not None
            and run._host_store is not None and run._record_log is None and run._peers is None
            and run._replica_check is None and bool(run._domains)
            and all(len({d.process_index for d in dom}) == 1 for dom in run._domains if dom))


def grow_back_if_due(run) -> None:
    """The job, smaller than ``-n``, grows back at this step (`membership.reform_due`): stores
    the step in the host store, lets a save in flight commit, and leaves (`leave_for_reform`)."""
    if not membership.reform_due(run.step, settle=lambda: _settle(run)):
        return
    e = worker.env()
    store, ckpt = run._host_store, run._checkpointer
    if store is not None and store.newest() != run.step:  # the store's cadence skipped it
        store.write(run.step, run._live, run._guard, run._data_position)
    if ckpt is not None and ckpt.paused is None:
        ckpt.store.wait()  # every worker is here: a save in flight commits before they detach
    leave_for_reform(run, e.generation + 1, f"the job grows back to {e.job_processes} processes")


def _settle(run) -> None:
    """Waits until the last dispatched step completed (one of its outputs is ready)."""
    leaves = jax.tree.leaves(run._live) if run._live is not None else []
    if leaves:
        leaves[0].block_until_ready()


def go_on(run, err: BaseException, entry: int, batch, finished, call: Callable):
    """A step failed under `resilax launch --in-place` (``err``: a collective or a save
    broke). Waits for the supervisor's verdict; if it names dead processes, the others
    (this one among them) agree on the newest step all of them hold in their own host
    store, restore it onto the mesh of the live domains, redo the steps after it up to
    ``entry`` from the data iterator, and run this call's step (``call(batch)``: the step's
    own step path). ``finished``: ``(step, metrics)`` of a step this call completed before
    the error. Returns the call's ``(state, metrics)``, or None without a verdict naming
    dead processes: the error stands (the supervisor then restarts the job)."""
    t_err = time.perf_counter()
    run._lookahead.clear()
    m = _verdict(run, err, f"step {entry + 1}")
    if m is None:
        return None
    finished = finished if finished is not None and finished[0] == entry + 1 else None
    with run._goodput_recorder.span("recovery"):
        while True:
            try:  # a step this call completed before the error (in its save) is not redone
                fields = _shrink(run, m, entry, entry + (finished is not None), t_err)
                break
            except membership.MembershipChanged as changed:  # another died meanwhile: agree again without it
                m = changed.membership
                if jax.process_index() not in m["alive"]:
                    raise err from changed
    run._event("recovery", run.step, **fields)
    redo = fields["steps_recomputed"]
    if redo:  # steps some survivor had not completed: recomputed from their batches
        with run._goodput_recorder.span("replay"):
            if run._data is None:
                run._mark_broken("in-place shrink without a data iterator")
                raise StateLostError(
                    f"resilax: going on in place after processes {m['dead']} died needs steps "
                    f"{run.step + 1}..{entry} again, but step.init(state) got no data iterator (data=...) to "
                    f"read their batches from; the supervisor restarts the job instead")
            here = run._data.get_state()
            run._data.set_state(decode_data_state(run._data_position))
            for _ in range(redo):
                call(next(run._data))
            run._data.set_state(here)
    run.compile_ahead()
    if run.step == entry + 1:  # every survivor completed this call's step: its metrics stand
        return run._live, finished[1]
    return call(batch)


def _verdict(run, err: BaseException, what: str) -> dict | None:
    """Waits for the supervisor's verdict on ``err`` (``what`` failed). None: no process was
    declared dead, or this one was (the error stands). A verdict to re-form: leaves
    (`leave_for_reform`, raises). Else the membership the survivors go on with."""
    e = worker.env()
    worker.set_phase("recover")  # not a step: the supervisor's step deadline does not apply
    wait_s = worker.in_place_wait(e)
    worker.say(f"{what} failed ({type(err).__name__}: {str(err)[:160]}); waiting up to "
               f"{wait_s:.0f} s for the supervisor's verdict (--in-place)")
    m = membership.wait_membership(membership.epoch(), wait_s)
    worker.say(f"verdict: {m}")
    if m is None or jax.process_index() not in m["alive"]:
        worker.say("no process was declared dead (or this one was): the error stands")
        return None
    worker.cut_links(m)  # (before this process connects anew: the next collectives, or a re-form)
    if m.get("reform"):  # the others re-form (with warm spares, or alone as a smaller job): leave
        membership.shrunk(m)  # (threads may wait on the dead for good: see worker.exit_if_shrunk)
        if run._checkpointer is not None:
            run._checkpointer.store.abandon()  # a save in flight waits on the dead: nothing waits for it
        leave_for_reform(run, m["reform"], f"processes {m['dead']} died: the others re-form on a new backend",
                         cause=err, dead_processes=m["dead"], after_error=True)
    return m


def after_failed_close(run, err: BaseException) -> None:
    """The last save failed in `ResilientStep.close` (``err``: its collective broke) under
    `resilax launch --in-place`: when the supervisor declares a process dead and the others
    re-form, this one leaves too (`leave_for_reform`: raises `membership.Reform`), and the
    next generation restores the step from the host stores and writes the save again. In
    any other case ``err`` stands (the supervisor restarts the job)."""
    _verdict(run, err, f"the save of step {run.step} at the end")
    raise err


def leave_for_reform(run, generation: int, why: str, cause: BaseException | None = None, **fields):
    """The step object is done: the job re-forms as ``generation`` (``why``), with every
    step this process completed in its host store. Raises `membership.Reform` for the worker
    command to rejoin in this process (`worker.reattach`)."""
    run._mark_broken("left to re-form as the next generation", reforming=True)
    store = run._host_store
    held = store.newest() if store is not None else None  # (a failed step's update never landed)
    worker.say(f"leaving at step {run.step}: {why}; this process rejoins generation {generation} without "
               f"restarting (its host store holds step {held})")
    run._event("reform", run.step, generation=generation, **fields)
    membership.leave_behind()  # the old backend's threads (a save's commit) fail on the dead: not shown
    raise membership.Reform(generation, run.step) from cause


def _shrink(run, m: dict, entry: int, upto: int, t_err: float) -> dict:
    """The survivors agree on the newest step all of them hold, read it back from their own
    host stores onto the mesh of the live domains, and meet at a barrier."""
    t0 = time.perf_counter()
    alive_p = set(m["alive"])
    membership.shrunk(m)
    domains, store = run._domains, run._host_store
    failed = [i for i in run.alive_domains if any(d.process_index not in alive_p for d in domains[i])]
    for i in failed:
        run._recovery.mark_dead(domains[i])
    survivors = [i for i in run.alive_domains if i not in failed]
    if not survivors:
        run._mark_broken("every failure domain is lost")
        raise StateLostError(f"resilax: processes {m['dead']} died and no failure domain is left")
    own = store.newest()
    target = membership.agree_min(min(upto, -1 if own is None else own), "in_place/step")
    t_agree = time.perf_counter()
    run._programs.cancel_outside(survivors)
    prog, ahead = run._programs.get(survivors, run._program.spec)
    prog.grad(False)
    prog.update(None)
    t_compile = time.perf_counter()
    tree = (prog.abstract_state(), run._abstract_guard(prog.mesh))
    abstract, treedef = jax.tree.flatten(tree)
    got = None if target < 0 else store.restore(target, abstract, [a.sharding for a in abstract])
    if not membership.agree(got is not None, f"in_place/restore/{target}"):
        run._mark_broken("in-place shrink: no host copy")
        raise StateLostError(
            f"resilax: processes {m['dead']} died; going on in place needs step {target} from every live "
            f"process's own host store, and some process could not read a verified copy; "
            f"{newest_checkpoint(run._checkpointer)} (the supervisor restarts the job from there)")
    leaves, meta, source = got
    state, guard = jax.tree.unflatten(treedef, leaves)
    t_restore = time.perf_counter()
    run._moved(prog, survivors)
    run._programs.keep_within(survivors)
    run._resume_at(target, state, guard, meta.get("data_state"))
    for p in run._protections:
        p.shrunk(run, state, sorted(alive_p))
    worker.say(f"agreed on step {target} (own newest {own}, at most {upto}); restored it; at the barrier")
    membership.barrier("in_place")  # nobody enters the new mesh's first collective alone
    worker.say(f"past the barrier; mesh {dict(prog.mesh.shape)}")
    worker.resumed(target)
    return {"in_place": True, "failed_domains": failed, "dead_processes": m["dead"], "epoch": m["epoch"],
            "source": "host_store", "copy": source, "restored_step": target, "target_step": upto,
            "steps_recomputed": max(0, entry - target), "lost_steps": max(0, entry - target),
            "mesh": dict(prog.mesh.shape),
            "compiled_ahead": ahead,
            "seconds": {"detect": t0 - t_err, "agree": t_agree - t0, "compile": t_compile - t_agree,
                        "restore": t_restore - t_compile, "total": time.perf_counter() - t_err}}
