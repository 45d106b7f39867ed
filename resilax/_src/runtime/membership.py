"""The job's membership under `resilax launch --in-place`: verdicts, votes, re-forming.

The supervisor's verdict after a worker died (who is alive, at which epoch), the key-value
votes and barriers among the live workers (`agree`, `agree_min`, `barrier`), and re-forming
as the next generation (`Reform`, `reform_due`). Outside a launch (no job joined: `joined`)
every vote is this process's own.

The worker's set-up (`worker.initialize`) tells this module the job it joined (`joined`);
leaving a generation (`worker.reattach`) forgets it (`reset`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import weakref
from typing import Callable

_state: dict = {}  # "env": the joined LaunchEnv; "membership": the verdict gone on under; "reform_at"
_went_on_in_place = False  # this process went on in place at least once (`went_on_in_place`)


def joined(e) -> None:
    """This process joined the job of `LaunchEnv` ``e`` (`worker.initialize`)."""
    _state["env"] = e


def reset() -> None:
    """This process left its generation (`worker.reattach`): no job, no membership."""
    _state.clear()


MEMBERSHIP_JSON = "membership.json"


def read_membership() -> dict | None:
    """The supervisor's newest verdict for this generation after a worker died while the
    others could go on in place: ``{"generation", "epoch", "alive", "dead"}``; None before
    any (or outside a launch)."""
    e = _state.get("env")
    if e is None:
        return None
    try:
        with open(os.path.join(e.run_dir, MEMBERSHIP_JSON)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("generation") == e.generation else None


def _newer(after_epoch: int) -> dict | None:
    """The supervisor's verdict if it is newer than ``after_epoch``, else None."""
    m = read_membership()
    return m if m is not None and m.get("epoch", 0) > after_epoch else None


def wait_membership(after_epoch: int, timeout_s: float, poll_s: float = 0.02) -> dict | None:
    """Waits for a verdict newer than ``after_epoch``; None when none comes within ``timeout_s``."""
    t0 = time.time()
    while True:
        m = _newer(after_epoch)
        if m is not None:
            return m
        if time.time() - t0 > timeout_s:
            return None
        time.sleep(poll_s)


class DeadProcessVerdict(RuntimeError):
    """`wait_unless_a_verdict` gave up its wait: the supervisor named a dead process."""


# the threads left behind by a wait given up on a verdict (the objects: a later thread may reuse an ident)
_ABANDONED: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


class _QuietAbandoned(logging.Filter):
    """Drops what Orbax logs (through absl) on the threads a verdict left behind
    (`leave_behind`): a given-up wait's helper thread, and, when this process leaves its
    backend to re-form, every thread alive then (Orbax's background commit of the save in
    flight), whose commit can only fail now (a barrier with a dead process). Orbax logged
    each as an ERROR with a 20-60-line traceback in the survivor's log, after a re-form that
    went on as it should. One line says so instead. Threads started later (the next
    generation's saves) log as usual; their failures also reach resilax's own waits."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if threading.current_thread() not in _ABANDONED:  # (a filter runs on the logging thread)
            return True
        if not self.said:
            _QuietAbandoned.said = True
            sys.stderr.write(f"resilax: Orbax's threads left behind by the supervisor's verdict fail on the dead "
                             f"process, as expected; their errors are not shown (the first, on {record.threadName}: "
                             f"{record.getMessage()[:160]})\n")
        return False


_quiet = _QuietAbandoned()


def _abandoned_excepthook(args) -> None:
    """`threading.excepthook` while threads are left behind: an exception that ends one of
    them (`_ABANDONED`) is not printed (one line says so, as for their logs); every other
    thread's goes to the hook that was installed before."""
    if args.thread is None or args.thread not in _ABANDONED:
        return _previous_excepthook[0](args)
    logging.getLogger("resilax").debug("resilax: a thread left behind ended with an error", exc_info=(
        args.exc_type, args.exc_value, args.exc_traceback))
    if not _QuietAbandoned.said:
        _QuietAbandoned.said = True
        sys.stderr.write(f"resilax: a thread left behind by the supervisor's verdict ended with "
                         f"{args.exc_type.__name__}: {str(args.exc_value)[:160]} (expected: it waited on the dead "
                         f"process); such errors are not shown\n")


_previous_excepthook: list = [threading.excepthook]


def leave_behind(threads=None) -> None:
    """What ``threads`` log through absl from now on, and an exception that ends one, is not
    shown (`_QuietAbandoned`, `_abandoned_excepthook`);
    default: every thread alive but the main one (this process leaves its backend to re-form:
    the save in flight's commit threads wait on the dead process)."""
    absl_log = logging.getLogger("absl")
    if _quiet not in absl_log.filters:
        absl_log.addFilter(_quiet)
    if threading.excepthook is not _abandoned_excepthook:  # (an uncaught error ends such a thread too)
        _previous_excepthook[0] = threading.excepthook
        threading.excepthook = _abandoned_excepthook
    main = threading.main_thread()
    _ABANDONED.update(t for t in (threading.enumerate() if threads is None else threads) if t is not main)


def wait_unless_a_verdict(wait: Callable[[], None], what: str) -> None:
    """Runs the blocking ``wait``. Under `launch --in-place` it runs on a helper thread and
    this returns early, raising, once the supervisor names a dead process: a wait that needs
    every process (Orbax's commit barrier, 20 min by default) must not hold a survivor in
    its step while the others re-form (a CI run: process 0 waited 25 s for the previous
    checkpoint's commit after process 2 was SIGSTOPped, the others left at once, and the
    launcher fell back to a restart). The helper thread is left waiting then, and what
    Orbax logs on it afterwards is not shown (`_QuietAbandoned`)."""
    e = _state.get("env")
    if e is None or getattr(e, "in_place_wait_s", 0) <= 0:
        wait()
        return
    done, err = threading.Event(), []

    def run():
        try:
            wait()
        except BaseException as x:  # handed to the caller below
            err.append(x)
        finally:
            done.set()

    helper = threading.Thread(target=run, name="resilax-wait-unless-verdict", daemon=True)
    helper.start()
    after = epoch()
    while not done.wait(0.05):
        m = _newer(after)
        if m is not None:
            leave_behind([helper])
            raise DeadProcessVerdict(f"process(es) {m.get('dead')} of the job failed while {what} (the supervisor's verdict, "
                                     f"epoch {m.get('epoch')})")
    if err:
        raise err[0]


def shrunk(m: dict) -> None:
    """From now on this worker's job is the processes ``m["alive"]``: the key-value votes,
    barriers and the primary process count only those."""
    global _went_on_in_place
    _state["membership"] = m
    _went_on_in_place = True  # for good: threads left waiting on the dead outlive a re-form too


def current() -> dict | None:
    """The membership this worker went on in place under (`shrunk`), or None."""
    return _state.get("membership")


def went_on_in_place() -> bool:
    """Whether this process ever went on in place after another died (re-forms included)."""
    return _went_on_in_place


def alive() -> list[int]:
    """The processes of this worker's job (all of the generation until an in-place shrink)."""
    e = _state.get("env")
    if e is None:
        return [0]
    m = _state.get("membership")
    return sorted(m["alive"]) if m is not None else list(range(e.num_processes))


def epoch() -> int:
    m = _state.get("membership")
    return 0 if m is None else int(m["epoch"])


class MembershipChanged(Exception):
    """The supervisor named another dead process while the live ones were agreeing."""

    def __init__(self, membership: dict):
        super().__init__(f"membership changed: epoch {membership.get('epoch')}, alive {membership.get('alive')}")
        self.membership = membership


def _votes(value: str, what: str) -> list[str]:
    """Publishes ``value`` for ``what`` and reads every live worker's. Waits up to the init
    timeout; after an in-place shrink, a newer verdict from the supervisor meanwhile (another
    worker died) raises `MembershipChanged` instead of waiting for a vote that never comes."""
    e = _state["env"]
    from resilax._src.runtime import jaxdist

    c = jaxdist.client()
    prefix = f"resilax/agree/g{e.generation}/e{epoch()}/{what}"
    c.key_value_set(f"{prefix}/{e.process_id}", value)
    if _state.get("membership") is None:
        return [c.blocking_key_value_get(f"{prefix}/{i}", e.init_timeout_s * 1000) for i in alive()]
    out, deadline = [], time.time() + e.init_timeout_s
    for i in alive():
        while True:
            try:
                out.append(c.blocking_key_value_get(f"{prefix}/{i}", 500))
                break
            except Exception:  # noqa: BLE001 (a timeout: the vote is not there yet)
                m = read_membership()
                if m is not None and m.get("epoch", 0) > epoch():
                    raise MembershipChanged(m) from None
                if time.time() > deadline:
                    raise
    return out


def agree(ok: bool, what: str) -> bool:
    """True when every worker of this job passed ``ok=True`` for ``what`` (through the
    coordination service's key-value store; waits up to the init timeout)."""
    if _state.get("env") is None:
        return ok
    return all(v == "1" for v in _votes("1" if ok else "0", what))


def agree_min(value: int, what: str) -> int:
    """The smallest ``value`` any worker of this job passed for ``what``."""
    if _state.get("env") is None:
        return value
    return min(int(v) for v in _votes(str(int(value)), what))


def agree_newest(values, what: str) -> int | None:
    """The newest value that every worker of this job passed in ``values`` (its set of
    integers) for ``what``, or None when no value is in all of them."""
    mine = ",".join(str(int(v)) for v in sorted(set(values))) or "none"
    votes = [mine] if _state.get("env") is None else _votes(mine, what)
    common = None
    for v in votes:
        got = set() if v == "none" else {int(x) for x in v.split(",")}
        common = got if common is None else common & got
    return max(common) if common else None


def barrier(name: str) -> None:
    """Every worker of this job waits here (a coordination-service barrier, not an XLA
    collective: its timeout is the init timeout, not the short collective timeout). Used
    before the first step: a worker still compiling must not make the others' first
    collective time out."""
    e = _state.get("env")
    if e is None:
        return
    from resilax._src.runtime import jaxdist

    if _state.get("membership") is not None:  # after an in-place shrink: votes (they notice a further death)
        _votes("1", f"barrier/{name}")
        return
    jaxdist.client().wait_at_barrier(f"resilax/g{e.generation}/{name}", e.init_timeout_s * 1000)


# ------------------------------------------------------------------ re-forming (growing back)
class Reform(Exception):
    """Raised by `ResilientStep` when the job re-forms with warm spares: after a step failed
    because a process died (the spares take the dead places), or at the step boundary the
    job agreed on to grow back to ``-n`` after it shrank in place. Every step this process
    completed is in its host store. The worker command catches it, calls `reattach` (this
    process joins the next generation without restarting) and runs its set-up again;
    `resilax train` does."""

    def __init__(self, generation: int, step: int):
        super().__init__(f"the job re-forms as generation {generation} after step {step}")
        self.generation, self.step = generation, step


def reform_assignment(run_dir, generation: int, process_id: int) -> str:
    """Where the supervisor writes a re-forming worker's place in ``generation``."""
    return os.path.join(run_dir, "spares", f"reform-g{generation}-p{process_id}.json")


def reform_due(step: int, settle=None) -> bool:
    """Whether this worker leaves the job now, at the boundary after ``step`` completed
    steps, to re-form (call it before every step, with the same step numbers on all
    workers; False at once unless the job went on in place).

    The supervisor asks by adding ``"reform"`` to the membership file; the lowest live
    process reads it here and publishes ``step + 1`` as the boundary in the key-value
    store before it dispatches step ``step + 1``. Any other worker completes that step only
    after the lowest one dispatched it, so each finds the boundary before it passes it,
    provided it looks only once its previous step completed: a host that runs ahead of its
    devices (as plain jit's do) could otherwise dispatch past the boundary. ``settle()``
    waits for that (the other workers call it before they look; only in a generation that
    can re-form, where a step costs this wait)."""
    m = _state.get("membership")
    e = _state.get("env")
    if e is None or (m is None and e.job_processes == e.num_processes):
        return False  # neither shrunk in place nor a generation smaller than the job: nothing to grow
    from resilax._src.runtime import jaxdist

    key = f"resilax/reform/g{e.generation}"
    if "reform_at" not in _state:
        c = jaxdist.client()
        if e.process_id == alive()[0]:  # the primary process
            cur = read_membership() or {}
            if cur.get("reform"):
                c.key_value_set(key, str(int(step) + 1))
                _state["reform_at"] = int(step) + 1
        else:
            if settle is not None:
                settle()  # its previous step completed: the lowest process had decided before dispatching it
            try:
                _state["reform_at"] = int(c.key_value_try_get(key))
            except Exception:  # noqa: BLE001 (not published yet)
                pass
    return _state.get("reform_at") == int(step)
