"""The record log's disk sink (`DiskLog`): entries that let `replay` redo steps exactly from
what the original steps recorded, their file format, and reading them back.

Two kinds of entries, one file each, per step ``i`` (the step that takes the state from
``i`` to ``i + 1``):

- ``inputs``: the data-iterator position before and after batch ``i`` (grain's JSON
  state) and the on-device checksums of the state step ``i`` started from. The RNG needs
  no logging (``fold_in(key(seed), i)``). Replaying it reruns the whole step on the batch
  the iterator yields from that position: exact when the data pipeline is deterministic.
  A run without a data iterator has no position to log: its inputs entries carry the
  batch itself (``"batch": true`` in the header, the batch's leaves as the payload), and a
  replay reruns the step on that batch.
- ``grads``: the values given to `resilax.record` (batch-mean gradients, and whatever else
  the update consumes) as raw arrays. Replaying it runs only `Split.update`: the forward
  and backward pass are dead code and XLA removes them.

Both kinds hold the step's verdict (0 applied, 1 skipped for NaN/Inf, 2 skipped for a
spike) and watched value: a replay gates the update with the recorded verdict, never a
recomputed one (``replay(..., verdicts=True)``, `ResilientStep`).

In ``grads`` mode both files are written; the selective policy (`SelectivePolicy`) keeps
grads files for the newest steps within ``log_budget_bytes`` and deletes older grads
files, leaving their inputs files: log bytes traded against replay time.

File format (no pickle): ``MAGIC | u64 header length | JSON header | payload | sha256 of
all before``. A flipped or missing byte fails the sha256; the header names the step, so
the error can too. A grads entry holds the recorded values packed as they crossed between
the step's two programs (`packed_layout`), read back leaf by leaf (`unpack_recorded`).
Files are written under a temporary name (a new file, never an existing one), then renamed
into place (atomic); files and directory are fsynced in groups (at most
``sync_every_s`` apart, and by `DiskLog.wait`). An existing file is never overwritten: a
stale one is moved to ``quarantine/`` first.

Durability: the copy to host and the write run on a background thread. After
``step(state, batch)`` returns for step ``k``, entries up to ``k - max_lag`` are durable
(the caller blocks if the writer falls further behind) against a process crash, and
against an OS crash once the next group fsync ran; `DiskLog.wait` makes all of them durable. After a crash, resume reaches the newest entry in an unbroken run of good
ones after the restored checkpoint; steps after it are trained again from the data.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import queue
import shutil
import struct
import threading
import time
import uuid
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilax._src.errors import ReplayLogError, StorageError, _is_disk_full

MAGIC = b"RXLOG01\n"
FORMAT = 1
KINDS = ("grads", "inputs")
QUARANTINE = "quarantine"
_SUFFIX = ".rxl"


# ---------------------------------------------------------------- batch templates
def batch_signature(batch) -> list:
    """``[[path, shape, dtype], ...]`` where path is ``[["d", key] | ["s", index], ...]``.

    Grads-mode replay after a restart has no batch, but tracing the user's step needs one
    of the right structure (its values are dead code). Dicts, lists and tuples are supported.
    """
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        elems = []
        for k in path:
            if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, (str, int)):
                elems.append(["d", k.key])
            elif isinstance(k, jax.tree_util.SequenceKey):
                elems.append(["s", k.idx])
            else:
                raise ReplayLogError(
                    f"resilax replay log: grads-mode replay rebuilds a batch template from its structure, so a batch "
                    f"must be a nest of dicts/lists/tuples of arrays, but it has a {type(k).__name__} at "
                    f"{jax.tree_util.keystr(path)}; use replay_log='inputs' or a dict batch"
                )
        out.append([elems, list(np.shape(x)), str(np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)])
    return out


def batch_template(sig, leaves=None):
    """A nest of ``jax.ShapeDtypeStruct`` rebuilt from `batch_signature`; with ``leaves``
    (host arrays in the signature's order), the batch itself."""
    if leaves is not None:
        if len(leaves) != len(sig) or any(list(np.shape(x)) != list(shape) or str(x.dtype) != dtype
                                          for x, (_, shape, dtype) in zip(leaves, sig)):
            raise ReplayLogError("resilax replay log: a logged batch does not match its batch signature")
    at = iter(leaves) if leaves is not None else None

    def leaf(shape, dtype):
        return next(at) if at is not None else jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))

    if len(sig) == 1 and not sig[0][0]:
        return leaf(sig[0][1], sig[0][2])
    root: Any = None

    def put(node, elems, leaf):
        kind, key = elems[0]
        if node is None:
            node = {} if kind == "d" else []
        if kind == "s":
            while len(node) <= key:
                node.append(None)
        if len(elems) == 1:
            node[key] = leaf
        else:
            node[key] = put(node[key] if (kind == "s" or key in node) else None, elems[1:], leaf)
        return node

    for elems, shape, dtype in sig:
        root = put(root, elems, leaf(shape, dtype))
    return root


# ---------------------------------------------------------------- entries
@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One step's entry, as read back (checksum verified)."""

    step: int
    kind: str
    data_state: Any  # encoded iterator position before batch `step` (None without data)
    data_next: Any  # ... and after it
    state_sums: np.ndarray | None  # [n_leaves, 2] checksums of the state the step started from
    batch_sig: list | None
    recorded: list[np.ndarray] | None  # grads: recorded leaves in tree order
    recorded_paths: list[str] | None
    scalars: dict = dataclasses.field(default_factory=dict)  # per-step scalars (verdict, watched value, variant)
    batch: Any = None  # inputs entries of a run without a data iterator: the step's batch (host arrays)


def encode_entry(header: dict, arrays: list[np.ndarray] = (), raw: dict | None = None) -> bytes:
    """The file bytes of one entry. One copy of the payload: the arrays are hashed and
    joined from their own buffers (a grads entry is written every step). ``raw``: header
    fields given already serialized (a packed entry's layout: JSON made once per run)."""
    leaves, views, off = [], [], 0
    for a in arrays:
        a = np.ascontiguousarray(a)
        # as bytes: a memoryview of an ml_dtypes array (bfloat16, float8) cannot be cast
        v = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        leaves.append({"shape": list(a.shape), "dtype": str(a.dtype), "offset": off, "nbytes": v.nbytes})
        views.append(v)
        off += v.nbytes
    header = dict(header, format=FORMAT, arrays=leaves, payload_bytes=off)
    hj = json.dumps(header, separators=(",", ":"))
    if raw:
        hj = hj[:-1] + "".join(f",{json.dumps(k)}:{v}" for k, v in raw.items()) + "}"
    hb = hj.encode()
    parts = [MAGIC, struct.pack("<Q", len(hb)), hb, *views]
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return b"".join(parts + [h.digest()])


def decode_entry(data: bytes, *, where: str) -> tuple[dict, list[np.ndarray]]:
    """Parses and verifies one entry file. Raises ReplayLogError naming ``where``."""
    n = len(data)
    if n < len(MAGIC) + 8 + 32 or data[: len(MAGIC)] != MAGIC:
        raise ReplayLogError(f"{where}: truncated or not a replay-log entry ({n} bytes)")
    body, digest = data[:-32], data[-32:]
    (hlen,) = struct.unpack("<Q", body[len(MAGIC): len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if hashlib.sha256(body).digest() != digest:
        hint = "truncated" if start + hlen > len(body) else "corrupt"
        raise ReplayLogError(f"{where}: sha256 mismatch, the file is {hint} ({n} bytes)")
    header = json.loads(body[start: start + hlen])
    if header.get("format") != FORMAT:
        raise ReplayLogError(f"{where}: unknown format {header.get('format')!r}")
    payload = body[start + hlen:]
    if len(payload) != header["payload_bytes"]:
        raise ReplayLogError(f"{where}: payload is {len(payload)} bytes, header says {header['payload_bytes']}")
    arrays = [
        np.frombuffer(payload, dtype=jnp.dtype(a["dtype"]), count=int(np.prod(a["shape"], dtype=np.int64)),
                      offset=a["offset"]).reshape(a["shape"])
        for a in header["arrays"]
    ]
    return header, arrays


# ---------------------------------------------------------------- packed grads entries
def packed_layout(paths, shapes, dtypes, shardings, pack) -> str:
    """The layout of a *packed* grads entry, as JSON (made once per program, spliced into
    each entry's header). The entry's arrays are the buffers the recorded values crossed
    between the step's two parts in (`ring.local_pack`: one 1-D buffer per dtype, each
    device's part its own blocks of the small leaves, concatenated), then the large leaves as
    they are. So an entry costs the step loop one host copy per buffer, not one per leaf;
    a reader cuts the leaves out on the host (`unpack_recorded`).

    Per leaf (tree order): ``shape``, ``dtype`` and either ``big`` (its index among the large
    leaves) or ``buf``/``off``/``block``/``at``: its dtype group, offset and block shape in
    each device's part, and ``at``, for each distinct block, ``[device position, [[start,
    stop] per dimension]]`` (a device's position in a buffer: the mesh's devices in
    row-major order, as a 1-D array sharded over every mesh axis lays them)."""
    devs = list(pack.mesh.devices.flat)
    leaves, big = [], 0
    for shape, dtype, sh, slot in zip(shapes, dtypes, shardings, pack.slots, strict=True):
        shape = tuple(int(d) for d in shape)
        d = {"shape": list(shape), "dtype": np.dtype(dtype).name}
        if slot is None:
            d["big"] = big
            big += 1
        else:
            g, off, block = slot
            where = sh.devices_indices_map(shape)
            at, seen = [], set()
            for k, dev in enumerate(devs):
                box = tuple(tuple(sl.indices(n)[:2]) for sl, n in zip(where[dev], shape))
                if box not in seen:
                    seen.add(box)
                    at.append([k, [list(b) for b in box]])
            d.update(buf=int(g), off=int(off), block=[int(b) for b in block], at=at)
        leaves.append(d)
    return json.dumps({"paths": list(paths), "devices": len(devs), "groups": list(pack.groups),
                       "lengths": [int(n) for n in pack.lengths], "leaves": leaves}, separators=(",", ":"))


def unpack_recorded(layout: dict, arrays: list[np.ndarray], *, where: str) -> list[np.ndarray]:
    """The recorded leaves (tree order) of a packed grads entry (`packed_layout`). Raises
    ReplayLogError naming ``where`` when the layout and the arrays disagree."""
    try:
        ng, devices = len(layout["groups"]), int(layout["devices"])
        bufs, bigs = arrays[:ng], arrays[ng:]
        if len(bufs) != ng:
            raise ValueError(f"{len(bufs)} buffers, the layout names {ng}")
        for b, g, n in zip(bufs, layout["groups"], layout["lengths"]):
            if b.dtype != jnp.dtype(g) or b.shape != (devices * int(n),):
                raise ValueError(f"a {b.dtype} buffer of shape {b.shape}, not {g} ({devices * int(n)},)")
        n_big = sum("big" in leaf for leaf in layout["leaves"])
        if len(bigs) != n_big:
            raise ValueError(f"{len(bigs)} large leaves, the layout names {n_big}")
        out = []
        for leaf in layout["leaves"]:
            shape, dtype = tuple(leaf["shape"]), jnp.dtype(leaf["dtype"])
            if "big" in leaf:
                x = bigs[int(leaf["big"])]
                if x.shape != shape or x.dtype != dtype:
                    raise ValueError(f"a large leaf of {x.shape} {x.dtype}, not {shape} {dtype}")
                out.append(x)
                continue
            g, off, block = int(leaf["buf"]), int(leaf["off"]), tuple(int(b) for b in leaf["block"])
            if bufs[g].dtype != dtype:
                raise ValueError(f"a {dtype} leaf in the {bufs[g].dtype} buffer")
            n, size = int(layout["lengths"][g]), int(np.prod(block, dtype=np.int64))
            x = np.empty(shape, dtype)
            covered = 0
            for k, box in leaf["at"]:
                if not 0 <= k < devices or off + size > n:
                    raise ValueError(f"a block at device {k}, offset {off} outside the buffers")
                part = bufs[g][k * n + off: k * n + off + size].reshape(block)
                x[tuple(slice(a, b) for a, b in box)] = part[tuple(slice(0, b - a) for a, b in box)]
                covered += int(np.prod([b - a for a, b in box], dtype=np.int64))
            if covered != x.size:
                raise ValueError(f"the blocks of a leaf of shape {shape} cover {covered} of its {x.size} elements")
            out.append(x)
        return out
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ReplayLogError(f"{where}: its packed layout does not match its arrays ({e})") from e


def _json_scalar(v):
    """A per-step scalar as JSON: device scalars are read (their copies were started at
    append); floats keep NaN/Inf as strings (JSON has no NaN)."""
    if v is None or isinstance(v, (str, bool, int)):
        return v
    x = np.asarray(v).item()
    if isinstance(x, float) and not np.isfinite(x):
        return repr(x)
    return x


def scalar_value(v):
    """Inverse of `_json_scalar` for numbers."""
    return float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v


def _write_new(path: str, data: bytes) -> None:
    """Writes ``data`` to a new file (never one that exists); a failed write (a full disk)
    leaves no partial file behind. A plain write: tensorstore's file kvstore hands each
    write to its own threads, which cost more CPU than a small entry's write itself."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    os.close(fd)


def entry_name(step: int, kind: str) -> str:
    return f"{step:010d}.{kind}{_SUFFIX}"


def parse_name(name: str) -> tuple[int, str] | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[0].isdigit() and parts[1] in KINDS and "." + parts[2] == _SUFFIX:
        return int(parts[0]), parts[1]
    return None


# ---------------------------------------------------------------- policy
@dataclasses.dataclass(frozen=True)
class SelectivePolicy:
    """Keep grads entries for the newest steps within ``budget_bytes``; older steps keep
    only their (tiny) inputs entry. ``budget_bytes=None``: keep every grads entry.

    The trade-off: each step kept as grads costs its bytes and saves ``step_s - update_s``
    seconds of replay (`tradeoff` tabulates it).
    """

    budget_bytes: int | None = None

    def grads_window(self, grads_bytes_per_step: int) -> int | None:
        """How many newest steps keep grads (None: all)."""
        if self.budget_bytes is None:
            return None
        return int(self.budget_bytes // max(grads_bytes_per_step, 1))

    @staticmethod
    def tradeoff(*, steps: int, grads_bytes: int, inputs_bytes: int, update_s: float, step_s: float,
                 points: int = 5) -> list[dict]:
        """Log bytes vs expected replay seconds for ``steps`` steps since the last checkpoint,
        keeping grads for the newest ``w`` of them, for a few ``w`` from 0 to ``steps``."""
        out = []
        for w in sorted({round(steps * i / (points - 1)) for i in range(points)}):
            out.append({
                "grads_steps": w,
                "log_bytes": w * grads_bytes + steps * inputs_bytes,
                "replay_s": w * update_s + (steps - w) * step_s,
            })
        return out


# ---------------------------------------------------------------- the log
class DiskLog:
    """Per-step entries on local storage, written in the background.

    Args:
      directory: where entry files live (created if missing).
      policy: `SelectivePolicy` for grads entries.
      max_lag: entries that may be in flight before `append` blocks (bounds host memory and
        how many steps a crash can lose from the log).
      sync_every_s: group commit: written files are fsynced (and the directory) at most this
        often, and by `wait`/`close`. An fsync per entry cost ~10% of a CPU step. A process
        crash loses nothing written (the page cache survives it); an OS crash or power loss
        may lose or tear the last ``sync_every_s`` of entries, which the sha256 detects: the
        resume then replays less and trains those steps again from the data.

      writes: whether this process writes and tidies the directory (a callable, asked at
        each change): in a job of several processes (`resilax launch`) the log lives in the
        shared run directory and one process (id 0) writes, truncates and quarantines; the
        others only read it (a resume). Default: always.

    Thread-safety: `append` and the query methods are called from the training thread;
    one writer thread does the host copies and file writes.
    """

    def __init__(self, directory: str | os.PathLike, *, policy: SelectivePolicy | None = None, max_lag: int = 2,
                 sync_every_s: float = 1.0, writes=None):
        self.directory = pathlib.Path(directory).absolute()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"resilax replay log: cannot create {str(self.directory)!r}: {e}") from e
        self.policy = policy or SelectivePolicy()
        self.max_lag = max(int(max_lag), 0)
        self.sync_every_s = float(sync_every_s)
        self.writes = writes or (lambda: True)
        self._unsynced: list[str] = []
        self._last_sync = time.monotonic()
        self._sync_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cv = threading.Condition()
        self._pending = 0
        self._paths = None  # (treedef, keystr of each recorded leaf): the same every step
        self._error: BaseException | None = None
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.bytes_written = {k: 0 for k in KINDS}
        self.entries_written = {k: 0 for k in KINDS}
        self._grads_sizes: dict[int, int] = {}
        # what one grads entry costs the writer (seconds, moving average; None until one was
        # written): its CPU time copying the shards together plus the wall time of hashing,
        # joining and writing it
        self.grads_cost_s: float | None = None
        self.unwritten: list[tuple[int, str]] = []  # (step, why): entries whose step's values failed
        self.grads_cost_total_s = 0.0
        for step, kind in self.files():
            if kind == "grads":
                self._grads_sizes[step] = (self.directory / entry_name(step, kind)).stat().st_size

    # ---------------------------------------------------------- writing
    def append(self, step: int, *, recorded=None, packed=None, state_sums=None, data_state=None, data_next=None,
               batch_sig=None, scalars=None, batch=None) -> None:
        """Queues entry ``step`` (grads too when ``recorded`` is given). Starts the
        device-to-host copies now; the writer thread waits for them. Returns once at most
        ``max_lag`` entries are in flight (this one included). Raises the writer's error, if any.

        ``batch``: the step's batch leaves (in ``batch_sig``'s order), carried by the inputs
        entry; the log owns them (nothing may change them: `RecordLog` hands it its copy).

        ``packed``: instead of ``recorded``, ``(layout, arrays)``: the recorded values as the
        buffers they crossed between the step's parts in, and their layout (`packed_layout`,
        JSON, or a callable the writer thread calls for it): a few host copies per entry
        however many leaves (`unpack_recorded` reads it)."""
        self._raise_error()
        if not self.writes():
            raise StorageError(f"resilax replay log: this process only reads {str(self.directory)!r} (another writes it)")
        if batch is not None and batch_sig is None:
            raise ValueError("DiskLog.append: a batch needs its batch_sig")
        leaves, paths = [], None
        if packed is not None:
            if recorded is not None:
                raise ValueError("DiskLog.append: recorded or packed, not both")
            paths, leaves = packed  # paths: the layout (a JSON string)
            leaves = list(leaves)
        elif recorded is not None:
            leaves, treedef = jax.tree.flatten(recorded)
            if self._paths is None or self._paths[0] != treedef:  # per run, not per entry: keystr of every leaf
                self._paths = (treedef, [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(recorded)[0]])
            paths = self._paths[1]
        scalars = dict(scalars or {})
        for x in leaves + (batch or []) + ([state_sums] if isinstance(state_sums, jax.Array) else []) + list(scalars.values()):
            if isinstance(x, jax.Array):
                x.copy_to_host_async()
        with self._cv:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._writer, name="resilax-replay-log", daemon=True)
            self._thread.start()
        self._q.put((int(step), leaves, paths, state_sums, data_state, data_next, batch_sig, scalars, batch))
        # at most max_lag entries in flight when this returns: entries up to step - max_lag are durable
        with self._cv:
            while self._pending > self.max_lag and self._error is None:
                self._cv.wait()

    def _writer(self):
        while True:
            job = self._q.get()
            if job is None:
                return
            step, leaves, paths, sums, ds, dn, bsig, scalars, batch = job
            try:
                if self._error is None:
                    if sums is not None and not isinstance(sums, (np.ndarray, jax.Array)):
                        from resilax._src.protect.checksum import tree_checksums
                        sums = tree_checksums(sums)  # a tree whose checksums were deferred to this thread
                    head = {"step": step, "data_state": ds, "data_next": dn, "batch_sig": bsig,
                            "state_sums": None if sums is None else np.asarray(sums).tolist(),
                            "scalars": {k: _json_scalar(v) for k, v in scalars.items()}}
                    files = [("inputs", encode_entry(dict(head, kind="inputs")) if batch is None else
                              encode_entry(dict(head, kind="inputs", batch=True), [np.asarray(x) for x in batch]))]
                    if callable(paths):  # a packed entry's layout, made here the first time
                        paths = paths()
                    if paths is not None:
                        c0 = time.thread_time()
                        arrays = [np.asarray(x) for x in leaves]  # waits for the async copies
                        cost = time.thread_time() - c0
                        t0 = time.perf_counter()
                        files.append(("grads", encode_entry(dict(head, kind="grads", paths=paths), arrays)
                                      if not isinstance(paths, str) else
                                      encode_entry(dict(head, kind="grads"), arrays, raw={"layout": paths})))
                    self._write(step, files)
                    if paths is not None:
                        cost += time.perf_counter() - t0
                        self.grads_cost_s = cost if self.grads_cost_s is None else 0.8 * self.grads_cost_s + 0.2 * cost
                        self.grads_cost_total_s += cost
                        with self._lock:
                            self._grads_sizes[step] = len(files[1][1])
                        self._apply_budget()
            except jax.errors.JaxRuntimeError as e:
                # the step's own computation failed (a collective broke: a process died or hung):
                # its values do not exist, so it has no entry; the training thread sees the
                # failure itself, and a replay stops before the missing step
                self.unwritten.append((step, str(e).splitlines()[0][:200]))
            except BaseException as e:  # surfaced on the training thread by the next call
                self._error = e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _write(self, step: int, files: list[tuple[str, bytes]]) -> None:
        """Writes one step's files (temporary name, rename) and then fsyncs the directory
        once for all of them."""
        kind = files[0][0]
        try:
            root = str(self.directory)  # string paths: pathlib's joins cost a third of a small entry's write
            for kind, data in files:
                name = entry_name(step, kind)
                final = os.path.join(root, name)
                if os.path.exists(final):
                    self._quarantine([pathlib.Path(final)], "a newer entry for the same step was written")
                tmp = os.path.join(root, f".tmp.{name}.{uuid.uuid4().hex[:8]}")
                _write_new(tmp, data)
                os.replace(tmp, final)
                with self._sync_lock:
                    self._unsynced.append(final)
            if time.monotonic() - self._last_sync >= self.sync_every_s:
                self.sync()
        except Exception as e:
            where = str(self.directory / entry_name(step, kind))
            if _is_disk_full(e):  # (tensorstore says RESOURCE_EXHAUSTED, with a page of spec)
                try:
                    free = shutil.disk_usage(self.directory).free
                except OSError:
                    free = 0
                raise StorageError(errno.ENOSPC, f"resilax replay log: writing entry {step} ({kind}) to {where!r} "
                                   f"failed: the disk is full ({free} bytes free); the entries written before and "
                                   f"the committed checkpoints are intact") from e
            raise StorageError(f"resilax replay log: writing entry {step} ({kind}) to {where!r} failed: {e}") from e
        for kind, data in files:
            self.bytes_written[kind] += len(data)
            self.entries_written[kind] += 1

    def sync(self) -> None:
        """fsyncs the files written since the last sync, then the directory (their names)."""
        with self._sync_lock:
            paths, self._unsynced = self._unsynced, []
            for p in paths:
                try:
                    fd = os.open(p, os.O_RDONLY)
                except FileNotFoundError:  # deleted by the budget or truncation meanwhile
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._last_sync = time.monotonic()

    def _apply_budget(self):
        budget = self.policy.budget_bytes
        if budget is None:
            return
        with self._lock:
            total = sum(self._grads_sizes.values())
            for step in sorted(self._grads_sizes):
                if total <= budget or len(self._grads_sizes) <= 1:
                    break
                total -= self._grads_sizes.pop(step)
                (self.directory / entry_name(step, "grads")).unlink(missing_ok=True)

    def _raise_error(self):
        if self._error is not None:
            e = self._error
            raise e if isinstance(e, StorageError) else StorageError(f"resilax replay log: background write failed: {e}")

    def wait(self, max_pending: int = 0) -> None:
        """Blocks until at most ``max_pending`` entries are in flight (0: all written and
        fsynced)."""
        with self._cv:
            while self._pending > max_pending and self._error is None:
                self._cv.wait()
        self._raise_error()
        if max_pending == 0 and self._unsynced:
            try:
                self.sync()
            except OSError as e:
                raise StorageError(f"resilax replay log: fsync in {str(self.directory)!r} failed: {e}") from e

    def close(self) -> None:
        """Makes every queued entry durable and stops the writer. Idempotent."""
        if self._thread is not None:
            try:
                self.wait()
            finally:
                self._q.put(None)
                self._thread.join()
                self._thread = None

    # ---------------------------------------------------------- reading
    def files(self) -> list[tuple[int, str]]:
        """``(step, kind)`` of every entry file in the directory."""
        out = []
        for name in os.listdir(self.directory):
            p = parse_name(name)
            if p is not None:
                out.append(p)
        return sorted(out)

    def steps(self, kind: str | None = None) -> list[int]:
        """Steps with an entry file of ``kind`` (any kind when None), oldest first."""
        return sorted({s for s, k in self.files() if kind is None or k == kind})

    def read(self, step: int, kind: str) -> LogEntry:
        """Reads and verifies entry ``step``. Raises ReplayLogError naming the step."""
        path = self.directory / entry_name(step, kind)
        where = f"resilax replay log: entry for step {step} ({kind}, {str(path)!r})"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as e:
            raise ReplayLogError(f"{where}: cannot be read: {e}") from e
        if not data:
            raise ReplayLogError(f"{where}: missing or empty")
        header, arrays = decode_entry(data, where=where)
        if header.get("step") != step or header.get("kind") != kind:
            raise ReplayLogError(f"{where}: header names step {header.get('step')} ({header.get('kind')})")
        sums = header.get("state_sums")
        batch = None
        if kind == "inputs" and header.get("batch"):
            if header.get("batch_sig") is None:
                raise ReplayLogError(f"{where}: a batch without its batch signature")
            try:
                batch = batch_template(header["batch_sig"], arrays)
            except ReplayLogError as e:
                raise ReplayLogError(f"{where}: {e}") from e
        paths = header.get("paths")
        if kind == "grads" and header.get("layout") is not None:  # a packed entry: leaves cut out here
            arrays = unpack_recorded(header["layout"], arrays, where=where)
            paths = header["layout"].get("paths")
        return LogEntry(step, kind, header.get("data_state"), header.get("data_next"),
                        None if sums is None else np.asarray(sums, np.uint32).reshape(-1, 2),
                        header.get("batch_sig"), arrays if kind == "grads" else None, paths,
                        header.get("scalars") or {}, batch)

    def nbytes(self, kind: str | None = None) -> int:
        return sum((self.directory / entry_name(s, k)).stat().st_size
                   for s, k in self.files() if kind is None or k == kind)

    # ---------------------------------------------------------- truncation
    def truncate_before(self, step: int) -> int:
        """Deletes entries for steps ``< step`` (a checkpoint or peer copy at ``step``
        makes them unnecessary). Returns how many files were removed (none where another
        process writes the log)."""
        n = 0
        if not self.writes():
            return n
        with self._lock:
            for s, k in self.files():
                if s < step:
                    (self.directory / entry_name(s, k)).unlink(missing_ok=True)
                    self._grads_sizes.pop(s, None)
                    n += 1
        return n

    def discard_from(self, step: int, reason: str, *, warn: bool = True) -> list[str]:
        """Moves entries for steps ``>= step`` to ``quarantine/`` (never deleted): after a
        rollback or a resume they describe steps that will be run again. Where another
        process writes the log, it moves them. Returns where they went; ``warn=False``: no
        warning (the caller's event says it)."""
        if not self.writes():
            return []
        self.wait()
        with self._lock:
            paths = [self.directory / entry_name(s, k) for s, k in self.files() if s >= step]
            for s, _ in self.files():
                if s >= step:
                    self._grads_sizes.pop(s, None)
        return self._quarantine(paths, reason, warn=warn)

    def _quarantine(self, paths, reason: str, *, warn: bool = True) -> list[str]:
        if not paths:
            return []
        qdir = self.directory / QUARANTINE
        qdir.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        moved = []
        for p in paths:
            dst = qdir / f"{p.name}.{stamp}.{uuid.uuid4().hex[:6]}"
            os.replace(p, dst)
            moved.append(str(dst))
        if warn:
            warnings.warn(f"resilax replay log: moved {len(moved)} entr{'y' if len(moved) == 1 else 'ies'} to "
                          f"{str(qdir)!r} ({reason})", RuntimeWarning, stacklevel=3)
        return moved
