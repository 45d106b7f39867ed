"""The recovery planner: a pure function from (what is alive, what each protection holds)
to a plan, or to the exact statement of what was lost.

Inputs are plain host data; devices are opaque hashable values and ``None`` means storage
(survives any device loss). Nothing here touches an array, so the planner is tested alone
and a campaign can check it against an oracle that knows nothing about resilax.

- A `Candidate` is one consistent state at a step: per leaf, per distinct shard, the places
  a copy can be read from (`Copy`). The live state, the newest peer snapshot and the newest
  checkpoint are candidates.
- A `LogStep` says how step ``s`` (the step from state ``s`` to ``s + 1``) can be redone:
  from a device entry of the record log (per recorded shard, its copies), from the disk
  log, or from the retained batch (recompute).

`plan` takes the first candidate, in the given order of preference, whose every shard has
a surviving copy and from which every step up to the target can be redone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class Copy:
    device: Any  # None: storage
    ref: Any = None  # opaque handle the restorer uses (which buffer, which offset)


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str  # "live", "peer", "checkpoint"
    step: int
    shards: tuple  # per leaf: tuple of (shard key, tuple of Copy)


@dataclasses.dataclass(frozen=True)
class LogStep:
    step: int
    sources: tuple  # of (kind, shards): kind "device" (shards as in Candidate), "disk" or "batch" (shards ())


@dataclasses.dataclass(frozen=True)
class Plan:
    source: str
    start: int
    target: int
    picks: tuple  # per leaf: tuple of (shard key, Copy)
    replay: tuple  # of (step, kind, picks) for steps start..target-1
    rejected: tuple  # (candidate name, why) of better candidates that did not work


@dataclasses.dataclass(frozen=True)
class Lost:
    target: int
    leaves: tuple  # leaf names with a shard no candidate could give
    why: tuple  # (candidate name, why) per candidate


def _alive(copy: Copy, dead) -> bool:
    return copy.device is None or copy.device not in dead


def _pick(shards, dead):
    """Per shard the first surviving copy; (picks, index of the first leaf without one)."""
    out = []
    for li, leaf in enumerate(shards):
        chosen = []
        for key, copies in leaf:
            c = next((c for c in copies if _alive(c, dead)), None)
            if c is None:
                return None, li
            chosen.append((key, c))
        out.append(tuple(chosen))
    return tuple(out), None


def plan(target: int, dead, candidates: Sequence[Candidate], log: dict[int, LogStep],
         leaf_names: Sequence[str]) -> Plan | Lost:
    """The first workable candidate (in the order given) and how to reach ``target``.

    Args:
      target: the step to restore (the newest step a survivor completed).
      dead: set of dead devices.
      candidates: in order of preference (cheapest first).
      log: step -> `LogStep` for the steps the record log can redo.
      leaf_names: names of the state's leaves, for the error.
    """
    rejected, lost_leaves = [], set()
    for cand in candidates:
        if cand.step > target:
            rejected.append((cand.name, f"holds step {cand.step}, newer than the target {target}"))
            continue
        picks, bad = _pick(cand.shards, dead)
        if picks is None:
            lost_leaves.add(leaf_names[bad] if bad < len(leaf_names) else f"#{bad}")
            rejected.append((cand.name, f"step {cand.step}: every copy of a shard of {leaf_names[bad]} is on a "
                                        f"dead device"))
            continue
        steps, gap = [], None
        for s in range(cand.step, target):
            entry = log.get(s)
            chosen = None
            for kind, shards in (entry.sources if entry is not None else ()):
                if kind != "device":
                    chosen = (s, kind, ())
                    break
                p, _ = _pick(shards, dead)
                if p is not None:
                    chosen = (s, kind, p)
                    break
            if chosen is None:
                gap = s
                break
            steps.append(chosen)
        if gap is not None:
            rejected.append((cand.name, f"step {cand.step}: step {gap} cannot be redone (no surviving log entry "
                                        f"and no retained batch)"))
            continue
        return Plan(cand.name, cand.step, target, picks, tuple(steps), tuple(rejected))
    return Lost(target, tuple(sorted(lost_leaves)), tuple(rejected))
