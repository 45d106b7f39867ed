"""Checkpoints of a `PipelineExecutor` taken in the pipeline's bubbles (BAFT): the state after
a checkpoint step ``k`` is copied to the host stage by stage, in pieces, while step ``k + 1``
runs, each piece dispatched into its stage's idle time as `protection.place` planned it, and
committed as one Orbax checkpoint (with checksums) once every stage's parts are on the host.

- **Where.** Stage ``s``'s parts come from one live replica of the stage (the lowest), at the
  points `ProtectionPlan.dispatch` names: right before item ``before`` of that domain's ops
  in step ``k + 1`` (``len(order)``: before its update). The executed order is recorded
  (`PipelineExecutor.executed`), so a test reads where each piece really went. The plan is
  the executor's (`PipelineExecutor.protection_plan`): with peer copies on, it places both.
- **Pieces.** A stage's leaves are cut into the plan's pieces round robin (piece ``j`` holds
  leaves ``j, j + P, ...``); a piece's copy is ``copy_to_host_async`` of its leaves, which
  the device runs in stream order, between the stage's ops.
- **Failures.** A part taken from a domain that is lost before the commit is dropped and
  taken again from another replica of its stage (the state after step ``k`` is the same
  bits there); a step redone after a failure takes only the pieces still missing. A process
  killed before the commit leaves no checkpoint ``k`` (Orbax writes nothing partial as
  committed): a restart restores the one before and recomputes.
- **End of step placement** (``placement="end"``): every part is taken right after step
  ``k``'s commit, as the executor's `save` does, for comparison.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from resilax._src.pipeline import protection as _protection


class BubbleCheckpoints:
    """Checkpoints every ``every`` steps into ``directory``, taken in the bubbles of the
    step after (``placement="bubbles"``) or at the step's end (``"end"``). ``units``: each
    stage's snapshot work in the table's cost units (one F op = 1), ``chunk``: the size of
    the pieces it is cut into."""

    def __init__(self, ex, directory: str, every, *, placement: str = "bubbles", units: float = 1.0,
                 chunk: float = 0.25, budget: float = 0.01):
        if placement not in ("bubbles", "end"):
            raise ValueError(f"resilax.PipelineExecutor: checkpoint placement must be 'bubbles' or 'end', but got "
                             f"{placement!r}")
        if every != "auto" and not (isinstance(every, int) and every >= 1):
            raise ValueError(f"resilax.PipelineExecutor: checkpoint_every must be an int >= 1 or 'auto', but got "
                             f"{every!r}")
        if not (isinstance(units, (int, float)) and units > 0):
            raise ValueError(f"resilax.PipelineExecutor: checkpoint_units must be > 0 (cost units), but got {units!r}")
        self.ex, self.directory, self.placement = ex, os.path.abspath(directory), placement
        self.units, self.chunk = units, chunk
        self.every = every
        if every == "auto":  # the fewest steps between checkpoints that add <= budget, bubbles counted free
            c = _protection.cadence(self._plan(), budget, bubbles=placement == "bubbles")
            if c.every is None:
                raise ValueError(f"resilax.PipelineExecutor: no checkpoint cadence keeps {units} units of snapshot "
                                 f"work per stage within {budget:.1%} of the step")
            self.every = c.every
            ex.events.append({"kind": "checkpoint_cadence", "every": c.every, "overhead": c.overhead,
                              "bubbles": c.bubbles})
        self.pending = None  # (step k, {stage: {piece: (domain, [device arrays])}}, state refs, guard ref)
        self.committed: list[int] = []
        self._mgr = None

    # ---------------------------------------------------------------- planning
    def _plan(self):
        return self.ex.protection_plan()

    @property
    def executed(self) -> dict:
        """The last step's dispatches per domain, protection pieces included (the executor's log)."""
        return self.ex.executed

    def _pieces(self, s: int) -> int:
        return self.ex.pieces("snapshot", s)

    def _source(self, s):
        return min(d for d in self.ex.state if d[1] == s)

    # ---------------------------------------------------------------- per step
    def begin(self, step: int) -> None:
        """Before step ``step + 1`` is dispatched (also when it is redone): the parts still
        to take of checkpoint ``step``, if it is one, or of the one whose window (the plan's
        ``every`` steps after it) is still open."""
        if self.pending is not None and not 0 <= step - self.pending[0] < self.ex._plan_every:
            self.pending = None
        if step and step % self.every == 0 and self.pending is None and step not in self.committed:
            self.pending = (step, {s: {} for s in range(self.ex.S)}, dict(self.ex.state), dict(self.ex.guard))
        if self.pending is not None:
            self._drop_lost()
            if self.placement == "end":
                for s in range(self.ex.S):
                    self._take(self._source(s), s, 0, self._pieces(s))
                self._commit()

    def before(self, domain, index: int) -> None:
        """Runs ``domain``'s planned pieces due right before its item ``index``."""
        if self.pending is None or self.placement != "bubbles" or domain[1] not in self.pending[1]:
            return
        if domain != self._source(domain[1]):
            return
        for op in self._plan().steady(domain, self.ex.step_no - self.pending[0]):
            if op.before == index and op.kind == "snapshot":
                self._take(domain, op.stage, op.chunk % self._pieces(op.stage), op.chunks)

    def end(self) -> None:
        """After the step's update is dispatched: in the last step of the window, whatever
        the plan left (pieces of a stage whose source changed) is taken now; once every part
        is taken checkpoint ``k`` is written (the host waits for the parts' copies here, while
        the device runs the step)."""
        if self.pending is None:
            return
        if self.ex.step_no - self.pending[0] >= self.ex._plan_every - 1:
            for s in range(self.ex.S):
                missing = [j for j in range(self._pieces(s)) if j not in self.pending[1][s]]
                if missing:
                    self._take(self._source(s), s, missing[0], len(missing), spill=True)
        if all(len(self.pending[1][s]) == self._pieces(s) for s in range(self.ex.S)):
            self._commit()

    # ---------------------------------------------------------------- parts
    def _take(self, domain, s, first, count, spill=False) -> None:
        k, parts, state, guard = self.pending
        leaves = jax.tree.leaves(state[domain])
        per = self._pieces(s)
        taken = [j for j in range(first, min(first + count, per)) if j not in parts[s]]
        for j in taken:
            chunk = leaves[j::per]
            for x in chunk:
                x.copy_to_host_async()
            parts[s][j] = (domain, chunk)
        if taken:  # (a step redone after a failure finds most pieces already on the host)
            self.ex.executed.setdefault(domain, []).append(("snapshot", s, taken[0], len(taken))
                                                        + (("spill",) if spill else ()))

    def _drop_lost(self) -> None:
        """Parts whose domain was lost are taken again from a live replica."""
        k, parts, state, guard = self.pending
        for s in parts:
            for j in [j for j, (d, _) in parts[s].items() if d not in self.ex.state]:
                del parts[s][j]
        for d in list(state):
            if d not in self.ex.state:
                del state[d]
        for d in list(guard):
            if d not in self.ex.guard:
                del guard[d]

    def _commit(self) -> None:
        import orbax.checkpoint as ocp

        from resilax._src.pipeline.stage_programs import write_checkpoint

        k, parts, state, guard = self.pending
        tree = {}
        for s in range(self.ex.S):
            src = self._source(s)
            treedef = jax.tree.structure(state[src])
            per, n = self._pieces(s), len(jax.tree.leaves(state[src]))
            host = [None] * n
            for j, (_, chunk) in parts[s].items():
                for i, x in zip(range(j, n, per), chunk):
                    host[i] = np.asarray(x)
            tree[f"stage_{s:03d}"] = jax.tree.unflatten(treedef, host)
        g = guard[min(guard)]
        tree["guard"] = jax.tree.map(np.asarray, g)
        if self._mgr is None:
            self._mgr = ocp.CheckpointManager(self.directory)
        write_checkpoint(self._mgr, k, tree)
        self.committed.append(k)
        self.ex.events.append({"kind": "save", "step": k, "placement": self.placement})
        self.pending = None

    def flush(self, step: int) -> None:
        """At the end of a run: checkpoint ``step`` (if it is one and not written yet), its
        parts taken now; so is the rest of one whose window is still open."""
        if any(not any(d[1] == s for d in self.ex.state) for s in range(self.ex.S)):
            self.pending = None  # a stage without a live domain (waiting for a rejoin): nothing to write
            return
        if self.pending is not None and self.pending[0] != step:
            self._drop_lost()
            for s in range(self.ex.S):
                self._take(self._source(s), s, 0, self._pieces(s), spill=True)
            self._commit()
        if step and step % self.every == 0 and step not in self.committed:
            if self.pending is None or self.pending[0] != step:
                self.pending = (step, {s: {} for s in range(self.ex.S)}, dict(self.ex.state), dict(self.ex.guard))
            self._drop_lost()
            for s in range(self.ex.S):
                self._take(self._source(s), s, 0, self._pieces(s), spill=True)
            self._commit()

    def close(self) -> None:
        if self._mgr is not None:
            self._mgr.wait_until_finished()
            self._mgr.close()
            self._mgr = None
