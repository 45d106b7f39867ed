"""A host store's files, read and written without JAX: which steps a store directory holds
and which every process can read back (the supervisor and the agents ask this between
generations and must not pay for importing JAX), a step's arrays and commit record.
`hoststore` holds the protection that writes and restores them."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import re
import tempfile

import numpy as np

KEEP = 3
STORE_DIR = re.compile(r"host[0-9]+/(own|mirror)")  # a store's directories, relative to its root


def _key(leaf: int, index, shape) -> str:
    parts = []
    for sl, n in zip(index, shape):
        a, b, _ = sl.indices(n)
        parts.append(f"{a}-{b}")
    return f"{leaf}:" + ",".join(parts)


def committed_steps(d: pathlib.Path) -> list[int]:
    """Steps with a commit record in ``d`` (not yet verified)."""
    if not d.is_dir():
        return []
    out = []
    for f in d.glob("step*.json"):
        try:
            out.append(int(f.stem[4:]))
        except ValueError:
            pass
    return sorted(out)


def _record(d: pathlib.Path, step: int) -> dict:
    try:
        return json.loads((d / f"step{step}.json").read_text())
    except (OSError, ValueError):
        return {}


def sources(root: pathlib.Path, process: int, n: int, step: int) -> list[pathlib.Path]:
    """The host copies of ``step`` that hold process ``process``'s shards: those it wrote
    (its own host first, then the mirror on the next host, then any other) and those that
    are whole (every process's shards are in them)."""
    dirs = [root / f"host{process}" / "own"]
    if n > 1:
        dirs.append(root / f"host{(process + 1) % n}" / "mirror")
    dirs += [root / f"host{j}" / kind for j in range(n) for kind in ("own", "mirror")]
    out = []
    for d in dict.fromkeys(dirs):
        rec = _record(d, step)
        if rec.get("step") == step and (rec.get("process") == process or rec.get("whole")):
            out.append(d)
    return out


def restorable_steps(root: pathlib.Path, n: int, processes=None, *, whole: bool = False) -> list[int]:
    """The steps every one of the ``n`` processes (or those of them in ``processes``: a
    generation smaller than the job, or one host's processes) can read back from some host
    under ``root``, ascending; ``whole``: only from whole copies (the bit-exact mode's,
    which fit any process and any mesh with the same sharding within a process)."""
    every = set()
    for j in range(n):
        for kind in ("own", "mirror"):
            every |= set(committed_steps(root / f"host{j}" / kind))
    want = range(n) if processes is None else processes

    def ok(s, i):
        return any(_record(d, s).get("whole") for d in sources(root, i, n, s)) if whole else sources(root, i, n, s)

    return sorted(s for s in every if all(ok(s, i) for i in want))


def restorable_step(root: pathlib.Path, n: int, processes=None) -> int | None:
    """The newest step every one of the ``n`` processes (or those of them in ``processes``:
    a generation smaller than the job) can read back from some host."""
    ok = restorable_steps(root, n, processes)
    return ok[-1] if ok else None


def encode(arrays: dict) -> bytes:
    """A step's arrays as the bytes of one ``.npz`` (no pickle)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def make_meta(step: int, raw: bytes, data_state, leaves: int, process: int, whole: bool, verdicts=None,
              keys=None, writers=None) -> dict:
    """A step's commit record: the SHA-256 of ``raw``; ``keys``: the (leaf, shard index)
    keys it holds (read without the arrays when a re-formed mesh needs other shards);
    ``writers``: the job's processes that stored this step (a step is whole when each of
    them has a copy somewhere)."""
    return {"step": step, "sha256": hashlib.sha256(raw).hexdigest(), "data_state": data_state, "leaves": leaves,
            "process": process, "whole": whole, "verdicts": verdicts, "keys": keys, "writers": writers}


def write_raw(d: pathlib.Path, step: int, raw: bytes, meta: dict) -> None:
    """Commits ``raw`` (the step's ``.npz``) in ``d``: the bytes, then the record (atomic,
    last), then drops all but the newest `KEEP` steps."""
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".step{step}.npz.tmp"
    tmp.write_bytes(raw)
    os.replace(tmp, d / f"step{step}.npz")
    (d / f".step{step}.json.tmp").write_text(json.dumps(meta))
    os.replace(d / f".step{step}.json.tmp", d / f"step{step}.json")
    for old in committed_steps(d)[:-KEEP]:
        for suffix in (".json", ".npz"):  # the commit record first: a half-deleted step is not offered
            try:
                os.unlink(d / f"step{old}{suffix}")
            except FileNotFoundError:
                pass


def records(root: pathlib.Path, step: int | None = None) -> dict[str, dict[int, dict]]:
    """The commit records under a store ``root``: ``{"host<j>/<own|mirror>": {step: record}}``
    (only ``step``'s when given; the records' ``keys`` only then, they can be long)."""
    out: dict[str, dict[int, dict]] = {}
    for d in sorted(root.glob("host*/*")):
        if not d.is_dir() or not STORE_DIR.fullmatch(f"{d.parent.name}/{d.name}"):
            continue
        recs = {}
        for s in ([step] if step is not None else committed_steps(d)):
            rec = _record(d, s)
            if rec.get("step") == s:
                recs[s] = rec if step is not None else {k: v for k, v in rec.items() if k != "keys"}
        if recs:
            out[f"{d.parent.name}/{d.name}"] = recs
    return out


def complete_writers(recs) -> list[tuple]:
    """The sets of writers (sorted tuples) of which ``recs``, records of one step, hold a
    copy of every process. Copies count together only when their ``writers`` are the same:
    a step stored again by a generation of other processes (after a resume from an older
    checkpoint) is another state, and mixing the two would make neither."""
    held: dict[tuple, set] = {}
    for rec in recs:
        if isinstance(rec.get("writers"), list):
            held.setdefault(tuple(sorted(rec["writers"])), set()).add(rec.get("process"))
    return [w for w, got in held.items() if set(w) <= got]


def covered_steps(listings) -> list[int]:
    """The steps some store in ``listings`` (each as `records` returns it, from this host or
    another's server) gives back whole: a whole copy, or a copy of every process that
    stored the step (its records' ``writers``, one set of them: `complete_writers`), from
    its own host or a mirror. Ascending."""
    by_step: dict[int, list] = {}
    for listing in listings:
        for recs in listing.values():
            for s, rec in recs.items():
                by_step.setdefault(int(s), []).append(rec)  # a JSON object's keys are strings
    return sorted(s for s, recs in by_step.items() if any(r.get("whole") for r in recs) or complete_writers(recs))


def read(d: pathlib.Path, step: int) -> tuple[dict, dict] | None:
    """``(arrays, meta)`` of ``step`` in ``d`` if it is committed and its bytes match; else None."""
    got = read_raw(d, step)
    return None if got is None else (decode(got[0]), got[1])


def read_raw(d: pathlib.Path, step: int) -> tuple[bytes, dict] | None:
    """``(npz bytes, meta)`` of ``step`` in ``d`` if it is committed and its bytes match; else None."""
    try:
        meta = json.loads((d / f"step{step}.json").read_text())
        raw = (d / f"step{step}.npz").read_bytes()
    except (OSError, ValueError):
        return None
    if hashlib.sha256(raw).hexdigest() != meta.get("sha256") or meta.get("step") != step:
        return None
    return raw, meta


def decode(raw: bytes) -> dict:
    """The arrays of a step's ``.npz`` bytes (no pickle)."""
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def remove_orphans(root: pathlib.Path, pattern: str) -> list[str]:
    """Removes the host stores in ``root`` whose names match ``pattern`` (a regular
    expression with a group ``pid``: the agent or supervisor that owns the store) and whose
    owner is gone. A SIGKILLed agent or supervisor cannot remove its store, and one in RAM
    (/dev/shm) would hold that memory until the machine restarts; no later process can use
    it (a new owner starts with an empty store). A live owner's store, or one whose pid now
    names another live process, is kept (`resilax launch`'s heartbeat directories in RAM are
    removed the same way, by their own pattern). Returns the names removed."""
    import shutil

    gone = []
    for d in sorted(root.glob("resilax-*")):  # (``pattern`` decides)
        m = re.fullmatch(pattern, d.name)
        if m is None or not d.is_dir():
            continue
        try:
            os.kill(int(m["pid"]), 0)
            continue  # alive (or reused by another live process: kept)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process: alive
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d.name)
    return gone


def ram_root(fallback: str | os.PathLike | None = None) -> pathlib.Path:
    """Where host stores go by default: RAM (``/dev/shm``) where there is one, else
    ``fallback`` (or the temp dir). Never a shared run directory on a cluster: that is a
    network file system, and a host's store is that host's memory."""
    if os.path.isdir("/dev/shm"):
        return pathlib.Path("/dev/shm")
    return pathlib.Path(fallback) if fallback is not None else pathlib.Path(tempfile.gettempdir())
