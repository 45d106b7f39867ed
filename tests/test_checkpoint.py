"""Persistent tier in one process: save, restore with data position, corruption fallback."""

import os
import pathlib

import jax
import numpy as np
import pytest

import resilax
from resilax.tools import example as ex
from helpers import SMALL, default_codegen_env, state_equal

TOPO = resilax.Topology.emulated(2, 4)


def run(ckpt_dir, steps, *, every=5, keep=3, data=None, state=None):
    """Trains to `steps` completed steps (resuming from ckpt_dir); returns (state, step, iterator)."""
    template = ex.make_state(SMALL)
    data = data if data is not None else ex.make_iterator(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=ex.fsdp_specs(template, "fsdp", 4),
                        config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(ckpt_dir), every=every, keep=keep)))
    with step:
        s = step.init(template, data=data)
        while step.step < steps:
            s, _ = step(s, next(data))
    return jax.device_get(s), step, data


@pytest.fixture(params=[False, True], ids=["per_leaf", "packed"])
def pack(request, monkeypatch):
    """Both checkpoint layouts: packed (the default; `CheckpointStore.PACK`, `test_packing.py`)
    and Orbax's one array per leaf."""
    from resilax._src.protect.checkpoints import CheckpointStore

    monkeypatch.setattr(CheckpointStore, "PACK", request.param)
    return request.param


def test_restore_continues_bitwise_with_data_position(tmp_path, pack):
    ref, _, _ = run(tmp_path / "ref", 20)
    run(tmp_path / "a", 10)                      # stops after saving step 10
    s, step, data = run(tmp_path / "a", 20)      # a new process would do exactly this
    assert step.events[0].kind == "restore" and step.events[0].step == 10
    assert state_equal(s, ref)
    import json  # the layout asked for is the one written
    metas = [json.loads(p.read_text()) for p in (tmp_path / "a" / "20" / "meta").rglob("*")
             if p.is_file() and p.read_text().startswith("{")]
    assert [m.get("format") for m in metas] == [2 if pack else 1], metas
    # the data position was restored: the next batch is batch 21 of a fresh iterator
    fresh = ex.make_iterator(SMALL)
    for _ in range(20):
        next(fresh)
    assert np.array_equal(next(data)["x"], next(fresh)["x"])


def test_keeps_n_and_commits(tmp_path):
    _, step, _ = run(tmp_path, 30, every=5, keep=2)
    assert step.checkpoints.steps() == [25, 30]
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]


def _newest_state_files(d: pathlib.Path, step: int):
    files = [p for p in (d / str(step) / "state").rglob("*") if p.is_file() and p.stat().st_size > 64]
    assert files, "checkpoint has data files"
    return files


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_newest_falls_back_with_warning(tmp_path, damage, pack):
    ref10, _, _ = run(tmp_path / "ref", 10)
    ref15, _, _ = run(tmp_path / "ref", 15)
    run(tmp_path / "c", 15)
    # Orbax's OCDBT store keeps some superseded nodes that a restore never reads, so damage
    # every data file: whatever the restore does read is then damaged.
    for victim in _newest_state_files(tmp_path / "c", 15):
        raw = bytearray(victim.read_bytes())
        if damage == "flip":
            for i in range(len(raw) // 2, len(raw) // 2 + 16):
                raw[i] ^= 0xFF
        else:
            raw = raw[: len(raw) // 3]
        victim.write_bytes(bytes(raw))
    template = ex.make_state(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=ex.fsdp_specs(template, "fsdp", 4),
                        config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path / "c"), every=5)))
    with pytest.warns(RuntimeWarning, match=r"checkpoint\(s\) \[15\].*failed verification.*restored the previous good checkpoint 10"):
        s = step.init(template, data=ex.make_iterator(SMALL))
    # checkpoint 10 is restored, then the record log (on by default, next to the
    # checkpoints) replays steps 10..14 bitwise (its inputs entries rerun the steps from the
    # data iterator, which the grads budget leaves most steps with): nothing is lost
    assert step.events[0].kind == "restore" and step.events[0].step == 10
    assert step.step == 15
    assert state_equal(jax.device_get(s), ref15)
    q = list((tmp_path / "c" / "quarantine").iterdir())
    assert len(q) == 1 and q[0].name.startswith("15."), "the bad checkpoint is kept aside, not deleted"
    assert step.events[0].fields["skipped"][0]["step"] == 15
    # training goes on and saves step 15 again without touching the quarantined copy
    data = ex.make_iterator(SMALL)
    for _ in range(15):
        next(data)
    with step:
        while step.step < 20:
            s, _ = step(s, next(data))
    assert 20 in step.checkpoints.steps() and q[0].exists()
    assert step.checkpoints.steps()[-1] == 20


def _tree_listing(d: pathlib.Path) -> list:
    return sorted((str(p.relative_to(d)), p.stat().st_size if p.is_file() else -1) for p in d.rglob("*"))


def test_read_checkpoint_reads_either_layout_verified_and_touches_nothing(tmp_path, pack):
    """`resilax.read_checkpoint` (evaluation, export, inspection: no wrapped step) returns the
    saved train state bitwise, newest good first or the step asked for; a damaged newest
    checkpoint is skipped with a warning but neither moved nor deleted (a job may be writing
    there); wrong targets and missing checkpoints are named errors."""
    ref10, _, _ = run(tmp_path / "ref", 10)
    ref15, _, _ = run(tmp_path / "c", 15)
    template = ex.make_state(SMALL)
    before = _tree_listing(tmp_path / "c")
    step, got = resilax.read_checkpoint(tmp_path / "c", template)
    assert step == 15 and state_equal(jax.device_get(got), ref15)
    step, got = resilax.read_checkpoint(tmp_path / "c", jax.eval_shape(lambda: template), step=10)
    assert step == 10 and state_equal(jax.device_get(got), ref10)
    for victim in _newest_state_files(tmp_path / "c", 15):  # damage the newest
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2: len(raw) // 2 + 16] = bytes(b ^ 0xFF for b in raw[len(raw) // 2: len(raw) // 2 + 16])
        victim.write_bytes(bytes(raw))
    damaged = _tree_listing(tmp_path / "c")
    with pytest.warns(RuntimeWarning, match=r"\[15\].*failed verification"):
        step, got = resilax.read_checkpoint(tmp_path / "c", template)
    assert step == 10 and state_equal(jax.device_get(got), ref10)
    assert _tree_listing(tmp_path / "c") == damaged and len(damaged) == len(before)  # nothing moved or made
    with pytest.raises(resilax.CheckpointError, match=r"no checkpoint 7 in .*\[5, 10, 15\]"):
        resilax.read_checkpoint(tmp_path / "c", template, step=7)
    other = ex.make_state(ex.ExampleSpec(hidden=32, depth=2, batch=32, features=16, examples=1024))
    with pytest.raises(resilax.CheckpointError, match="was written for a different state"):
        resilax.read_checkpoint(tmp_path / "c", other, step=10)
    with pytest.raises(resilax.CheckpointError, match="no checkpoint directory"):
        resilax.read_checkpoint(tmp_path / "nothing", template)
    assert not (tmp_path / "nothing").exists()


def test_all_corrupt_is_a_clear_error(tmp_path):
    run(tmp_path, 10, every=5)
    for st in (5, 10):
        for f in _newest_state_files(tmp_path, st):
            f.write_bytes(b"\0" * 10)
    template = ex.make_state(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path))))
    with pytest.raises(resilax.CorruptCheckpointError, match=r"no good checkpoint in .*10: .*5: .*moved to"):
        step.init(template)


def test_checkpoint_of_another_state_is_refused_and_kept(tmp_path):
    run(tmp_path, 5, every=5)
    other = ex.make_state(ex.ExampleSpec(hidden=32, depth=2, batch=32, features=16, examples=1024))
    step = resilax.wrap(ex.train_step, topology=TOPO, config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path))))
    with pytest.raises(resilax.CheckpointError, match="was written for a different state"):
        step.init(other)
    assert (tmp_path / "5").is_dir() and not (tmp_path / "quarantine").exists()


def test_unwritable_checkpoint_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    step = resilax.wrap(ex.train_step, topology=TOPO, config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(blocker / "ckpt"))))
    with pytest.raises(resilax.StorageError, match="cannot create checkpoint_dir"):
        step.init(ex.make_state(SMALL))


def test_checksum_mismatch_is_caught_even_when_storage_reads_fine(tmp_path, monkeypatch):
    """Bytes that decode fine but differ from what was saved (silent corruption) fail verification."""
    from resilax._src.protect import checkpoints as _checkpoint
    run(tmp_path, 5, every=5)
    template = ex.make_state(SMALL)
    cfg = resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path), every=5))
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=ex.fsdp_specs(template, "fsdp", 4), config=cfg)
    data = ex.make_iterator(SMALL)
    s = step.init(template, data=data)
    real = _checkpoint.CheckpointStore.checksums  # the sums saved with step 10 disagree with its state
    monkeypatch.setattr(_checkpoint.CheckpointStore, "checksums", lambda self, t: real(self, t) ^ 1)
    with step:
        while step.step < 10:
            s, _ = step(s, next(data))
    monkeypatch.setattr(_checkpoint.CheckpointStore, "checksums", real)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=ex.fsdp_specs(template, "fsdp", 4), config=cfg)
    with pytest.warns(RuntimeWarning, match=r"10: CorruptCheckpointError: checksum mismatch in leaves .*\].step"):
        step.init(template, data=ex.make_iterator(SMALL))  # the log's inputs entries rerun steps from the data
    assert step.events[0].kind == "restore" and step.events[0].step == 5
    assert step.step == 10, "the record log replays 5..9 after the fallback"


@pytest.mark.verify  # its events include the cross-check's
def test_goodput_buckets_sum_to_wall_and_are_saved(tmp_path):
    from resilax._src.runtime.goodput import load_goodput

    _, step, _ = run(tmp_path, 10, every=5)
    saved = load_goodput(tmp_path)  # written at close, checksummed, frozen at that moment
    t = saved.totals()
    assert sum(t.values()) == pytest.approx(saved.wall(), abs=1e-9)
    assert t["compile"] > 0 and t["checkpoint_save"] > 0 and t["productive"] > 0
    assert step.goodput()["checkpoint_save"] == pytest.approx(t["checkpoint_save"], rel=1e-6)
    _, again, _ = run(tmp_path, 12, every=5)
    assert again.goodput()["checkpoint_restore"] > 0
    # the second run: its restore, then the cross-check of its first step
    assert [e["kind"] for e in load_goodput(tmp_path).events] == ["restore", "crosscheck"]


def test_rng_key_in_state_is_checkpointed(tmp_path, pack):
    """A typed PRNG key carried in the state round-trips bitwise, and so does the run using it."""
    import jax.numpy as jnp

    def step_fn(state, batch):
        k, sub = jax.random.split(state["rng"])
        g = resilax.record({"w": jax.random.normal(sub, (8,)) * batch["x"].mean()})
        return {"w": state["w"] - 0.1 * g["w"], "rng": k}, {}

    def go(d, steps):
        st = resilax.wrap(step_fn, topology=TOPO, config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(d), every=2)))
        with st:
            s = st.init({"w": jnp.zeros(8), "rng": jax.random.key(0)})
            while st.step < steps:
                s, _ = st(s, {"x": np.full((8,), st.step, np.float32)})
        return s

    ref = go(tmp_path / "ref", 6)
    go(tmp_path / "a", 4)
    s = go(tmp_path / "a", 6)
    assert np.array_equal(s["w"], ref["w"])
    assert np.array_equal(jax.random.key_data(s["rng"]), jax.random.key_data(ref["rng"]))


def test_save_blocks_only_for_a_snapshot_that_is_a_real_copy(tmp_path):
    """The loop gives save() the live state and then donates it to the next step: the
    checkpoint must hold the state as it was at save(), even when the source buffers are
    overwritten or deleted right after save() returned."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from resilax._src.protect.checkpoints import CheckpointStore

    mesh = TOPO.mesh([list(d) for d in TOPO.domains()])
    sh = NamedSharding(mesh, P(("data", "fsdp")))
    host = {"a": np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024), "b": np.full((16, 4), 7, np.int32)}
    store = CheckpointStore(tmp_path / "ckpt")
    try:
        store.warm(jax.device_put(host, sh))
        src = jax.device_put(host, sh)
        store.save(3, src, {"note": "x"})
        bump = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
        moved = bump(src)  # the donated source buffers are reused for the next values
        jax.block_until_ready(moved)
        for x in jax.tree.leaves(moved):
            x.delete()
        store.wait()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), host)
        got = store.restore_newest(abstract)
        assert got.step == 3 and state_equal(got.state, host)
        assert store.blocking_s.count == 1 and store.persist_s.count == 1
    finally:
        store.close()


def test_an_uncopied_save_builds_the_shard_lists_before_the_persister_reads_them(tmp_path):
    """An uncopied save hands the live state to the persister (Orbax reads
    ``addressable_shards`` there) while the loop reads it too. jaxlib 0.10.2 builds an array's
    per-device list lazily and two threads building it at once cache a part-built one
    (campaign trial 12 of seed 7: the cross-check's device_put after a rejoin saw 5 of 8
    shards). The lists must be built on the caller's thread, before the persister runs: it
    is held here on the Orbax lock, so nothing else has read the arrays."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from resilax._src.protect import checkpoints as ck

    mesh = TOPO.mesh([list(d) for d in TOPO.domains()])
    fresh = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), out_shardings=NamedSharding(mesh, P()))
    live = fresh({"a": np.zeros(8, np.float32), "b": np.zeros((2, 3), np.int32)})  # shard lists not built yet
    store = ck.CheckpointStore(tmp_path / "ckpt")
    try:
        with ck.ORBAX_LOCK:
            store.save(1, live, {}, copy=False)
            built = [len(x.__dict__.get("addressable_shards", ())) for x in jax.tree.leaves(live)]
        assert built == [8, 8]
        store.wait()
    finally:
        store.close()


def test_a_failed_background_save_is_a_storage_error_at_the_next_call(tmp_path):
    """The persister's error is not lost: the next save()/wait() raises it as StorageError."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from resilax._src.protect.checkpoints import CheckpointStore

    mesh = TOPO.mesh([list(d) for d in TOPO.domains()])
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data")))
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(1, {"x": x}, {})
    store.wait()
    import shutil
    shutil.rmtree(tmp_path / "ckpt")
    (tmp_path / "ckpt").write_text("not a directory")  # the next write fails on the persister thread
    assert store.save(2, {"x": x}, {}) < 5.0  # returns: the failure is in the background
    with pytest.raises(resilax.StorageError, match="saving checkpoint 2|finishing a checkpoint save"):
        store.wait()
    with pytest.raises(resilax.StorageError):  # and it is not forgotten: the next save raises too
        store.save(3, {"x": x}, {})
        store.wait()
    try:
        store.close()
    except resilax.StorageError:
        pass


_EXIT_AFTER_CLOSE = """
import sys, threading, time
import jax, jax.numpy as jnp
from resilax._src.protect.checkpoints import CheckpointStore

def chain(x):  # unrolled: XLA:CPU needs a while to compile it
    for i in range(300):
        x = jnp.sin(x) * (i + 1.0) + jnp.cos(x[::-1])
    return x

store = CheckpointStore(sys.argv[1], async_save=False)
tree = {"w": jnp.ones((8,), jnp.float32)}
lowered = jax.jit(chain).lower(tree["w"])  # traced here: the warm-up thread is inside XLA's compile
store.warm(tree, also=lowered.compile)
time.sleep(0.3)  # the warm-up thread is in XLA's compile (GIL released)
store.close()
print("warm-up threads alive after close:", [t.name for t in threading.enumerate() if t.name == "resilax-ckpt-warm"])
"""


def test_a_process_exits_cleanly_right_after_close_while_a_warm_up_was_compiling(tmp_path, child_env):
    """The warm-up compiles off the loop; `close` waits for it. Before, it ran on a daemon
    thread that could still be inside XLA's compile at exit: finalization killed it as the
    compile wait re-took the GIL, through a noexcept jaxlib frame, and the process died by
    SIGABRT after its work was done ("terminate called after throwing an instance of ''"; a
    worker of `resilax launch` did, right after its preemption save, with a cold compilation
    cache). This script aborted that way every time before the fix."""
    import subprocess
    import sys

    # a real compile, not a cache hit; with XLA:CPU's default code generation (the suite's
    # test-speed emitters take minutes over this chain, not the seconds it needs)
    env = dict(default_codegen_env(child_env), JAX_ENABLE_COMPILATION_CACHE="false")
    r = subprocess.run([sys.executable, "-c", _EXIT_AFTER_CLOSE, str(tmp_path / "ckpt")], env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "warm-up threads alive after close: []" in out and "terminate called" not in out, out[-3000:]


def test_a_save_neither_compiles_nor_waits_for_the_warm_up(tmp_path):
    """Issue 26: on an H100 the first save stalled the loop 29 s, joining the background
    warm-up that was still compiling. A save due while the warm-up is still running (held here
    forever by its caller part) returns without it, and its checkpoint is a real copy of the
    state at save() (the source donated and deleted right after)."""
    import threading

    from jax.sharding import NamedSharding, PartitionSpec as P
    from resilax._src.protect.checkpoints import CheckpointStore

    mesh = TOPO.mesh([list(d) for d in TOPO.domains()])
    sh = NamedSharding(mesh, P(("data", "fsdp")))
    host = {"a": np.arange(8 * 256, dtype=np.float32).reshape(8, 256), "b": np.full((16, 4), 3, np.int32)}
    release = threading.Event()
    store = CheckpointStore(tmp_path / "ckpt")
    try:
        store.warm(jax.device_put(host, sh), also=lambda: release.wait(120))
        store._compiled = None  # as if the snapshot program were not compiled yet either
        src = jax.device_put(host, sh)
        done = threading.Event()
        saver = threading.Thread(target=lambda: (store.save(4, src, {}), done.set()))
        saver.start()
        assert done.wait(60), "save() waited for the warm-up"
        assert not release.is_set()  # the warm-up is still blocked: the save did not need it
        moved = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)(src)
        for x in jax.tree.leaves(moved):
            x.block_until_ready().delete()
        release.set()
        store.wait()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), host)
        got = store.restore_newest(abstract)
        assert got.step == 4 and state_equal(got.state, host)
    finally:
        release.set()
        store.close()


def test_orbax_slices_of_a_replicated_shard_are_compiled_by_the_warm_up_not_the_first_save(tmp_path, monkeypatch):
    """Issue 26 (every program a save needs compiled ahead): Orbax saves a replicated shard
    cooperatively, each replica writing a slice it cuts on the device, one program per shape,
    compiled at the layout's first save (0.55 s of the tiny GPT's first save on 8 CPU
    devices). On CPU resilax's store turns that slicing off (the devices are the host's
    memory): no save compiles a slice, warmed or not, the checkpoint reads back bitwise, and
    Orbax's own global handler (the user's saves) still slices. Where it is on (as on a TPU:
    here by declaring the devices not CPU), after `warm` the first save compiles nothing; a
    layout that was not warmed (other shapes, the control) does compile its slices at its
    first save."""
    import logging

    import orbax.checkpoint as ocp
    from resilax._src.protect import orbax_warm

    from jax.sharding import NamedSharding, PartitionSpec as P
    from resilax._src.protect.checkpoints import CheckpointStore

    rep = NamedSharding(TOPO.mesh([list(d) for d in TOPO.domains()]), P())
    msgs = []

    class Grab(logging.Handler):
        def emit(self, r):
            msgs.append(r.getMessage())

    def first_save(shape, warm, where, restore=False):
        rng = np.random.default_rng(shape[0])
        tree = {"w": jax.device_put(rng.standard_normal(shape).astype(np.float32), rep),
                "b": jax.device_put(rng.standard_normal((shape[0] * 3,)).astype(np.float32), rep)}
        store = CheckpointStore(where, pack=False)  # (per leaf: packed groups reach Orbax on the host, unsliced)
        try:
            if warm:
                store.warm(tree)
                store._join_warming()
            del msgs[:]
            jax.config.update("jax_log_compiles", True)  # (a context manager would be this thread's only)
            try:
                store.save(1, tree, {})
                store.wait()  # the persister's work, Orbax's commit
            finally:
                jax.config.update("jax_log_compiles", False)
            if restore:
                got = store.restore_newest(jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)).state
                for k in tree:
                    assert np.array_equal(np.asarray(got[k]), np.asarray(tree[k])), k
            return [m for m in msgs if m.startswith("Compiling jit(slice)")]
        finally:
            store.close()

    h = Grab()
    logging.getLogger().addHandler(h)
    try:
        # on CPU: no slicing at all, and the user's Orbax is untouched
        assert first_save((48, 16), False, tmp_path / "cpu", restore=True) == []
        assert first_save((40, 16), True, tmp_path / "cpu_warm") == []
        assert ocp.type_handlers.get_type_handler(jax.Array)._use_replica_parallel
        # where Orbax slices: the warm-up compiles them
        monkeypatch.setattr(orbax_warm, "cpu_only", lambda: False)
        assert first_save((40, 16), True, tmp_path / "warm") == []
        assert first_save((56, 16), False, tmp_path / "cold"), "the control compiled no slice: Orbax did not slice"
    finally:
        logging.getLogger().removeHandler(h)


def test_a_save_due_while_the_previous_one_writes_waits_and_says_so(tmp_path):
    """The one wait a save may make: the previous save still writing when the next is due. It
    is booked in goodput (checkpoint_save) and reported as a `checkpoint_wait` event; a save
    whose predecessor has committed waits for nothing and reports nothing."""
    import threading

    template = ex.make_state(SMALL)
    data = ex.make_iterator(SMALL)
    step = resilax.wrap(ex.train_step, topology=TOPO, state_sharding=ex.fsdp_specs(template, "fsdp", 4),
                        config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path / "c"), every=2)))
    with step:
        s = step.init(template, data=data)
        for _ in range(2):
            s, _ = step(s, next(data))
        step.checkpoints.wait()  # step 2's save committed
        assert not [e for e in step.events if e.kind == "checkpoint_wait"]
        gate = threading.Event()
        step.checkpoints.after_commit(lambda: gate.wait(0.5))  # the previous save "still writing"
        before = step._goodput_recorder.totals()["checkpoint_save"]
        for _ in range(2):
            s, _ = step(s, next(data))  # step 4's save is due while it writes
        ev = [e for e in step.events if e.kind == "checkpoint_wait"]
        assert len(ev) == 1 and ev[0].step == 4 and ev[0].fields["previous"] == 2
        assert ev[0].fields["seconds"] > 0.2
        assert step._goodput_recorder.totals()["checkpoint_save"] - before >= ev[0].fields["seconds"] * 0.9


def test_a_plain_orbax_save_beside_resilax_waits_for_the_lock_and_returns_committed(tmp_path):
    """Orbax runs one save per process at a time (a class-wide operation id): a bench's plain
    manager saving while resilax's persister saved waited on the other's keys until Orbax's
    300 s timeout (CI, `bench overhead`). `resilax.exclusive_orbax_save` (public, for a user's
    own manager) holds the lock every resilax store holds until its commit,
    `resilax.orbax_lock`: it waits while another thread holds it, the step is committed when
    it returns, and the wait is reported apart from the save's own blocking."""
    import threading
    import time

    import orbax.checkpoint as ocp

    from resilax._src.protect import checkpoints as ck

    assert resilax.orbax_lock is ck.ORBAX_LOCK and resilax.exclusive_orbax_save is ck.exclusive_orbax_save
    assert {"orbax_lock", "exclusive_orbax_save"} <= set(resilax.__all__)
    store = ck.CheckpointStore(str(tmp_path / "ck"), keep=1)
    assert store._lock is resilax.orbax_lock  # what every resilax store holds
    store.close()
    mgr = ocp.CheckpointManager(tmp_path / "plain", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    held, release = threading.Event(), threading.Event()

    def hold():
        with resilax.orbax_lock:  # as a persister does from its save to its commit
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    threading.Timer(0.5, release.set).start()
    t0 = time.perf_counter()
    blocked, waited = resilax.exclusive_orbax_save(mgr, 3, ocp.args.StandardSave({"w": np.arange(4.0)}))
    total = time.perf_counter() - t0
    t.join()
    assert waited >= 0.4 and blocked + waited == pytest.approx(total, abs=0.05), (blocked, waited, total)
    assert mgr.all_steps() == [3] and not [p for p in os.listdir(tmp_path / "plain") if "tmp" in p]
    restored = mgr.restore(3, args=ocp.args.StandardRestore({"w": np.zeros(4)}))
    assert np.array_equal(restored["w"], np.arange(4.0))
    mgr.close()


def test_one_checksum_program_serves_the_start_state_and_the_steps_outputs(tmp_path, monkeypatch):
    """A step's outputs carry ``P('fsdp', None)`` where the placed state had ``P('fsdp')``:
    unequal shardings of one layout. The store compiles its checksum program once for both
    (before, saves never found the program the warm-up compiled for the start state, and a
    save's anchor compiled another on the loop), and refuses nothing it should not: a truly
    other layout gets a program of its own. Every result equals jit's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from resilax._src.protect.checkpoints import CheckpointStore
    from resilax._src.protect.checksum import anchor_tree, tree_checksums

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8])
    placed = {"w": jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("fsdp")))}
    stepped = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t))(placed)
    assert stepped["w"].sharding != placed["w"].sharding  # the premise: unequal, one layout
    other = {"w": jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data")))}
    store = CheckpointStore(str(tmp_path / "ck"))
    try:
        for tree in (placed, stepped, other):
            t = anchor_tree(tree, None)
            assert np.array_equal(np.asarray(store.checksums(t)), np.asarray(tree_checksums(t)))
        assert len(store._sums) == 2, list(store._sums)
        # the on-device snapshot likewise: the program warmed for the placed state copies the
        # step's outputs (before, every save after the first step fell back to device_put)
        store.warm(placed)
        store._join_warming()
        copied, real = [], jax.device_put
        monkeypatch.setattr(jax, "device_put", lambda *a, **k: copied.append(a) or real(*a, **k))
        snap, other_snap = store._snapshot(stepped), store._snapshot(other)
        monkeypatch.undo()
        assert len(copied) == 1 and copied[0][0] is other, "only the other layout falls back to device_put"
        assert np.array_equal(np.asarray(snap["w"]), np.asarray(stepped["w"]))
        assert np.array_equal(np.asarray(other_snap["w"]), np.asarray(other["w"]))
    finally:
        store.close()


def test_a_save_shortens_the_switch_interval_only_while_the_persister_saves(tmp_path, monkeypatch):
    """`gil.shorter_switch_interval`: Orbax's save runs Python on the persister thread; while
    it does, the interpreter's switch interval is 0.5 ms (the step loop gets the GIL back
    sooner), and the caller's value comes back after (a value changed meanwhile stays)."""
    import sys

    from jax.sharding import NamedSharding, PartitionSpec as P
    from resilax._src.gil import shorter_switch_interval
    from resilax._src.protect import checkpoints as _checkpoint

    before = sys.getswitchinterval()
    with shorter_switch_interval(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005, abs=1e-6)
    assert sys.getswitchinterval() == before
    with shorter_switch_interval(None), shorter_switch_interval(before * 2):
        assert sys.getswitchinterval() == before  # None and a longer one change nothing
    try:
        with shorter_switch_interval(0.0005):
            sys.setswitchinterval(0.002)  # someone else's choice, made meanwhile, is kept
        assert sys.getswitchinterval() == pytest.approx(0.002, abs=1e-6)
    finally:
        sys.setswitchinterval(before)
    seen = []
    real = _checkpoint.CheckpointStore.checksums
    monkeypatch.setattr(_checkpoint.CheckpointStore, "checksums",
                        lambda self, t: seen.append(sys.getswitchinterval()) or real(self, t))
    mesh = TOPO.mesh([list(d) for d in TOPO.domains()])
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data")))
    store = _checkpoint.CheckpointStore(tmp_path / "ckpt")
    store.save(1, {"x": x}, {})
    store.wait()
    store.close()
    assert seen and seen[0] == pytest.approx(0.0005, abs=1e-6), seen  # on the persister thread, saving
    assert sys.getswitchinterval() == before
    assert store.steps() == [1]


@pytest.mark.parametrize("pinned", [True, False])
def test_the_pinned_host_transfer_setting_reaches_orbax_and_the_checkpoint_reads_back(tmp_path, monkeypatch, pinned):
    """`CheckpointStore.PINNED_HOST_TRANSFER` (None: Orbax's choice, with pinned memory on a
    GPU) is what `resilax bench gpt --unpinned` measures on a GPU: the store hands it to the
    PyTreeCheckpointHandler its CheckpointManager saves with, and a checkpoint saved so reads
    back bitwise."""
    from resilax._src.protect import checkpoints as ck
    from resilax._src.protect import orbax_warm

    seen = []
    real = orbax_warm.item_handlers

    def spy(names, p=None, compress=True):
        got = real(names, p, compress)
        seen.append((p, None if got is None else got[0]["state"]._impl._handler_impl._enable_pinned_host_transfer))
        return got

    monkeypatch.setattr(orbax_warm, "item_handlers", spy)
    monkeypatch.setattr(ck.CheckpointStore, "PINNED_HOST_TRANSFER", pinned)
    store = ck.CheckpointStore(tmp_path / "ck", async_save=False)
    assert seen == [(pinned, pinned)], seen
    st = {"w": jax.numpy.arange(8.0), "b": jax.numpy.ones((2, 3), jax.numpy.bfloat16)}
    store.save(3, st, {})
    got = store.restore_newest(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), st))
    assert got is not None and got.step == 3 and state_equal(got.state, st)
    store.close()


def _bytes_under(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_arrays_are_compressed_unless_told_not_to_and_either_reads_back(tmp_path):
    """`CheckpointConfig.compress` (default on, as Orbax's): off, a restore took 0.55x the
    time for ~10% more disk on float state (docs/performance.md). Zeros compress to nearly
    nothing, so the bytes on disk say which was written; a store of either setting restores
    both (a checkpoint written by an earlier resilax, compressed, reads with it off)."""
    from resilax._src.protect import checkpoints as ck

    assert resilax.CheckpointConfig(str(tmp_path)).compress is True
    st = {"z": jax.numpy.zeros((1 << 20,), jax.numpy.float32), "b": jax.numpy.arange(6, dtype=jax.numpy.bfloat16)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), st)
    sizes = {}
    for compress in (False, True):
        store = ck.CheckpointStore(tmp_path / f"c{compress}", async_save=False, compress=compress)
        store.save(2, st, {})
        store.close()
        sizes[compress] = _bytes_under(tmp_path / f"c{compress}")
    assert sizes[False] >= 4 << 20 > 8 * sizes[True], sizes
    for written in (False, True):
        for reader in (False, True):
            store = ck.CheckpointStore(tmp_path / f"c{written}", async_save=False, compress=reader)
            got = store.restore_newest(abstract)
            assert got is not None and got.step == 2 and state_equal(got.state, st), (written, reader)
            store.close()
    with pytest.raises(resilax.ConfigError, match="compress"):
        resilax.CheckpointConfig(str(tmp_path), compress="yes")


def test_the_step_saves_with_the_configs_compression(tmp_path):
    """The setting reaches the store a wrapped step saves with (its checkpoints' bytes)."""
    sizes = {}
    for compress in (False, True):
        d = tmp_path / f"w{compress}"
        step = resilax.wrap(ex.train_step, topology=resilax.Topology.load("cpu-2x4"),
                            config=resilax.Config(checkpoint=resilax.CheckpointConfig(str(d), every=0, compress=compress),
                                                  log=None, peers=None))
        state = step.init(ex.make_state(SMALL))
        state = jax.tree.map(lambda x: jax.numpy.zeros_like(x, device=x.sharding), state)
        step.save(state)
        step.close()
        sizes[compress] = _bytes_under(d)
    assert sizes[False] > 2 * sizes[True], sizes


def test_a_restores_event_loop_ends_its_pending_reads_before_it_closes(caplog):
    """Orbax restores every array in one gather on a loop it closes as soon as the gather
    raises; the other reads, still in flight, then completed into the closed loop ("Event
    loop is closed" tracebacks) or were collected unretrieved ("Task exception was never
    retrieved"): 27-54 tracebacks for one corrupt checkpoint. Inside `quiet.draining_loops`
    (each restore) a loop made on this thread ends them before it closes; outside it, and on
    other threads, loops are Python's own."""
    import asyncio
    import gc
    import logging
    import threading

    from resilax._src import quiet

    tasks = []

    async def read(delay, fail):
        await asyncio.sleep(delay)
        raise ValueError(fail)

    async def restore():  # Orbax's shape: one gather, the first failure raises at once
        tasks.extend(asyncio.ensure_future(read(d, f"read {i}")) for i, d in enumerate((0, 0.05, 0.1)))
        await asyncio.gather(*tasks)

    with caplog.at_level(logging.DEBUG):
        with quiet.draining_loops():
            loop = asyncio.new_event_loop()  # (what Orbax's run_sync does)
            with pytest.raises(ValueError, match="read 0"):
                loop.run_until_complete(restore())
            assert sum(not t.done() for t in tasks) == 2  # in flight when the gather raised
            loop.close()
            other = []
            threading.Thread(target=lambda: other.append(asyncio.new_event_loop())).start()
        assert all(t.done() for t in tasks), "every read ended before the loop closed"
        tasks.clear()
        gc.collect()
        assert not [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR], \
            "no read was left unretrieved"
        plain = asyncio.new_event_loop()
        assert type(plain) is not type(loop) and type(other[0]) is not type(loop)  # outside it: Python's own
        plain.close()
        other[0].close()


_OTHER_PROCESS_HOLDS = """
import sys
from resilax._src import dirlock
try:
    key = dirlock.hold(sys.argv[1])
    print("held", flush=True)
except dirlock.DirectoryInUse as e:
    print("refused:", e.holder, flush=True)
"""


def test_a_directory_hold_counts_within_a_process_and_excludes_other_processes(tmp_path):
    """`dirlock.hold` (a single-process run's checkpoint directory): a second hold in the same
    process counts (a script that opens its directory again to resume), another process is
    refused while any hold is left (naming this one's pid only if its command line says
    resilax), and takes it once the last hold is given back."""
    import subprocess
    import sys

    from resilax._src import dirlock

    def other():
        r = subprocess.run([sys.executable, "-c", _OTHER_PROCESS_HOLDS, str(tmp_path)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip()

    first, second = dirlock.hold(tmp_path), dirlock.hold(tmp_path)
    assert first == second == str(tmp_path / "resilax.lock")
    dirlock.release(first)
    said = other()  # (pytest's command line names resilax only where the checkout's path does)
    assert said in ("refused: another process",) or said.startswith(f"refused: pid {os.getpid()}, started "), said
    dirlock.release(second)
    assert other() == "held"  # (its hold ended with it)
