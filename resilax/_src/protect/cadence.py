"""``PeersConfig.every="auto"``: the peer-copy cadence calibrated to a share of step time.

A peer copy costs what moving the protected bytes costs on this machine: next to nothing
where the ring copy runs on an interconnect overlapped with compute, ~7% of a step on 2
CPU cores where it is a memcpy competing with the step for the same cores (measured:
docs/performance.md). One fixed cadence cannot be right for both, so it is measured.

**Calibration** (once per mesh, after its background compiles, which would otherwise
compete with it): the step runs the four variants a cadence is made of, in rotation,
each blocked to completion and timed, ``calibration_samples`` times each:

- ``ring``: the ring copy alone (``every=1``; the live state is the local part);
- ``ring+local``: ring and local copy (``every=k>1``: a whole step survives while the
  live state moves on);
- ``none``: no copy, no log entry (a recovery recomputes this step from its batch);
- ``log``: no copy, the record log's device entry and its ring copy (a recovery replays
  the update from it: bitwise, no recompute).

The rotation keeps every step covered: a ``ring`` step's snapshot is valid until the
next step, which is the ``ring+local`` one. Costs are differences of medians against
``none``; each is taken at its upper bound (median + 2 standard errors, from the MAD), so
a noisy machine gets a longer cadence, never a budget it does not meet. While the noise
still changes the choice (the cadence from the medians differs from the one from the
upper bounds), sampling goes on, up to 4x ``calibration_samples``.

**Choice**, ``A = budget x step time`` (the ``none`` median), first that fits:

1. every step (``ring``) if its cost is at most ``A``;
2. every ``k`` with log entries between copies: ``(C_copy + (k - 1) C_log) / k <= A``;
3. every ``k`` without them: ``C_copy / k <= A``;

with ``k <= max_every``; when nothing fits, ``max_every`` without log entries and the
report says the budget is not met. Switching to a cadence starts with a ``ring+local``
copy, so the newest snapshot always holds a whole step.
"""

from __future__ import annotations

import statistics

ORDER = ("ring", "ring+local", "none", "log")


def _robust(xs):
    """(median, standard error of the median estimated from the MAD)."""
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    return med, 1.4826 * mad * 1.2533 / len(xs) ** 0.5


class Cadence:
    def __init__(self, cfg, *, has_log: bool):
        self.budget, self.max_every, self.n = cfg.budget, cfg.max_every, cfg.calibration_samples
        self.has_log = has_log
        self.decisions: list[dict] = []  # one per calibrated mesh, newest last
        self.reset()

    def reset(self, *, copies: bool = True):
        """A new mesh: copies every step until its variants are compiled (`ready`, a future
        set by the caller) and calibrated. ``copies``: whether the mesh makes copies at all."""
        self.phase = "idle" if not copies else "wait" if self.has_log else "fixed"
        self.every, self.log_ring, self.anchor = 1, True, None
        self.samples = {k: [] for k in ORDER}
        self.i = -1
        self.now = None  # (variant, block, timed) of the step in flight
        self.ready = None

    # ------------------------------------------------------------------ per step
    def plan(self, step_after: int, *, background_idle: bool, over_cap: bool) -> str | None:
        """The copy variant of the step that completes ``step_after`` steps."""
        if self.phase == "wait" and self.ready is not None and self.ready.done() and background_idle:
            if self.ready.exception() is None:
                self.phase, self.i = "calibrate", -1
        if self.phase in ("wait", "fixed"):
            self.now = ("ring", False, False)
            return "ring"
        if self.phase == "calibrate":
            # step -1 is blocked, not timed: the work still queued from the step before drains
            v = "ring" if self.i < 0 else ORDER[self.i % len(ORDER)]
            self.now = (v, True, self.i >= 0)
            return v if v in ("ring", "ring+local") else None
        if self.anchor is None:
            self.anchor = step_after  # the first step of the cadence makes a whole copy
        due = (step_after - self.anchor) % self.every == 0 or over_cap
        v = ("ring" if self.every == 1 else "ring+local") if due else None
        self.now = (v or ("log" if self.log_ring else "none"), False, False)
        return v

    def log_ring_wanted(self) -> bool:
        """Whether a step without a copy keeps its device log entry (and its ring copy)."""
        return self.now is None or self.now[0] == "log"

    def blocks(self) -> bool:
        return self.now is not None and self.now[1]

    def timed(self, seconds: float) -> dict | None:
        """The step in flight took ``seconds`` (blocked to completion). Returns the decision
        when this sample completed the calibration."""
        if self.phase != "calibrate" or self.now is None:
            return None
        v, _, timed = self.now
        self.i += 1
        if timed:
            self.samples[v].append(seconds)
        counts = {len(x) for x in self.samples.values()}
        have = min(counts)
        # only at the end of a round (every variant has the same count): after a noisy look
        # the minimum count stays where it was while the next round's first variants add
        # samples, and a choice was then taken on unequal samples
        if len(counts) > 1 or have < self.n or have % self.n:
            return None
        d = decide(self.samples, self.budget, self.max_every)
        if have < 4 * self.n and decide(self.samples, self.budget, self.max_every, z=0.0)["every"] != d["every"]:
            return None  # the noise still changes the choice: more samples (at most 4x)
        self.every, self.log_ring, self.phase, self.anchor = d["every"], d["log_entries_between"], "set", None
        self.decisions.append(d)
        return d

    def report(self) -> dict:
        """The cadence now and how it was chosen (``phase``: ``wait`` for compiles,
        ``calibrate``, ``set``; ``fixed``: no record log to cover steps between copies;
        ``idle``: the mesh makes no copies)."""
        last = self.decisions[-1] if self.decisions and self.phase == "set" else None
        out = {"mode": "auto", "phase": self.phase, "every": self.every,
               "log_entries_between": self.log_ring and self.every > 1, "budget": self.budget,
               "share": None if last is None else last["share"],
               "meets_budget": None if last is None else last["meets_budget"],
               "decisions": list(self.decisions)}
        if self.phase == "fixed":
            out["why"] = "no record log: the steps between copies could not be redone, so copies stay at every step"
        elif self.phase == "idle":
            out["why"] = "no state lives in one failure domain only on this mesh: no copies are made"
        return out


def decide(samples: dict, budget: float, max_every: int, z: float = 2.0) -> dict:
    """The cadence from timed samples (``{variant: [seconds]}`` for ``ORDER``), each cost
    taken at median + ``z`` standard errors; see the module docstring. Pure: tested alone."""
    base, base_se = _robust(samples["none"])
    cost, upper = {}, {}
    for v in ("ring", "ring+local", "log"):
        med, se = _robust(samples[v])
        cost[v] = max(0.0, med - base)
        upper[v] = max(0.0, med - base + z * (se ** 2 + base_se ** 2) ** 0.5)
    allow = budget * base
    c1, c2, cl = upper["ring"], upper["ring+local"], upper["log"]
    every, log_ring = None, True
    if c1 <= allow:
        every = 1
    elif cl < allow:
        k = max(2, -(-(c2 - cl) // (allow - cl)))
        if k <= max_every:
            every = int(k)
    if every is None:
        k = max(2, -(-c2 // allow)) if allow > 0 else max_every + 1
        every, log_ring = int(min(k, max_every)), False
    if every == 1:
        share = c1 / base
    elif log_ring:
        share = (c2 + (every - 1) * cl) / every / base
    else:
        share = c2 / every / base
    return {"every": every, "log_entries_between": log_ring and every > 1, "step_s": base,
            "cost_s": {"ring": cost["ring"], "ring+local": cost["ring+local"], "log": cost["log"]},
            "cost_upper_s": {"ring": c1, "ring+local": c2, "log": cl},
            "samples": min(len(x) for x in samples.values()), "budget": budget, "share": share,
            "meets_budget": share <= budget}
