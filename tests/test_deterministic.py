"""The bit-exact elastic mode (`resilax.DeterministicConfig`): a run that loses failure
domains ends bitwise where the failure-free run of the same config ends, on 2x4 and 4x2,
for dropout, BatchNorm, a token-weighted loss and a transformer."""

import jax
import numpy as np
import pytest

import resilax
from resilax.tools.models import CASES, tree_rel_diff
from test_pipeline import host, run, sharded

DET = resilax.Config(deterministic=resilax.DeterministicConfig())


def _run(name, faults=(), topo=(2, 4), config=DET, steps=6, **kw):
    return run(name, faults, topo=resilax.Topology.emulated(*topo), config=config, steps=steps, **kw)


@pytest.mark.verify  # it checks the bit-exact mode's first step passes the cross-check
@pytest.mark.parametrize("name,topo,faults", [
    ("transformer_lm", (2, 4), ["fail_slice@2:mid_step/1"]),
    ("dropout_mlp", (2, 4), ["fail_slice@3:before_step/0"]),
    ("batchnorm_mlp", (4, 2), ["fail_slice@1:mid_step/2", "fail_slice@3:after_step/0"]),
    ("token_lm", (4, 2), ["fail_slice@2:during_peer_copy/3"]),
])
def test_bitwise_equal_to_failure_free_across_shrinks(name, topo, faults):
    cfg = resilax.Config(deterministic=resilax.DeterministicConfig())  # (made here: with the cross-check)
    ref, ref_step, _, ref_mets = _run(name, topo=topo, config=cfg)
    got, step, _, mets = _run(name, faults, topo=topo, config=cfg)
    evs = [e for e in step.events if e.kind == "recovery"]
    assert len(evs) == len(faults)
    assert evs[-1].fields["mesh"]["data"] == topo[0] - len(faults)
    assert all(e.fields["lost_steps"] == 0 for e in evs)
    assert tree_rel_diff(got, ref) == 0.0, "bitwise, not merely close"
    for a, b in zip(mets, ref_mets):  # metrics too (the token count is a declared sum)
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    checks = [e.fields for e in ref_step.events if e.kind == "crosscheck"]
    assert checks and checks[0]["checked"] and checks[0]["differing"] == []


@pytest.mark.parametrize("name", ["batchnorm_mlp", "token_lm"])
def test_recorded_values_cross_packed_between_domains_and_the_bits_are_those_of_per_leaf_transfers(name, monkeypatch):
    """One process: each replica's recorded values reach every domain packed, one buffer per
    dtype (`DeterministicProgram.xfer`), unpacked inside each domain's combine. Pure data
    movement: a run that shrinks from 2 domains to 1 ends bitwise where the same run with
    one transfer per leaf ends, metrics included; the cross-check reads replica 0's values
    unpacked and passes."""
    from resilax._src.step import deterministic as det

    cfg = resilax.Config(deterministic=resilax.DeterministicConfig(),
                         verify=resilax.VerifyConfig())  # the cross-check reads `last_replica0`
    got, step, _, mets = _run(name, ["fail_slice@3:after_step/1"], config=cfg)
    assert step._program.xfer and len(step._program.doms) == 1  # packed on the mesh it ended on
    checks = [e.fields for e in step.events if e.kind == "crosscheck"]
    assert checks and checks[0]["checked"] and checks[0]["differing"] == []
    monkeypatch.setattr(det.DeterministicProgram, "packs_transfer", False)
    ref, ref_step, _, ref_mets = _run(name, ["fail_slice@3:after_step/1"], config=cfg)
    assert not ref_step._program.xfer
    assert tree_rel_diff(got, ref) == 0.0
    for a, b in zip(mets, ref_mets):
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_more_replicas_than_domains_and_the_default_mode_differs():
    """4 virtual replicas on 2 domains (2 each), then on 1 (all 4): still bitwise. The
    default mode on the same run is not (reduction order), which is why the mode exists."""
    cfg = resilax.Config(deterministic=resilax.DeterministicConfig(replicas=4))
    ref, *_ = _run("dropout_mlp", config=cfg)
    got, *_ = _run("dropout_mlp", ["fail_slice@2:mid_step/1"], config=cfg)
    assert tree_rel_diff(got, ref) == 0.0
    two, *_ = _run("dropout_mlp", config=resilax.Config(deterministic=resilax.DeterministicConfig(replicas=2)))
    assert tree_rel_diff(two, ref) > 0.0, "another number of replicas is another (documented) trajectory"


def test_state_is_replicated_across_domains_and_no_peer_copies_are_made():
    case = CASES["dropout_mlp"]
    st = case.make_state(0)
    step = resilax.wrap(case.train_step, topology=resilax.Topology.emulated(2, 4), state_sharding=sharded(st),
                        rng=True, config=DET)
    state = step.init(st)
    for leaf in jax.tree.leaves(state):
        assert "data" not in str(leaf.sharding.spec), leaf.sharding
    state, _ = step(state, case.make_batches(1)[0])
    assert not step._program.protects and step._program.deterministic
    step.close()


def test_replicas_must_divide_the_batch():
    with pytest.raises(resilax.WrapError, match="replicas=3 must divide the global batch"):
        _run("dropout_mlp", config=resilax.Config(deterministic=resilax.DeterministicConfig(replicas=3)), steps=1)
    with pytest.raises(resilax.ConfigError, match="replicas must be >= 1"):
        resilax.DeterministicConfig(replicas=0)
    cfg = resilax.Config.from_configdict({"deterministic": {"replicas": 4}})
    assert cfg.deterministic == resilax.DeterministicConfig(4)


def test_checkpoint_restore_and_log_replay_on_a_smaller_mesh_are_bitwise(tmp_path, monkeypatch):
    """A domain is lost, then the process 'dies' (no close); a new run restores the newest
    checkpoint onto the full mesh and replays the disk log: bitwise the failure-free run.
    The first run's checkpoints are labelled as written under `jax.distributed` (what
    `resilax launch` gives; on CPU its gloo collectives sum a 4-device domain in another
    order): the resume says so, and still goes on (here the bits are the same: it is one
    process both times)."""
    from resilax._src.protect import checkpoints as _ck

    assert _ck.collectives() == "cpu:local"
    monkeypatch.setattr(_ck, "collectives", lambda: "cpu:distributed")
    name = "batchnorm_mlp"
    case = CASES[name]
    ref, *_ = _run(name, steps=8)
    cfg = DET.replace(checkpoint=resilax.CheckpointConfig(str(tmp_path / "ck"), every=3))
    st = case.make_state(0)
    first = resilax.wrap(case.train_step, topology=resilax.Topology.emulated(2, 4), rng=True, config=cfg,
                         state_sharding=sharded(st), faults=resilax.FaultPlan(["fail_slice@2:mid_step/1"]))
    state = first.init(st)
    batches = case.make_batches(8)
    for b in batches[:5]:
        state, _ = first(state, b)
    first.checkpoints.wait()
    first._log.disk.wait()  # the process "dies" here
    monkeypatch.undo()
    st2 = case.make_state(0)
    second = resilax.wrap(case.train_step, topology=resilax.Topology.emulated(2, 4), rng=True, config=cfg,
                          state_sharding=sharded(st2))
    with pytest.warns(RuntimeWarning, match="written with cpu:distributed collectives and this run has cpu:local"):
        state = second.init(st2)
    assert [e.fields["written"] for e in second.events if e.kind == "collectives_changed"] == ["cpu:distributed"]
    assert second.step == 5 and [e for e in second.events if e.kind == "replay"][0].fields["steps"] == 2
    for b in batches[5:]:
        state, _ = second(state, b)
    second.close()
    assert tree_rel_diff(host(state), ref) == 0.0


def test_with_a_cache_one_domain_is_built_before_the_others_load_its_executables():
    """`build_all`: with a persistent compilation cache the first domain's programs are built
    before the other domains' (the same programs on other devices, which a cache key without
    the device assignment then loads instead of compiling); without a cache all run at once."""
    import os
    import threading
    import time

    from resilax._src.step.deterministic import build_all

    def run(cache_dir):
        spans, lock = {}, threading.Lock()

        def builder(i):
            def b():
                t0 = time.perf_counter()
                time.sleep(0.05)
                with lock:
                    spans[i] = (t0, time.perf_counter())
            return b

        old = jax.config.jax_compilation_cache_dir
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        try:
            build_all([builder(i) for i in range(4)], first=1)
        finally:
            jax.config.update("jax_compilation_cache_dir", old)
        return spans

    spans = run(jax.config.jax_compilation_cache_dir or "/tmp/unused-cache")
    assert sorted(spans) == list(range(4))
    assert spans[0][1] <= min(spans[i][0] for i in range(1, 4))
    spans = run(None)
    assert sorted(spans) == list(range(4))
    if (os.cpu_count() or 1) > 1:  # all at once: another domain starts before the first ends
        assert spans[1][0] < spans[0][1]
