"""``resilax bench gpt``: issue 26's GPU measurement, on whatever devices are present.

A GPT-style flax LM (`resilax.tools.gpt`: bf16 compute, f32 parameters, AdamW, dropout
through ``rng=True``; ``--size small`` is the ~110 M-parameter one of the report, ``tiny``
runs on CPU) on one failure domain holding every device present (state FSDP-sharded over
them, the batch over them), five variants run in interleaved blocks:

- ``plain``: ``jax.jit`` of the same step, state donated;
- ``split``: the same step as two plain jits, gradients then update (state donated): what
  running a step as two programs costs on this platform without resilax (on a GPU nothing
  measurable; on emulated CPU devices each program's launch is a task per device);
- ``orbax``: the same plus a plain Orbax async ``CheckpointManager`` save every ``--every``;
- ``off``: `resilax.wrap` with every protection off (the grad/update split only);
- ``default``: `resilax.wrap` with ``Config()``;
- ``default_ckpt``: ``Config()`` plus checkpoints every ``--every``.

Each round runs every variant for ``--block`` consecutive steps, the order rotating each
round; every step is timed to completion (state and metrics waited for) and, separately,
to the return of the call (the host time a call takes: a plain jit call returns once
dispatched). Blocks start at multiples of ``--block`` and ``--block`` divides ``--every``,
so a save is the first step of its block and the steps it touches run back to back.

JSON keys (the table prints them): ``platform``, ``device_kind``, ``devices``,
``state_bytes``, ``plain_ms`` (mean step), ``split_ratio``, ``orbax_ratio``, ``off_ratio``,
``default_ratio``, ``default_ckpt_ratio`` (ratios of means against ``plain``, saves
included), ``save_blocking_s`` (median over the saves after the first of the steps' time
above the variant's median step, summed over the save's block), ``first_save_blocking_s``,
``orbax_save_blocking_s`` (the same for plain Orbax), ``host_copy_s`` (one host copy of the
state), ``host_overhead_ms`` (per step: median return time of a ``default`` call minus a
``plain`` one), ``run_to_run_bitwise`` (two uninterrupted ``Config()`` runs, in this
process), ``resume_bitwise`` (subprocesses: a run with a NaN injected at a checkpoint step
and SIGKILLed later, restarted, against an uninterrupted run with the same NaN, run in this
process).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from resilax.tools.bench import option_adder, write_result
from resilax.tools.argtypes import int_at_least, output_path

VARIANTS = ("plain", "split", "orbax", "off", "default", "default_ckpt")
UNPINNED = "default_ckpt_unpinned"  # --unpinned: Orbax's copy to host without pinned memory (its GPU default: with)
PER_LEAF = "default_ckpt_per_leaf"  # --per-leaf: one array per leaf (`CheckpointStore.PACK` off; packed is the default)
EXTRA = (UNPINNED, PER_LEAF)
# a round of `_interleave` taking longer dumps every thread's stack to stderr (repeating)
WATCHDOG_S = float(os.environ.get("RESILAX_BENCH_WATCHDOG_S", "120"))
# what each of them sets on `CheckpointStore` (read when the store is made, at the step's init)
OVERRIDES = {UNPINNED: {"PINNED_HOST_TRANSFER": False}, PER_LEAF: {"PACK": False}}


def add_arguments(parser) -> None:
    opt = option_adder(parser)
    opt("--size", choices=("tiny", "small"), default="tiny")
    opt("--json", type=output_path, default=None, help="write results here")
    opt("--steps", type=int_at_least(1), default=None, help="timed steps per variant (default: tiny 200, small 300)")
    opt("--every", type=int_at_least(1), default=100, help="checkpoint cadence of the orbax and default_ckpt variants")
    opt("--block", type=int_at_least(1), default=5, help="consecutive steps per variant per round (divides --every)")
    opt("--resume-steps", type=int_at_least(1), default=12, help="steps of the resume runs (checkpoint every 4, NaN at 4)")
    opt("--no-resume", action="store_true", help="skip the SIGKILL + resume subprocess runs")
    opt("--unpinned", action="store_true",
        help=f"another variant, {UNPINNED}: default_ckpt with Orbax's copy to host not through pinned memory")
    opt("--per-leaf", action="store_true",
        help=f"another variant, {PER_LEAF}: default_ckpt with one array per leaf (not packed, the default)")
    opt("--no-split", action="store_true", help="leave out the split variant (two plain jits a step)")
    opt("--cpu-devices", type=int_at_least(1), default=8, help="emulated CPU devices when the platform is CPU")
    opt("--quiet", action="store_true")


def run(args) -> int:
    import faulthandler
    import signal

    from resilax.tools.runner import configure_cpu_devices

    # A run cut by its time limit (`timeout` sends SIGTERM) says where every thread was: on an
    # H100 (2026-11-28) a run stopped making progress at its second saves, and the device
    # time was spent before anything said why.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    configure_cpu_devices(args.cpu_devices)  # before JAX starts; no effect on a GPU or TPU
    r = bench_gpt(size=args.size, steps=args.steps, every=args.every, block=args.block,
                  resume_steps=args.resume_steps, resume=not args.no_resume, quiet=args.quiet,
                  unpinned=args.unpinned, per_leaf=args.per_leaf, split=not args.no_split)
    print_gpt(r)
    write_result(args.json, r)
    return 0


# ----------------------------------------------------------------------------- set-up
def _topology():
    """One failure domain holding every device present, mesh ``data`` (1) x ``fsdp`` (n)."""
    import jax

    import resilax

    devs = jax.devices()
    return resilax.Topology(
        name=f"{devs[0].platform}-1x{len(devs)}", platform=devs[0].platform, domain_kind="host", num_domains=1,
        devices_per_domain=len(devs), axis_names=("data", "fsdp"), axis_sizes=(1, len(devs)),
        is_emulated=devs[0].platform == "cpu")


def _shardings(st, n):
    from jax.sharding import PartitionSpec as P

    from resilax.tools import gpt

    return gpt.fsdp_spec(st, "fsdp", n), P(("data", "fsdp"))


def _config(variant, directory, every):
    import resilax

    if variant in EXTRA:
        return _config("default_ckpt", directory, every)
    if variant == "off":
        return resilax.Config(checkpoint=None, log=None, peers=None, anomaly=None, verify=None)
    if variant == "default":
        return resilax.Config()
    return resilax.Config(checkpoint=resilax.CheckpointConfig(directory, every=every))


def _wrapped(variant, size, topo, directory, every):
    import warnings

    import resilax
    from resilax.tools import gpt

    from resilax._src.protect.checkpoints import CheckpointStore

    st = gpt.make_state(size)
    spec, bspec = _shardings(st, topo.num_devices)
    overrides = OVERRIDES.get(variant, {})
    saved = {a: getattr(CheckpointStore, a) for a in overrides}
    with warnings.catch_warnings():  # one domain: "no peers to hold copies" is this bench's set-up
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            for a, v in overrides.items():
                setattr(CheckpointStore, a, v)
            step = resilax.wrap(gpt.train_step, topology=topo, state_sharding=spec, batch_sharding=bspec, rng=True,
                                config=_config(variant, f"{directory}_{variant}" if variant in EXTRA else directory,
                                               every))
            state = step.init(st)  # (the store is made here)
        finally:
            for a, v in saved.items():
                setattr(CheckpointStore, a, v)
    return step, state


def _finish(run) -> None:
    """Waits until ``run``'s save in flight is written."""
    if hasattr(run, "finish"):
        run.finish()
    elif getattr(run, "checkpoints", None) is not None:
        run.checkpoints.settle()


def _saving(run) -> bool:
    """A save of ``run`` (a wrapped step or `_Plain`) is still copying or writing."""
    if hasattr(run, "saving"):
        return run.saving()
    store = getattr(run, "checkpoints", None)
    return store is not None and store.in_flight()


class _Plain:
    """``jax.jit`` of the same step (the key resilax would pass: ``fold_in(key(0), step)``),
    state donated; ``orbax``: a plain async ``CheckpointManager`` save every ``every``, the
    loop going on while Orbax writes, as a plain Orbax user's does."""

    def __init__(self, size, mesh, n, directory=None, every=100, split=False):
        import jax
        from jax.sharding import NamedSharding

        from resilax.tools import gpt

        st = gpt.make_state(size)
        spec, bspec = _shardings(st, n)
        self.state_sh = jax.tree.map(lambda p: NamedSharding(mesh, p), spec)
        self.batch_sh = NamedSharding(mesh, bspec)
        self.state = jax.device_put(st, self.state_sh)

        def step(state, batch, k):
            return gpt.plain_step(state, batch, jax.random.fold_in(jax.random.key(0), k))

        if not split:
            self._fn = jax.jit(step, in_shardings=(self.state_sh, self.batch_sh, None),
                               out_shardings=(self.state_sh, None), donate_argnums=(0,))
        else:  # ``split``: gradients, then the update, as two programs
            grad = jax.jit(lambda s, b, k: gpt.plain_grad(s, b, jax.random.fold_in(jax.random.key(0), k)),
                           in_shardings=(self.state_sh, self.batch_sh, None),
                           out_shardings=(self.state_sh.params, None))
            update = jax.jit(lambda s, g: s.apply_gradients(grads=g), in_shardings=(self.state_sh, self.state_sh.params),
                             out_shardings=self.state_sh, donate_argnums=(0,))

            def two(state, batch, k):
                grads, loss = grad(state, batch, k)
                return update(state, grads), {"loss": loss}

            self._fn = two
        self.step = 0
        self.mgr = None
        self.every = every
        self.blocking_s: list[float] = []
        self.excluded_s = 0.0
        self._held = False  # this thread holds ORBAX_LOCK from a save until `saving` sees it written
        self._written: threading.Thread | None = None  # waits for the save's commit
        if directory is not None:
            import orbax.checkpoint as ocp

            self.mgr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def __call__(self, state, batch):
        import jax
        import numpy as np

        state, m = self._fn(state, jax.device_put(batch, self.batch_sh), np.uint32(self.step))
        self.step += 1
        if self.mgr is not None and self.step % self.every == 0:
            import orbax.checkpoint as ocp

            from resilax._src.protect.checkpoints import ORBAX_LOCK

            # One Orbax save at a time in a process (its operation ids are class-wide: a save
            # beside another one in flight waits for the other's keys until Orbax's 300 s
            # timeout). The loop holds ORBAX_LOCK from the save until `saving` sees it written,
            # while a thread waits for the commit; a wait for the lock is not this call's.
            t0 = time.perf_counter()
            if not self._held:
                ORBAX_LOCK.acquire()
                self._held = True
            t1 = time.perf_counter()
            self.mgr.save(self.step, args=ocp.args.StandardSave(state))
            self.blocking_s.append(time.perf_counter() - t1)
            self.excluded_s += t1 - t0
            self._written = threading.Thread(target=self.mgr.wait_until_finished, name="bench-orbax-commit")
            self._written.start()
        return state, m

    def saving(self) -> bool:
        """The last save is still being written; else the lock is let go (by the loop's thread)."""
        from resilax._src.protect.checkpoints import ORBAX_LOCK

        if self._written is not None and self._written.is_alive():
            return True
        if self._held:
            self._held = False
            ORBAX_LOCK.release()
        return False

    def take_excluded(self) -> float:
        """Seconds of the calls since the last take that were not the plain loop's own."""
        out, self.excluded_s = self.excluded_s, 0.0
        return out

    def finish(self) -> None:
        if self._written is not None:
            self._written.join()
        self.saving()  # (lets the lock go)

    def close(self):
        if self.mgr is not None:
            from resilax._src.protect.checkpoints import ORBAX_LOCK

            self.finish()
            with ORBAX_LOCK:
                self.mgr.wait_until_finished()
                self.mgr.close()


def _update_temp_bytes(plain, wrapped) -> dict:
    """Temporary device memory per device of the update (XLA's memory analysis of the compiled
    programs): plain jit's ``apply_gradients`` with the state donated, and the update part of
    the wrapped `Config()` step (its skip gate once made XLA copy both Adam moments)."""
    import jax

    from resilax._src.step.program import temp_bytes

    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), plain.state,
                            plain.state_sh)
    upd = jax.jit(lambda s, g: s.apply_gradients(grads=g), out_shardings=plain.state_sh, donate_argnums=(0,))
    return {"plain": temp_bytes(upd.lower(abstract, abstract.params).compile()),
            "default": temp_bytes(wrapped._program.update(None))}


def _state_bytes(state) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes")))


# ----------------------------------------------------------------------------- timing
def _interleave(runs, states, batches, steps, block, warm, quiet, every):
    """``(samples, spans)``: per variant ``[(call index, seconds to return, seconds to
    completion)]`` of its timed steps, and ``[(first call, last call)]`` of the blocks that
    held a save and the blocks run after them while it was still being written. Every
    variant first runs ``warm`` untimed steps (``warm % block == block - 1`` makes a call with
    a multiple of ``block`` the first of its block).

    A variant whose save is still copying or writing at the end of its block runs on, block
    by block, until it is written (at most ``every`` steps): a save's background work slows
    the steps that run beside it, and these are its own variant's, not the next variant's in
    the round (before 2026-11-28 the next variants absorbed it; on an H100 the plain jit
    variant's mean step came out 9% over its median)."""
    import faulthandler

    import jax

    names = list(runs)
    out = {k: [] for k in names}
    spans = {k: [] for k in names}
    calls = {k: 0 for k in names}
    for k in names:
        for _ in range(warm):
            states[k], m = runs[k](states[k], batches[calls[k] % len(batches)])
            calls[k] += 1
        jax.block_until_ready((states[k], m))
        if _saving(runs[k]):  # a save in the warm-up (--every below 2 blocks): written before the
            _finish(runs[k])  # next variant runs, as every save is (`ORBAX_LOCK`)
        if hasattr(runs[k], "take_excluded"):  # a save in the warm-up is not a timed call's
            runs[k].take_excluded()
    rounds = -(-steps // block)
    t_start = time.perf_counter()

    def run_block(k):
        for _ in range(block):
            b = batches[calls[k] % len(batches)]
            t0 = time.perf_counter()
            states[k], m = runs[k](states[k], b)
            t1 = time.perf_counter()
            t0 += runs[k].take_excluded() if hasattr(runs[k], "take_excluded") else 0.0
            jax.block_until_ready((states[k], m))
            calls[k] += 1
            out[k].append((calls[k], t1 - t0, time.perf_counter() - t0))

    try:
        for i in range(rounds):
            faulthandler.dump_traceback_later(WATCHDOG_S, repeat=True)  # a stalled round prints every thread's stack
            r = i % len(names)
            for k in names[r:] + names[:r]:
                first = calls[k] + 1
                run_block(k)
                if first % every == 0:  # the block began with a save
                    while _saving(runs[k]) and calls[k] - first < every:
                        run_block(k)
                    spans[k].append((first, calls[k]))
                    if _saving(runs[k]):  # still writing `every` steps on: finished here, untimed, so
                        _finish(runs[k])  # that no save is in flight while another variant saves
            if not quiet and (i + 1) % max(1, rounds // 10) == 0:
                print(f"  round {i + 1}/{rounds} ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return out, spans


def _ratio_ci(samples, block: int, base: str = "plain", n: int = 2000, seed: int = 0) -> dict:
    """``{variant: [low, high]}``: a 95% interval of each variant's ratio of means to
    ``base``, by resampling the rounds (each variant's block of a round, paired by block
    index) with replacement: how far run-to-run noise moves the ratios of one run. Saves
    stay in (a resampled round keeps its save span's steps with their block)."""
    rng = np.random.default_rng(seed)
    blocks = {}
    for k, rows in samples.items():
        per: dict[int, list] = {}
        for c, _, t in rows:
            per.setdefault((c - 1) // block, []).append(t)
        blocks[k] = per
    ids = sorted(set.intersection(*(set(b) for b in blocks.values()))) if blocks else []
    if len(ids) < 4 or base not in blocks:
        return {}
    sums = {k: np.array([sum(blocks[k][i]) for i in ids]) for k in blocks}
    cnts = {k: np.array([len(blocks[k][i]) for i in ids]) for k in blocks}
    draw = rng.integers(0, len(ids), size=(n, len(ids)))
    mean = {k: sums[k][draw].sum(1) / cnts[k][draw].sum(1) for k in blocks}
    return {k: [float(np.percentile(mean[k] / mean[base], 2.5)), float(np.percentile(mean[k] / mean[base], 97.5))]
            for k in blocks if k != base}


def _save_blocking(samples, spans):
    """``[seconds]`` per save: the steps' time above the variant's median step, summed over
    the save's span (its block and the blocks run while it was written, `_interleave`)."""
    med = statistics.median(t for _, _, t in samples)
    by_call = {c: t for c, _, t in samples}
    return [sum(max(0.0, by_call[j] - med) for j in range(a, b + 1) if j in by_call) for a, b in spans]


def _span_ms(samples, spans):
    """Each save span's step times (ms), for the JSON."""
    by_call = {c: t for c, _, t in samples}
    return [[round(by_call[j] * 1e3, 2) for j in range(a, b + 1) if j in by_call] for a, b in spans]


# ----------------------------------------------------------------------------- bitwise
def _final(step_or_plain, state, batches, n):
    import jax

    for i in range(n):
        state, _ = step_or_plain(state, batches[i % len(batches)])
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state))]


def _bytes(x):
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(x.size * x.dtype.itemsize == y.size * y.dtype.itemsize and
                                    np.array_equal(_bytes(x), _bytes(y)) for x, y in zip(a, b))


def _run_to_run(size, topo, batches, n=6) -> bool:
    finals = []
    for _ in range(2):
        step, s = _wrapped("default", size, topo, None, 100)
        finals.append(_final(step, s, batches, n))
        step.close()
    return _equal(*finals)


def _train_to(size_name, steps, every, ckpt, faults=()):
    """``Config()`` + checkpoints every ``every`` (resuming from ``ckpt``) trained to ``steps``
    steps, batches by step number; the final state's leaves."""
    import warnings

    import jax

    import resilax
    from resilax.tools import gpt

    size = gpt.SIZES[size_name]
    topo = _topology()
    st = gpt.make_state(size)
    spec, bspec = _shardings(st, topo.num_devices)
    batches = gpt.batches(size, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        step = resilax.wrap(gpt.train_step, topology=topo, state_sharding=spec, batch_sharding=bspec, rng=True,
                            config=resilax.Config(checkpoint=resilax.CheckpointConfig(ckpt, every=int(every))),
                            faults=resilax.FaultPlan(list(faults)) if faults else None)
    s = step.init(st)
    while step.step < int(steps):
        s, _ = step(s, batches[step.step % len(batches)])
    leaves = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(s))]
    step.close()
    return leaves


def _worker(argv) -> int:
    """``python -m resilax.tools.bench_gpt --worker SIZE DEVICES STEPS EVERY CKPT_DIR OUT [FAULT ...]``:
    :func:`_train_to` in a process of its own; writes the final state's leaves to ``OUT`` (.npz)."""
    size_name, ndev, steps, every, ckpt, out, *faults = argv
    from resilax.tools.runner import configure_compilation_cache, configure_cpu_devices

    configure_cpu_devices(int(ndev))  # on CPU: as many emulated devices as the parent had
    configure_compilation_cache()  # the restart reuses the executables of the run it replaces
    leaves = _train_to(size_name, steps, every, ckpt, faults)
    np.savez(out, *[_bytes(x) for x in leaves])  # bytes: bf16 and friends round-trip exactly
    return 0


def _resume(size_name, ndev, steps, tmp, quiet) -> dict:
    """SIGKILL + restart vs an uninterrupted run, both with a NaN injected at the checkpoint
    step 4 (checkpoints every 4): ``{"bitwise": bool | None, ...}``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    every, nan_at, kill_at = 4, 4, min(steps - 2, 7)

    def go(tag, *faults):
        cmd = [sys.executable, "-m", "resilax.tools.bench_gpt", "--worker", size_name, str(ndev), str(steps),
               str(every), os.path.join(tmp, tag), os.path.join(tmp, tag + ".npz"), *faults]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def done(p):
        out, err = p.communicate(timeout=900)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    t0 = time.perf_counter()
    killed_p = go("run", f"nan@{nan_at}", f"kill_process@{kill_at}")
    # the reference runs here, beside the killed run (independent directories): one process
    # start fewer than a third subprocess, on the same devices
    try:
        ref = [_bytes(x) for x in _train_to(size_name, steps, every, os.path.join(tmp, "ref"), [f"nan@{nan_at}"])]
    except BaseException:
        killed_p.kill()
        killed_p.wait()
        raise
    killed = done(killed_p)
    resumed = done(go("run", f"nan@{nan_at}"))  # the restart: the same plan without the kill
    info = {"steps": steps, "checkpoint_every": every, "faults": [f"nan@{nan_at}", f"kill_process@{kill_at}"],
            "killed_rc": killed.returncode, "seconds": time.perf_counter() - t0}
    if resumed.returncode != 0:
        info.update(bitwise=None, error=resumed.stderr[-2000:])
        return info
    b = np.load(os.path.join(tmp, "run.npz"))
    run = [b[f"arr_{i}"] for i in range(len(b.files))]  # np.savez's names, in the leaves' order
    info["bitwise"] = killed.returncode == -9 and _equal(ref, run)
    info["differing_leaves"] = sum(not np.array_equal(x, y) for x, y in zip(ref, run)) + abs(len(ref) - len(run))
    return info


# ----------------------------------------------------------------------------- the bench
def bench_gpt(*, size: str = "tiny", steps: int | None = None, every: int = 100, block: int = 5,
              resume_steps: int = 12, resume: bool = True, quiet: bool = False, unpinned: bool = False,
              per_leaf: bool = False, split: bool = True) -> dict:
    import jax

    from resilax.tools import gpt
    from resilax.tools.bench_protection import host_copy_s

    if every % block:
        raise SystemExit(f"resilax bench gpt: --block {block} must divide --every {every}")
    sz = gpt.SIZES[size]
    steps = steps or (200 if size == "tiny" else 300)
    topo = _topology()
    devs = jax.devices()
    mesh = topo.mesh([list(d) for d in topo.domains()])
    batches = gpt.batches(sz, 8)
    tmp = tempfile.mkdtemp(prefix="resilax-bench-gpt-")
    runs, states = {}, {}
    extras = [v for v, on in ((UNPINNED, unpinned), (PER_LEAF, per_leaf)) if on]
    variants = tuple(v for v in VARIANTS if split or v != "split") + tuple(extras)
    try:
        t0 = time.perf_counter()
        for v in variants:
            if v in ("plain", "split", "orbax"):
                runs[v] = _Plain(sz, mesh, topo.num_devices, os.path.join(tmp, "orbax") if v == "orbax" else None,
                                 every, split=v == "split")
                states[v] = runs[v].state
            else:
                runs[v], states[v] = _wrapped(v, sz, topo, os.path.join(tmp, "ckpt"), every)
        setup_s = time.perf_counter() - t0
        warm = 2 * block - 1  # compiles and first steps; then blocks start at multiples of `block`
        samples, spans = _interleave(runs, states, batches, steps, block, warm, quiet, every)
        timed_s = time.perf_counter() - t0 - setup_s
        mean = {k: statistics.fmean(t for _, _, t in samples[k]) for k in samples}
        ret = {k: statistics.median(t for _, t, _ in samples[k]) for k in samples}
        saves = _save_blocking(samples["default_ckpt"], spans["default_ckpt"])
        osaves = _save_blocking(samples["orbax"], spans["orbax"])
        state_bytes = _state_bytes(states["plain"])
        host_copy = host_copy_s(states["plain"])
        waits = [e.fields for e in runs["default_ckpt"].events if e.kind == "checkpoint_wait"]
        store = runs["default_ckpt"].checkpoints
        store_blocking, handoff, persist = list(store.blocking_s), list(store.handoff_s), list(store.persist_s)
        orbax_calls = list(runs["orbax"].blocking_s)
        extra: dict = {}
        for v in extras:  # "unpinned", "per_leaf"
            u = _save_blocking(samples[v], spans[v])
            us = runs[v].checkpoints
            extra[v.removeprefix("default_ckpt_")] = {
                "ratio": mean[v] / mean["plain"], "save_blocking_all_s": u,
                "save_blocking_s": statistics.median(u[1:]) if len(u) > 1 else None,
                "first_save_blocking_s": u[0] if u else None, "save_steps_ms": _span_ms(samples[v], spans[v]),
                "handoff_s": list(us.handoff_s), "persist_s": list(us.persist_s)}
        save_steps = {v: _span_ms(samples[v], spans[v]) for v in ("orbax", "default_ckpt")}
        update_temp = _update_temp_bytes(runs["plain"], runs["default"])
        for v in variants:
            runs[v].close()
        runs = {}
        states.clear()  # the variants' train states off the device before the bitwise runs (1.33 GB each on `small`)
        t1 = time.perf_counter()
        r2r = _run_to_run(sz, topo, batches)
        r2r_s = time.perf_counter() - t1
        res = _resume(size, len(devs), resume_steps, tmp, quiet) if resume else {"bitwise": None}
    finally:
        for v in runs.values():
            try:
                v.close()
            except Exception:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "bench": "gpt", "size": size, "platform": devs[0].platform, "device_kind": devs[0].device_kind,
        "devices": len(devs), "model": {k: getattr(sz, k) for k in ("d", "layers", "heads", "seq", "batch", "vocab")},
        "params": int(sum(np.size(x) for x in jax.tree.leaves(gpt.make_state(sz).params))),
        "state_bytes": state_bytes, "steps": steps, "every": every, "block": block,
        "phase_s": {"setup": setup_s, "interleaved": timed_s, "run_to_run": r2r_s,
                    "resume": res.get("seconds")},
        "plain_ms": mean["plain"] * 1e3,
        "split_ratio": mean["split"] / mean["plain"] if split else None,
        "orbax_ratio": mean["orbax"] / mean["plain"],
        "off_ratio": mean["off"] / mean["plain"],
        "default_ratio": mean["default"] / mean["plain"],
        "default_ckpt_ratio": mean["default_ckpt"] / mean["plain"],
        "ratio_ci95": _ratio_ci(samples, block),
        "median_ms": {k: statistics.median(t for _, _, t in samples[k]) * 1e3 for k in samples},
        "mean_ms": {k: mean[k] * 1e3 for k in mean},
        "return_ms": {k: ret[k] * 1e3 for k in ret},
        "save_blocking_s": statistics.median(saves[1:]) if len(saves) > 1 else None,
        "first_save_blocking_s": saves[0] if saves else None,
        "save_blocking_all_s": saves,
        "save_call_s": store_blocking,
        "save_handoff_s": handoff,
        "save_persist_s": persist,
        "save_steps_ms": save_steps,
        "steps_run": {k: len(v) for k, v in samples.items()},
        "checkpoint_waits": waits,
        "orbax_save_blocking_s": statistics.median(osaves[1:]) if len(osaves) > 1 else None,
        "orbax_first_save_blocking_s": osaves[0] if osaves else None,
        "orbax_save_call_s": orbax_calls,
        "host_copy_s": host_copy,
        "host_overhead_ms": (ret["default"] - ret["plain"]) * 1e3,
        "update_temp_bytes": update_temp,
        "run_to_run_bitwise": bool(r2r),
        "resume_bitwise": res.get("bitwise"),  # None: not run (--no-resume) or failed
        "resume": res,
        **extra,
    }


def print_gpt(r: dict) -> None:
    print(f"\nresilax bench gpt --size {r['size']}: {r['platform']} ({r['device_kind']}) x{r['devices']}, "
          f"{r['params'] / 1e6:.2f} M params, state {r['state_bytes'] / 1e6:.1f} MB, {r['steps']} timed steps per "
          f"variant, checkpoints every {r['every']}")
    print(f"{'variant':<14}{'mean ms':>10}{'median ms':>11}{'call returns ms':>17}{'ratio (means)':>15}"
          f"{'95% interval':>16}")
    ci = r.get("ratio_ci95") or {}
    for v in (v for v in VARIANTS if v in r["mean_ms"]):
        ratio = 1.0 if v == "plain" else r[f"{v}_ratio"]
        lo_hi = f"{ci[v][0]:.3f}-{ci[v][1]:.3f}" if v in ci else ""
        print(f"{v:<14}{r['mean_ms'][v]:>10.2f}{r['median_ms'][v]:>11.2f}{r['return_ms'][v]:>17.2f}{ratio:>15.3f}"
              f"{lo_hi:>16}")
    if r["split_ratio"]:
        print(f"two programs a step, no resilax (split): {r['split_ratio']:.3f}; resilax against it: every "
              f"protection off {r['off_ratio'] / r['split_ratio']:.3f}, Config() {r['default_ratio'] / r['split_ratio']:.3f}")
    f = lambda x: "n/a" if x is None else f"{x * 1e3:.1f} ms"  # noqa: E731
    print(f"save blocking (steps above the median, per save): first {f(r['first_save_blocking_s'])}, later "
          f"(median) {f(r['save_blocking_s'])}; plain Orbax first {f(r['orbax_first_save_blocking_s'])}, later "
          f"{f(r['orbax_save_blocking_s'])}; host copy of the state {f(r['host_copy_s'])}")
    print(f"host time per call vs plain jit: {r['host_overhead_ms']:+.2f} ms; waits for a previous save: "
          f"{len(r['checkpoint_waits'])}")
    mb = {k: "n/a" if v is None else f"{v / 1e6:.1f} MB" for k, v in r["update_temp_bytes"].items()}
    print(f"update program's temporary memory per device: plain jit {mb['plain']}, Config() {mb['default']}")
    print(f"run to run bitwise: {r['run_to_run_bitwise']}; SIGKILL + resume bitwise: {r['resume_bitwise']} "
          f"({ {k: v for k, v in r['resume'].items() if k != 'error'} })")
    for v in EXTRA:
        u = r.get(v.removeprefix("default_ckpt_"))
        if u:
            print(f"{v}: ratio {u['ratio']:.3f}, save blocking first {f(u['first_save_blocking_s'])}, later "
                  f"{f(u['save_blocking_s'])}")
    if r["resume"].get("error"):
        print(f"resume run failed: {r['resume']['error'][-600:]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2:]))
    raise SystemExit("usage: resilax bench gpt ... (this module's own entry is the resume worker)")
