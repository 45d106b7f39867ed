"""Peer copies of a `PipelineExecutor`'s stages taken in the pipeline's bubbles (BAFT): the
state of every stage after a copy step ``k`` (parameters, optimizer state and the anomaly
guard) is copied, in pieces, to the device of a domain that does *not* hold that stage, while
step ``k + 1`` runs, each piece dispatched into its stage's idle time as `protection.place`
planned it.

- **Where the copy goes.** The other replicas of stage ``s`` already hold its state, bitwise
  (each runs the same update), so a copy there would add nothing. Stage ``s``'s copy is sent
  from its lowest live replica ``(r, s)`` to a live domain of another stage, of another
  replica first: ``(r + 1, s + 1)``, ``(r + 1, s + 2)``, ..., then ``(r, s + 1)``, ...
  (mod ``D`` and ``S``). It covers the loss of *every* replica of a stage: with one replica,
  any single failure; with more, a stage whose other replicas are already gone. Preferring
  another replica keeps the copies of a stage that is down to one replica off that
  replica's domains, so losing that last replica leaves the other copies whole.
- **Pieces and log.** A stage's leaves are cut round robin into the plan's pieces (piece
  ``j``: leaves ``j, j + P, ...``), each a ``device_put`` to the keeper's device, which JAX
  runs asynchronously between the stage's ops; the executor's ``executed`` log records each
  one where it was dispatched.
- **Consistent copies.** Copies of one step form a consistent cut: the newest step whose
  every stage is fully copied (``base``) is kept until the next one is complete, so a keeper
  holds at most two copies of its neighbour stage (this one and the one in progress).
- **Recovery.** When the last live domain of a stage is lost, the executor waits for a
  domain of that stage to come back (`PipelineExecutor.rejoin`) and fills it from the copy:
  if the stage's copy of the current step is complete, nothing else changes; otherwise every
  stage goes back to the ``base`` step and the caller recomputes the steps since then (the
  step's randomness is a function of the step number, the caller feeds the same batches).
  A lost domain that kept a piece of ``base`` takes ``base`` with it (the stage it copied
  has moved on); with neither copy, `StateLostError` says to restore a checkpoint. So with
  one replica, where every domain keeps its neighbour's copy, a stage lost while its copy
  is pending falls back to the checkpoint; with more, usually to ``base``.
- **Failures.** A keeper's loss deletes the copies on its device (and the next pieces go
  elsewhere); a source's loss leaves the pieces already copied and takes the rest from another
  replica of the stage, if one is left.

Costs: one copy of one stage per copy step over the link between two domains (in the
model: ``units`` of the source domain's idle time); device memory for up to two copies of a
neighbour's stage on every keeper.
"""

from __future__ import annotations

import jax

from resilax._src.errors import StateLostError


class BubblePeers:
    """Peer copies of every stage every ``every`` steps (an int >= 1), dispatched in the
    bubbles of the steps after per ``ex.protection_plan()``'s ``peer`` ops, in
    ``ex.pieces("peer", s)`` pieces per stage."""

    def __init__(self, ex, every: int):
        self.ex, self.every = ex, every
        # step -> {stage: {piece: (keeper domain, [device arrays on the keeper's device])}}
        self.copies: dict = {}
        self.treedefs: dict = {}  # stage -> treedef of (params, opt state), guard
        self.counts: dict = {}  # (step, stage) -> pieces of that copy
        self.base: int | None = None  # newest step whose every stage is fully copied
        self.pending = None  # (step k, {domain: (state, guard)} of step k) while its copies are taken

    # ---------------------------------------------------------------- helpers
    def _per(self, k: int, s: int) -> int:
        """Pieces of stage ``s``'s copy of step ``k`` (the plan's count when it began)."""
        return self.counts[(k, s)]

    def _source(self, s):
        live = [d for d in self.ex.state if d[1] == s]
        return min(live) if live else None

    def _keeper(self, src):
        r, s = src
        S, D = self.ex.S, self.ex.D
        order = [((r + q) % D, (s + j) % S) for q in range(1, D) for j in range(1, S)]
        order += [(r, (s + j) % S) for j in range(1, S)]
        return next((d for d in order if d in self.ex.state), None)

    def complete(self, step: int, s: int) -> bool:
        return step in self.copies and len(self.copies[step][s]) == self._per(step, s)

    def arrays(self) -> list:
        """Every copy buffer held (what a failure waits for before it deletes anything)."""
        return [x for per in self.copies.values() for parts in per.values() for _, xs in parts.values() for x in xs]

    # ---------------------------------------------------------------- per step
    def begin(self, step: int) -> None:
        """Before step ``step + 1`` is dispatched (also when it is redone): a copy of step
        ``step`` if it is a copy step; one whose window (the plan's ``every`` steps after its
        step) is still open goes on."""
        if self.pending is not None and not 0 <= step - self.pending[0] < self.ex._plan_every:
            self.pending = None
        if step % self.every == 0 and step != self.base and self.pending is None:
            if step not in self.copies:
                self.copies[step] = {s: {} for s in range(self.ex.S)}
                self.counts.update({(step, s): self.ex.pieces("peer", s) for s in range(self.ex.S)})
            self.pending = (step, {d: (self.ex.state[d], self.ex.guard[d]) for d in self.ex.state})
            for s in range(self.ex.S):
                d = self._source(s)
                self.treedefs[s] = jax.tree.structure(self.pending[1][d])

    def before(self, domain, index: int) -> None:
        """Runs ``domain``'s planned copy pieces due right before its item ``index``."""
        if self.pending is None or domain != self._source(domain[1]):
            return
        for op in self.ex.protection_plan().steady(domain, self.ex.step_no - self.pending[0]):
            if op.before == index and op.kind == "peer":
                self._take(domain, op.stage, op.chunk % self._per(self.pending[0], op.stage), op.chunks)

    def end(self) -> None:
        """After the step's update is dispatched: in the last step of the window, pieces the
        plan did not place (a stage whose source changed) are taken now; a step whose every
        stage is copied becomes ``base``."""
        if self.pending is None:
            return
        k = self.pending[0]
        last = self.ex.step_no - k >= self.ex._plan_every - 1
        if last:
            for s in range(self.ex.S):
                missing = [j for j in range(self._per(k, s)) if j not in self.copies[k][s]]
                src = self._source(s)
                if missing and src is not None:
                    self._take(src, s, missing[0], len(missing), spill=True)
        if all(self.complete(k, s) for s in range(self.ex.S)):
            self._new_base(k)
            self.pending = None
        elif last:
            self.pending = None  # a stage without a source: this copy stays incomplete

    def _new_base(self, k: int) -> None:
        self._drop(lambda st: st != k)
        self.base = k

    def _drop(self, which) -> None:
        for st in [st for st in self.copies if which(st)]:
            for parts in self.copies.pop(st).values():
                for _, xs in parts.values():
                    for x in xs:
                        x.delete()

    def reset(self) -> None:
        """The state was replaced (a checkpoint restored): every copy is stale."""
        self._drop(lambda st: True)
        self.base = self.pending = None

    def _take(self, src, s, first, count, spill=False) -> None:
        k, refs = self.pending
        keeper = self._keeper(src)
        if keeper is None or src not in refs:
            return
        leaves = jax.tree.leaves(refs[src])
        per, parts = self._per(k, s), self.copies[k][s]
        taken = [j for j in range(first, min(first + count, per)) if j not in parts]
        dev = self.ex.devices[keeper]
        for j in taken:
            parts[j] = (keeper, [jax.device_put(x, dev) for x in leaves[j::per]])
        if taken:
            self.ex.executed.setdefault(src, []).append(("peer", s, taken[0], len(taken), keeper)
                                                        + (("spill",) if spill else ()))

    # ---------------------------------------------------------------- failures
    def lost(self, domain) -> None:
        """Domain ``domain`` is lost: the copies it kept are deleted, the source state it held
        is not read again, and a ``base`` it made incomplete is given up."""
        dev = self.ex.devices[domain]
        for k, per in self.copies.items():
            for s, parts in per.items():
                for j in [j for j, (kp, _) in parts.items() if kp == domain]:
                    for x in parts.pop(j)[1]:
                        if dev in x.devices() and not x.is_deleted():
                            x.delete()
        if self.pending is not None:
            self.pending[1].pop(domain, None)
        if self.base is not None and not all(self.complete(self.base, s) for s in range(self.ex.S)):
            self.ex.events.append({"kind": "peer_copy_lost", "step": self.base, "domain": domain})
            self.base = None

    def covers(self, stages) -> bool:
        """Whether the copies can bring back ``stages`` (none of which has a live domain)."""
        k = self.ex.step_no
        if self.base is not None:
            return True
        return all(self.complete(k, s) for s in stages)

    def restore(self, domain) -> int:
        """Fills ``domain`` (its stage has no live domain) from the stage's copy: the current
        step's when complete, else every live domain goes back to ``base`` (the caller redoes
        the steps since). Returns the step the job continues from. Raises StateLostError."""
        s, k = domain[1], self.ex.step_no
        if not self.complete(k, s):
            if self.base is None:
                raise StateLostError(f"resilax.PipelineExecutor.rejoin: stage {s}'s state is gone and no complete peer "
                                     f"copy holds it; restore a checkpoint")
            k = self.base
        if k != self.ex.step_no:  # back to a consistent cut: every live stage from its copy of step k
            for d in sorted(self.ex.state):
                self.ex.state[d], self.ex.guard[d] = self._gather(k, d[1], d)
            self.ex.events.append({"kind": "rollback", "step": k, "from": self.ex.step_no, "domain": domain})
            self.ex.step_no = k
            self.pending = None
            self._drop(lambda st: st > k)
        state, guard = self._gather(k, s, domain)
        self.ex.events.append({"kind": "restore_from_peer", "step": k, "domain": domain,
                               "keeper": self.copies[k][s][0][0]})
        self.ex.state[domain], self.ex.guard[domain] = state, guard
        return k

    def _gather(self, k, s, domain):
        parts, per = self.copies[k][s], self._per(k, s)
        n = self.treedefs[s].num_leaves
        leaves = [None] * n
        dev = self.ex.devices[domain]
        for j, (_, xs) in parts.items():
            for i, x in zip(range(j, n, per), xs):
                leaves[i] = jax.device_put(x, dev)
        return jax.tree.unflatten(self.treedefs[s], leaves)
