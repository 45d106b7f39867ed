"""Silent data corruption (`HealthConfig`, fault `bitflip@N/k`): replicas of the state across
failure domains are compared before each step uses them; an outvoted domain is named,
treated as failed, and the run goes on from the good replicas (bitwise in the bit-exact
mode); two replicas that disagree, or a corruption found late, raise a clear error."""

import pytest

import resilax
from resilax.tools.models import CASES, tree_rel_diff
from test_pipeline import TOL, host, replicated, run, sharded

H = resilax.HealthConfig()


def _run(faults=(), topo=(4, 2), det=True, layout=sharded, health=H, steps=6):
    cfg = resilax.Config(deterministic=resilax.DeterministicConfig() if det else None, health=health)
    return run("batchnorm_mlp", faults, topo=resilax.Topology.emulated(*topo), config=cfg, steps=steps, layout=layout)


@pytest.mark.parametrize("det,layout,tol", [(True, sharded, 0.0), (False, replicated, TOL)],
                         ids=["deterministic", "default-replicated"])
def test_bitflip_is_found_before_use_and_the_bad_domain_is_named_and_dropped(det, layout, tol):
    ref, *_ = _run(det=det, layout=layout)
    got, step, _, _ = _run(["bitflip@3/2"], det=det, layout=layout)
    flip = next(e for e in step.events if e.kind == "bitflip")
    sdc = next(e for e in step.events if e.kind == "sdc")
    assert sdc.step == flip.step == 3, "found at the start of the next step, before it used the state"
    assert sdc.fields["bad_domains"] == [2] and sdc.fields["leaves"] == [flip.fields["leaf"]]
    rec = next(e for e in step.events if e.kind == "recovery")
    assert rec.fields["failed_domains"] == [2] and rec.fields["mesh"]["data"] == 3
    assert tree_rel_diff(got, ref) <= tol


def test_without_the_check_the_flip_silently_changes_the_result():
    """The control: the same flip with no health check trains on and ends elsewhere."""
    ref, *_ = _run(health=None)
    got, step, _, _ = _run(["bitflip@3/2"], health=None)
    assert not [e for e in step.events if e.kind in ("sdc", "recovery")]
    assert tree_rel_diff(got, ref) > 0.0  # the bit-exact mode: any difference is the flip's doing


def test_two_replicas_or_a_late_check_raise_naming_the_leaf():
    with pytest.raises(resilax.SilentDataCorruptionError, match=r"domains \[0, 1\] differ in leaves .*no majority"):
        _run(["bitflip@3/1"], topo=(2, 4))
    with pytest.raises(resilax.SilentDataCorruptionError, match=r"domain\(s\) \[2\] disagree.*last checked equal at step 2"):
        _run(["bitflip@3/2"], health=resilax.HealthConfig(sdc_every=2), steps=6)  # found at 4: step 3 used it


def test_a_corrupted_replica_is_never_checkpointed(tmp_path):
    """The flip lands right before a save (after_step of a save step): the check before the
    save finds it, the domain is dropped, and the checkpoint holds the good values."""
    cfg = resilax.Config(deterministic=resilax.DeterministicConfig(), health=H,
                         checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=4))
    ref, *_ = _run(steps=4)
    got, step, _, _ = run("batchnorm_mlp", ["bitflip@4:after_step/1"], topo=resilax.Topology.emulated(4, 2),
                          config=cfg, steps=4, layout=sharded)
    assert [(e.step, e.fields["bad_domains"]) for e in step.events if e.kind == "sdc"] == [(4, [1])]
    assert tree_rel_diff(got, ref) == 0.0
    case = CASES["batchnorm_mlp"]  # what the checkpoint holds, read back by a new run
    st = case.make_state(0)
    again = resilax.wrap(case.train_step, topology=resilax.Topology.emulated(4, 2), rng=True, config=cfg,
                         state_sharding=sharded(st))
    restored = again.init(st)
    assert again.step == 4 and tree_rel_diff(host(restored), ref) == 0.0
    again.close()


@pytest.mark.parametrize("target", [0, 1])
def test_two_replicas_are_told_apart_by_rebuilding_the_step(tmp_path, target):
    """With two replicas there is no majority: the step is rebuilt from the newest checkpoint
    (4) and the record log (steps 4, 5), the replica that matches it is kept, the other
    failed, and the run ends bitwise equal to the failure-free one."""
    ref, *_ = _run(topo=(2, 4), steps=8)
    cfg = resilax.Config(deterministic=resilax.DeterministicConfig(), health=H,
                         checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=4))
    got, step, _, _ = run("batchnorm_mlp", [f"bitflip@6/{target}"], topo=resilax.Topology.emulated(2, 4),
                          config=cfg, steps=8, layout=sharded)
    (sdc,) = [e for e in step.events if e.kind == "sdc"]
    assert sdc.step == 6 and sdc.fields["bad_domains"] == [target] and sdc.fields["decided_by"] == "rebuilt"
    (rebuilt,) = [e for e in step.events if e.kind == "rebuilt"]
    assert rebuilt.fields["restored_step"] == 4 and rebuilt.fields["steps_redone"] == 2
    assert tree_rel_diff(got, ref) == 0.0


@pytest.mark.parametrize("topo,target,named", [((4, 2), 2, [2]), ((2, 4), 1, [])], ids=["4-domains", "2-domains"])
def test_a_late_find_goes_on_from_the_rebuilt_state(tmp_path, topo, target, named):
    """Checked every 3 steps (and at the save at 4): the flip after step 5 feeds the next step
    on every replica before the check at 6 finds it. No replica is right any more; the step is
    rebuilt from the checkpoint (4) and the record log (step 4 from the log, step 5 recomputed
    from its batch), the run goes on from that, bitwise the failure-free run, and the log's
    entries after 4 are quarantined. A strict majority still names the flipped domain; two
    replicas cannot (both are kept)."""
    ref, *_ = _run(topo=topo, steps=8)
    cfg = resilax.Config(deterministic=resilax.DeterministicConfig(), health=resilax.HealthConfig(sdc_every=3),
                         checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=4))
    with pytest.warns(RuntimeWarning, match="recorded from corrupted replicas after step 4"):
        got, step, _, _ = run("batchnorm_mlp", [f"bitflip@5/{target}"], topo=resilax.Topology.emulated(*topo),
                              config=cfg, steps=8, layout=sharded)
    (sdc,) = [e for e in step.events if e.kind == "sdc"]
    assert sdc.step == 6 and sdc.fields["decided_by"] == "rebuilt_adopted" and sdc.fields["bad_domains"] == named
    (rebuilt,) = [e for e in step.events if e.kind == "rebuilt"]
    assert rebuilt.fields["restored_step"] == 4 and rebuilt.fields["steps_redone"] == 2
    assert [e.fields["failed_domains"] for e in step.events if e.kind == "recovery"] == ([named] if named else [])
    assert tree_rel_diff(got, ref) == 0.0


def test_auto_cadence_is_measured_and_a_find_within_it_is_recovered(tmp_path):
    """``sdc_every="auto"``: every step while the check and the step are timed, then the cadence
    the budget allows (the rule applied to its own samples); a flip after that is found at the
    next due check and the run ends bitwise on the failure-free trajectory. Without a checkpoint
    to rebuild from (none configured, or none committed yet), it checks every step."""
    H4 = resilax.HealthConfig(sdc_budget=0.001, sdc_max_every=4)
    ref, *_ = _run(steps=22)
    cfg = resilax.Config(deterministic=resilax.DeterministicConfig(), health=H4,
                         checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=8))
    got, step, _, _ = run("batchnorm_mlp", ["bitflip@17/1"], topo=resilax.Topology.emulated(4, 2), config=cfg,
                          steps=22, layout=sharded)
    (cad,) = [e for e in step.events if e.kind == "sdc_cadence"]
    f = cad.fields
    assert f["every"] == min(4, max(1, -(-f["check_s"] // (0.001 * f["step_s"])))) == 4 and f["samples"] >= 8
    assert cad.step < 17, "calibrated before the flip"
    (sdc,) = [e for e in step.events if e.kind == "sdc"]
    assert sdc.step - 17 in range(0, 4) and (sdc.step - cad.step) % 4 == 0 and sdc.fields["bad_domains"] == [1]
    assert tree_rel_diff(got, ref) == 0.0
    _, plain, _, _ = _run(health=H4, steps=3)
    assert plain._sdc.report()["phase"] == "fixed" and plain._sdc.every == 1 and plain._sdc.seconds.count == 3


def _host_checksum(x):
    """The checksum's definition on the host: words of the raveled leaf, flat positions."""
    import numpy as np

    x = np.asarray(x)
    w = (x.astype(np.uint32) if x.dtype == bool else
         x.view({8: np.uint32, 4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize]).astype(np.uint32)).ravel()
    i = np.arange(w.size, dtype=np.uint32)
    h = w ^ (i * np.uint32(0x9E3779B9))
    h ^= h >> 16
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> 16
    return [int(np.sum(w * (2 * i + 1), dtype=np.uint32)), int(np.sum(h, dtype=np.uint32))]


def test_checksums_of_sharded_leaves_follow_their_definition():
    """Summed where each shard lies (no ravel), but the same numbers as the raveled definition,
    for 4-, 2- and 1-byte words and bools, sharded or not (a change here would break reading old record logs)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from resilax._src.protect.checksum import replica_sums, tree_checksums

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    r = np.random.default_rng(0)
    leaves = [(r.standard_normal((6, 4)).astype(np.float32), P("a", "b")),
              (r.standard_normal((4, 6)).astype(np.float16), P(None, "b")),
              (np.arange(10, dtype=np.int32) * 7919, P("b")), (r.random((3, 2, 2)) > 0.5, P()),
              (np.arange(8, dtype=np.int8), P("a")), (np.float32(3.5), P())]
    tree = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in leaves]
    got = np.asarray(tree_checksums(tree)).tolist()
    assert got == [_host_checksum(np.asarray(x)) for x in tree]  # (int64 is int32 without jax_enable_x64)
    # the replica check's sums are the first lane, and any one flipped bit changes them
    assert np.asarray(jax.jit(replica_sums)(tree)).tolist() == [[g[0]] for g in got]
    flipped = np.asarray(tree[0]).copy().view(np.uint32)
    flipped[5, 3] ^= np.uint32(1 << 31)
    one = jax.device_put(flipped.view(np.float32), tree[0].sharding)
    assert int(np.asarray(jax.jit(replica_sums)([one]))[0, 0]) != got[0][0]


def test_a_replica_check_program_is_never_reused_for_another_mesh_under_a_dead_ones_id():
    """The replica check compiles one executable per program, cached by ``id(prog)``: when a
    program dies (a mesh shrank or grew) CPython may give its id to the next one, which must
    not get the dead one's executable, compiled for another mesh (a campaign trial once failed
    after a rejoin with 'safe_zip() argument 1 has length 8 but argument 0 has length 5')."""
    import gc
    import weakref

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from resilax._src.protect.sdc import SdcCheck

    class Prog:  # what `_fn` reads of a program: its mesh
        def __init__(self, devices):
            self.mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("slice", "fsdp"))

    check = SdcCheck(resilax.HealthConfig())
    old = Prog(jax.devices()[:5])
    stale = check._fn(old, [0], [jax.device_put(np.ones(4, np.float32), NamedSharding(old.mesh, P()))])
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None
    new = Prog(jax.devices()[:8])
    check._fns[(id(new), (0,))] = (gone, stale)  # what a reused id finds in the cache
    x = jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(new.mesh, P()))
    sums = np.asarray(check._fn(new, [0], [x])([x]))
    assert check._fns[(id(new), (0,))][0]() is new and sums.shape[0] == 8 and len(set(sums.reshape(8, -1)[:, 0])) == 1
