"""Fencing across generations (`resilax._src.runtime.fence`) and the rendezvous' clock check.

In one process, with a real rendezvous directory, real Orbax checkpoints and real clocks:
a checkpoint a fenced side wrote (an older generation past the next one's resume step, or a
generation the rendezvous never held) is never restored and is moved aside, not deleted;
a host whose clock is off from the shared file system's by more than the lease allows takes
no rank; processes.json is not written by an agent whose generation is not the rendezvous'.
The same rules across real separate hosts (network namespaces): tests/test_netns.py.
"""

import json
import time
import types

import jax
import numpy as np
import pytest

from helpers import agree_together
from resilax._src.runtime import fence, rendezvous
from resilax._src.runtime.rendezvous import ClockSkewError, Rendezvous


def _job(run, gen):
    return types.SimpleNamespace(run_dir=str(run), generation=gen.generation, generation_id=gen.sha256)


def test_a_fenced_sides_checkpoint_is_never_restored_and_is_moved_aside_not_deleted(tmp_path):
    """Generation 0 (nodes 0, 1) saves step 5; generation 1 resumes at 5 (its fence) and saves
    8. Then the fenced side writes: generation 0's zombie step 9 (past the fence) and step 10
    of a "generation 1" it formed in a view of the run directory of its own (another
    identity). The restore takes 8, with the values of 8; without the fence it would take 10
    (checked: the test can fail). 9 and 10 are in quarantine/, whole."""
    from jax.sharding import SingleDeviceSharding

    from resilax._src.protect.checkpoints import CheckpointStore

    run = tmp_path / "run"
    a, b = (Rendezvous(run, r, workers=1, lease_s=30.0) for r in (0, 1))
    for r in (a, b):
        r.register(renew=False)
    g0 = agree_together([a, b])
    g1 = agree_together([a, b], after=0)
    assert (g0.generation, g1.generation) == (0, 1)
    forged = types.SimpleNamespace(run_dir=str(run), generation=1, generation_id="f" * 64)

    sh = SingleDeviceSharding(jax.devices()[0])
    abstract = {"w": jax.ShapeDtypeStruct((4, 4), np.float32, sharding=sh)}
    store = CheckpointStore(run / "checkpoints", keep=10, async_save=False)

    def save(step, job):
        store.save(step, {"w": jax.device_put(np.full((4, 4), step, np.float32), sh)}, fence.stamp(job))

    try:
        save(5, _job(run, g0))
        fence.record_resume(_job(run, g1), 5)
        fence.record_resume(_job(run, g1), 7)  # create-once: the first record stays
        save(8, _job(run, g1))
        save(9, _job(run, g0))  # the side still in generation 0, after generation 1 resumed at 5
        save(10, forged)  # a generation 1 the rendezvous never held
        assert fence.fences(run) == {1: 5}
        unfenced = store.restore_newest(abstract)
        assert unfenced.step == 10  # what a restore without the rule would take
        with pytest.warns(RuntimeWarning, match=r"fenced: written by generation 1 f+ is not the rendezvous'"):
            got = store.restore_newest(abstract, lambda step, meta: fence.rejected(run, meta, step))
        assert got.step == 8 and np.array_equal(np.asarray(got.state["w"]), np.full((4, 4), 8, np.float32))
        reasons = dict(got.skipped)
        assert set(reasons) == {9, 10}, reasons
        assert "past step 5 at which generation 1 resumed" in reasons[9], reasons
        assert "is not the rendezvous' generation 1" in reasons[10], reasons
        assert store.steps() == [5, 8]
    finally:
        store.close()
    moved = sorted(p.name.split(".")[0] for p in (run / "checkpoints" / "quarantine").iterdir())
    assert moved == ["10", "9"]
    # a fence record forged by the cut-off side is not a fence
    fence.record_resume(types.SimpleNamespace(run_dir=str(run), generation=2, generation_id="e" * 64), 0)
    assert fence.fences(run) == {1: 5}
    # outside a job across hosts nothing is stamped and nothing is refused
    assert fence.stamp(None) == {} and fence.rejected(run, {"step": 3}, 3) is None


def test_a_host_whose_clock_is_off_takes_no_rank_and_says_by_how_much(tmp_path):
    """Leases compare wall clocks across hosts; the rendezvous compares this host's clock with
    the shared file system's (a lease file's modification time) at every lease write. A clock
    10 s ahead (lease 4 s: at most 1 s) is refused with a clear error and leaves no lease
    behind, so no other host counts it live and its rank stays free; within the bound it
    registers; a clock that drifts off later stops renewing (the lease expires, the agent is
    fenced and says why)."""
    run = tmp_path / "run"
    bad = Rendezvous(run, 1, workers=1, lease_s=4.0, clock=lambda: time.time() + 10.0)
    with pytest.raises(ClockSkewError, match=r"node 1's clock is \+10\.\d\d s off the run directory's file system") \
            as e:
        bad.register(renew=False)
    assert "at most 1 s (a quarter of --lease 4 s)" in str(e.value) and "NTP" in str(e.value)
    assert not (run / rendezvous.RENDEZVOUS / "leases" / "node1.json").exists()
    good = Rendezvous(run, 1, workers=1, lease_s=4.0, clock=lambda: time.time() - 0.5)
    good.register(renew=False)  # half a second off: within a quarter of the lease
    assert set(good.live()) == {1}
    drift = {"s": 0.0}
    later = Rendezvous(run, 0, workers=1, lease_s=4.0, clock=lambda: time.time() + drift["s"])
    later.register(renew=False)
    drift["s"] = -3.0
    with pytest.raises(ClockSkewError, match=r"node 0's clock is -3\.\d\d s off"):
        later.renew()
    with pytest.raises(ClockSkewError):
        later.check_fence()  # fenced: it proposes, acks and renews nothing from now on
    assert set(good.live()) == {1}  # the drifted host withdrew its lease
    # a clock that jumps ahead makes every other lease look expired: the agent checks its own
    # clock against the file system's before it ends a generation for that
    jump = {"s": 0.0}
    j = Rendezvous(run, 2, workers=1, lease_s=4.0, clock=lambda: time.time() + jump["s"])
    j.register(renew=False)
    gen = agree_together([good, j])
    assert j.changed(gen) is None
    jump["s"] = 10.0
    with pytest.raises(ClockSkewError, match=r"node 2's clock is \+10\.\d\d s off"):
        j.changed(gen)
    assert set(good.live()) == {1} and good.changed(gen) == "node 2 left"


def test_processes_json_is_not_written_by_an_agent_whose_generation_is_not_the_rendezvous(tmp_path):
    """The service node's agent writes processes.json only for the rendezvous' own generation
    (by identity, not only by number), and the file names that identity for readers."""
    from resilax.tools.agent import Agent

    run = tmp_path / "run"
    agent = Agent(["true"], nodes=1, node_rank=0, n=1, devices_per_process=1, run_dir=run, host_store_every=0)
    agent.rdv = Rendezvous(run, 0, workers=1, lease_s=30.0)
    agent.rdv.register(renew=False)
    agent.gen = agree_together([agent.rdv])
    agent._write_processes({0: {"agent": 1, "workers": {"0": 2}}}, "running")
    rec = json.loads((run / "processes.json").read_text())
    assert rec["generation_id"] == agent.gen.sha256
    # the same number, formed in a view of the run directory of its own (cut off): not written
    agent.gen = rendezvous.Generation(**{**agent.gen.__dict__, "sha256": "f" * 64})
    agent._write_processes({0: {"agent": 1, "workers": {"0": 3}}}, "running")
    assert json.loads((run / "processes.json").read_text()) == rec
    assert agent.rdv.changed(agent.gen).endswith("(it was cut off from the run directory while its generation was "
                                                  "formed: fenced)")


def test_a_host_store_takes_no_mirror_from_a_fenced_generation(tmp_path, monkeypatch):
    """The store server of a host in generation 2 refuses a mirror written by generation 1 (a
    side still running it) or by another "generation 2" (formed in a view of the run
    directory of its own), saying why; it takes its own generation's and a newer one's (whose
    writers may start before this host's agent does)."""
    from resilax._src.protect import hoststore_files, hoststore_net

    monkeypatch.setenv("RESILAX_STORE_KEY", "ab" * 16)
    server = hoststore_net.StoreServer(tmp_path / "store")
    server.fence(2, "a" * 64)
    raw = b"not an npz: the server checks the bytes' sha256 only"

    def put(step, g, gid):
        meta = hoststore_files.make_meta(step, raw, None, 1, 0, False)
        hoststore_net.put(server.address, {**meta, "generation": g, "generation_id": gid}, raw)

    try:
        with pytest.raises(OSError, match=r"refused: it was written by generation 1 \(bbbbbbbbbbbb\), and this host "
                                          r"runs generation 2 \(aaaaaaaaaaaa\): the writer was fenced"):
            put(5, 1, "b" * 64)
        with pytest.raises(OSError, match=r"written by generation 2 \(cccccccccccc\)"):
            put(6, 2, "c" * 64)
        assert server.puts == 0 and not (tmp_path / "store" / "host0" / "mirror").exists()
        put(7, 2, "a" * 64)
        put(8, 3, "d" * 64)
        assert server.puts == 2
        assert sorted(hoststore_files.records(tmp_path / "store")["host0/mirror"]) == [7, 8]
    finally:
        server.close()
