"""Host state store (resilax/_src/protect/hoststore.py) in one process: what the supervisor
and the workers of `resilax launch` do with it, on real sharded arrays and real files.
The multi-process path is tested end to end in test_launch.py."""

import functools
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilax._src.protect import hoststore as hs, hoststore_files as hsf


def _run(step, mesh):
    sh = NamedSharding(mesh, P("a"))
    rep = NamedSharding(mesh, P())
    live = {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2) + step, sh), "n": jax.device_put(jnp.int32(step), rep)}
    guard = jax.device_put(jnp.float32(step * 0.5), rep)
    ev = []
    run = types.SimpleNamespace(step=step, _live=live, _guard=guard, _data_position={"kind": "json", "value": {"i": step}},
                                _data=None, events=ev)
    run._event = lambda kind, step, **f: ev.append((kind, step, f))
    return run


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices()[:4]), ("a",))


def test_store_round_trip_mirror_and_restorable_step(tmp_path, mesh):
    n = 3
    stores = [hs.HostStore(str(tmp_path), i, n) for i in range(n)]
    for step in (1, 2, 3, 4):
        run = _run(step, mesh)
        for s in stores:  # in one process every "host" writes the same shards; enough for the files' logic
            s.after_step(run, None)
    for s in stores:
        s.flush()  # (each stored step is written off the step's path; the next one waits for it)
    assert hsf.committed_steps(tmp_path / "host0" / "own") == [2, 3, 4]  # the newest KEEP
    assert hsf.restorable_step(tmp_path, n) == 4
    # host 1 dies: its shards come from the mirror on host 2
    import shutil

    shutil.rmtree(tmp_path / "host1")
    assert hsf.restorable_step(tmp_path, n) == 4
    tmpl = jax.tree.leaves((_run(0, mesh)._live, _run(0, mesh)._guard))
    leaves, meta, src = stores[1].restore(4, tmpl, [x.sharding for x in tmpl])
    assert src.endswith("host2/mirror") and meta["data_state"] == {"kind": "json", "value": {"i": 4}}
    want = jax.tree.leaves((_run(4, mesh)._live, _run(4, mesh)._guard))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves, want))
    # its neighbour dies too. In one process every host's copy holds every element (the
    # bit-exact mode's case under launch: one process, one domain, the whole state), so
    # host 0's own copy serves process 1 as well
    shutil.rmtree(tmp_path / "host2")
    assert hsf.restorable_step(tmp_path, n) == 4
    leaves, _, src = stores[1].restore(4, tmpl, [x.sharding for x in tmpl])
    assert src.endswith("host0/own") and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves, want))
    # a copy of only the writer's shards (a layout sharded across processes) serves only it:
    # nothing holds process 1's shards any more
    import json

    for f in (tmp_path / "host0").glob("*/step*.json"):
        f.write_text(json.dumps(dict(json.loads(f.read_text()), whole=False)))
    assert hsf.restorable_step(tmp_path, n) is None
    assert hsf.sources(tmp_path, 0, n, 4) == [tmp_path / "host0" / "own"]


def test_a_corrupt_copy_is_not_used_and_the_mirror_is(tmp_path, mesh):
    n = 2
    stores = [hs.HostStore(str(tmp_path), i, n) for i in range(n)]
    run = _run(7, mesh)
    for s in stores:
        s.after_step(run, None)
        s.flush()
    f = tmp_path / "host0" / "own" / "step7.npz"
    raw = bytearray(f.read_bytes())
    raw[-40] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert hsf.read(tmp_path / "host0" / "own", 7) is None
    tmpl = jax.tree.leaves((run._live, run._guard))
    _, _, src = stores[0].restore(7, tmpl, [x.sharding for x in tmpl])
    assert src.endswith("host1/mirror")
    (tmp_path / "host1" / "mirror" / "step7.json").unlink()  # uncommitted: not offered
    _, _, src = stores[0].restore(7, tmpl, [x.sharding for x in tmpl])
    assert src.endswith("host0/mirror")  # process 1's copy: whole (one process holds every element here)
    for d in ("host0/mirror", "host1/own"):
        (tmp_path / d / "step7.json").unlink()
    assert stores[0].restore(7, tmpl, [x.sharding for x in tmpl]) is None


def test_resume_keeps_the_checkpoint_state_unless_every_process_agrees(tmp_path, mesh):
    store = hs.HostStore(str(tmp_path), 0, 1)
    store.after_step(_run(5, mesh), None)
    store.flush()
    run = _run(2, mesh)
    before = run._live
    out = hs.resume(run, store, run._live, 5, agree=lambda ok: False)
    assert out is before and run.step == 2 and run.events[-1][0] == "host_store_skipped"
    out = hs.resume(run, store, run._live, 5, agree=lambda ok: ok)
    assert run.step == 5 and run.events[-1][0] == "restore" and run.events[-1][2]["source"] == "host_store"
    assert np.array_equal(np.asarray(out["w"]), np.asarray(_run(5, mesh)._live["w"]))
    assert out["w"].sharding == before["w"].sharding


def test_a_restored_state_is_stored_again_at_once(tmp_path, mesh):
    """A second death right after a recovery must not find the first dead host's copies
    gone: resume (and start, after a checkpoint restore) write the restored step back."""
    import shutil

    a = hs.HostStore(str(tmp_path / "a"), 0, 2)
    a.after_step(_run(5, mesh), None)
    a.flush()
    shutil.rmtree(tmp_path / "a" / "host0")  # host 0 died: its shards live on in host 1's mirror
    run = _run(2, mesh)
    hs.resume(run, a, run._live, 5, agree=lambda ok: ok)
    assert run.step == 5 and hsf.committed_steps(tmp_path / "a" / "host0" / "own") == [5]
    b = hs.HostStore(str(tmp_path / "b"), 1, 2)
    run = _run(3, mesh)
    b.start(run, run._live)  # e.g. after a checkpoint restore at step 3
    assert hsf.committed_steps(tmp_path / "b" / "host1" / "own") == [3]
    assert hsf.committed_steps(tmp_path / "b" / "host0" / "mirror") == [3]


# ------------------------------------------------------------------ across hosts (hoststore_net)
def _pieces_of(x, devices):
    """The shards of ``x`` on ``devices``, keyed as a process holding those devices writes them."""
    idx = x.sharding.devices_indices_map(x.shape)
    out = {}
    for d in devices:
        out[hsf._key(LEAF[id(x)], idx[d], x.shape)] = np.asarray(x)[idx[d]]
    return out


LEAF: dict = {}


def _commit_process(d, step, leaves, devices, slot, writers, data_state=None):
    arrays = {}
    for i, x in enumerate(leaves):
        LEAF[id(x)] = i
        arrays.update(_pieces_of(x, devices))
    raw = hsf.encode(arrays)
    meta = hsf.make_meta(step, raw, data_state, len(leaves), slot, False, keys=list(arrays), writers=writers)
    hsf.write_raw(d, step, raw, meta)
    return raw, meta


def test_a_reformed_mesh_assembles_its_shards_from_this_hosts_copies_and_another_hosts_server(tmp_path):
    """The default mode across hosts: 4 processes of 2 devices stored their own shards (rows
    of the 8 devices); the host of processes 0 and 1 is lost. Process 2's host holds its own
    copy and process 1's mirror, another host's server process 3's own and process 0's mirror.
    A re-formed mesh shards by columns over 4 devices (pieces of every process's rows): each
    region is assembled from both hosts' copies, checksummed, equal to the stored values,
    bf16 included; with a copy missing nowhere is every element found: None."""
    from resilax._src.protect import hoststore_net as net

    devs = jax.devices()
    old = Mesh(np.array(devs), ("x",))
    rows, rep = NamedSharding(old, P("x")), NamedSharding(old, P())
    leaves = [jax.device_put(jnp.arange(64 * 24, dtype=jnp.float32).reshape(64, 24), rows),
              jax.device_put((jnp.arange(16 * 8) / 7).astype(jnp.bfloat16).reshape(16, 8), rows),
              jax.device_put(jnp.arange(8.0), rows), jax.device_put(jnp.int32(11), rep)]
    procs = {p: devs[2 * p:2 * p + 2] for p in range(4)}
    here, there = tmp_path / "host-b", tmp_path / "host-c"
    _commit_process(here / "host2" / "own", 5, leaves, procs[2], 2, [0, 1, 2, 3], {"i": 2})
    _commit_process(here / "host1" / "mirror", 5, leaves, procs[1], 1, [0, 1, 2, 3])
    _commit_process(there / "host3" / "own", 5, leaves, procs[3], 3, [0, 1, 2, 3])
    raw0, meta0 = _commit_process(there / "host0" / "mirror", 5, leaves, procs[0], 0, [0, 1, 2, 3])
    new = Mesh(np.array(devs[4:8]), ("y",))
    shardings = [NamedSharding(new, P(None, "y")), NamedSharding(new, P(None, "y")), NamedSharding(new, P()),
                 NamedSharding(new, P())]
    server = net.StoreServer(there)
    try:
        store = hs.HostStore(str(here), 2, 4, peers=[server.address], writers=[0, 1, 2, 3])
        got = store.restore(5, leaves, shardings)
        assert got is not None
        out, meta, source = got
        for a, b, sh in zip(out, leaves, shardings):
            assert a.sharding == sh and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert meta["process"] == 2 and meta["data_state"] == {"i": 2}  # this process's own record
        assert source.startswith("assembled from ") and server.address in source and "host2/own" in source
        # the agents' view: every writer's shards of step 5 are on one of the two hosts
        assert hsf.covered_steps([hsf.records(here), net.listing(server.address)]) == [5]
        assert hsf.covered_steps([hsf.records(here)]) == []
        # damaged bytes on the other host: the server's get refuses them, nothing is assembled
        npz = there / "host0" / "mirror" / "step5.npz"
        b = bytearray(npz.read_bytes())
        b[len(b) // 2] ^= 0xFF
        npz.write_bytes(bytes(b))
        assert net.get(server.address, "host0/mirror", 5) is None
        assert store.restore(5, leaves, shardings) is None
        # a put of damaged bytes is refused and stores nothing; a good one is committed as a mirror
        with pytest.raises(OSError, match="do not match their SHA-256"):
            net.put(server.address, {**meta0, "step": 6}, raw0[:-8] + b"damaged!")
        assert not (there / "host0" / "mirror" / "step6.json").exists()
        net.put(server.address, meta0, raw0)
        assert store.restore(5, leaves, shardings) is not None
        with pytest.raises(OSError, match="not a store directory"):
            net._request(server.address, {"op": "get", "dir": "../../etc", "step": 5})
    finally:
        server.close()
    # the other host gone: its copies cannot be reached, so no step is offered and none assembled
    assert store.restore(5, leaves, shardings) is None


def test_a_store_server_with_the_jobs_key_serves_only_requests_made_with_it(tmp_path, monkeypatch):
    """The host stores' key (issue 29: the mirror crosses hosts over TCP). The first agent of
    a run directory makes the key (owner-only), later ones read the same; with it set, a put
    and a listing made with the key are served, one without it or with another key is refused
    and stores nothing, a forged MAC is refused, and a client with the key trusts no reply
    from a server without it."""
    import os
    import socket
    import stat

    from resilax._src.protect import hoststore_net as net

    monkeypatch.setenv(net.KEY_ENV, "")  # (recorded, so that teardown restores this process's environment:
    monkeypatch.delenv(net.KEY_ENV)  # `job_key` sets the variable for the workers an agent starts)
    run = tmp_path / "run"
    run.mkdir()
    key = net.job_key(run)
    assert os.environ[net.KEY_ENV] == key and len(bytes.fromhex(key)) == 32
    assert stat.S_IMODE((run / net.KEY_FILE).stat().st_mode) == 0o600
    monkeypatch.delenv(net.KEY_ENV)
    assert net.job_key(run) == key  # another agent of the job: the same key
    arrays = {"0:0-4": np.arange(4.0)}
    raw = hsf.encode(arrays)
    meta = hsf.make_meta(7, raw, None, 1, 3, False, keys=list(arrays), writers=[3])
    server = net.StoreServer(tmp_path / "next")
    try:
        net.put(server.address, meta, raw)  # with the key
        assert server.puts == 1 and 7 in net.listing(server.address)["host3/mirror"]
        for other in (None, "ab" * 32):  # no key; another job's key
            if other is None:
                monkeypatch.delenv(net.KEY_ENV)
            else:
                monkeypatch.setenv(net.KEY_ENV, other)
            with pytest.raises(OSError, match="not authenticated"):
                net.put(server.address, {**meta, "step": 8}, raw)
            with pytest.raises(OSError, match="not authenticated"):
                net.listing(server.address)
            assert net.get(server.address, "host3/mirror", 7) is None
        assert server.puts == 1 and not (tmp_path / "next" / "host3" / "mirror" / "step8.json").exists()
        # a request with a made-up MAC (an attacker without the key), by hand
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            net._recv(sock)  # the nonce
            net._send(sock, {"op": "list", "step": None, "mac": "00" * 32})
            reply, _ = net._recv(sock)
        assert reply["ok"] is False and "not authenticated" in reply["error"]
    finally:
        server.close()
    # a server without the key: a client with it trusts none of its replies
    monkeypatch.delenv(net.KEY_ENV, raising=False)
    plain = net.StoreServer(tmp_path / "plain")
    try:
        monkeypatch.setenv(net.KEY_ENV, key)
        with pytest.raises(OSError, match="reply of the store .* is not authenticated"):
            net.listing(plain.address)
    finally:
        plain.close()


def test_the_mirror_across_hosts_goes_to_the_next_hosts_server_and_stops_when_it_is_gone(tmp_path, capsys):
    from resilax._src.protect import hoststore_net as net

    server = net.StoreServer(tmp_path / "next")
    store = hs.HostStore(str(tmp_path / "mine"), 3, 4, alive=[3], remote=server.address, writers=[0, 1, 2, 3])
    arrays = {"0:0-4": np.arange(4.0)}
    raw = hsf.encode(arrays)
    meta = hsf.make_meta(7, raw, None, 1, 3, False, keys=list(arrays), writers=[0, 1, 2, 3])
    store._send(raw, meta)
    assert server.puts == 1 and hsf.read(tmp_path / "next" / "host3" / "mirror", 7)[0]["0:0-4"].tolist() == [0, 1, 2, 3]
    server.close()
    store._send(raw, {**meta, "step": 8})
    assert store.mirror_error is not None and "step 8" in store.mirror_error
    assert f"no mirror on the host at {server.address} from now on" in capsys.readouterr().err
    server2 = net.StoreServer(tmp_path / "next")  # (a server back at another port is not the one named)
    store._send(raw, {**meta, "step": 9})  # not tried again: the generation is about to end
    assert server2.puts == 0 and "step 8" in store.mirror_error
    server2.close()


def test_with_two_mirrors_a_host_and_its_neighbour_lost_at_once_still_leave_every_shard(tmp_path, capsys):
    """``--host-store-mirrors 2``: host 0's shards go to the next two hosts' servers. Hosts 0
    and 1 are lost at once (host 1's server closed, host 0's store gone): host 2 still has
    host 0's mirror beside its own copy, so the step is offered. With one mirror (the next
    host only) the same two losses leave host 0's shards nowhere."""
    from resilax._src.protect import hoststore_net as net

    arrays = {"0:0-4": np.arange(4.0)}
    raw = hsf.encode(arrays)
    meta = hsf.make_meta(7, raw, None, 1, 0, False, keys=list(arrays), writers=[0, 2])
    own2 = hsf.encode({"0:4-8": np.arange(4.0, 8.0)})
    hsf.write_raw(tmp_path / "h2" / "host2" / "own", 7,
                  own2, hsf.make_meta(7, own2, None, 1, 2, False, keys=["0:4-8"], writers=[0, 2]))
    for mirrors, want in ((1, []), (2, [7])):
        servers = {j: net.StoreServer(tmp_path / f"h{j}") for j in (1, 2)}
        store = hs.HostStore(str(tmp_path / "h0"), 0, 3, alive=[0], writers=[0, 2],
                             remote=",".join(servers[j].address for j in (1, 2)[:mirrors]))
        store._send(raw, meta)
        assert [servers[j].puts for j in (1, 2)] == [1, mirrors - 1]
        servers[1].close()  # host 1 lost; host 0 is the writer, lost with its own copy
        store._send(raw, {**meta, "step": 8})  # the next stored step: host 1 refuses, host 2 (if named) takes it
        assert "step 8" in store.mirror_error and servers[1].address in store.mirror_error
        assert f"no mirror on the host at {servers[1].address} from now on" in capsys.readouterr().err
        assert servers[2].puts == 2 * (mirrors - 1)
        assert hsf.covered_steps([net.listing(servers[2].address)]) == want, mirrors
        servers[2].close()
        import shutil

        shutil.rmtree(tmp_path / "h2" / "host0", ignore_errors=True)  # (the next round starts with no mirror there)


def test_a_stored_step_is_written_off_the_step_path_from_a_copy_the_next_step_cannot_donate(tmp_path, mesh):
    """`after_step` copies the state on its devices and returns; a thread reads the copy
    back and writes it. The state's own buffers may be donated (deleted) by the next step
    at once: the stored values are still the step's. The verdict record is read in the
    thread too (an unread verdict of a skipped step lands in the record), and a write that
    fails raises at the next stored step, not silently."""
    from resilax._src.protect import anomaly

    store = hs.HostStore(str(tmp_path), 0, 1)
    run = _run(6, mesh)
    want = {k: np.asarray(v) for k, v in run._live.items()}
    nan = jax.device_put(jnp.int32(anomaly.NONFINITE))
    snap = {"through": 5, "counts": {"nonfinite": 0, "spike": 0}, "skipped": {2: anomaly.SPIKE},
            "pending": [(4, jax.device_put(jnp.int32(anomaly.OK))), (5, nan)]}
    store._verdicts = lambda: snap
    store.after_step(run, None)
    for x in run._live.values():
        x.delete()  # what the next step's donation does
    store.flush()
    got, meta = hsf.read(tmp_path / "host0" / "own", 6)
    w_rows = sorted((k for k in got if k.startswith("1:")), key=lambda k: int(k[2:].split("-")[0]))  # leaf 1: "w"
    assert np.array_equal(np.concatenate([got[k] for k in w_rows]), want["w"])
    assert meta["verdicts"] == {"through": 5, "counts": {"nonfinite": 1, "spike": 0}, "skipped": [[2, 2], [5, 1]]}
    assert store.seconds.count == 1 and list(store.waited) == [pytest.approx(0, abs=1.0)]
    # a write that fails (the store's directory is a file now) raises at the next stored step
    import shutil

    shutil.rmtree(tmp_path / "host0")
    (tmp_path / "host0").write_text("not a directory")
    store.after_step(_run(7, mesh), None)
    with pytest.raises(OSError):
        store.after_step(_run(8, mesh), None)
    store.drain()  # after a failure: said, not raised


def test_storing_a_step_does_not_wait_for_the_step_to_finish(tmp_path):
    """On an accelerator the host runs ahead of the device; a store that read the state back
    on the step loop would make the host wait for every stored step. `after_step` returns
    while the step (here a slow chain of matmuls) still runs; the thread writes it after."""
    # 60 matmuls (~0.6 s here): the store's own host work, which a loaded machine slows too,
    # stays well under half of it (with 30, 0.17 of 0.33 s once in a fresh-clone run)
    heavy = jax.jit(lambda a: functools.reduce(lambda b, _: jnp.tanh(b @ a) , range(60), a))
    x = jnp.ones((768, 768), jnp.float32) / 768
    heavy(x).block_until_ready()  # compiled
    t0 = time.perf_counter()
    heavy(x).block_until_ready()
    compute = time.perf_counter() - t0
    store = hs.HostStore(str(tmp_path), 0, 1)
    y = heavy(x)
    run = types.SimpleNamespace(step=3, _live={"w": y}, _guard=None, _data_position=None)
    t0 = time.perf_counter()
    store.after_step(run, None)
    took = time.perf_counter() - t0
    running = not y.is_ready()
    store.flush()
    got, meta = hsf.read(tmp_path / "host0" / "own", 3)
    assert np.array_equal(got["0:0-768,0-768"], np.asarray(y)) and meta["whole"]
    assert compute > 0.2, compute  # (a step slow enough to tell)
    assert running and took < 0.5 * compute, (took, compute)


def test_a_step_stored_again_by_other_writers_is_not_mixed_with_the_old_copies(tmp_path):
    """Across hosts, a generation that resumed from a checkpoint older than the hosts'
    copies stores the same step numbers again with other writers (a smaller job, another
    reduction order): another state. A stale mirror of the first state (process 0's, whose
    host is gone) must not fill regions of the second: the agents count copies together and
    a worker assembles from them only when their writers are the same."""
    devs = jax.devices()
    rows = NamedSharding(Mesh(np.array(devs), ("x",)), P("x"))
    old = [jax.device_put(jnp.zeros((8, 4)), rows)]
    new = [jax.device_put(jnp.ones((8, 4)), rows)]
    procs = {p: devs[2 * p:2 * p + 2] for p in range(4)}
    here = tmp_path / "host-b"
    _commit_process(here / "host0" / "mirror", 12, old, procs[0], 0, [0, 1, 2, 3])  # stale: the first state
    for p in (1, 2, 3):  # the second state of step 12, by processes 1-3 (2 devices each on the old layout too)
        _commit_process(here / f"host{p}" / "own", 12, new, procs[p] if p else procs[0], p, [1, 2, 3])
    _commit_process(here / "host1" / "mirror", 12, new, procs[0], 1, [1, 2, 3])  # ... and the rows of 0-1
    sh = [NamedSharding(Mesh(np.array(devs[:4]), ("y",)), P(None, "y"))]
    store = hs.HostStore(str(here), 2, 4)
    got = store.restore(12, new, sh)
    assert got is not None
    np.testing.assert_array_equal(np.asarray(got[0][0]), np.ones((8, 4)))
    assert "host0/mirror" not in got[2], got[2]
    assert hsf.covered_steps([hsf.records(here)]) == [12]


def test_timings_of_a_long_run_keep_their_totals_in_bounded_memory():
    """The store's, the SDC check's and the checkpoints' per-action seconds were lists that
    grew by one float per stored step: a million-step run held a million. Now: count and
    total over the whole run, the median over the last ``keep``."""
    from resilax._src.timings import Timings

    t = Timings(keep=4)
    for i in range(1, 11):
        t.append(float(i))
    assert (t.count, t.total) == (10, 55.0)
    assert list(t) == [7.0, 8.0, 9.0, 10.0] and t.median() == 8.5 and Timings().median() is None


def test_the_stores_of_killed_owners_are_removed_and_live_ones_kept(tmp_path):
    """A SIGKILLed agent or supervisor leaves its host store (in RAM, /dev/shm, until the
    machine restarts); the next one of the same kind on the host removes the stores whose
    owner is gone (`hoststore_files.remove_orphans`; an agent: any job's and rank's, as
    tests leave them), and only those: a live owner's store and anything not named like a
    store stay; a supervisor's heartbeat directories in RAM go the same way."""
    import os
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # (reaped: its pid names no process now)
    mine = os.getpid()
    from resilax.tools import agent, launch

    names = [f"resilax-store-0123456789ab-node1-{dead.pid}", f"resilax-store-0123456789ab-node1-{mine}",
             f"resilax-store-fedcba987654-node2-{dead.pid}", f"resilax-store-{dead.pid}-17", f"resilax-store-{mine}-18",
             "something-else", f"resilax-hb-{dead.pid}-19", f"resilax-hb-{mine}-20"]
    for n in names:
        (tmp_path / n / "host0").mkdir(parents=True)
    gone = hsf.remove_orphans(tmp_path, agent.ORPHAN_STORES)  # an agent: any job's, any rank's
    assert gone == [names[0], names[2]]
    gone = hsf.remove_orphans(tmp_path, launch.ORPHAN_STORES)  # a single-host supervisor
    assert gone == [names[3]]
    gone = hsf.remove_orphans(tmp_path, launch.ORPHAN_HEARTBEATS)  # its heartbeats in RAM
    assert gone == [names[6]]
    assert sorted(os.listdir(tmp_path)) == sorted([names[1], names[4], names[5], names[7]])


def test_a_store_servers_unexpected_error_is_one_line_not_a_traceback(tmp_path, caplog, capfd):
    """A request the server fails on in a way it does not answer (a bug, not a bad request:
    those get an error reply) ends that request only: the client's call fails, and the
    server says so in one warning line instead of socketserver's traceback on stderr
    (issue 53); the traceback goes to the debug log. The server goes on serving."""
    import logging

    from resilax._src.protect import hoststore_net as net

    server = net.StoreServer(tmp_path / "next")
    serve = server._serve
    try:
        server._serve = lambda header, body: (_ for _ in ()).throw(RuntimeError("an unforeseen state"))
        with caplog.at_level(logging.DEBUG, logger="resilax"):
            with pytest.raises(OSError):
                net.listing(server.address, timeout_s=5)
        said = [r for r in caplog.records if r.levelno == logging.WARNING and "host store server" in r.getMessage()]
        assert len(said) == 1 and "RuntimeError: an unforeseen state" in said[0].getMessage(), caplog.records
        assert [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info], "the details are kept"
        assert "Traceback" not in capfd.readouterr().err
        server._serve = serve
        assert net.listing(server.address, timeout_s=5) == {}  # still serving
    finally:
        server.close()
