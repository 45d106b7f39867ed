"""Host state store: every process's shards of the state, kept in host memory that outlives
the worker's JAX runtime, and mirrored to the ring neighbour host.

Under `resilax launch` the supervisor owns a directory per host (on ``/dev/shm``: RAM);
after every ``every``-th step worker ``i`` writes the shards of (state, anomaly guard) its
devices hold into ``host<i>/own`` and into ``host<(i+1) % N>/mirror``, with the step, the
data position, the verdict record (the skipped steps: `anomaly.Watch.record`) and a
SHA-256 of the bytes. When worker ``i`` dies the supervisor deletes
``host<i>`` (honest emulation: that host's memory is gone), picks the newest step every
process can get back (its own copy, or the mirror on the next host) and tells the next
generation; there each worker reads its shards back, verifies them, and the workers agree
through the coordination service's key-value store that all of them could, or all fall
back to the checkpoint. The new generation has the same processes and mesh, so each
process needs exactly the shard indices it wrote.

Each commit record names the process that wrote it and whether that process held every
element of every leaf (``whole``: the bit-exact mode, where each failure domain is one
process holding the whole state). A whole copy serves any process, so when the ring has a
gap (two neighbouring hosts lost, or hosts lost earlier in the job by an in-place shrink,
after which the survivors mirror to the next *live* host: `HostStore.shrunk`) a process
still gets its shards from any live host.

Across hosts (`resilax launch --nodes`) each agent's store is its host's, and the mirror
goes through the next live host's store server (`hoststore_net`; sent in the background,
only for copies that are not whole), or the next *k* hosts' (``--host-store-mirrors k``):
then any k hosts next to each other may be lost at once. After a host loss in the default mode the re-formed
mesh needs other shards than any process wrote: `HostStore.restore` assembles each of them
from the pieces in every reachable copy (this host's directories, the other hosts'
servers), using each record's ``keys``; the agents offer only the steps of which every
process in the record's ``writers`` has a copy on a live host.

Files: ``step<k>.npz`` (one array per (leaf, shard index), no pickle) committed by
``step<k>.json`` (written last, atomically: ``{"step", "sha256", "data_state", "leaves", "process", "whole",
"verdicts", "keys", "writers"}``).
The newest ``KEEP`` steps are kept: workers step in lock-step, so a process killed while
writing step ``k`` leaves every other process with ``k - 1`` still on hand.

Cost on the step loop's path: a copy of the state on its own devices (the next step may
donate the state's buffers) dispatched after the step, and the wait for the previous stored
step; a thread reads the copy back (waiting for the step there), encodes, checksums and
writes it and sends the mirror. So a stored step lands a step later than it ran (a
worker killed meanwhile leaves the one before), and the copy holds one more state's worth
of device memory until the thread has read it.
"""

from __future__ import annotations

import pathlib
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from resilax._src.protect import base
from resilax._src.runtime import fence
from resilax._src.protect.anomaly import resolve_record
from resilax._src.step.sharding import copy_tree, local_shards
from resilax._src.timings import Timings

from resilax._src.protect import hoststore_files as _files
from resilax._src.protect import hoststore_net as _net
from resilax._src.protect.hoststore_files import _key, committed_steps, read, sources


class HostStore(base.Protection):
    """Writes this process's shards every ``every`` steps (see the module docstring)."""

    name = "host_store"

    def __init__(self, root: str, process: int, n: int, every: int = 1, alive=None, *, remote: str | None = None,
                 peers=(), writers=None, stamp=None):
        self.root = pathlib.Path(root)
        # across hosts: the generation that writes (`runtime.fence.stamp`), in each mirror's record:
        # a store server takes no mirror of a generation older than (or other than) its host's
        self.stamp = dict(stamp or {})
        self.process, self.n, self.every = process, n, every
        # the ring: this process mirrors to the next live one (a generation smaller than the
        # job, `resilax launch` re-formed without replacements, starts with some hosts gone)
        self.alive = sorted(alive) if alive is not None else list(range(n))
        # across hosts: the next live hosts' store servers get the mirror (`hoststore_net`;
        # ``remote``: their addresses, comma-separated), and the other hosts' servers are
        # asked for the copies a re-formed mesh needs
        self.remotes, self.peers = [a for a in (remote or "").split(",") if a], list(peers)
        self.writers = sorted(writers) if writers is not None else list(self.alive)  # who stores each step
        self.seconds = Timings()  # each stored step's time on the step loop's path (its wait included)
        self.waited = Timings()  # of that, waiting for the previous stored step to be written and sent
        self._verdicts = None  # () -> the anomaly watcher's verdict snapshot (`anomaly.Watch.snapshot`), or None
        self._job: threading.Thread | None = None  # the stored step being copied, written and sent
        self._job_error: BaseException | None = None
        self._copy = jax.jit(copy_tree)  # fresh buffers the next step cannot donate
        self.mirror_errors: dict[str, str] = {}  # a host's address -> why a mirror to it failed (then no more to it)

    @classmethod
    def for_job(cls, job) -> "HostStore":
        """The store of a worker started by `resilax launch` (`LaunchEnv` ``job``)."""
        return cls(job.host_store, job.slot, job.job_processes, job.host_store_every,
                   alive=job.slot_list if job.host_store_mirror else [job.slot],
                   remote=job.host_store_remote or None,
                   peers=[a for a in job.host_store_peers.split(",") if a], writers=job.slot_list,
                   stamp=fence.stamp(job))

    def _targets(self) -> list[pathlib.Path]:
        out = [self.root / f"host{self.process}" / "own"]
        if len(self.alive) > 1:
            i = self.alive.index(self.process)
            out.append(self.root / f"host{self.alive[(i + 1) % len(self.alive)]}" / "mirror")
        return out

    def newest(self) -> int | None:
        """The newest step committed in this process's own host copy (the one being written
        first finishes: after a failure it may be a step the failure broke, then it is not)."""
        self.drain()
        steps = committed_steps(self._targets()[0])
        return steps[-1] if steps else None

    def shrunk(self, run, state, alive: list[int]) -> None:
        """Processes outside ``alive`` are gone (an in-place shrink): mirror to the next live
        host from now on, and store the restored step at once."""
        self.drain()
        self.alive = self.writers = sorted(alive)
        self.write(run.step, state, run._guard, run._data_position)

    def after_step(self, run, rec) -> None:
        if run.step % self.every:
            return
        self.write(run.step, run._live, run._guard, run._data_position, wait=False)

    def start(self, run, state) -> None:
        """Re-protects a restored state at once (own host and the neighbour's mirror): until
        this generation's first stored step, a second death would otherwise find the dead
        hosts' copies gone and fall back to the checkpoint."""
        self.drain()
        watch = getattr(run, "_watch", None)
        self._verdicts = (lambda: watch.snapshot(run)) if watch is not None else None
        if run.step > 0 and run.step not in committed_steps(self._targets()[0]):
            self.write(run.step, state, run._guard, run._data_position)

    def close(self) -> None:
        self.drain()

    def write(self, step: int, state, guard, data_pos, wait: bool = True) -> None:
        """Stores ``step``: at once (``wait``), or off the step loop's path: the state is copied
        on its devices (the next step may donate it) and a thread reads the copy back,
        writes it and sends the mirror while the loop goes on. At most one step is in flight:
        the next one waits for it (`flush`), so the store is at most a step behind."""
        t0 = time.perf_counter()
        self.flush()
        self.waited.append(time.perf_counter() - t0)
        leaves = jax.tree.leaves((state, guard))
        # the skipped steps up to this one: known verdicts, and the unread ones' arrays (no device read here)
        verdicts = self._verdicts() if self._verdicts is not None else None
        if wait:
            self._store(step, leaves, data_pos, verdicts)
        else:
            try:
                copies = self._copy(leaves)
            except ValueError:  # leaves on different sets of devices: one copy each
                copies = [jnp.copy(x) for x in leaves]
            self._job = threading.Thread(target=self._run, args=(step, copies, data_pos, verdicts, True),
                                         name="resilax-host-store", daemon=True)
            self._job.start()
        self.seconds.append(time.perf_counter() - t0)

    def _run(self, *args) -> None:
        try:
            self._store(*args)
        except BaseException as e:  # raised on the step loop by the next `flush`
            self._job_error = e

    def _store(self, step: int, leaves, data_pos, verdicts, owned: bool = False) -> None:
        """Reads ``leaves`` back and commits them as ``step``. ``owned``: the arrays are this
        store's own copies (nothing donates them), so host views of them need no copy."""
        verdicts = resolve_record(verdicts) if verdicts is not None else None  # reads the unread verdicts
        arrays = {}
        whole = True
        for i, x in enumerate(leaves):
            shards, covered = local_shards(x)  # a replicated leaf: one copy per index is enough
            whole = whole and covered
            for s in shards:
                arrays[_key(i, s.index, x.shape)] = np.asarray(s.data) if owned else np.array(s.data, copy=True)
        raw = _files.encode(arrays)
        meta = _files.make_meta(step, raw, data_pos, len(leaves), self.process, whole, verdicts, keys=list(arrays),
                                writers=self.writers)
        for d in self._targets():
            _files.write_raw(d, step, raw, meta)
        if self.remotes and not whole:  # a whole copy is on every host already
            self._send(raw, {**meta, **self.stamp})

    @property
    def remote(self) -> str | None:
        """The mirrors' addresses, comma-separated (None: no mirror across hosts)."""
        return ",".join(self.remotes) or None

    @property
    def mirror_error(self) -> str | None:
        """Why mirrors across hosts failed (None: none did)."""
        return "; ".join(self.mirror_errors.values()) or None

    def _send(self, raw: bytes, meta: dict) -> None:
        """The step's copy to the next hosts' store servers (to one that failed, no more: that
        host is gone or hung, and its generation is about to end)."""
        for address in self.remotes:
            if address in self.mirror_errors:
                continue
            try:
                _net.put(address, meta, raw)
            except OSError as e:
                self.mirror_errors[address] = f"step {meta['step']} to {address}: {e}"
                print(f"resilax: host store: no mirror on the host at {address} from now on "
                      f"({self.mirror_errors[address]})", file=sys.stderr, flush=True)

    def flush(self) -> None:
        """Waits for the stored step in flight, if any; raises what made it fail (a full
        RAM disk, say), one step late."""
        if self._job is not None:
            self._job.join()
            self._job = None
        err, self._job_error = self._job_error, None
        if err is not None:
            raise err

    def drain(self) -> None:
        """`flush`, after a failure: a step the failure broke cannot be stored, said, not raised."""
        try:
            self.flush()
        except Exception as e:
            print(f"resilax: host store: the step in flight was not stored ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)

    def restore(self, step: int, abstract_leaves, shardings):
        """Arrays of ``step`` for this process's shards, from its own host or the mirror;
        ``(leaves, meta, source)`` or None when no verified copy has every shard it needs.

        Its own copy serves when the mesh is the one that stored it. A re-formed mesh (a
        generation without a lost host, in the default mode: other shards per process) is
        assembled from every copy of the step this host holds and the other hosts' stores
        serve (`hoststore_net`), piece by piece, each copy checked against its SHA-256."""
        for d in sources(self.root, self.process, self.n, step):
            got = read(d, step)
            if got is None:
                continue
            arrays, meta = got
            try:
                out = [jax.make_array_from_callback(a.shape, sh, lambda idx, i=i, a=a: arrays[_key(i, idx, a.shape)])
                       for i, (a, sh) in enumerate(zip(abstract_leaves, shardings))]
            except KeyError:
                continue
            return self._fresh(out, shardings), meta, str(d)
        pieces = _Pieces(self, step)
        try:
            out = [jax.make_array_from_callback(a.shape, sh, lambda idx, i=i, a=a: pieces.region(i, idx, a.shape,
                                                                                                 a.dtype))
                   for i, (a, sh) in enumerate(zip(abstract_leaves, shardings))]
        except KeyError:
            return None
        return self._fresh(out, shardings), pieces.meta(), pieces.source()

    @staticmethod
    def _fresh(out, shardings):
        # fresh buffers: arrays built from host memory may alias it, and the state is donated
        return jax.jit(copy_tree, out_shardings=list(shardings))(out)


def _box(key: str) -> tuple[int, list[tuple[int, int]]]:
    leaf, _, parts = key.partition(":")
    return int(leaf), [tuple(int(v) for v in p.split("-")) for p in parts.split(",") if p]


class _Pieces:
    """Every copy of ``step`` that ``store``'s process can reach (this host's directories
    first, then the other hosts' servers), read lazily and checked: a region of a leaf is
    filled from whichever copies hold its pieces (`region`)."""

    def __init__(self, store: HostStore, step: int):
        self.step, self.copies, self._loaded, self._used, self._index = step, [], {}, set(), {}
        for d, recs in _files.records(store.root, step).items():
            self.copies.append((d, recs[step], lambda d=d: _files.read(store.root / d, step)))
        for addr in store.peers:
            try:
                listing = _net.listing(addr, step)
            except OSError:
                continue
            for d, recs in listing.items():
                if step in recs:
                    self.copies.append((f"{addr}/{d}", recs[step], lambda a=addr, d=d: _get(a, d, step)))
        # one state only: whole copies, or the copies of one complete set of writers
        # (`hoststore_files.complete_writers`), this process's own first
        full = _files.complete_writers([c[1] for c in self.copies])
        mine = next((c[1].get("writers") for c in self.copies if c[1].get("process") == store.process), None)
        pick = tuple(sorted(mine)) if isinstance(mine, list) and tuple(sorted(mine)) in full else \
            (max(full, key=len) if full else None)

        def writers(c):
            w = c[1].get("writers")
            return tuple(sorted(w)) if isinstance(w, list) else None

        self.copies = [c for c in self.copies if c[1].get("whole")] + \
            [c for c in self.copies if not c[1].get("whole") and writers(c) == pick]
        own = [c for c in self.copies if c[1].get("process") == store.process]
        self._meta = (own or self.copies or [(None, {}, None)])[0][1]

    def _arrays(self, c: int):
        if c not in self._loaded:
            got = self.copies[c][2]()
            self._loaded[c] = None if got is None else got[0]
        return self._loaded[c]

    def _boxes(self, c: int) -> dict[int, list]:
        """Copy ``c``'s pieces by leaf: ``{leaf: [(key, box)]}`` (indexed once per copy)."""
        if c not in self._index:
            keys = self.copies[c][1].get("keys")
            if keys is None:  # a record without its keys: read the copy to know them
                keys = list(self._arrays(c) or ())
            index: dict[int, list] = {}
            for k in keys:
                i, box = _box(k)
                index.setdefault(i, []).append((k, box))
            self._index[c] = index
        return self._index[c]

    def region(self, leaf: int, idx, shape, dtype) -> np.ndarray:
        want = [sl.indices(n)[:2] for sl, n in zip(idx, shape)]
        out = np.zeros([b - a for a, b in want], dtype)
        left = np.ones(out.shape, bool)
        for c in range(len(self.copies)):
            if not left.any():
                break
            for k, box in self._boxes(c).get(leaf, ()):
                if len(box) != len(want):
                    continue
                cut = [(max(a, p), min(b, q)) for (a, b), (p, q) in zip(want, box)]
                if any(lo >= hi for lo, hi in cut):
                    continue
                dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(cut, want))
                if not left[dst].any():
                    continue
                arrays = self._arrays(c)
                if arrays is None or k not in arrays:
                    break  # unreadable or damaged: the next copy
                src = arrays[k]
                if src.dtype != out.dtype and src.dtype.itemsize == out.dtype.itemsize and src.dtype.kind == "V":
                    src = src.view(out.dtype)  # bfloat16 and the like come back as raw bytes
                out[dst] = src[tuple(slice(lo - p, hi - p) for (lo, hi), (p, _) in zip(cut, box))]
                left[dst] = False
                self._used.add(c)
        if left.any():
            raise KeyError(f"leaf {leaf} {want}: {int(left.sum())} elements in no copy of step {self.step}")
        return out

    def meta(self) -> dict:
        """This process's own record of the step if a copy of it is reachable (its data
        position), else any copy's."""
        return self._meta

    def source(self) -> str:
        return "assembled from " + ", ".join(self.copies[c][0] for c in sorted(self._used))


def _get(address: str, d: str, step: int):
    got = _net.get(address, d, step)
    return None if got is None else (_files.decode(got[0]), got[1])


def resume(run, store: HostStore, state, step: int | None, agree):
    """Replaces the restored ``state`` (and guard, data position, step) by the host store's
    copy of ``step`` when it is newer and every process could read its shards back.

    ``agree(ok) -> bool``: True when every process reported ok (the coordination service's
    key-value store); all processes take the same branch, so none resumes alone.
    Returns the state to continue from.
    """
    if step is None or step <= run.step:
        return state
    t0 = time.perf_counter()
    tree = (state, run._guard)
    leaves, treedef = jax.tree.flatten(tree)
    got = store.restore(step, leaves, [x.sharding for x in leaves])
    if not agree(got is not None):
        run._event("host_store_skipped", run.step, wanted_step=step,
                  reason="some process could not read back a verified copy of its shards; using the checkpoint")
        return state
    new_leaves, meta, source = got
    state, guard = jax.tree.unflatten(treedef, new_leaves)
    from resilax._src.protect.data_state import decode_data_state

    if run._data is not None and meta.get("data_state") is not None:
        run._data.set_state(decode_data_state(meta["data_state"]))
    run._data_position = meta.get("data_state")
    watch = getattr(run, "_watch", None)
    if watch is not None:
        watch.restored(meta.get("verdicts"))
    from_step, run.step, run._guard = run.step, step, guard
    store.write(step, state, guard, run._data_position)  # re-protected before anything else can fail
    run._event("restore", step, source="host_store", copy=source, from_step=from_step,
              seconds=time.perf_counter() - t0)
    return state
