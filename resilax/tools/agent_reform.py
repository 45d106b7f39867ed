"""Re-forming in place across hosts (`resilax launch --nodes N --in-place`).

When a generation ends because another host was lost (its lease expired, it left, it was
replaced) or another host's worker failed, the workers of the live hosts need not be
restarted: as `resilax launch --in-place` does on one host (`launch.py`), they leave their
broken step, detach from the coordination service, drop their JAX backend and join the
next generation in their own processes (same pids: no process start, no imports), resuming
from their host stores at the step they all hold. The agents first agree on that
generation (`Rendezvous.agree`, while the workers wait), then each writes the verdict
(``D/membership.json``: the same record on every host, derived from the two generations'
records) and hands each of its workers its place in the new generation
(`membership.reform_assignment`); a worker that does not detach in time is stopped and its
place gets a new process. The old service host keeps its service until every survivor has
detached (detaching talks to it).

Where it applies: the bit-exact mode with one failure domain per process and the host store
(each worker says so in its heartbeat, ``in_place``), every worker of this host alive and
past a step of the generation. **Not when the service host is lost:** measured on jax
0.10.2 (``benchmarks/service_death_probe.py``), a worker's JAX client aborts (SIGABRT)
0.2 s after the process running the coordination service dies, so the survivors are gone
before any agent could keep them; that loss restarts every worker (a new generation from
the host stores), as without ``--in-place``.
"""

from __future__ import annotations

import time

from resilax._src.io import write_json
from resilax._src.runtime import membership
from resilax.tools import processes
from resilax.tools.processes import heartbeat_file, not_ready_in_place, read_json, stop_all


def refused(workers, outcome: str, term) -> str | None:
    """Why this host's ``workers`` cannot re-form in place after the generation ended with
    ``outcome`` (None: they can)."""
    if term is not None:
        return "the job is being stopped"
    if outcome != "ended":
        return "a worker of this host failed" if outcome == "failed" else f"the generation ended with {outcome}"
    if not workers:
        return "this host has no worker"
    for w in workers:
        why = f"process {w.process_id} has exited" if w.proc.poll() is not None else not_ready_in_place(w)
        if why is not None:
            return why
    return None


def write_verdict(run_dir, old, new, failed_nodes) -> dict:
    """``D/membership.json`` for the workers of generation ``old``: the processes of the nodes
    that are not members of ``new`` or whose workers failed are dead; the others re-form as
    generation ``new`` (every agent writes the same record)."""
    dead = sorted(p for r in old.members if r not in new.members or r in failed_nodes for p in old.process_ids[r])
    rec = {"generation": old.generation, "epoch": 1, "dead": dead,
           "alive": sorted(p for r in old.members for p in old.process_ids[r] if p not in dead),
           "reform": new.generation}
    write_json(run_dir / membership.MEMBERSHIP_JSON, rec)
    return rec


def await_detached(workers, timeout_s: float, heartbeat_timeout_s: float) -> dict:
    """Waits until each of ``workers`` detached from the old service (its heartbeat says
    ``detached``), up to ``timeout_s``; stops the others (exited, hung or late). Returns the
    detached ones by their place in the job (`WorkerProcess.slot`)."""
    limit = time.time() + timeout_s
    pending, done = list(workers), {}
    while pending and time.time() < limit:
        now = time.time()
        for w in list(pending):
            hb = w.heartbeat() or {}
            if hb.get("phase") == "detached" and w.proc.poll() is None:
                done[w.slot] = w
                pending.remove(w)
            elif w.proc.poll() is not None or processes.stale_and_stopped(w.proc.pid, now - hb.get("t", now),
                                                                           heartbeat_timeout_s):
                pending.remove(w)  # (a stale heartbeat of a running worker: waited for, as `resilax launch` does)
                stop_all([w], "did not re-form in place (exited, or stopped with a stale heartbeat)")
        time.sleep(0.05)
    stop_all(pending, f"did not detach within {timeout_s:g} s to re-form in place")
    return done


def await_survivors(run_dir, verdict: dict, timeout_s: float, heartbeat_timeout_s: float) -> list[int]:
    """The old service host: waits until every process the verdict calls alive, on every host,
    has detached, exited or gone silent, up to ``timeout_s`` (then it shuts the service
    down). Returns those still attached at the end."""
    g, limit = verdict["generation"], time.time() + timeout_s
    while True:
        now, left = time.time(), []
        for p in verdict["alive"]:
            hb = read_json(heartbeat_file(run_dir, g, p)) or {}
            if hb.get("phase") != "detached" and now - hb.get("t", 0) <= heartbeat_timeout_s:
                left.append(p)
        if not left or now > limit:
            return left
        time.sleep(0.05)
