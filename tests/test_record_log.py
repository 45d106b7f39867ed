"""The record log's sinks and bounds: a restart from the disk log in either mode, refused
onto a state it was not recorded from; host memory bounded in every layout; faults on the
peer copy only where a copy is made; compile-ahead. Each compares with a failure-free run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import resilax
from resilax.tools import example as ex
from resilax.tools.models import CASES, tree_rel_diff
from helpers import SMALL, state_equal

TOPO = resilax.Topology.emulated(2, 4)


def sharded(st):
    return jax.tree.map(lambda x: P(("data", "fsdp")) if np.ndim(x) and np.shape(x)[0] % 8 == 0 else P(), st)


def replicated(st):
    return jax.tree.map(lambda x: P("fsdp") if np.ndim(x) and np.shape(x)[0] % 4 == 0 else P(), st)


def mlp_run(config, steps, *, state=None, layout=sharded, faults=(), wait_compiled=False):
    """The example MLP with a grain iterator; returns (host state, step)."""
    template = ex.make_state(SMALL) if state is None else state
    data = ex.make_iterator(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=layout(template), config=config,
                        faults=resilax.FaultPlan(faults))
    s = step.init(template, data=data)
    while step.step < steps:
        s, _ = step(s, next(data))
        if wait_compiled:  # background compiles of the degraded meshes done before any failure
            assert step.wait_compiled(timeout=300)
            wait_compiled = False
    out = jax.device_get(s)
    step.close()
    return out, step


@pytest.mark.parametrize("mode", ["grads", "inputs"])
def test_restart_from_the_disk_log_alone_in_each_mode(tmp_path, mode):
    """No checkpoint: a restart replays the disk log from the initial state (0.1 lost
    inputs-mode logs: their entries had no batch signature, so no program could be built)."""
    off = resilax.Config(log=None, peers=None, anomaly=None)
    ref, _ = mlp_run(off, 8)
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log"), mode=mode, grads_budget=None))
    mlp_run(cfg, 6)  # a process that stopped after 6 steps (closing flushes: as a clean stop)
    got, step = mlp_run(cfg, 8)
    ev = next(e for e in step.events if e.kind == "replay")
    assert ev.fields["from_step"] == 0 and ev.fields["steps"] == 6, ev.fields
    assert ev.fields[f"{mode}_steps"] == 6 and not ev.fields["unreplayable"]
    assert state_equal(got, ref)


def bf16_state():
    """The example MLP with bfloat16 parameters and moments: its recorded gradients are bf16."""
    st = ex.make_state(SMALL)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), st.params)
    return st.replace(params=params, opt_state=st.tx.init(params))


def test_a_bf16_state_restarts_from_its_grads_log_bitwise(tmp_path):
    """bfloat16 recorded values are written to and read back from the disk log bitwise (a
    bf16 array's buffer cannot be taken as bytes directly: the writer failed on it)."""
    off = resilax.Config(log=None, peers=None, anomaly=None)
    ref, _ = mlp_run(off, 5, state=bf16_state())
    assert {x.dtype for x in jax.tree.leaves(ref.params)} == {jnp.dtype(jnp.bfloat16)}
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log"), mode="grads", grads_budget=None))
    mlp_run(cfg, 4, state=bf16_state())
    got, step = mlp_run(cfg, 5, state=bf16_state())
    ev = next(e for e in step.events if e.kind == "replay")
    assert ev.fields["grads_steps"] == 4 and not ev.fields["unreplayable"], ev.fields
    assert state_equal(got, ref)


def test_log_is_not_replayed_onto_another_start_state(tmp_path):
    """The first entry carries checksums of the state it started from: a restart with another
    initial state is refused (a clear error, nothing in the log touched) instead of replaying
    the log onto it."""
    cfg = resilax.Config(log=resilax.LogConfig(directory=str(tmp_path / "log")))
    mlp_run(cfg, 4)
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "log").iterdir() if p.is_file())
    other = ex.make_state(SMALL)
    other = other.replace(params=jax.tree.map(lambda x: x + 1.0, other.params))
    with pytest.raises(resilax.ReplayLogError, match="recorded from another state at step 0.*Nothing was changed"):
        mlp_run(cfg, 6, state=other)
    after = sorted((p.name, p.read_bytes()) for p in (tmp_path / "log").iterdir() if p.is_file())
    assert after == before


@pytest.mark.parametrize("layout, ckpt_every, most", [
    (replicated, None, 1),  # nothing lives in one domain: the live state is its own copy
    (sharded, None, 1),  # a ring copy every step
    (replicated, 3, 4),  # the checkpoint fallback needs the batches since the checkpoint
])
def test_host_batches_are_bounded_in_every_layout(tmp_path, layout, ckpt_every, most):
    """0.1 (and the first cut of the pipeline) kept every batch when nothing was ring-placed."""
    cfg = resilax.Config(checkpoint=None if ckpt_every is None else
                         resilax.CheckpointConfig(str(tmp_path / "ck"), every=ckpt_every))
    template = ex.make_state(SMALL)
    data = ex.make_iterator(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=layout(template), config=cfg)
    s = step.init(template, data=data)
    seen = []
    for _ in range(10):
        s, _ = step(s, next(data))
        seen.append(len(step.retained()["host_batch_steps"]))
    step.close()
    assert max(seen) <= most, seen
    r = step.retained()
    assert r["host_batch_bytes"] <= most * (SMALL.batch * (SMALL.features * 4 + 4))


def test_no_copies_and_no_checkpoints_keeps_no_batches():
    cfg = resilax.Config(peers=None)
    template = ex.make_state(SMALL)
    data = ex.make_iterator(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=replicated(template), config=cfg)
    s = step.init(template, data=data)
    for _ in range(5):
        s, _ = step(s, next(data))
        assert len(step.retained()["host_batch_steps"]) <= 1
    step.close()


@pytest.mark.parametrize("spec, cfg, match", [
    ("fail_slice@3:during_peer_copy/1", resilax.Config(peers=None), "needs peer copies"),
    ("fail_slice@3:during_peer_copy/1", resilax.Config(peers=resilax.PeersConfig(every=3)), "makes no peer copy"),
])
def test_peer_copy_faults_only_where_a_copy_is_made(spec, cfg, match):
    with pytest.raises(resilax.ConfigError, match=match):
        resilax.wrap(ex.train_step, topology=TOPO, config=cfg, faults=resilax.FaultPlan([spec]))


def test_peer_copy_fault_on_a_copy_step_and_on_a_mesh_without_copies():
    name = "batchnorm_mlp"
    case = CASES[name]
    off = resilax.Config(log=None, peers=None, anomaly=None)

    def go(layout, faults, cfg):
        st = case.make_state(0)
        step = resilax.wrap(case.train_step, topology=TOPO, state_sharding=layout(st), rng=True, config=cfg,
                            faults=resilax.FaultPlan(faults))
        s = step.init(st)
        for b in case.make_batches(6):
            s, _ = step(s, b)
        step.close()
        return jax.device_get(s), step

    for layout in (sharded, replicated):
        ref, _ = go(layout, [], off)
        got, step = go(layout, ["fail_slice@2:during_peer_copy/0"], resilax.Config(peers=resilax.PeersConfig(every=3)))
        ev = next(e for e in step.events if e.kind == "recovery")
        assert ev.fields["copy_in_flight"] == [layout is sharded]  # a replicated mesh makes no copies
        assert tree_rel_diff(got, ref) < 1e-4


def test_compile_ahead_takes_compiles_off_the_recovery(tmp_path):
    cfg = resilax.Config(peers=resilax.PeersConfig(compile_ahead=True))
    ref, _ = mlp_run(resilax.Config(log=None, peers=None, anomaly=None), 6)
    got, step = mlp_run(cfg, 6, faults=["fail_slice@3:mid_step/1"], wait_compiled=True)
    ahead = [e for e in step.events if e.kind == "compile_ahead"]
    assert ahead and ahead[0].step == 0 and ahead[0].fields["meshes"] == [{"data": 1, "fsdp": 4}] * 2
    ev = next(e for e in step.events if e.kind == "recovery")
    assert ev.fields["compiled_ahead"] is True
    assert ev.fields["seconds"]["compile"] < 0.05, ev.fields["seconds"]
    assert tree_rel_diff(got, ref) < 1e-4


def test_a_log_anchor_in_the_layout_before_0_3_is_still_accepted_and_a_foreign_one_refused():
    """Anchors checksum the checkpoint's tree ({"state", "guard"}: the guard's rows first)
    since 0.3, so one compiled program serves saves, anchors and restarts; a log written
    before checksums ``(state, guard)`` (the same rows, the guard's last) and must still
    resume, while a log of another state is refused."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from resilax._src.errors import ReplayLogError
    from resilax._src.protect.checksum import anchor_tree, tree_checksums
    from resilax._src.step.resume import _start_mismatch

    state = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
    guard = {"count": jnp.int32(3), "mean": jnp.float32(0.5)}
    run = SimpleNamespace(_guard=guard, _record_log=SimpleNamespace(sums=tree_checksums,
                                                                  disk=SimpleNamespace(directory="/log")))
    new = np.asarray(tree_checksums(anchor_tree(state, guard)))
    legacy = np.asarray(tree_checksums((state, guard)))
    assert not np.array_equal(new, legacy)  # the orders differ: the test can tell them apart
    for sums in (new, legacy):
        assert _start_mismatch(run, SimpleNamespace(step=4, state_sums=sums), state) is None
    other = dict(state, b=jnp.zeros(4))
    for sums in (np.asarray(tree_checksums(anchor_tree(other, guard))), np.asarray(tree_checksums((other, guard)))):
        with pytest.raises(ReplayLogError, match="recorded from another state"):
            _start_mismatch(run, SimpleNamespace(step=4, state_sums=sums), state)


def test_copy_batches_decides_whether_the_log_keeps_its_own_copy_of_each_batch():
    """`LogConfig.copy_batches` (default True): the batches the log retains for a recompute
    are its own copies, not the caller's arrays; False keeps the caller's (one memcpy a step
    saved, for callers that never change a batch). A non-bool is refused by name."""
    template = ex.make_state(SMALL)
    for copy in (True, False):
        cfg = resilax.Config(log=resilax.LogConfig(copy_batches=copy),
                             peers=resilax.PeersConfig(every=4, log_entries_between=False))
        step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=sharded(template), config=cfg)
        s = step.init(template)
        data = ex.make_iterator(SMALL)
        given = [next(data) for _ in range(3)]
        for b in given:
            s, _ = step(s, b)
        kept = step._record_log.batches
        assert sorted(kept) and all(k < 3 for k in kept), sorted(kept)
        for k, b in kept.items():
            same = [x is y for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(given[k]))]
            assert all(same) if not copy else not any(same), (copy, k)
            assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(given[k])))
        step.close()
    with pytest.raises(resilax.ConfigError, match="copy_batches must be bool"):
        resilax.LogConfig(copy_batches="yes")


def test_a_packed_grads_entry_holds_the_buffers_and_reads_back_every_leaf_bitwise(tmp_path):
    """A grads entry holds the buffers the recorded values crossed between the step's parts in
    (a few host copies, however many leaves); reading cuts every leaf back out, for leaves
    replicated, sharded over one axis, over both, and along a second dimension."""
    from jax.sharding import Mesh, NamedSharding
    from resilax._src.protect import ring
    from resilax._src.protect.disk_log import DiskLog, decode_entry, packed_layout, unpack_recorded
    from resilax._src.errors import ReplayLogError

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    specs = [P(), P("fsdp"), P(("data", "fsdp")), P(None, "data"), P("data", "fsdp"), P(), P("fsdp")]
    shapes = [(3,), (8, 2), (16,), (5, 4), (4, 8), (64, 64, 80), (4, 3)]  # (64, 64, 80) f32: large, not packed
    dtypes = [np.float32, np.float32, np.int32, np.float32, np.float32, np.float32, jnp.bfloat16]
    rng = np.random.default_rng(0)
    host = [rng.normal(size=s).astype(d) if d != np.int32 else rng.integers(-9, 9, size=s).astype(d)
            for s, d in zip(shapes, dtypes)]
    shs = [NamedSharding(mesh, s) for s in specs]
    small = [None if np.prod(s) * 4 >= 1 << 20 else ring.RING for s in shapes]
    pack = ring.ring_pack_layout(shapes, dtypes, shs, small, "data")
    assert pack.groups == ("float32", "int32", "bfloat16")
    xs = jax.device_put(host, shs)
    bufs, bigs = jax.jit(lambda xs: ring.local_pack(xs, pack))(xs)
    paths = [f"['l{i}']" for i in range(len(host))]
    layout = packed_layout(paths, shapes, dtypes, shs, pack)
    log = DiskLog(tmp_path)
    log.append(3, packed=(layout, [*bufs, *bigs]), scalars={"verdict": 0})
    log.close()
    header, arrays = decode_entry((tmp_path / "0000000003.grads.rxl").read_bytes(), where="x")
    assert len(arrays) == 4 and header["layout"]["paths"] == paths  # 3 buffers + 1 large leaf, not 7 arrays
    entry = DiskLog(tmp_path).read(3, "grads")
    assert entry.recorded_paths == paths
    for got, want in zip(entry.recorded, host, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    with pytest.raises(ReplayLogError, match="packed layout does not match"):
        unpack_recorded(header["layout"], [arrays[0][:-1], *arrays[1:]], where="x")
    with pytest.raises(ReplayLogError, match="large leaves"):
        unpack_recorded(header["layout"], arrays[:3], where="x")
