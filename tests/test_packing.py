"""Packed checkpoints (experimental, `CheckpointStore.PACK`; docs/packed_checkpoints.md): the
leaves sharing a dtype and a sharding saved as one array, packed without communication, and
read back bitwise, onto the same mesh or another one; a wrong unpacking is caught by the
per-leaf checksums, never restored."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resilax._src.protect import checkpoints as ck
from resilax._src.protect import packing


def _bits(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


def _equal(a, b) -> bool:
    la, lb = _bits(a), _bits(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))
                                      for x, y in zip(la, lb))


def _state(mesh):
    r = np.random.default_rng(0)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {
        "w1": put(r.normal(size=(16, 3)).astype(np.float32), P("d")),  # sharded on dim 0
        "w2": put(r.normal(size=(8,)).astype(np.float32), P("d")),
        "b": put(r.normal(size=(5,)).astype(np.float32), P()),  # replicated
        "h": put(r.normal(size=(8, 4)).astype(jnp.bfloat16), P("d")),  # another dtype
        "cols": put(r.normal(size=(3, 8)).astype(np.float32), P(None, "d")),  # dim 1: saved alone
        "step": put(np.int32(7), P()),  # a scalar: alone
        "key": jax.device_put(jax.random.key(3), NamedSharding(mesh, P())),  # a typed key: alone
    }


def _abstract(tree, mesh=None, spec_of=None):
    def one(x):
        sh = x.sharding if mesh is None else NamedSharding(mesh, spec_of(x))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    return jax.tree.map(one, tree)


@pytest.fixture
def packed_store(tmp_path, monkeypatch):
    monkeypatch.setattr(ck.CheckpointStore, "PACK", True)
    store = ck.CheckpointStore(tmp_path / "ck", async_save=False)
    yield store
    store.close()


def test_a_packed_checkpoint_reads_back_bitwise_from_few_arrays(packed_store):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    st = _state(mesh)
    packed_store.save(4, st, {})
    man = packing.manifest(st)
    assert sorted(len(g["members"]) for g in man["groups"]) == [1, 1, 2], man  # f32 sharded, f32 replicated, bf16
    assert len(man["singles"]) == 3, man  # dim-1 sharded, the scalar, the key
    got = packed_store.restore_newest(_abstract(st))
    assert got is not None and got.step == 4 and got.meta["format"] == 2
    assert _equal(got.state, st)
    assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(st)))


def test_a_packed_checkpoint_restores_onto_another_mesh(packed_store):
    mesh8 = Mesh(np.array(jax.devices()), ("d",))
    st = _state(mesh8)
    packed_store.save(2, st, {})
    mesh4 = Mesh(np.array(jax.devices()[:4]), ("d",))  # four devices lost: an elastic restore
    target = _abstract(st, mesh4, lambda x: x.sharding.spec)
    got = packed_store.restore_newest(target)
    assert got is not None and _equal(got.state, st)
    assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(got.state))
    # the groups saved sharded over 8 are read spread over the four devices, not whole on each
    man = json.loads((packed_store.directory / "2" / "meta" / "metadata").read_text())["packing"]
    sharded = [a for a in packing.packed_abstract(target, man)["packed"].values() if a.shape[0] == 8]
    assert len(sharded) == 2 and all(a.sharding.shard_shape(a.shape)[0] == 2 for a in sharded), sharded


def test_a_packed_checkpoint_restores_onto_a_mesh_of_other_axes_without_reading_it_whole_per_device(packed_store):
    """A restore onto a 2 x 3 mesh (six of the eight devices; no axis size divides the
    saved rows' 8): each packed group is read with its rows or columns spread where some axis
    divides them (replicated only where none does), and the state comes back bitwise."""
    mesh8 = Mesh(np.array(jax.devices()), ("d",))
    st = _state(mesh8)
    packed_store.save(3, st, {})
    mesh6 = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("a", "b"))
    target = _abstract(st, mesh6, lambda x: P())
    got = packed_store.restore_newest(target)
    assert got is not None and _equal(got.state, st)
    man = json.loads((packed_store.directory / "3" / "meta" / "metadata").read_text())["packing"]
    specs = {tuple(a.shape): a.sharding.spec for a in packing.packed_abstract(target, man)["packed"].values()}
    assert any(any(e is not None for e in spec) for spec in specs.values()), specs


def test_the_pack_program_moves_no_data_between_devices():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    st = _state(mesh)
    text = "".join(p.as_text() for p in packing.pack_program(st)[1])
    for op in ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter"):
        assert op not in text, op


def test_a_wrong_unpacking_is_a_checksum_mismatch_not_a_restored_state(packed_store, tmp_path):
    """Two same-sized members of a group swapped in the manifest: the unpacked state is
    wrong, its checksums do not match the saved ones, and the checkpoint is quarantined."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    st = _state(mesh)
    st["w3"] = jax.device_put(np.arange(8, dtype=np.float32) + 100, NamedSharding(mesh, P("d")))  # w2's size
    packed_store.save(6, st, {})
    meta_files = list((tmp_path / "ck" / "6" / "meta").glob("*"))
    path = next(p for p in meta_files if p.is_file() and p.suffix in ("", ".json") and "packing" in p.read_text())
    meta = json.loads(path.read_text())
    members = next(g["members"] for g in meta["packing"]["groups"] if len(g["members"]) == 3)  # w1, w2, w3
    i, j = [k for k, (_, cols) in enumerate(members) if cols == 1]  # w2 and w3: one column each per row
    members[i][0], members[j][0] = members[j][0], members[i][0]
    path.write_text(json.dumps(meta))
    with pytest.raises(ck.CorruptCheckpointError, match="checksum mismatch"):
        packed_store.restore_newest(_abstract(st))
    assert (tmp_path / "ck" / ck.QUARANTINE).exists()


def test_a_packed_save_writes_its_arrays_in_bounded_chunks(packed_store, monkeypatch):
    """One storage chunk per packed array would be compressed and written by one thread (on
    an H100 host a 1.3 GB state committed in 4-7 s packed, 2 s per leaf): a packed array's
    chunks are at most `packing.CHUNK_BYTES`, and it reads back bitwise."""
    monkeypatch.setattr(packing, "CHUNK_BYTES", 256)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    st = {"w": jax.device_put(np.arange(4096, dtype=np.float32).reshape(512, 8), NamedSharding(mesh, P("d")))}
    packed_store.save(1, st, {})
    packed_store.wait()
    got = packed_store.restore_newest(_abstract(st)).state
    assert _equal(got, st)
    import orbax.checkpoint as ocp  # the chunks, as Orbax's metadata records them

    md = ocp.StandardCheckpointHandler().metadata(packed_store.directory / "1" / "state")
    chunks = [m.storage.chunk_shape for m in jax.tree.leaves(md.tree if hasattr(md, "tree") else md,
                                                             is_leaf=lambda x: hasattr(x, "storage"))]
    assert len(chunks) == 1 and int(np.prod(chunks[0])) * 4 == 256, chunks  # the (8, 512) group in 256-byte chunks


def test_a_warmed_packed_save_compiles_nothing(tmp_path, monkeypatch):
    """Every program a packed save needs is compiled by the warm-up (issue 26: on an H100 the
    first packed save compiled its pack program on the persister): the pack programs and,
    where Orbax slices replicated shards (as on a TPU: here by declaring the devices not
    CPU), the slices of the single leaves (the packed groups reach Orbax on the host). The
    first save after `warm` compiles nothing."""
    import logging

    from resilax._src.protect import orbax_warm

    monkeypatch.setattr(ck.CheckpointStore, "PACK", True)
    monkeypatch.setattr(orbax_warm, "cpu_only", lambda: False)
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("r", "d"))
    st = _state(mesh)
    msgs = []

    class Grab(logging.Handler):
        def emit(self, r):
            msgs.append(r.getMessage())

    store = ck.CheckpointStore(tmp_path / "ck")
    h = Grab()
    logging.getLogger().addHandler(h)
    try:
        store.warm(st)
        store._join_warming()
        assert store._packers._progs and orbax_warm.plan(st, store._array_handler)  # there are slices to cut
        jax.config.update("jax_log_compiles", True)
        try:
            store.save(1, st, {})
            store.wait()
        finally:
            jax.config.update("jax_log_compiles", False)
        assert not [m for m in msgs if m.startswith("Compiling")], [m[:120] for m in msgs if m.startswith("Compiling")]
        assert _equal(store.restore_newest(_abstract(st)).state, st)
    finally:
        logging.getLogger().removeHandler(h)
        store.close()


@pytest.mark.parametrize("pack", [True, False])
def test_checkpoint_config_pack_chooses_the_layout_over_the_default(tmp_path, monkeypatch, pack):
    """`CheckpointConfig.pack` reaches the store and wins over the process-wide default
    (`CheckpointStore.PACK`, from ``RESILAX_PACK_CHECKPOINTS``): the checkpoint is written in
    the layout it names, and a run resumed from it (with the other setting: a restore reads
    either layout) ends bitwise on an uninterrupted run."""
    import resilax
    from resilax.tools import example as ex

    from helpers import SMALL, state_equal

    monkeypatch.setattr(ck.CheckpointStore, "PACK", not pack)
    topo = resilax.Topology.emulated(2, 4)
    template = ex.make_state(SMALL)

    def run(steps, directory, pack):
        data = ex.make_iterator(SMALL)
        cfg = resilax.Config(checkpoint=resilax.CheckpointConfig(str(directory), every=2, pack=pack))
        with resilax.wrap(ex.train_step, topology=topo, state_sharding=ex.fsdp_specs(template, "fsdp", 4),
                          config=cfg) as step:
            s = step.init(template, data=data)
            for _ in range(steps - int(s.step)):
                s, _ = step(s, next(data))
            step.checkpoints.wait()
            return jax.device_get(s)

    run(4, tmp_path / "a", pack)
    meta = json.loads((tmp_path / "a" / "4" / "meta" / "metadata").read_text())  # (Orbax's JSON item)
    assert meta["format"] == (packing.FORMAT if pack else ck.FORMAT), meta
    resumed = run(6, tmp_path / "a", not pack)  # resumes from step 4's checkpoint, in the other layout
    assert state_equal(resumed, run(6, tmp_path / "b", pack))
    with pytest.raises(resilax.ConfigError, match="pack must be bool or None"):
        resilax.CheckpointConfig(str(tmp_path), pack=1)


def test_the_pinned_host_pool_is_grown_ahead_by_the_bytes_a_save_copies_per_device():
    """On a GPU Orbax copies a save to pinned host memory, whose first allocation is slow and
    synchronizes the device (the H100's first save stalled the loop 1.2-1.8 s, later ones
    not); the store's warm-up allocates, per device, the bytes a save copies there and frees
    them (the pool keeps them). The bytes: each leaf's replica-0 shards, a replicated leaf
    once; the allocation runs here on the CPU's own pinned_host memory kind (the pool's
    effect on a GPU is not measurable here), and not at all where the platform is not one
    the warm-up is for (the default: GPU only)."""
    from resilax._src.protect import orbax_warm

    mesh = Mesh(np.array(jax.devices()), ("d",))
    st = {"w": jax.device_put(np.zeros((16, 4), np.float32), NamedSharding(mesh, P("d"))),  # 32 bytes per device
          "b": jax.device_put(np.zeros((6,), np.float32), NamedSharding(mesh, P())),  # 24 bytes, once
          "key": jax.device_put(jax.random.key(0), NamedSharding(mesh, P()))}  # Orbax saves its data separately
    got = orbax_warm.pinned_bytes(_abstract(st))
    devs = jax.devices()
    assert sum(got.values()) == 16 * 4 * 4 + 6 * 4 and all(got[d] >= 32 for d in devs), got
    assert sorted(got.values()) == [32] * 7 + [56], got  # the replicated leaf on one device
    assert orbax_warm.warm_pinned(_abstract(st)) == {}  # not a GPU: nothing allocated
    assert orbax_warm.warm_pinned(_abstract(st), on=False, platforms=("cpu",)) == {}
    assert orbax_warm.warm_pinned(_abstract(st), platforms=("cpu",)) == got  # allocated and freed, per device


def test_a_packed_save_holds_one_group_at_a_time_on_the_devices(packed_store, monkeypatch):
    """Packing copies the state on the device; a save must not hold a whole extra copy there
    (the per-leaf save with the keep-input update holds none). The leaves of a key are cut
    into groups of at most `PIECE_BYTES` per device, and each group is packed, copied to
    host and freed before the next is packed: at each group's copy, it is the only packed
    group alive on the devices. The checkpoint reads back bitwise."""
    monkeypatch.setattr(packing, "PIECE_BYTES", 64 * 4)  # 64 float32 per device per group
    mesh = Mesh(np.array(jax.devices()), ("d",))
    r = np.random.default_rng(1)
    st = {f"w{k}": jax.device_put(r.normal(size=(8, 32)).astype(np.float32), NamedSharding(mesh, P("d")))
          for k in range(6)}  # 32 floats per device each: 2 per group, 3 groups
    man = packing.manifest(st)
    assert [len(g["members"]) for g in man["groups"]] == [2, 2, 2], man
    seen = []  # at each group's copy to host: the packed groups alive on the devices
    real = packing._to_host
    # what other tests of this worker process left alive (held here, so that no array made
    # by the save reuses one's id): a state's (8, 64) float32 leaf looked like a packed group
    before = list(jax.live_arrays())
    old = {id(b) for b in before}

    def spy(x):
        # (packed groups are the only (8, 64) float32 arrays the save makes; counting them,
        # not every live buffer, keeps what other tests left behind out of the count)
        seen.append([b for b in jax.live_arrays() if id(b) not in old and not b.is_deleted()
                     and b.shape == (8, 64) and b.dtype == np.float32
                     and b.sharding.memory_kind in (None, "device")])
        return real(x)

    monkeypatch.setattr(packing, "_to_host", spy)
    packed_store.save(2, st, {}, copy=False)  # (the driver's save once the next step keeps its input: no snapshot)
    packed_store.wait()
    assert len(seen) == 3 and all(len(live) == 1 for live in seen), seen  # one group at a time, the others freed
    assert all(live[0].nbytes == 8 * 64 * 4 for live in seen)  # 8 rows x 64 float32: a third of the packed state
    assert _equal(packed_store.restore_newest(_abstract(st)).state, st)
