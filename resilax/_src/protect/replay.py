"""Replay: redo steps ``start..stop`` from the record log's disk entries (`disk_log.DiskLog`),
each gated by its recorded verdict; grads entries run only the update, inputs entries the
whole step on the batch they carry (a run without a data iterator) or on the one the data
iterator yields from the logged position."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from resilax._src.errors import ReplayLogError
from resilax._src.protect.disk_log import DiskLog


@dataclasses.dataclass(frozen=True)
class Replayed:
    """What `replay` did: the state at ``step``, how each step was replayed, what failed."""

    state: Any
    step: int
    modes: tuple[str, ...]  # per replayed step: "grads" or "inputs"
    seconds: float
    failed: tuple[tuple[int, str], ...] = ()  # (step, reason) of the first step that could not be replayed
    data_next: Any = None  # iterator position after the last replayed batch
    verdicts: tuple[int, ...] = ()  # per replayed step: its recorded verdict (0 applied, 1 NaN/Inf, 2 spike)


def replay(
    state,
    log: DiskLog,
    start: int,
    stop: int | None = None,
    *,
    update: Callable[[Any, int, list[np.ndarray], list | None], Any],
    full: Callable[[Any, Any, int], Any] | None = None,
    data=None,
    decode_data_state: Callable[[Any], Any] = lambda s: s,
    checksums: Callable[[Any], np.ndarray] | None = None,
    strict: bool = True,
    verdicts: bool = False,
) -> Replayed:
    """Replays steps ``start .. stop-1`` from the log onto ``state`` (the state at ``start``).

    Per step it prefers the grads entry (``update(state, step, recorded_leaves, batch_sig)``,
    no gradient computation) and falls back to the inputs entry (``full(state, batch, step)``
    on the batch the entry carries, else on the one ``data`` yields from the logged
    position; needs ``full``, and ``data`` for an entry without its batch).

    Args:
      stop: last step + 1; ``None``: as far as the log has an unbroken run of good entries.
      checksums: ``state -> [n, 2]`` checksums; when given, the start state is checked
        against the checksums the original step logged (a log written for another state
        raises), and so is the final state when the log has the entry that follows it.
      strict: with ``stop`` given, raise when a step cannot be replayed.
      verdicts: pass each step's recorded verdict as a last argument to ``update`` and
        ``full`` (``update(state, step, recorded, batch_sig, verdict)``,
        ``full(state, batch, step, verdict)``): a replay must gate the update with it, never
        with a recomputed one (`ResilientStep` does). An entry without a valid verdict then
        raises `ReplayLogError`.

    Returns:
      `Replayed`. ``state`` is donated to the update/step functions: use the returned one.

    Raises:
      ReplayLogError: the start state does not match the log; or (strict, ``stop`` given)
        an entry is missing or corrupt: the message names the steps that could not be
        replayed; ``err.replayed`` holds the `Replayed` reached so far.
    """
    t0 = time.perf_counter()
    step, modes, failed, data_next = start, [], [], None
    files = set(log.files())
    have = {s for s, _ in files}
    limit = stop if stop is not None else (max(have) + 1 if have else start)
    first = True
    at = None  # encoded position the iterator is at, once replay has moved it
    seen: list = []  # recorded verdicts of the replayed steps
    while step < limit:
        entry, reasons = None, []
        for kind in ("grads", "inputs"):
            if kind == "inputs" and full is None:
                reasons.append("inputs entry unusable without a step function (full=)")
                continue
            if (step, kind) not in files:
                reasons.append(f"resilax replay log: no {kind} entry for step {step}")
                continue
            try:
                entry = log.read(step, kind)
            except ReplayLogError as e:
                reasons.append(str(e))
                continue
            if entry.kind == "inputs" and entry.batch is None and data is None:
                entry = None
                reasons.append("inputs entry without its batch unusable without a data iterator")
                continue
            break
        if entry is None:
            failed.append((step, "; ".join(reasons)))
            break
        if first and checksums is not None and entry.state_sums is not None:
            got = np.asarray(checksums(state))
            if not np.array_equal(got, entry.state_sums):
                raise ReplayLogError(
                    f"resilax replay: the state at step {step} does not match the state the replay log at "
                    f"{str(log.directory)!r} was recorded from (checksums differ); this log belongs to another run"
                )
        first = False
        from resilax._src.protect.anomaly import recorded_verdict

        extra = (recorded_verdict(entry.scalars.get("verdict"), step),) if verdicts else ()
        if entry.kind == "grads":
            state = update(state, step, entry.recorded, entry.batch_sig, *extra)
        elif entry.batch is not None:
            state = full(state, entry.batch, step, *extra)
        else:
            # Consecutive inputs steps read consecutive batches: position the iterator once
            # (grain's set_state costs ~10 steps' time) and then iterate.
            if at is None or at != entry.data_state:
                data.set_state(decode_data_state(entry.data_state))
            state = full(state, next(data), step, *extra)
            at = entry.data_next
        seen.append(entry.scalars.get("verdict"))
        data_next = entry.data_next
        modes.append(entry.kind)
        step += 1
    if checksums is not None and step > start and step in have:
        try:
            after = log.read(step, "inputs")
        except ReplayLogError:
            after = None
        if after is not None and after.state_sums is not None:
            if not np.array_equal(np.asarray(checksums(state)), after.state_sums):
                raise ReplayLogError(
                    f"resilax replay: replaying steps {start}..{step - 1} did not reproduce the state the original "
                    f"run had at step {step} (checksums differ): replay is not deterministic here"
                )
    out = Replayed(state, step, tuple(modes), time.perf_counter() - t0, tuple(failed), data_next,
                   tuple(v if isinstance(v, int) else None for v in seen))
    if strict and stop is not None and step < stop:
        err = ReplayLogError(
            f"resilax replay: replayed steps {start}..{step - 1} but could not replay steps {step}..{stop - 1}: "
            f"{failed[0][1] if failed else 'no entry'}"
        )
        err.replayed = out
        raise err
    return out
