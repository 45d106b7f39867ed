"""Slice failures at every phase: rebuild bitwise from survivors, continue on the smaller mesh.

Every test compares against a failure-free reference run of the same steps and batches.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import resilax
from resilax.tools.example import ExampleSpec, fsdp_specs, make_iterator, make_state, train_step

SPEC = ExampleSpec(hidden=64, batch=48)
STEPS = 7
# Continuing on the smaller mesh sums microbatch gradients in another order: the result is
# not bitwise, only within reassociation. Bound: per leaf, ||got - ref|| <= TOL * ||ref||.
TOL = 1e-4
MAX_REL = {}  # test id -> max elementwise relative difference seen (printed at the end)


@functools.lru_cache(maxsize=None)
def batches():
    it = make_iterator(SPEC)
    return tuple(next(it) for _ in range(STEPS))


def layout(kind, topo, st):
    if kind == "replicated":  # replicated across slices, sharded inside each
        return fsdp_specs(st, "fsdp", topo.axis_sizes[1])
    n = topo.num_devices  # sharded across every device: a shard lives in one slice only
    return jax.tree.map(lambda x: P(("data", "fsdp")) if np.shape(x) and np.shape(x)[0] % n == 0 else P(), st)


def flat(state):
    return [np.array(x) for x in jax.tree.leaves(state)]


def run(topo_name, kind, faults=(), peer_every=1, compile_ahead=False, checkpoint_dir=None, checkpoint_every=0,
        protect=True, wait_compiled=False):
    topo = resilax.Topology.load(topo_name)
    st = make_state(SPEC)
    if protect:
        cfg = resilax.Config(
            peers=resilax.PeersConfig(every=peer_every, compile_ahead=compile_ahead),
            checkpoint=None if checkpoint_dir is None else resilax.CheckpointConfig(checkpoint_dir, every=checkpoint_every))
    else:  # the failure-free reference: a plain run, every protection off
        cfg = resilax.Config(peers=None, log=None, anomaly=None)
    step = resilax.wrap(train_step, topology=topo, state_sharding=layout(kind, topo, st),
                        config=cfg, faults=resilax.FaultPlan(faults))
    state = step.init(st)
    states = {}
    for b in batches():
        state, _ = step(state, b)
        if wait_compiled:  # the background compiles of the degraded meshes finish before any failure
            assert step.wait_compiled(timeout=300)
            wait_compiled = False
        states[step.step] = flat(state)
        if any(e.kind == "recovery" for e in step.events):
            assert_nothing_on_dead_devices(step, state)
    step.close()
    return states, step


@functools.lru_cache(maxsize=None)
def reference(topo_name, kind):
    return run(topo_name, kind, protect=False)[0]


def assert_nothing_on_dead_devices(step, state):
    dead = {d for e in step.events if e.kind == "recovery" for d in e.fields["failed_devices"]}
    assert dead
    held = [x for x in jax.tree.leaves((state, step._guard)) if isinstance(x, jax.Array)]
    for p in step._protections:  # what each protection holds for the next failure (test-only peek)
        held += p.held()
    assert held
    for a in held:
        ids = {d.id for d in a.devices()}
        assert not (ids & dead), f"array on dead devices {ids & dead}"
    assert not ({d.id for d in step.mesh.devices.flat} & dead)


def close(got, ref, key):
    worst = 0.0
    for a, b in zip(got, ref):
        if a.dtype.kind != "f":
            np.testing.assert_array_equal(a, b)
            continue
        assert np.linalg.norm(a - b) <= TOL * np.linalg.norm(b) + 1e-30
        worst = max(worst, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6))))
    MAX_REL[key] = max(MAX_REL.get(key, 0.0), worst)


def bitwise(got, ref):
    return all(np.array_equal(a, b) for a, b in zip(got, ref))


CASES = [
    ("cpu-2x4", "sharded", "before_step", 1),
    ("cpu-2x4", "sharded", "mid_step", 1),
    ("cpu-2x4", "sharded", "after_step", 0),
    ("cpu-2x4", "sharded", "during_peer_copy", 1),
    ("cpu-2x4", "replicated", "mid_step", 0),
    ("cpu-4x2", "sharded", "mid_step", 2),
    ("cpu-4x2", "sharded", "after_step", 3),
    ("cpu-4x2", "sharded", "during_peer_copy", 0),
]


REBUILT = []


@pytest.fixture(autouse=True)
def capture_rebuilt(monkeypatch):
    """Keeps a host copy of every state a recovery rebuilds (before any later step)."""
    from resilax._src.step.driver import ResilientStep
    orig = ResilientStep._do_recover
    REBUILT.clear()

    def recover(self):
        orig(self)
        REBUILT.append(flat(self._live))

    monkeypatch.setattr(ResilientStep, "_do_recover", recover)


@pytest.mark.parametrize("topo_name,kind,phase,target", CASES)
def test_slice_failure_recovers_bitwise_and_continues(topo_name, kind, phase, target):
    ref = reference(topo_name, kind)
    got, step = run(topo_name, kind, [f"fail_slice@3:{phase}/{target}"])
    (ev,) = [e for e in step.events if e.kind == "recovery"]
    f = ev.fields
    n = f["target_step"]
    assert n == (3 if phase in ("before_step", "after_step") else 4)
    assert f["failed_domains"] == [target]
    assert f["lost_steps"] == 0 and f["steps_recomputed"] == 0
    assert set(f["seconds"]) == {"detect", "plan", "restore", "compile", "replay"}
    if kind == "sharded":  # the dead slice's shards come from its ring copies on the next slice
        assert f["source"] == "peer" and f["bytes_moved"] > 0
    else:  # replicated across slices: the survivors' live state is the copy
        assert f["source"] == "live"
    # the rebuilt state is the reference's at that step, bit for bit
    (rebuilt,) = REBUILT
    assert bitwise(rebuilt, ref[n])
    if phase != "before_step":
        assert bitwise(got[n], ref[n])  # and it is what the failing call returned
    assert step.mesh.shape["data"] == resilax.Topology.load(topo_name).num_domains - 1
    assert step.step == STEPS
    for s in range(n + 1, STEPS + 1):
        close(got[s], ref[s], f"{topo_name}-{kind}-{phase}")
    assert f["microbatches"] == 1  # the global batch fits: the full mesh's maths on the smaller one


def test_compile_ahead_makes_recovery_skip_compiles():
    ref = reference("cpu-2x4", "sharded")
    got, step = run("cpu-2x4", "sharded", ["fail_slice@3:mid_step/0"], compile_ahead=True, wait_compiled=True)
    ahead = [e for e in step.events if e.kind == "compile_ahead"]
    assert ahead and ahead[0].fields["meshes"] == [{"data": 1, "fsdp": 4}] * 2 and ahead[0].fields["background"]
    (ev,) = [e for e in step.events if e.kind == "recovery"]
    assert ev.fields["compiled_ahead"] is True
    assert ev.fields["seconds"]["compile"] < 0.5 * ahead[0].fields["seconds"]
    assert bitwise(REBUILT[0], ref[4]) and bitwise(got[4], ref[4])
    for s in range(5, STEPS + 1):
        close(got[s], ref[s], "cpu-2x4-compile-ahead")


@pytest.mark.parametrize("fault,replayed,recomputed,restored", [
    ("fail_slice@5:before_step/1", 2, 0, 3),  # snapshot at 3, log 4 and 5 durable
    ("fail_slice@4:mid_step/2", 1, 1, 3),     # entry of the in-flight step 5 died with the slice
])
def test_copy_every_k_steps_replays_the_log_between_copies(fault, replayed, recomputed, restored):
    ref = reference("cpu-4x2", "sharded")
    got, step = run("cpu-4x2", "sharded", [fault], peer_every=3)
    (ev,) = [e for e in step.events if e.kind == "recovery"]
    f = ev.fields
    assert (f["steps_replayed"], f["steps_recomputed"], f["restored_step"]) == (replayed, recomputed, restored)
    assert f["source"] == "peer"
    (rebuilt,) = REBUILT
    if recomputed == 0:
        assert bitwise(rebuilt, ref[f["target_step"]])  # snapshot + logged update replay is exact
    for s in range(f["target_step"], STEPS + 1):
        close(got[s], ref[s], f"cpu-4x2-k3-{fault}")


def test_failure_while_a_checkpoint_is_being_written(tmp_path):
    ref = reference("cpu-2x4", "sharded")
    got, step = run("cpu-2x4", "sharded", ["fail_slice@3:during_save/0"],
                    checkpoint_dir=str(tmp_path), checkpoint_every=3)
    (ev,) = [e for e in step.events if e.kind == "recovery"]
    assert ev.fields["source"] == "peer" and ev.fields["target_step"] == 3
    assert bitwise(REBUILT[0], ref[3])
    assert step.checkpoints.steps()[-1] == 6  # saving continued on the smaller mesh
    for s in range(4, STEPS + 1):
        close(got[s], ref[s], "cpu-2x4-during_save")


def test_two_neighbouring_slices_lost_falls_back_to_checkpoint_and_recompute(tmp_path):
    ref = reference("cpu-4x2", "sharded")
    got, step = run("cpu-4x2", "sharded", ["fail_slice@5:after_step/1", "fail_slice@5:after_step/2"],
                    checkpoint_dir=str(tmp_path), checkpoint_every=2)
    (ev,) = [e for e in step.events if e.kind == "recovery"]
    f = ev.fields
    assert f["failed_domains"] == [1, 2] and f["source"] == "checkpoint"
    assert (f["restored_step"], f["steps_recomputed"], f["target_step"]) == (4, 1, 5)
    assert bitwise(got[4], ref[4])
    assert step.mesh.shape["data"] == 2
    for s in range(5, STEPS + 1):
        close(got[s], ref[s], "cpu-4x2-neighbours")


def test_neighbouring_slices_lost_without_checkpoint_names_the_lost_leaves():
    with pytest.raises(resilax.StateLostError,
                       match=r"state lost after failure of domain\(s\) \[2, 3\] at step 3: leaves \[.*params.*no checkpoints"):
        run("cpu-4x2", "sharded", ["fail_slice@2:mid_step/2", "fail_slice@2:mid_step/3"])


def test_replicated_state_survives_neighbours_without_checkpoint():
    ref = reference("cpu-4x2", "replicated")
    got, step = run("cpu-4x2", "replicated", ["fail_slice@2:mid_step/2", "fail_slice@2:mid_step/3"])
    assert bitwise(REBUILT[0], ref[3])
    close(got[STEPS], ref[STEPS], "cpu-4x2-replicated-neighbours")


def test_every_slice_lost_is_a_clear_error():
    faults = [f"fail_slice@2:after_step/{i}" for i in range(2)]
    with pytest.raises(resilax.StateLostError, match="every failure domain is lost"):
        run("cpu-2x4", "sharded", faults)


@pytest.fixture(scope="module", autouse=True)
def report_max_rel():
    yield
    if MAX_REL:
        print("\nmax elementwise relative difference vs failure-free reference (after continuing):")
        for k, v in sorted(MAX_REL.items()):
            print(f"  {k}: {v:.3e}")
        print(f"  overall: {max(MAX_REL.values()):.3e}")


def test_failure_before_the_first_step():
    ref = reference("cpu-4x2", "sharded")
    got, step = run("cpu-4x2", "sharded", ["fail_slice@0:before_step/3"])
    (ev,) = [e for e in step.events if e.kind == "recovery"]
    assert ev.fields["target_step"] == 0 and ev.fields["source"] == "peer"
    assert ev.fields["replicated_across_domains_now"]  # 64-row leaves no longer divide 3x2 devices
    for s in range(1, STEPS + 1):
        close(got[s], ref[s], "cpu-4x2-before-first-step")


def test_a_recovery_during_the_background_compile_builds_the_mesh_once(monkeypatch):
    """Compile-ahead runs on a background thread; a failure that comes first waits for the
    compile in flight (or builds the mesh itself if it had not started): never twice, and
    the run still matches the failure-free one."""
    from resilax._src.step import driver, program

    built = []
    init = program.Program.__init__

    def counting(self, spec, mesh, *, full_mesh):
        built.append(tuple(sorted(d.id for d in mesh.devices.flat)))
        init(self, spec, mesh, full_mesh=full_mesh)

    monkeypatch.setattr(driver.Program, "__init__", counting)
    ref = reference("cpu-2x4", "sharded")
    got, step = run("cpu-2x4", "sharded", ["fail_slice@1:after_step/1"], compile_ahead=True)
    (ev,) = [e for e in step.events if e.kind == "recovery"]
    survivors = tuple(sorted(d.id for d in step.mesh.devices.flat))
    assert built.count(survivors) == 1, built
    assert ev.fields["compiled_ahead"] in (True, False)
    for s in range(2, STEPS + 1):
        close(got[s], ref[s], "cpu-2x4-recovery-during-compile")


def test_packed_recorded_values_round_trip_and_each_device_reads_its_own_blocks():
    """`ring.local_pack` / `local_unpack` / `local_block` (how the recorded values cross from
    the grad part to the update part, and how a recovery reads a device log entry): on a 2x4
    mesh, leaves sharded on either axis, on both, on none, a scalar, three dtypes. The round
    trip is bitwise with each leaf's sharding, and every device's block of every leaf read
    back from its own packed buffer is that device's shard."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding

    from resilax._src.protect import ring as _ring

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("slice", "data"))
    rng = np.random.default_rng(0)
    vals = [(rng.normal(size=(8, 6)).astype(np.float32), P("slice")),
            (rng.normal(size=(4, 8)).astype(np.float32), P(None, "data")),
            (rng.normal(size=(8, 8)).astype(jnp.bfloat16), P("slice", "data")),
            (rng.normal(size=(3,)).astype(np.float32), P()),
            (np.int32(7), P())]
    shardings = [NamedSharding(mesh, s) for _, s in vals]
    xs = [jax.device_put(v, sh) for (v, _), sh in zip(vals, shardings)]
    # every leaf packed, then leaf 1 (as a large one would) left out and passed as it is
    for places, lengths in (([_ring.RING] * 5, [8 * 35, 8 * 8, 8 * 1]),
                            ([_ring.RING, None, _ring.RING, _ring.RING, _ring.RING], [8 * 27, 8 * 8, 8 * 1])):
        layout = _ring.ring_pack_layout([x.shape for x in xs], [x.dtype for x in xs], shardings, places, "slice")
        packed, others = jax.jit(lambda *a: _ring.local_pack(list(a), layout))(*xs)
        assert [str(b.dtype) for b in packed] == ["float32", "bfloat16", "int32"]
        # per device: 8*6/2 + 4*8/4 + 3 = 35 float32 (27 without leaf 1), 8*8/8 = 8 bfloat16, 1 int32
        assert [b.shape[0] for b in packed] == lengths and len(others) == places.count(None)
        back = jax.jit(lambda p: tuple(_ring.local_unpack(p, layout)), out_shardings=tuple(shardings))((packed, others))
        for (v, _), x, b in zip(vals, xs, back):
            assert b.sharding.is_equivalent_to(x.sharding, x.ndim) and b.dtype == x.dtype
            np.testing.assert_array_equal(np.asarray(b), np.asarray(v))
        bufs = [_ring.buffers(g) for g in packed]
        for i, x in enumerate(xs):
            if places[i] is None:
                continue
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(_ring.local_block(layout, bufs, i, shard.device), np.asarray(shard.data))
