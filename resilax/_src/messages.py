"""What a person reads about a failure: one line per event, worded here once.

`describe` turns an event (`Event.to_json()`, or the dict the goodput file keeps: ``kind``,
``step`` and the event's fields) into one line that says what failed, what resilax did and
what was lost. `resilax train` prints it as each event happens, `resilax report RUN_DIR`
lists a run's events with it, and the warnings resilax gives for the same events
(`checkpoints_skipped`) use the same words. The full details stay in the event
(`ResilientStep.events`, the run directory's ``goodput.json``), not in the line.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping

__all__ = ["describe", "checkpoints_skipped", "short_reason", "FAILURE_KINDS", "OWN_STEP_KINDS"]

#: the event kinds that are a failure, a fault injected, or what resilax did about one (those
#: `describe` has a line for); bookkeeping events (cadences, compiles ahead, checks that
#: passed) have none
FAILURE_KINDS = ("restore", "replay", "host_store_skipped", "anomaly", "recovery", "bitflip", "sdc", "rebuilt",
                 "hang_slice", "slow_slice", "repair_slice", "hang", "straggler", "rejoin", "domain_answering",
                 "fault_ignored", "preempted", "checkpoints_paused", "reform", "collectives_changed")

#: kinds whose line names its step itself, and that scripts read from the line's start
#: (``"preempted: every worker stopped after step N, ..."``): `resilax train` prints them
#: without the ``"step N: "`` it puts before the others
OWN_STEP_KINDS = ("host_store_skipped", "preempted")

_SPEC = re.compile(r"\s*\[tensorstore_spec.*", re.S)  # tensorstore's spec payloads (JSON, at the end of its errors)


def short_reason(reason: str, limit: int = 160) -> str:
    """``reason`` (an error's ``"Type: message"``) in at most ``limit`` characters that keep
    what a person acts on: tensorstore's spec dumps are dropped, and a long chain of
    ``"Error ...: Error ...: cause"`` keeps its head (the error type and status) and its
    tail (the cause), e.g. ``ValueError: DATA_LOSS: ... Error decoding b-tree node: CRC-32C
    checksum verification failed: expected=..., actual=...``."""
    text = " ".join(_SPEC.sub("", str(reason)).split())
    if len(text) <= limit:
        return text
    parts = text.split(": ")
    head = ": ".join(parts[:2]) if len(parts) > 2 and parts[1].isupper() else parts[0]  # "ValueError: DATA_LOSS"
    tail = ""
    for p in reversed(parts[1:]):
        grown = f"{p}: {tail}" if tail else p
        if len(head) + len(grown) + 6 > limit:
            break
        tail = grown
    if not tail:
        return text[: limit - 3] + "..."
    return f"{head}: ... {tail}"


def _steps(xs) -> str:
    xs = list(xs)
    return str(xs[0]) if len(xs) == 1 else str(xs)


def checkpoints_skipped(skipped, restored_step: int | None, directory: str | os.PathLike,
                        moved, *, read_only: bool = False) -> str:
    """The line for newer checkpoints that failed verification: ``skipped`` is
    ``[(step, reason), ...]``, ``restored_step`` the older one restored instead (None: none
    was good), ``moved`` where the bad ones went (``quarantine/``, never deleted)."""
    steps = [s for s, _ in skipped]
    why = "; ".join(f"{s}: {short_reason(r)}" for s, r in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
    where = ", ".join(os.path.join(os.path.basename(os.path.dirname(m)), os.path.basename(m)) for m in moved)
    did = (f"restored the previous good checkpoint {restored_step} instead" if restored_step is not None
           else "no older checkpoint is good")
    return (f"checkpoint(s) {steps} in {str(os.fspath(directory))!r} failed verification ({why}); {did}. "
            + ("The bad ones were left where they are (read only)." if read_only else
               f"The bad ones were moved to {where or 'quarantine/'}, not deleted."))


def _restore(e):
    if e.get("source") == "host_store":
        return f"restored step {e['step']} from the host store ({e.get('copy')})"
    skipped = [(s["step"], s["reason"]) for s in e.get("skipped") or []]
    if skipped:
        return checkpoints_skipped(skipped, e["step"], e.get("directory", ""), e.get("quarantined") or [])
    return f"restored checkpoint {e['step']}"


def _replay(e):
    start, end = e.get("from_step"), e["step"]
    line = (f"replayed steps {start}..{end - 1} from the record log" if end > start
            else f"no record log entry replayed after step {start}")
    bad = e.get("unreplayable") or []
    if bad:
        moved = e.get("quarantined")
        aside = f" ({moved} entries from it on moved to record_log/quarantine, not deleted)" if moved else ""
        line += (f"; the entry of step {bad[0]['step']} is unusable ({short_reason(bad[0]['reason'])}){aside}: the "
                 f"steps from {bad[0]['step']} on are trained again from their data, nothing is lost")
    return line


_CAUSES = {"nonfinite": "NaN/Inf in the step's values", "spike": "a loss spike"}


def _anomaly(e):
    cause = _CAUSES.get(e.get("cause"), str(e.get("cause")))
    value = e.get("value")
    if e.get("cause") == "spike" and value is not None:
        cause += f" ({value:.6g})" if isinstance(value, float) else f" ({value})"
    if e.get("action") == "replayed":
        return f"{cause}, replayed with its recorded verdict: its update is not applied"
    if e.get("action") == "stop":
        return f"{cause}: its update was not applied and the run stops (AnomalyConfig.on_anomaly='stop')"
    return f"{cause}: its update was skipped inside the step (the state is as before it); the run goes on"


_FAILED_BY = {"sdc": "failed (outvoted by the replica check)", "hang": "failed (hung)",
              "straggler": "failed (a straggler)"}


def _recovery(e):
    sec = dict(e.get("seconds") or {})
    if e.get("in_place"):
        return (f"went on in place without process(es) {e['dead_processes']}: step {e['restored_step']} from the "
                f"host store ({e['copy']}), {e['steps_recomputed']} step(s) recomputed, mesh {e['mesh']}, "
                f"{sec.get('total', 0.0):.1f} s after the error (detect {sec.get('detect', 0.0):.1f} s, compile "
                f"{sec.get('compile', 0.0):.1f} s, compiled ahead: {e.get('compiled_ahead')})")
    detect = sec.pop("detect", 0.0)
    found = f" (found after {detect:.1f} s)" if detect > 0.05 else ""
    redo = f", {e['steps_replayed']} step(s) replayed from the log" if e.get("steps_replayed") else ""
    recomputed = f", {e['steps_recomputed']} recomputed from their batches" if e.get("steps_recomputed") else ""
    # a slice is lost (its memory deleted), or failed by resilax itself: outvoted, hung, too slow
    how = ", ".join(sorted({_FAILED_BY.get(p, "lost") for p in e.get("phases_failed") or ("",)}))
    return (f"slice(s) {e['failed_domains']} {how}{found}; state from "
            f"{e['source']} copies of step {e['restored_step']}{redo}{recomputed}, {sum(sec.values()) * 1e3:.0f} ms; "
            f"now mesh {e['mesh']}; nothing lost")


def _sdc(e):
    if e.get("bad_domains"):
        what = f"replica checksums: slice(s) {e['bad_domains']} outvoted by {e['good_domains']} in {e['leaves']}"
    else:
        what = f"replica checksums: slices {e['good_domains']} disagree in {e['leaves']}, no majority names one"
    if e.get("decided_by") == "rebuilt_adopted":
        what += (f"; found after the flip fed updates (checked every few steps), so the state was rebuilt "
                 f"from the checkpoint and the record log after step {e['trusted_through']}")
    elif e.get("decided_by") == "rebuilt":
        what += "; told apart by the state rebuilt from the checkpoint and the record log"
    if e.get("bad_domains"):
        what += f"; slice(s) {e['bad_domains']} failed and dropped"
    return what


_LINES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "restore": _restore,
    "replay": _replay,
    "host_store_skipped": lambda e: f"host store not used (step {e.get('wanted_step')}): {e.get('reason')}",
    "anomaly": _anomaly,
    "recovery": _recovery,
    "bitflip": lambda e: f"fault injected: a bit of {e['leaf']} flipped on slice {e['domain']} (silent data corruption)",
    "sdc": _sdc,
    "rebuilt": lambda e: (f"step {e['step']} rebuilt from checkpoint {e.get('restored_step')} and "
                          f"{e.get('steps_redone')} step(s) after it ({e.get('why')})"),
    "hang_slice": lambda e: f"fault injected: slice {e['domain']} stops answering (emulated hang: its memory is kept)",
    "slow_slice": lambda e: f"fault injected: slice {e['domain']} answers {e.get('late_s')} s late (emulated straggler)",
    "repair_slice": lambda e: f"fault injected: slice {e['domain']}'s hardware is back (it rejoins once it answers)",
    "hang": lambda e: (f"liveness watchdog: slice {e['domain']} silent for {float(e.get('detected_s') or 0.0):.1f} s "
                       f"(found by {str(e.get('reason', 'its deadline')).replace('_', ' ')}); it is failed"),
    "straggler": lambda e: (f"liveness watchdog: slice {e.get('domain')} is a straggler"
                            + ("; it is failed" if e.get("removed") else
                               "; kept (HealthConfig.remove_stragglers is off)")),
    "rejoin": lambda e: (f"slice {e['domain']} rejoined: mesh {e['mesh']}, {int(e.get('bytes_moved') or 0):,} bytes "
                         f"copied to it"),
    "domain_answering": lambda e: (f"slice {e['domain']} answers again; not rejoined (HealthConfig.rejoin_answering "
                                   f"is off)"),
    "fault_ignored": lambda e: f"fault {e.get('fault')} on slice {e.get('domain')} not applied: {e.get('reason')}",
    "preempted": lambda e: (f"preempted: every worker stopped after step {e['step']}"
                            + (", checkpoint saved; relaunch to resume" if e.get("checkpoint") else
                               ", nothing saved (no checkpoint directory)")),
    "checkpoints_paused": lambda e: f"checkpoints paused at step {e['step']}: {e.get('why')}",
    "reform": lambda e: (f"left at step {e['step']} to re-form as generation {e.get('generation')}"
                         + (f" (processes {e['dead_processes']} died)" if e.get("dead_processes") else "")),
    "collectives_changed": lambda e: (f"checkpoint {e['step']} was written with {e.get('written')} collectives and "
                                      f"this run has {e.get('now')}: it goes on bitwise equal to a run like this one, "
                                      f"not to the run that wrote the checkpoint"),
}


def describe(event: Mapping[str, Any]) -> str | None:
    """One line for ``event`` (``{"kind", "step", **fields}``: `Event.to_json()` or a goodput
    file's event), or None for a kind that is not a failure, an injected fault or a recovery
    (`FAILURE_KINDS`). The line does not start with the event's step: callers put ``"step
    N: "`` before it (but for `OWN_STEP_KINDS`). An event whose fields lack what its line
    names (one written by another version) gets its kind and fields, never an error."""
    fn = _LINES.get(str(event.get("kind")))
    if fn is None:
        return None
    try:
        return fn(event)
    except (KeyError, TypeError, ValueError):
        rest = {k: v for k, v in event.items() if k not in ("kind", "step", "time", "t")}
        return f"{event.get('kind')} at step {event.get('step')}: {rest}"


def signature_mismatch(directory, step, saved, want) -> str:
    """A checkpoint written for another state: which leaves differ (shape, dtype) and what to do."""
    diffs = []
    saved_d = {p: (s, d) for p, s, d in saved}
    want_d = {p: (s, d) for p, s, d in want}
    for p in sorted(set(saved_d) | set(want_d)):
        if saved_d.get(p) != want_d.get(p):
            diffs.append(f"{p}: checkpoint {saved_d.get(p)} vs state {want_d.get(p)}")
    return (
        f"resilax: checkpoint {step} in {str(directory)!r} was written for a different state "
        f"({len(diffs)} leaves differ, e.g. {diffs[:3]}); pass the state this run was started with, "
        f"or use a new checkpoint_dir"
    )
