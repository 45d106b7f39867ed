"""Silent data corruption: replicas of the same state across failure domains must be
bitwise equal, so their checksums are compared at the start of every
``HealthConfig.sdc_every``-th step, before the state is used, and before every checkpoint
save (a corrupted state is never persisted).

Every device checksums its own shard of every leaf replicated across the elastic axis (all
of the state in the bit-exact mode, where every domain computes the same update), in one
executable; only the ``[devices, leaves, 2]`` sums come to the host, and each domain's rows
are its replica's fingerprint. On a mismatch:

- 3 or more domains, and the replicas were equal at the previous step (so the corrupted
  values fed nothing yet): the strict majority's sums are the right ones; every other
  domain is named (event ``sdc``) and treated as failed (`ResilientStep.fail_domain`), so
  the state goes on from the good replicas, bitwise, and the domain can rejoin later;
- found later than that (``sdc_every > 1``): the corruption may have entered every
  replica's update through the gradients, so the majority is not known to be right (see
  the next case);
- 2 domains (or no majority), or found later than that: the step is rebuilt from the
  newest checkpoint and the record log (disk entries or retained batches, never a live
  buffer: `ResilientStep.rebuilt_state`) and the replicas that match it are the good ones
  (event ``sdc`` with ``decided_by: rebuilt``); the others are failed as above;
- no checkpoint to rebuild from, or no replica matches the rebuilt state:
  `SilentDataCorruptionError` is raised, naming the leaves and domains, before anything is
  saved; a restart resumes from the newest checkpoint (checked at its save).

Leaves that live in one domain only (the default mode's sharded layout) have no replica to
compare with; an event at the first check says how many leaves are covered. Corruption
inside a computation that feeds every domain (a gradient replica, the combine) leaves the
replicas equal and is not caught here.
"""

from __future__ import annotations

import time
import weakref

import jax
import numpy as np

from resilax._src.errors import SilentDataCorruptionError
from resilax._src.protect import ring as _ring
from resilax._src.protect.base import Protection
from resilax._src.protect.checksum import tree_checksums


class SdcCheck(Protection):
    name = "sdc"

    def __init__(self, cfg):
        self.every = cfg.sdc_every
        self._checked_at = None
        self._good_at = None  # the newest step whose replicas were found equal
        self._told = set()
        self._fns: dict = {}
        self.seconds: list[float] = []

    def before_step(self, run, state, step: int) -> None:
        if step % self.every == 0 and self._checked_at != step:
            self.check(run, state, step)

    def before_save(self, run, state, step: int) -> None:
        if self._checked_at != step:
            self.check(run, state, step)

    def _fn(self, prog, idx, leaves):
        """One executable per program: every device checksums its own shard of the leaves
        replicated across domains (`checksum.tree_checksums` on the local block), all in one
        dispatch; the ``[devices, leaves, 2]`` sums come to the host in one transfer. Within a
        domain the shards are laid out alike in every domain, so equal replicas give equal
        rows, domain by domain."""
        key = (id(prog), tuple(idx))
        if key not in self._fns:
            from jax.sharding import PartitionSpec as P

            mesh = prog.mesh
            specs = [x.sharding.spec for x in leaves]
            body = lambda xs: tree_checksums(list(xs))[None]  # noqa: E731  [1, leaves, 2] per device
            self._fns = {k: v for k, v in self._fns.items() if v[0]() is not None}  # programs still alive
            self._fns[key] = (weakref.ref(prog), jax.jit(jax.shard_map(
                body, mesh=mesh, in_specs=(specs,), out_specs=P(tuple(mesh.axis_names)), check_vma=False)))
        return self._fns[key][1]

    def start(self, run, state) -> None:
        self._good_at = run.step  # placed or restored from one copy: the replicas are equal
        self._checked_at = None

    def restart(self, run, state) -> None:
        self._good_at = run.step  # a new mesh: its replicas were made from one good copy
        self._checked_at = None

    def check(self, run, state, step: int) -> list[int]:
        """Compares the live domains' replicas; returns the domains found bad (original
        indices; they were failed), or raises when it cannot tell."""
        t0 = time.perf_counter()
        self._checked_at = step
        prog = run.program
        mesh = prog.mesh
        leaves = jax.tree.leaves(state)
        places = jax.tree.leaves(prog.places)
        idx = [i for i, p in enumerate(places) if p == _ring.REPLICATED]
        live = mesh.shape[prog.spec.elastic_axis]
        multi = jax.process_count() > 1  # another process's domain cannot be read here
        if id(prog) not in self._told:
            self._told.add(id(prog))
            run.event("sdc_coverage", step, leaves_checked=0 if multi else len(idx), leaves=len(leaves), domains=live,
                      **({"reason": "multi-process run: not built yet"} if multi else {}))
        if live < 2 or not idx or multi:
            return []
        picked = [leaves[i] for i in idx]
        shard_sums = self._fn(prog, idx, picked)
        sums = list(np.asarray(shard_sums(picked)).reshape(live, -1, len(idx), 2))
        self.seconds.append(time.perf_counter() - t0)
        keys = [s.tobytes() for s in sums]
        if len(set(keys)) == 1:
            self._good_at = step
            return []
        alive = list(run.alive_domains)
        groups: dict = {}
        for d, k in enumerate(keys):
            groups.setdefault(k, []).append(d)
        best = max(groups.values(), key=len)
        names = run.leaf_names  # a mismatch: only now are the names needed
        differing = sorted({names[idx[j]] for s in sums for j in np.nonzero(np.any(s != sums[best[0]], axis=(0, 2)))[0]})
        late = self._good_at is None or step - self._good_at > 1
        if 2 * len(best) <= live or late:
            # no majority, or it may be wrong too: rebuild the step from the newest
            # checkpoint and the record log, and keep the replicas that match it
            witness = run.rebuilt_state(step, trusted_through=-1 if self._good_at is None else self._good_at)
            if witness is not None:
                wl = jax.tree.leaves(witness)
                ws = np.asarray(shard_sums([wl[i] for i in idx])).reshape(live, -1, len(idx), 2)
                good = groups.get(ws[0].tobytes())
                if good is None:
                    raise SilentDataCorruptionError(
                        f"resilax: silent data corruption at step {step}: the replicas on failure domains {alive} "
                        f"differ in leaves {differing[:8]}, and none matches the state rebuilt from the newest "
                        f"checkpoint and the record log. Nothing was saved from them; restart from the newest "
                        f"checkpoint")
                return _decide(run, step, alive, good, differing, "rebuilt", t0)
        if 2 * len(best) <= live:
            raise SilentDataCorruptionError(
                f"resilax: silent data corruption at step {step}: the replicas of the state on failure domains "
                f"{alive} differ in leaves {differing[:8]} and no majority says which is right, and no checkpoint with "
                f"the record log after it can rebuild the step to tell (Config.checkpoint). Nothing was saved from "
                f"them; restart from the newest checkpoint (each one was checked when it was saved)")
        if late:
            bad = [alive[d] for d in range(live) if d not in best]
            # the corruption may have fed a gradient (every replica's update) since the
            # replicas were last seen equal: the majority's state is not known to be right
            raise SilentDataCorruptionError(
                f"resilax: silent data corruption at step {step}: domain(s) {bad} disagree with the majority "
                f"{[alive[d] for d in best]} in leaves {differing[:8]}, but the replicas were last checked equal "
                f"at step {self._good_at}, so the corrupted values may have entered the updates since. Nothing was "
                f"saved from them; restart from the newest checkpoint (each one was checked when it was saved). "
                f"HealthConfig(sdc_every=1) checks every step, before the state is used, and recovers in place")
        return _decide(run, step, alive, best, differing, "majority", t0)


def _decide(run, step, alive, good, differing, how, t0) -> list[int]:
    """Keeps the replicas at positions ``good``; fails the other domains."""
    bad = [d for i, d in enumerate(alive) if i not in good]
    run.event("sdc", step, bad_domains=bad, good_domains=[alive[i] for i in good], leaves=differing[:16],
              decided_by=how, seconds=time.perf_counter() - t0)
    for d in bad:
        run.fail_domain(d, "sdc")
    return bad
