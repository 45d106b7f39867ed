"""Placement, the ring copy, honest deletion, and elastic microbatch sizing."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import resilax
from resilax._src.step import elastic as _elastic
from resilax._src.protect import ring as _peers
from resilax.tools.example import ExampleSpec, make_state, train_step


def _mesh(name):
    topo = resilax.Topology.load(name)
    return topo, topo.mesh(topo.domains())


def test_placement_ring_only_where_the_elastic_axis_shards():
    _, mesh = _mesh("cpu-2x4")
    shs = {"rep": NamedSharding(mesh, P()), "fsdp": NamedSharding(mesh, P("fsdp")),
           "all": NamedSharding(mesh, P(("data", "fsdp"))), "data": NamedSharding(mesh, P(None, "data"))}
    assert _peers.placement(shs, "data") == {"rep": "replicated", "fsdp": "replicated", "all": "ring", "data": "ring"}


@pytest.mark.parametrize("name", ["cpu-2x4", "cpu-4x2"])
def test_ring_copy_is_held_by_the_next_domain_and_is_a_real_copy(name):
    topo, mesh = _mesh(name)
    sh = NamedSharding(mesh, P(("data", "fsdp")))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4), sh)
    ring = jax.jit(lambda a: _peers.ring_shift(a, sh, "data"))(x)
    src = {s.device: np.array(s.data) for s in x.addressable_shards}
    held = {s.device: s for s in ring.addressable_shards}
    domain_of = {d: i for i, dom in enumerate(topo.domains()) for d in dom}
    for dev, data in src.items():
        holder = _peers.ring_holder(mesh, dev, "data")
        assert domain_of[holder] == (domain_of[dev] + 1) % topo.num_domains
        np.testing.assert_array_equal(np.array(held[holder].data), data)
    # delete every source buffer of domain 0: its copy (held by domain 1) survives intact
    dom0 = set(topo.domains()[0])
    nbytes = x.nbytes
    bufs = _peers.buffers(x)
    freed = _peers.delete_on([bufs], dom0)
    assert freed == nbytes // topo.num_domains
    for dev in dom0:
        holder = _peers.ring_holder(mesh, dev, "data")
        assert holder not in dom0
        np.testing.assert_array_equal(np.array(held[holder].data), src[dev])
    assert all(b.is_deleted() == (dev in dom0) for dev, b in bufs.items())
    assert x.is_deleted()  # jax now refuses the whole array: recovery must read the buffer map


def test_one_failure_domain_warns_at_wrap_time():
    topo = resilax.Topology.emulated(slices=1, devices_per_slice=8)
    with pytest.warns(RuntimeWarning, match="one failure domain"):
        resilax.wrap(train_step, topology=topo)


def test_microbatch_count_keeps_per_device_batch_and_names_sizes_when_impossible():
    topo, _ = _mesh("cpu-4x2")
    doms = topo.domains()
    three = topo.mesh(doms[:3])
    two = topo.mesh(doms[:2])
    assert _elastic.microbatch_count(48, 4, three, 3) == 2   # 24 per microbatch, 8 per domain <= 12
    assert _elastic.microbatch_count(48, 4, two, 2) == 2
    assert _elastic.microbatch_count(96, 2, topo.mesh(doms[:1]), 1) == 2
    with pytest.raises(resilax.WrapError, match="global batch of 20 .* m >= 2 .* 3 devices"):
        _elastic.microbatch_count(20, 4, three, 3)


def test_accumulated_step_matches_full_step_within_reassociation():
    spec = ExampleSpec(hidden=64, batch=48)
    st = make_state(spec)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(48, spec.features)).astype(np.float32),
             "y": rng.integers(0, spec.classes, 48).astype(np.int32)}
    from resilax._src.step.split import Split

    split = Split(train_step, 0)
    full, _, rec_full = jax.jit(split.full)(st, batch, np.uint32(0))
    acc, _, rec_acc = jax.jit(_elastic.accumulate(split, 3))(st, _elastic.split_batch(batch, 3), np.uint32(0))
    for a, b in zip(jax.tree.leaves(rec_acc), jax.tree.leaves(rec_full)):
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 1e-5 * np.linalg.norm(np.asarray(b))
    # a recorded batch *sum* would be off by m: the contract (batch means) matters
    for a, b in zip(jax.tree.leaves(acc.params), jax.tree.leaves(full.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["cpu-2x4", "cpu-4x2"])
def test_packed_ring_copy_rebuilds_a_lost_domains_blocks(name):
    """The log's ring copy: many leaves (two dtypes) in one buffer per dtype, held by the
    next domain; a lost domain's blocks come back bit for bit from the holder's buffer."""
    topo, mesh = _mesh(name)
    shs = [NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P()),
           NamedSharding(mesh, P(None, "data")), NamedSharding(mesh, P(("data", "fsdp")))]
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32),
          rng.normal(size=(2, 8)).astype(np.float32), rng.integers(0, 9, (8,)).astype(np.int32)]
    places = [_peers.placement(s, "data") for s in shs]
    pack = _peers.ring_pack_layout([x.shape for x in xs], [x.dtype for x in xs], shs, places, "data")
    assert pack.groups == ("float32", "int32") and pack.slots[1] is None
    arrs = [jax.device_put(x, s) for x, s in zip(xs, shs)]
    packed = jax.jit(lambda a: _peers.ring_pack(a, pack))(arrs)
    groups = [_peers.buffers(p) for p in packed]
    dom0 = set(topo.domains()[0])
    _peers.delete_on(groups + [_peers.buffers(a) for a in arrs], dom0)
    for i, (x, sh) in enumerate(zip(xs, shs)):
        if pack.slots[i] is None:
            continue
        for dev, idx in sh.devices_indices_map(x.shape).items():
            if dev in dom0:
                np.testing.assert_array_equal(_peers.ring_block(pack, groups, i, dev), x[idx])
