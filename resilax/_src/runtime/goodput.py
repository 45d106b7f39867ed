"""Run-time accounting: every second of wall time lands in exactly one bucket.

A :class:`GoodputRecorder` splits the wall time since it was created into the
named buckets of :data:`BUCKETS`. Time is attributed by spans (``with
rec.span("productive", step=12): ...``); nested spans give their time to the
innermost bucket only, so nothing is counted twice. Time measured elsewhere
(a phase timer, a background thread) is attributed with :meth:`add`, which
*moves* that many seconds into the bucket from wherever they would otherwise
have gone (the innermost open span, or the unattributed remainder). Whatever no
span or ``add`` claimed is ``other``. Hence, always::

    sum(rec.totals().values()) == rec.wall()     # up to float rounding

Bucket names line up with Google's ml-goodput-measurement ``BadputType`` where
they mean the same thing (:data:`ML_GOODPUT_NAMES`), so numbers can be compared.

Files: :meth:`GoodputRecorder.save` writes ``RUN_DIR/goodput.json`` atomically
(temporary file, then ``os.replace``) with a sha256 over the canonical JSON
body; :func:`load_goodput` verifies it and raises :class:`GoodputFileError`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from resilax._src.errors import ResilaxError

__all__ = [
    "BUCKETS", "ML_GOODPUT_NAMES", "GOODPUT_FILE", "GoodputFileError",
    "GoodputRecorder", "load_goodput",
]

#: Buckets, in report order. ``other`` is the unattributed remainder.
BUCKETS: tuple[str, ...] = (
    "productive",          # steps whose result is kept
    "protection",          # peer copies, replay log, checksums (failure-free cost)
    "checkpoint_save",     # blocking part of a checkpoint save
    "checkpoint_restore",  # reading a checkpoint back
    "detection",           # failure happened -> failure noticed
    "recovery",            # plan / restore / compile / restart / rejoin (label: phase)
    "replay",              # rerunning logged optimizer updates
    "compile",             # compiles and recompiles outside recovery
    "lost",                # steps computed, then thrown away and recomputed
    "idle",                # waiting on purpose (slices to come back, capacity held idle)
    "other",               # everything no span claimed
)

#: resilax bucket -> ml-goodput-measurement name (``GoodputType`` / ``BadputType``
#: members, as in google/ml-goodput-measurement ``goodput_utils.py``). Buckets that
#: map to the same name there are finer splits of it here.
ML_GOODPUT_NAMES: dict[str, str] = {
    "productive": "GoodputType.TOTAL",
    # ml-goodput lists SDC checks as an example of custom badput events.
    "protection": "BadputType.CUSTOM_BADPUT_EVENTS",
    "checkpoint_save": "BadputType.UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "checkpoint_restore": "BadputType.UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
    "detection": "BadputType.INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    "recovery": "BadputType.INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION",
    # Replay redoes progress a disruption destroyed, only faster.
    "replay": "BadputType.WASTED_PROGRESS_FROM_DISRUPTION",
    # ml-goodput counts "compilation or re-compilation" as program startup.
    "compile": "BadputType.PROGRAM_STARTUP",
    "lost": "BadputType.WASTED_PROGRESS_FROM_DISRUPTION",
    "idle": "BadputType.OTHER",
    "other": "BadputType.OTHER",
}

GOODPUT_FILE = "goodput.json"
_FORMAT = "resilax.goodput"
_VERSION = 1


class GoodputFileError(ResilaxError, ValueError):
    """A goodput.json file is missing, truncated, corrupt or of an unknown format."""


def _check_bucket(api: str, bucket: str) -> None:
    if bucket not in BUCKETS:
        raise ValueError(
            f"{api} expects a bucket in {BUCKETS}, but got {bucket!r}")


MAX_SEGMENTS = 4096  # timeline pieces kept (`GoodputRecorder._compact`)
MAX_EARLIER = 64  # earlier processes of a resumed run kept (`GoodputRecorder.continue_from`)
_MERGE = 8  # unlabelled pieces merged into one per bucket when the timeline is compacted


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


class GoodputRecorder:
    """Splits wall time into :data:`BUCKETS`.

    Args:
      clock: a monotonic ``() -> seconds`` (default ``time.perf_counter``);
        inject a fake one in tests. Wall time starts at construction.

    Thread-safe: spans belong to the thread that opened them conceptually, but
    one lock guards all state, so ``add``/``event`` may come from other threads.
    A recorder built by :meth:`from_json` is frozen: its wall time is the saved
    one and it refuses new spans.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._t0 = float(clock())
        self._lock = threading.RLock()
        self._frozen_wall: float | None = None
        # Closed, non-overlapping pieces of spans: (bucket, start, end, labels),
        # times relative to start. ``add`` pieces carry ``"added": True``.
        self._segments: list[tuple[str, float, float, dict]] = []
        # Seconds moved between buckets by ``add``: bucket -> +/- seconds.
        self._moved: dict[str, float] = {b: 0.0 for b in BUCKETS}
        # Open spans, innermost last: [bucket, labels, piece_start].
        self._stack: list[list[Any]] = []
        self._events: list[dict] = []
        self.id = uuid.uuid4().hex  # this recorder's: a run resumed by another process has another
        # the processes that ran this run before this one (a restart resumed it): their wall
        # time, totals and events, oldest first (`continue_from`)
        self.earlier: list[dict] = []

    # -- recording ---------------------------------------------------------
    def _now(self) -> float:
        if self._frozen_wall is not None:
            return self._frozen_wall
        return float(self._clock()) - self._t0

    def _writable(self, api: str) -> None:
        if self._frozen_wall is not None:
            raise RuntimeError(
                f"GoodputRecorder.{api} needs a live recorder, but this one was "
                "loaded from JSON and is frozen")

    @contextlib.contextmanager
    def span(self, bucket: str, **labels: Any) -> Iterator[None]:
        """Attribute the time inside the block to ``bucket``.

        A span opened inside another pauses the outer one: its time goes to the
        inner bucket only. Labels (``step=12``, ``phase="restore"``) are kept
        with the span's pieces for the timeline.
        """
        _check_bucket("GoodputRecorder.span", bucket)
        self._writable("span")
        with self._lock:
            now = self._now()
            if self._stack:
                self._close_piece(self._stack[-1], now)
            self._stack.append([bucket, dict(labels), now])
        try:
            yield
        finally:
            with self._lock:
                now = self._now()
                top = self._stack.pop()
                self._close_piece(top, now)
                if self._stack:
                    self._stack[-1][2] = now

    def _close_piece(self, entry: list, now: float) -> None:
        bucket, labels, start = entry
        if now > start:
            self._append((bucket, start, now, labels))

    def _append(self, seg: tuple) -> None:
        self._segments.append(seg)
        if len(self._segments) > MAX_SEGMENTS:
            self._compact()

    def _compact(self) -> None:
        """Coarsens the older half of the timeline: runs of unlabelled pieces (the loop's
        steps and their protection work, ~2 a step) are merged ``_MERGE`` at a time into one
        piece per bucket, laid end to end in the merged pieces' time in proportion to their
        seconds, so each bucket's seconds (the totals) stay. Labelled pieces (saves,
        compiles, recoveries, `add`) stay as they are. The timeline keeps at most
        `MAX_SEGMENTS` pieces, older times at a coarser resolution, so a long run's memory
        and the goodput.json written at every save stay bounded."""
        half = len(self._segments) // 2
        old, out, run = self._segments[:half], [], []

        def flush():
            for i in range(0, len(run), _MERGE):
                group = run[i:i + _MERGE]
                secs: dict[str, float] = {}
                for b, st, en, _ in group:
                    secs[b] = secs.get(b, 0.0) + (en - st)
                t = group[0][1]
                for b in sorted(secs, key=BUCKETS.index):
                    out.append((b, t, t + secs[b], {}))
                    t += secs[b]
            run.clear()

        for seg in old:
            if seg[3]:
                flush()
                out.append(seg)
            else:
                run.append(seg)
        flush()
        self._segments = out + self._segments[half:]

    def add(self, bucket: str, seconds: float, *, source: str | None = None, **labels: Any) -> None:
        """Attribute ``seconds`` that have already elapsed to ``bucket``.

        The seconds are taken from ``source`` when given, else from the innermost
        open span's bucket, or from the unattributed remainder (``other``) when
        no span is open, so the buckets still sum to wall time. A given
        ``source`` gives at most what it holds (a step thrown away is taken back
        from ``productive``, never driving a bucket below zero). Raises
        ValueError for a negative or non-finite ``seconds``.
        """
        _check_bucket("GoodputRecorder.add", bucket)
        if source is not None:
            _check_bucket("GoodputRecorder.add", source)
        self._writable("add")
        seconds = float(seconds)
        if not (seconds >= 0.0 and seconds != float("inf")):
            raise ValueError(
                f"GoodputRecorder.add expects finite seconds >= 0, but got {seconds!r}")
        with self._lock:
            now = self._now()
            if source is None:
                source = self._stack[-1][0] if self._stack else "other"
            else:
                seconds = min(seconds, max(0.0, self.totals()[source]))
            self._moved[bucket] += seconds
            self._moved[source] -= seconds
            self._append((bucket, max(0.0, now - seconds), now, {**labels, "added": True}))

    def event(self, kind: str, **fields: Any) -> dict:
        """Record a point event (failure, recovery, rejoin...) at the current time."""
        self._writable("event")
        with self._lock:
            ev = {"t": self._now(), "kind": str(kind), **fields}
            self._events.append(ev)
            return ev

    # -- reading -----------------------------------------------------------
    def wall(self) -> float:
        """Seconds since the recorder started (or the saved wall time if frozen)."""
        with self._lock:
            return self._now()

    def totals(self) -> dict[str, float]:
        """Bucket -> seconds, every bucket present; sums to :meth:`wall`.

        Open spans count up to now.
        """
        with self._lock:
            now = self._now()
            out = {b: 0.0 for b in BUCKETS}
            for bucket, start, end, labels in self._segments:
                if not labels.get("added"):
                    out[bucket] += end - start
            if self._stack:
                bucket, _, start = self._stack[-1]
                out[bucket] += max(0.0, now - start)
            for b, s in self._moved.items():
                out[b] += s
            # The remainder absorbs explicit "other" spans and moves into or
            # out of it, and makes the sum exact by construction.
            out["other"] = now - sum(v for b, v in out.items() if b != "other")
            return out

    def goodput(self) -> float:
        """productive / wall (0.0 before any time has passed)."""
        with self._lock:
            wall = self._now()
            return self.totals()["productive"] / wall if wall > 0 else 0.0

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self._events]

    def segments(self) -> list[dict]:
        """Timeline pieces, closed ones plus the open innermost span up to now."""
        with self._lock:
            out = [{"bucket": b, "start": s, "end": e, "labels": dict(l)}
                   for b, s, e, l in self._segments]
            if self._stack:
                b, l, s = self._stack[-1]
                now = self._now()
                if now > s:
                    out.append({"bucket": b, "start": s, "end": now,
                                "labels": {**l, "open": True}})
            return out

    def continue_from(self, prev: "GoodputRecorder") -> bool:
        """This process resumed the run ``prev`` (its saved goodput.json) recorded: its
        processes (and theirs before it) are kept as ``earlier``, so the run's report covers
        every process, not only the newest. Returns False (nothing kept) for this recorder's
        own file. At most `MAX_EARLIER` processes are kept, the oldest dropped first."""
        if prev.id == self.id:
            return False
        with self._lock:
            mine = {"wall_s": prev.wall(), "totals": prev.totals(), "events": prev.events}
            self.earlier = (list(prev.earlier) + [mine])[-MAX_EARLIER:]
        return True

    def run_totals(self) -> dict[str, float]:
        """Bucket -> seconds over every process of the run (``earlier`` and this one)."""
        out = self.totals()
        for e in self.earlier:
            for b in BUCKETS:
                out[b] += float(e["totals"].get(b, 0.0))
        return out

    def run_wall(self) -> float:
        """Seconds of wall time over every process of the run (time between processes, when
        none ran, is not counted)."""
        return self.wall() + sum(float(e["wall_s"]) for e in self.earlier)

    # -- serialisation -----------------------------------------------------
    def to_json(self) -> dict:
        """A JSON-able snapshot: wall, totals, goodput, segments, events, moved."""
        with self._lock:
            return {
                "wall_s": self._now(),
                "totals": self.totals(),
                "goodput": self.goodput(),
                "buckets": list(BUCKETS),
                "ml_goodput_names": dict(ML_GOODPUT_NAMES),
                "segments": self.segments(),
                "moved": dict(self._moved),
                "events": self.events,
                "id": self.id,
                "earlier": [dict(e) for e in self.earlier],
            }

    @classmethod
    def from_json(cls, data: dict) -> "GoodputRecorder":
        """Rebuild a frozen recorder from :meth:`to_json` output.

        Raises GoodputFileError when required fields are missing or malformed.
        """
        try:
            rec = cls(clock=lambda: 0.0)
            rec._frozen_wall = float(data["wall_s"])
            for seg in data["segments"]:
                if seg["bucket"] not in BUCKETS:
                    raise ValueError(f"unknown bucket {seg['bucket']!r}")
                labels = dict(seg.get("labels", {}))
                labels.pop("open", None)
                rec._segments.append(
                    (seg["bucket"], float(seg["start"]), float(seg["end"]), labels))
            for b, s in data.get("moved", {}).items():
                if b not in BUCKETS:
                    raise ValueError(f"unknown bucket {b!r}")
                rec._moved[b] = float(s)
            rec._events = [dict(e) for e in data.get("events", [])]
            rec.id = str(data.get("id") or rec.id)
            rec.earlier = []
            for e in data.get("earlier", []):
                if set(e["totals"]) - set(BUCKETS):
                    raise ValueError(f"unknown buckets {sorted(set(e['totals']) - set(BUCKETS))}")
                rec.earlier.append({"wall_s": float(e["wall_s"]), "events": [dict(v) for v in e["events"]],
                                    "totals": {b: float(v) for b, v in e["totals"].items()}})
        except (KeyError, TypeError, ValueError) as e:
            raise GoodputFileError(
                f"GoodputRecorder.from_json expects the output of to_json(), but "
                f"the data is malformed: {type(e).__name__}: {e}") from e
        return rec

    def save(self, run_dir: str | os.PathLike) -> str:
        """Write ``run_dir/goodput.json`` atomically; returns its path.

        Costs one JSON encoding of the timeline (at most `MAX_SEGMENTS` pieces): the body
        is written as the canonical bytes its checksum is taken over.
        """
        canon = _canonical(self.to_json())
        head = json.dumps({"format": _FORMAT, "sha256": hashlib.sha256(canon).hexdigest(), "version": _VERSION},
                          sort_keys=True)
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(os.fspath(run_dir), GOODPUT_FILE)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(b'{"body":' + canon + b"," + head[1:].encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path


def load_goodput(run_dir: str | os.PathLike) -> GoodputRecorder:
    """Read and verify ``run_dir/goodput.json``; returns a frozen recorder.

    Raises GoodputFileError naming the file and what is wrong: missing,
    not JSON (e.g. truncated), unknown format/version, checksum mismatch.
    """
    path = os.path.join(os.fspath(run_dir), GOODPUT_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise GoodputFileError(
            f"load_goodput expects {path} to exist, but it does not "
            "(was the run's GoodputRecorder saved?)") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GoodputFileError(
            f"{path} is not valid JSON ({len(raw)} bytes; truncated or corrupt): {e}"
        ) from e
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise GoodputFileError(
            f"{path} is not a resilax goodput file: expected format {_FORMAT!r}, "
            f"got {doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}")
    if doc.get("version") != _VERSION:
        raise GoodputFileError(
            f"{path} has version {doc.get('version')!r}; this resilax reads "
            f"version {_VERSION}")
    body, want = doc.get("body"), doc.get("sha256")
    if not isinstance(body, dict) or not isinstance(want, str):
        raise GoodputFileError(f"{path} lacks its 'body' or 'sha256' field")
    got = hashlib.sha256(_canonical(body)).hexdigest()
    if got != want:
        raise GoodputFileError(
            f"{path} failed its checksum: stored sha256 {want[:16]}..., "
            f"content hashes to {got[:16]}... (file corrupted after writing)")
    try:
        return GoodputRecorder.from_json(body)
    except GoodputFileError as e:
        raise GoodputFileError(f"{path}: {e}") from e
