"""Host state store (resilax/_src/protect/hoststore.py) in one process: what the supervisor
and the workers of `resilax launch` do with it, on real sharded arrays and real files.
The multi-process path is tested end to end in test_launch.py."""

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
    run = types.SimpleNamespace(step=step, live=live, guard=guard, data_position={"kind": "json", "value": {"i": step}},
                                data=None, events=ev)
    run.event = lambda kind, step, **f: ev.append((kind, step, f))
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
    assert hsf.committed_steps(tmp_path / "host0" / "own") == [2, 3, 4]  # the newest KEEP
    assert hsf.restorable_step(tmp_path, n) == 4
    # host 1 dies: its shards come from the mirror on host 2
    import shutil

    shutil.rmtree(tmp_path / "host1")
    assert hsf.restorable_step(tmp_path, n) == 4
    tmpl = jax.tree.leaves((_run(0, mesh).live, _run(0, mesh).guard))
    leaves, meta, src = stores[1].restore(4, tmpl, [x.sharding for x in tmpl])
    assert src.endswith("host2/mirror") and meta["data_state"] == {"kind": "json", "value": {"i": 4}}
    want = jax.tree.leaves((_run(4, mesh).live, _run(4, mesh).guard))
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
    f = tmp_path / "host0" / "own" / "step7.npz"
    raw = bytearray(f.read_bytes())
    raw[-40] ^= 0xFF
    f.write_bytes(bytes(raw))
    assert hsf.read(tmp_path / "host0" / "own", 7) is None
    tmpl = jax.tree.leaves((run.live, run.guard))
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
    run = _run(2, mesh)
    before = run.live
    out = hs.resume(run, store, run.live, 5, agree=lambda ok: False)
    assert out is before and run.step == 2 and run.events[-1][0] == "host_store_skipped"
    out = hs.resume(run, store, run.live, 5, agree=lambda ok: ok)
    assert run.step == 5 and run.events[-1][0] == "restore" and run.events[-1][2]["source"] == "host_store"
    assert np.array_equal(np.asarray(out["w"]), np.asarray(_run(5, mesh).live["w"]))
    assert out["w"].sharding == before["w"].sharding


def test_a_restored_state_is_stored_again_at_once(tmp_path, mesh):
    """A second death right after a recovery must not find the first dead host's copies
    gone: resume (and start, after a checkpoint restore) write the restored step back."""
    import shutil

    a = hs.HostStore(str(tmp_path / "a"), 0, 2)
    a.after_step(_run(5, mesh), None)
    shutil.rmtree(tmp_path / "a" / "host0")  # host 0 died: its shards live on in host 1's mirror
    run = _run(2, mesh)
    hs.resume(run, a, run.live, 5, agree=lambda ok: ok)
    assert run.step == 5 and hsf.committed_steps(tmp_path / "a" / "host0" / "own") == [5]
    b = hs.HostStore(str(tmp_path / "b"), 1, 2)
    run = _run(3, mesh)
    b.start(run, run.live)  # e.g. after a checkpoint restore at step 3
    assert hsf.committed_steps(tmp_path / "b" / "host1" / "own") == [3]
    assert hsf.committed_steps(tmp_path / "b" / "host0" / "mirror") == [3]
