"""Fencing across generations: what a cut-off side wrote is never taken as current.

A job across hosts (`resilax launch --nodes`) moves through generations agreed in the
rendezvous (`rendezvous.py`). A host that is cut off (its network, its view of the run
directory, or both) may keep running the generation it was in, or, in a view of the run
directory of its own, agree on a generation that the others never saw. Once the others have
moved on, whatever that side writes is stale. The rule, for every record that says what is
current (a checkpoint, ``processes.json``):

- Every such record names the generation that wrote it: its number and its *identity*, the
  sha256 of its proposal in the rendezvous (``generation``, ``generation_id``). Two sides
  that each formed a "generation 3" in views of their own have different identities; the
  rendezvous in the shared run directory holds one.
- A record counts only if its generation's proposal in the rendezvous has that identity and
  was committed there.
- When a generation resumes, its workers record the step they resumed at
  (``rendezvous/fences/g<k>.json``, created once, with the generation's identity). That is
  the fence of every older generation: a checkpoint an older generation wrote of a step past
  the resume step of the first later generation is the fenced side's (the others were
  stopped before that generation started), and it is never restored. A fenced side's
  checkpoint of a step at or before it holds the same computation as the resumed state
  (the same program from the same state; bitwise in the bit-exact mode) and may count.

A rejected checkpoint is moved aside by the restore (``quarantine/``), never deleted.

What this assumes of the shared file system: create-once by ``os.link`` and ``os.replace``
of a whole file are atomic and visible to every host once they return (NFSv3/v4 with
``sync`` or close-to-open consistency, Lustre, GPFS, CephFS; a Kubernetes ReadWriteMany
volume backed by one of these). Where they are not (object-store FUSE mounts such as
gcsfuse or s3fs: rename is copy + delete, link is missing), the rendezvous cannot fence and
`resilax launch --nodes` refuses such a directory (`rendezvous.check_run_dir`). Costs: one
small file per generation; a restore reads one proposal, one outcome and the fences
(``O(generations)`` small files).
"""

from __future__ import annotations

import pathlib
import re

from resilax._src.runtime import rendezvous

FENCES = "fences"  # <run_dir>/rendezvous/fences/g<k>.json
_FENCE_RE = re.compile(r"g(\d+)\.json")


def stamp(job) -> dict:
    """What a record written by this worker carries of its generation (``{}`` outside a job
    across hosts, where there is no rendezvous to fence by)."""
    if job is None or not getattr(job, "generation_id", ""):
        return {}
    return {"generation": int(job.generation), "generation_id": job.generation_id}


def _root(run_dir) -> pathlib.Path:
    return pathlib.Path(run_dir).absolute() / rendezvous.RENDEZVOUS


def record_resume(job, step: int) -> None:
    """Records (create-once) that generation ``job.generation`` resumed at ``step``: the fence
    of the generations before it. Every worker may call it; the first call's record stays."""
    if not stamp(job):
        return
    d = _root(job.run_dir) / FENCES
    d.mkdir(parents=True, exist_ok=True)
    rendezvous.create_record(d / f"g{int(job.generation)}.json", {
        "generation": int(job.generation), "generation_id": job.generation_id, "resumed_step": int(step)})


def _genuine(root: pathlib.Path, g: int, gid: str) -> str | None:
    """Why generation ``g`` with identity ``gid`` is not the rendezvous' committed generation
    ``g`` (None: it is)."""
    try:
        prop = rendezvous.read_record(root / "generations" / f"g{g}.proposal.json")
        out = rendezvous.read_record(root / "generations" / f"g{g}.outcome.json")
    except rendezvous.CorruptRecordError as e:
        return f"its generation's record is unreadable ({e})"
    if prop is None or prop["sha256"] != gid:
        return (f"generation {g} {gid[:12]} is not the rendezvous' generation {g}"
                + (f" ({prop['sha256'][:12]})" if prop else " (none was proposed)")
                + ": a side cut off from the run directory formed it")
    if out is None or out.get("outcome") != rendezvous.COMMITTED:
        return f"generation {g} was never committed in the rendezvous"
    return None


def fences(run_dir) -> dict[int, int]:
    """The genuine fences: generation -> the step it resumed at."""
    root = _root(run_dir)
    out = {}
    d = root / FENCES
    if not d.is_dir():
        return out
    for p in d.iterdir():
        m = _FENCE_RE.fullmatch(p.name)
        if not m:
            continue
        try:
            rec = rendezvous.read_record(p)
        except rendezvous.CorruptRecordError:
            continue
        if rec is not None and _genuine(root, int(rec["generation"]), rec["generation_id"]) is None:
            out[int(rec["generation"])] = int(rec["resumed_step"])
    return out


def rejected(run_dir, meta: dict, step: int) -> str | None:
    """Why a checkpoint of ``step`` with ``meta`` is a fenced side's and must not be restored
    (None: it counts). Checkpoints without a generation (written outside a job across hosts)
    always count."""
    if not isinstance(meta, dict) or not meta.get("generation_id"):
        return None
    g, gid = int(meta["generation"]), str(meta["generation_id"])
    root = _root(run_dir)
    why = _genuine(root, g, gid)
    if why is not None:
        return f"fenced: written by {why}"
    later = sorted((k, r) for k, r in fences(run_dir).items() if k > g)
    if later and step > later[0][1]:
        k, r = later[0]
        return (f"fenced: written by generation {g} of step {step}, past step {r} at which generation {k} resumed "
                f"(the side still running generation {g} after the others had moved on)")
    return None
