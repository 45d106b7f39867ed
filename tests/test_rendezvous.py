"""The shared-directory rendezvous (`runtime/rendezvous.py`): agents as real processes, killed.

The process test runs 3 agents (2 workers each) that loop "agree on a generation, record
it, wait until it changes": they agree on generation 0; SIGKILL of the service node's agent
gives generation 1 without it and the service on the next rank; a replacement with the dead
rank gives generation 2 with all three; SIGKILL of another agent gives generation 3 with the
service where it was. The other tests drive the protocol in one process with an injected
clock: concurrent proposers, corrupt records, a rank held by a live agent, fencing, and a
proposal abandoned because a member died before it acknowledged.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import agree_together

from resilax._src.runtime import rendezvous as rdv
from resilax._src.runtime.rendezvous import (ABANDONED, COMMITTED, CorruptRecordError, LeaseLostError, RankTakenError,
                                             Rendezvous, RendezvousError)

LEASE_S = 2.0
_AGENT = r"""
import dataclasses, json, os, pathlib, sys, time
from resilax._src.runtime.rendezvous import Rendezvous
run_dir, rank, out, lease_s = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3]), float(sys.argv[4])
r = Rendezvous(run_dir, rank, workers=2, lease_s=lease_s, ack_timeout_s=10, poll_s=0.02)
r.register()
gen = r.agree(min_nodes=3 if not os.environ.get("REPLACEMENT") else 1, timeout_s=60)
while True:
    rec = {**dataclasses.asdict(gen), "pid": os.getpid(), "incarnation": r.incarnation}
    tmp = out / f".node{rank}.g{gen.generation}.tmp"
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, out / f"node{rank}.g{gen.generation}.json")
    while r.changed(gen) is None:
        time.sleep(0.02)
    gen = r.agree(gen.generation, min_nodes=2, timeout_s=60)
"""


def _start(tmp_path, rank, child_env, replacement=False):
    env = dict(child_env, **({"REPLACEMENT": "1"} if replacement else {}))
    return subprocess.Popen([sys.executable, "-c", _AGENT, str(tmp_path / "run"), str(rank), str(tmp_path / "out"),
                             str(LEASE_S)], env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _generation(tmp_path, g, ranks, procs, timeout=30.0) -> dict:
    """Waits until every agent in ``ranks`` recorded generation ``g``; checks they agree."""
    t0 = time.time()
    paths = [tmp_path / "out" / f"node{r}.g{g}.json" for r in ranks]
    while not all(p.exists() for p in paths):
        for r, p in procs.items():
            if p.poll() is not None and r in ranks:
                raise AssertionError(f"agent {r} exited with {p.returncode}: {p.stdout.read().decode()[-3000:]}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for generation {g} on nodes {ranks}: have "
                                 f"{sorted(os.listdir(tmp_path / 'out'))}")
        time.sleep(0.05)
    recs = [json.loads(p.read_text()) for p in paths]
    for rec in recs[1:]:
        assert rec["sha256"] == recs[0]["sha256"], "agents disagree on the generation record"
    return recs[0]


def _kill(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=10)


def test_agents_agree_lose_the_service_node_and_grow_back(tmp_path, child_env):
    (tmp_path / "out").mkdir()
    procs = {r: _start(tmp_path, r, child_env) for r in range(3)}
    try:
        g0 = _generation(tmp_path, 0, [0, 1, 2], procs)
        assert g0["members"] == [0, 1, 2] and g0["service_node"] == 0 and g0["num_processes"] == 6
        assert g0["process_ids"] == {"0": [0, 1], "1": [2, 3], "2": [4, 5]}
        host, port = g0["coordinator"].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0

        t_kill = time.time()
        _kill(procs[0])  # the service node's agent
        g1 = _generation(tmp_path, 1, [1, 2], procs)
        took = time.time() - t_kill
        assert g1["members"] == [1, 2] and g1["service_node"] == 1 and g1["num_processes"] == 4
        assert g1["process_ids"] == {"1": [0, 1], "2": [2, 3]}
        assert g1["coordinator"] != g0["coordinator"]
        # noticed when the lease expired: at least 2/3 of a lease after the kill (renewed every third)
        assert LEASE_S * 0.6 <= took < LEASE_S + 10, took

        procs[0] = _start(tmp_path, 0, child_env, replacement=True)  # its rank, a new incarnation
        g2 = _generation(tmp_path, 2, [0, 1, 2], procs)
        assert g2["members"] == [0, 1, 2] and g2["service_node"] == 0 and g2["num_processes"] == 6
        assert g2["incarnations"]["0"] != g0["incarnations"]["0"]
        assert g2["incarnations"]["1"] == g0["incarnations"]["1"]

        _kill(procs[2])  # not the service node: the service stays
        g3 = _generation(tmp_path, 3, [0, 1], procs)
        assert g3["members"] == [0, 1] and g3["service_node"] == 0

        gens = tmp_path / "run" / rdv.RENDEZVOUS / "generations"
        outcomes = [json.loads((gens / f"g{g}.outcome.json").read_text())["outcome"] for g in range(4)]
        assert outcomes == [COMMITTED] * 4 and not (gens / "g4.proposal.json").exists()
    finally:
        for p in procs.values():
            _kill(p)


def _agents(tmp_path, ranks, clock, **kw):
    out = {}
    for r in ranks:
        a = Rendezvous(tmp_path, r, workers=1 + r % 2, lease_s=1.0, clock=clock, clock_check=False, **kw)
        a.register(renew=False)
        out[r] = a
    return out


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_concurrent_proposers_make_exactly_one_generation(tmp_path):
    clock = _Clock()
    agents = _agents(tmp_path, range(8), clock)
    live = agents[0].live()
    assert sorted(live) == list(range(8))
    start, got = threading.Barrier(len(agents)), {}

    def go(r):
        start.wait()
        got[r] = agents[r].propose(0, live)

    threads = [threading.Thread(target=go, args=(r,)) for r in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    gens = os.listdir(tmp_path / rdv.RENDEZVOUS / "generations")
    assert gens == ["g0.proposal.json"]  # one record, no temporary file left behind
    winner = got[0]
    assert all(g == winner for g in got.values())
    assert winner.members == tuple(range(8)) and winner.service_node in agents
    # process ids follow each node's worker count (1 or 2 here), in rank order
    assert winner.process_ids[0] == (0,) and winner.process_ids[1] == (1, 2) and winner.num_processes == 12
    for a in agents.values():
        a.ack(winner)
    assert {a.decide(winner) for a in agents.values()} == {COMMITTED}


def test_a_corrupt_record_is_a_clear_error_naming_the_file(tmp_path):
    clock = _Clock()
    a = _agents(tmp_path, [0], clock)[0]
    gen = a.propose(0, a.live())
    path = tmp_path / rdv.RENDEZVOUS / "generations" / "g0.proposal.json"
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "service_node": 7}))  # a changed field, old checksum
    with pytest.raises(CorruptRecordError, match=r"g0\.proposal\.json fails its checksum"):
        a.agree(timeout_s=1)
    path.write_text(path.read_text()[:40])  # a torn write
    with pytest.raises(CorruptRecordError, match=r"g0\.proposal\.json is not valid JSON"):
        a.proposal(0)
    lease = tmp_path / rdv.RENDEZVOUS / "leases" / "node0.json"
    lease.write_text(json.dumps({"rank": 0}))
    with pytest.raises(CorruptRecordError, match=r"node0\.json has no sha256"):
        a.changed(gen)


def test_a_live_rank_is_refused_an_expired_one_is_taken_over_and_the_old_agent_fenced(tmp_path):
    clock = _Clock()
    old = _agents(tmp_path, [1], clock)[1]
    new = Rendezvous(tmp_path, 1, workers=1, lease_s=1.0, clock=clock, clock_check=False)
    clock.t += 0.5
    with pytest.raises(RankTakenError, match="node rank 1 is held by a live agent"):
        new.register(renew=False)
    clock.t += 1.0  # the old lease expired (its agent stopped, say)
    new.register(renew=False)
    with pytest.raises(RankTakenError, match=r"waited 0\.05 s"):  # a third agent waits, then gives up
        Rendezvous(tmp_path, 1, workers=1, clock=clock, clock_check=False, poll_s=0.01).register(renew=False, wait_s=0.05)
    with pytest.raises(LeaseLostError, match="incarnation .* was claimed"):
        old.renew()
    assert old.lost
    with pytest.raises(LeaseLostError):
        old.agree(timeout_s=1)
    new.renew()  # the replacement keeps it
    old.close()  # a fenced agent does not remove its successor's lease
    assert sorted(new.live()) == [1]


def test_a_renewal_stopped_between_its_read_and_its_write_does_not_take_the_rank_back(tmp_path):
    """SIGSTOP can land inside a renewal: the hung agent read its own lease, then its write
    lands after a spare claimed the rank and wrote its lease (what made CI's spare test hang
    once: the woken agent overwrote the spare's lease and the spare was fenced instead). The
    claim decides: the woken agent finds its incarnation claimed right after the write and is
    fenced; the other nodes do not take its stale lease for a replacement; the spare writes
    its own lease back at its next renewal and keeps the rank."""
    clock = _Clock()
    agents = _agents(tmp_path, [0, 1], clock)
    gen = agree_together([agents[0], agents[1]], after=-1, min_nodes=2)
    zombie = agents[1]
    clock.t += 1.5  # node 1 hangs: its lease expires (node 0's too, on this clock: renew it)
    agents[0].renew()
    assert rdv.standby(tmp_path, 2, ended=lambda: False, poll_s=0.01, clock=clock) == (1, zombie.incarnation)
    spare = Rendezvous(tmp_path, 1, workers=2, lease_s=1.0, clock=clock, clock_check=False)
    spare.register(renew=False)
    g1 = agree_together([agents[0], spare], after=gen.generation, min_nodes=2)
    assert g1.members == (0, 1) and g1.incarnations[1] == spare.incarnation
    zombie._write_lease()  # the stopped renewal's write lands
    lease = tmp_path / rdv.RENDEZVOUS / "leases" / "node1.json"
    assert json.loads(lease.read_text())["incarnation"] == zombie.incarnation
    assert agents[0].changed(g1) is None  # a claimed incarnation's lease is not a replacement
    with pytest.raises(LeaseLostError, match="was claimed"):
        zombie.check_fence()  # what renew() does right after its write
    with pytest.raises(LeaseLostError):
        zombie.renew()
    with pytest.raises(LeaseLostError):
        zombie.agree(after=gen.generation, timeout_s=1)  # proposes and acks nothing
    spare.renew()  # not fenced: it writes its own lease back
    assert not spare.lost and json.loads(lease.read_text())["incarnation"] == spare.incarnation
    assert agents[0].changed(g1) is None
    zombie.close()
    assert lease.exists()


def test_a_member_that_dies_before_it_acknowledges_abandons_the_proposal(tmp_path):
    clock = _Clock()
    agents = _agents(tmp_path, [0, 1, 2], clock, ack_timeout_s=30)
    gen = agents[0].propose(0, agents[0].live())
    agents[0].ack(gen)
    agents[1].ack(gen)
    assert agents[1].decide(gen) is None  # node 2 is alive and may still ack
    clock.t += 1.5  # node 2 stops renewing; the others go on
    agents[0].renew()
    agents[1].renew()
    assert agents[1].decide(gen) == ABANDONED
    agents[2].ack(gen)  # too late: the outcome is recorded once
    assert agents[0].decide(gen) == ABANDONED
    assert "node 2 lost its lease" in agents[0].outcome(0)["why"]
    assert agents[0].changed(gen) is not None
    nxt = agents[0].propose(1, agents[0].live())
    assert nxt.members == (0, 1) and nxt.service_node == 0
    for a in agents.values():
        a.ack(nxt)  # node 2 is no member: its ack is a no-op
    assert agents[1].decide(nxt) == COMMITTED and agents[1].changed(nxt) is None
    agents[1].request(1, "its workers died")  # a member asks for the next generation
    assert agents[0].changed(nxt) == "node 1 asked for a new generation: its workers died"
    # a member that never acknowledges (alive but stuck) abandons it after the ack timeout
    stuck = agents[0].propose(2, agents[0].live())
    assert agents[1].changed(nxt) == "generation 2 was proposed"
    agents[0].ack(stuck)
    clock.t += 0.5
    agents[0].renew()
    agents[1].renew()
    assert agents[0].decide(stuck) is None
    clock.t += 30
    agents[0].renew()
    agents[1].renew()
    assert agents[0].decide(stuck) == ABANDONED and "did not acknowledge within 30" in agents[0].outcome(2)["why"]


def test_agree_times_out_with_what_it_waited_for(tmp_path):
    a = Rendezvous(tmp_path, 1, workers=1, lease_s=5.0, poll_s=0.01)
    a.register()
    try:
        with pytest.raises(RendezvousError, match=r"live nodes \[1\] \(need 2"):
            a.agree(min_nodes=2, timeout_s=0.3)
    finally:
        a.close()
    assert a.leases() == {}  # released on close


def test_a_renewal_that_failed_is_retried_soon_a_gap_of_half_a_lease_does_not_expire_it(tmp_path):
    """The leases directory is gone (renamed away: the run directory cut off) for half a lease,
    from just before a renewal, so that two tries on the lease/3 cadence fail. A failed try is
    retried every lease/40: the lease is renewed before it expires. (Retried only on the
    lease/3 cadence, the next try came at the very instant the lease expired, and after it on a
    loaded host: a 4 s flap expired an 8 s lease in a netns test.) No temporary files left."""
    lease = 3.0
    a = Rendezvous(tmp_path, 0, workers=1, lease_s=lease)
    a.register()
    try:
        path, leases = a._lease_path(0), a.root / "leases"
        t0 = rdv.read_record(path)["t"]
        while (last := rdv.read_record(path))["t"] == t0:
            time.sleep(0.005)
        time.sleep(lease / 3 - 0.1)
        os.rename(leases, a.root / "away")  # the tries at +lease/3 and +2 lease/3 fail
        time.sleep(lease / 2)
        os.rename(a.root / "away", leases)
        while (now := rdv.read_record(path))["t"] == last["t"]:
            time.sleep(0.005)
        assert now["t"] < last["expires"], (now["t"] - last["t"], "s between renewals, lease", lease)
        assert not [p.name for p in leases.iterdir() if p.name.endswith(".tmp")]
    finally:
        a.close()
