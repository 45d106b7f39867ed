"""Host time per step: the CPU time the calling thread spends in one call of the step,
resilax vs plain jit, on a state of many small leaves (default ~1,800: 300 layers x
(kernel, bias) x (params, Adam mu, nu)), one CPU device, interleaved blocks.

Wall time cannot say it on CPU: XLA:CPU runs some programs on the calling thread and some
on its own threads, and a loop that runs ahead of the device waits at a bound (plain jit's
queue has none). The calling thread's CPU time (``time.thread_time``) counts Python and
dispatch, not waiting; but XLA:CPU runs these small programs inline, so it counts their
compute too. So the thread's CPU time inside each executable's call is also counted
(``xla_call_ms``: dispatch, and compute when XLA runs the program inline; for resilax also
its putting the host batch on the mesh, which plain jit does inside its call), and the host's
own work is the rest: ``python_ms`` = thread CPU time minus time inside executables' calls
(resilax's Python, tree handling, dispatch). ``host_overhead_ms`` is resilax's
``python_ms`` minus plain jit's; ``thread_over_plain_ms`` the whole thread-time difference
(on CPU it includes the extra device work of the split programs). Prints a table and
writes JSON.

The CPU time of resilax's own background threads (the record log's writer, the checkpoint
persister: threads named ``resilax-*``, each thread's own CPU clock) is counted per step
too (``background_ms``): on an accelerator they compete with the loop for the GIL. ``--layers``
takes a list: one run per size, and the slope (the largest size's host time over the
smallest's).

    python benchmarks/host_overhead.py --layers 33,300,1666 --steps 100 --json benchmarks/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
import warnings

import jax

jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import resilax  # noqa: E402
from resilax._src.io import write_json  # noqa: E402

W = 4  # layer width: tiny, so the device's work is small next to the host's


def make(layers: int, model: str = "chain"):
    """``(state, step)``: ``chain``, `resilax.tools.models.many_leaves` (``6 * layers + 1``
    leaves: a chain of tiny dense layers); ``wide``, ``layers`` independent (4,) parameters
    summed into one prediction (``3 * layers + 1`` leaves under Adam). XLA:CPU compiles the
    wide one far faster (a 10,000-leaf chain's plain jit was still compiling after 14
    minutes; the wide one's takes ~95 s): the same number of leaves for the host to handle,
    not a deep program."""
    if model == "chain":
        from resilax.tools.models import many_leaves

        return many_leaves(layers, W)
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    params = {f"p{i:05d}": jnp.full((W,), 0.01, jnp.float32) for i in range(layers)}

    def step(state, batch):
        def loss(p):
            return jnp.mean((batch["x"] * sum(p.values()) - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=resilax.record(grads)), {"loss": value}

    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3)), step


from _clock import ExecutableClock as _ExecutableClock, finish  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="300", help="layers per run, comma-separated (6 * layers + 1 leaves; "
                    "--model wide: parameters, 3 * layers + 1 leaves)")
    ap.add_argument("--model", choices=("chain", "wide"), default="chain",
                    help="chain: tiny dense layers in a chain; wide: independent parameters (fast to compile)")
    ap.add_argument("--steps", type=int, default=200, help="timed calls per variant")
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--rows", type=int, default=8, help="batch rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-split", action="store_true", help="leave out the bare split (the step as two plain jits)")
    ap.add_argument("--groups", action="store_true", help="also each protection group of Config() alone")
    ap.add_argument("--profile", nargs="?", const="default", default=None,
                    help="print this variant's top functions by own time (default: default)")
    ap.add_argument("--variants", default=None, help="comma-separated subset of off,default,default_ckpt,ckpt_grads (a grads entry every step)")
    ap.add_argument("--no-gc", action="store_true", help="Python's cyclic garbage collector off while timing")
    args = ap.parse_args(argv)
    runs_ = [one(args, int(n)) for n in str(args.layers).split(",")]
    if len(runs_) == 1:
        res = runs_[0]
    else:
        res = {"sweep": runs_, "slope": {}}
        print(f"\n{'leaves':>8s} " + " ".join(f"{k + ' ms':>22s}" for k in runs_[0]["host_ms"]))
        for r in runs_:
            print(f"{r['leaves']:8d} " + " ".join(f"{v:22.3f}" for v in r["host_ms"].values()))
        for k in runs_[0]["host_ms"]:
            lo, hi = runs_[0]["host_ms"][k], runs_[-1]["host_ms"][k]
            res["slope"][k] = hi / lo if lo > 0 else None
        print("slope (largest over smallest): " + ", ".join(f"{k} {v:.2f}" for k, v in res["slope"].items() if v))
        if runs_[0].get("host_ms_over_split"):  # against the bare split: what resilax adds to two programs a step
            over = [r["host_ms_over_split"] for r in runs_]
            print(f"\nover the bare split\n{'leaves':>8s} " + " ".join(f"{k + ' ms':>22s}" for k in over[0]))
            for r, o in zip(runs_, over):
                print(f"{r['leaves']:8d} " + " ".join(f"{v:22.3f}" for v in o.values()))
    if args.json:
        write_json(args.json, res)
    return res


def _bare_split(step_fn, state, batch):
    """The step as two plain programs, split where resilax splits it (`resilax.record`):
    the gradient part (state, batch) -> recorded values, then the update (the state
    donated). Both compiled ahead, as plain's; the state's leaves are handed to both, as a
    plain split (`resilax bench gpt`'s ``split``) does."""
    import jax.numpy as jnp

    from resilax._src.step.split import Split

    sp = Split(step_fn, 0, False)
    grad = jax.jit(lambda s, b: sp.grad(s, b, jnp.uint32(0))).lower(state, batch).compile()
    rec = jax.eval_shape(lambda s, b: sp.grad(s, b, jnp.uint32(0))[0], state, batch)
    update = jax.jit(lambda s, b, r: sp.update(s, b, jnp.uint32(0), r), donate_argnums=0).lower(state, batch, rec).compile()

    def two(s, b):
        r, _, metrics = grad(s, b)
        return update(s, b, r), metrics

    return two


def _arrays_handed(f, states, k, batch) -> int:
    """The arrays one step hands to compiled executables (every leaf of their arguments): a
    call checks and hands over each one, host work that on CPU is inside the executable's
    call, beside its compute, so not in ``python_ms``."""
    from jax._src import stages

    orig, n = stages.Compiled.__call__, [0]

    def counting(obj, *a, **kw):
        n[0] += len(jax.tree.leaves((a, kw)))
        return orig(obj, *a, **kw)

    stages.Compiled.__call__ = counting
    try:
        states[k], _ = f(states[k], batch)
    finally:
        stages.Compiled.__call__ = orig
    jax.block_until_ready(states[k])
    return n[0]


_NAMES: dict = {}  # thread ident -> name


def _background_cpu() -> dict:
    """``{thread ident: CPU seconds so far}`` of this process's threads named ``resilax-*``
    (each thread's own CPU clock: nanoseconds, where ``/proc``'s clock ticks were 10 ms)."""
    import threading

    out = {}
    for t in threading.enumerate():
        if not t.name.startswith("resilax-") or t.ident is None:
            continue
        _NAMES[t.ident] = t.name
        try:
            out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return out


class _Owners:
    """Each background thread's CPU time booked to the variant that started it (the variants
    run interleaved in one process: a writer finishing its entries during another variant's
    block is still its own variant's cost)."""

    def __init__(self):
        self.owner, self.last, self.spent, self.by_thread = {}, {}, {}, {}

    def claim(self, variant) -> None:
        """Threads not yet owned belong to ``variant`` (call after its init and first steps)."""
        for ident, cpu in _background_cpu().items():
            if ident not in self.owner:
                self.owner[ident], self.last[ident] = variant, cpu

    def reset(self) -> None:
        """Timing starts: CPU time spent before it is nobody's."""
        for ident, cpu in _background_cpu().items():
            self.owner.setdefault(ident, None)
            self.last[ident] = cpu

    def book(self, variant) -> None:
        """Adds every owned thread's CPU time since the last call to its variant; threads
        started since then belong to ``variant`` (the one that just ran)."""
        for ident, cpu in _background_cpu().items():
            v = self.owner.setdefault(ident, variant)
            self.spent[v] = self.spent.get(v, 0.0) + cpu - self.last.get(ident, 0.0)
            self.by_thread[ident] = self.by_thread.get(ident, 0.0) + cpu - self.last.get(ident, 0.0)
            self.last[ident] = cpu


def one(args, layers: int) -> dict:
    state, step_fn = make(layers, args.model)
    n_leaves = len(jax.tree.leaves(state))
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(args.rows, W)).astype(np.float32), "y": rng.normal(size=(args.rows, W)).astype(np.float32)}
               for _ in range(4)]
    topo = resilax.Topology.emulated(slices=1, devices_per_slice=1)
    tmp = tempfile.mkdtemp(prefix="resilax-host-")
    off = resilax.Config(checkpoint=None, log=None, peers=None, anomaly=None, verify=None)
    only = {g: dataclasses.replace(off, **{g: getattr(resilax.Config(), g)}) for g in ("log", "anomaly", "verify", "peers")}
    configs = {
        "off": off,
        **({f"only_{g}": c for g, c in only.items()} if args.groups else {}),
        "default": resilax.Config(),
        "default_ckpt": resilax.Config(checkpoint=resilax.CheckpointConfig(os.path.join(tmp, "ck"), every=100_000)),
        # a grads entry every step (no time budget): what one entry costs the loop and the writer
        "ckpt_grads": resilax.Config(checkpoint=resilax.CheckpointConfig(os.path.join(tmp, "ck2"), every=100_000),
                                     log=resilax.LogConfig(grads_budget=None)),
    }
    if args.variants:
        configs = {k: v for k, v in configs.items() if k in args.variants.split(",")}
    runs, states = {}, {}
    states["plain"] = jax.device_put(state, jax.devices()[0])
    # compiled ahead, like resilax's executables: both are timed by the same clock
    plain = jax.jit(step_fn, donate_argnums=0).lower(states["plain"], batches[0]).compile()
    runs["plain"] = plain
    if not args.no_split:  # the bare split: what every resilax variant runs, minus resilax
        # buffers of its own (device_put of arrays already there hands back the same ones,
        # which plain's call donates)
        states["split"] = jax.tree.map(lambda a: a.copy(), jax.device_put(state, jax.devices()[0]))
        runs["split"] = _bare_split(step_fn, states["split"], batches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one failure domain: no peers
        for name, cfg in configs.items():
            w = resilax.wrap(step_fn, topology=topo, state_sharding=P(), batch_sharding=P(), config=cfg)
            states[name] = w.init(state)
            runs[name] = w
    owners = _Owners()
    owners.claim(None)  # threads from before (none of the variants')
    for name in runs:  # compile, first-step work
        for i in range(3):
            states[name], _ = runs[name](states[name], batches[i % 4])
        jax.block_until_ready(states[name])
        if hasattr(runs[name], "wait_compiled"):  # one-time work (compiles, warm-ups) done before timing
            runs[name].wait_compiled(600)
            ck = getattr(runs[name], "_ckpt", None)
            if ck is not None:
                ck.store._join_warming(every=True)
        owners.claim(name)
    handed = {k: _arrays_handed(runs[k], states, k, batches[0]) for k in runs}
    owners.reset()
    times = {k: [] for k in runs}
    inside = {k: [] for k in runs}
    names = list(runs)
    # plain jit puts the host batch on the device inside its executable's call; resilax puts
    # it first (`Program.put_batch`, the same jax.device_put work): counted as in-call for both
    from resilax._src.step.program import Program

    clock = _ExecutableClock(also=[(Program, "put_batch")])
    prof = cProfile.Profile() if args.profile else None
    rounds = -(-args.steps // args.block)
    if args.no_gc:
        import gc

        gc.disable()
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            f, s = runs[k], states[k]
            jax.block_until_ready(s)
            if prof is not None and k == args.profile:
                prof.enable()
            clock.total = 0.0
            c0 = time.thread_time()
            with clock:
                for i in range(args.block):
                    s, m = f(s, batches[i % 4])
            dt = time.thread_time() - c0
            inside[k].append(clock.total / args.block)
            owners.book(k)
            if prof is not None and k == args.profile:
                prof.disable()
            states[k] = s
            times[k].append(dt / args.block)
        print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True) if (r + 1) % 5 == 0 else None
    host, exe, py = finish(runs, states, times, inside)
    shutil.rmtree(tmp, ignore_errors=True)  # the runs are closed: their checkpoints and logs go
    back = {k: owners.spent.get(k, 0.0) / (rounds * args.block) * 1e3 for k in runs}
    n = rounds * args.block
    threads = {k: {_NAMES[i]: owners.by_thread.get(i, 0.0) / n * 1e3 for i, v in owners.owner.items() if v == k}
               for k in runs}
    res = {"leaves": n_leaves, "model": args.model, "platform": jax.devices()[0].platform, "steps": args.steps, "gc": not args.no_gc,
           "thread_cpu_ms": host, "xla_call_ms": exe, "python_ms": py, "background_ms": back, "background_threads": threads,
           "arrays_handed_per_step": handed,
           "host_overhead_ms": {k: py[k] - py["plain"] for k in runs if k != "plain"},
           "host_ms": {k: py[k] - py["plain"] + back[k] for k in runs if k != "plain"},
           "thread_over_plain_ms": {k: host[k] - host["plain"] for k in runs if k != "plain"},
           "host_ms_over_split": ({k: py[k] - py["split"] + back[k] for k in runs if k not in ("plain", "split")}
                                  if "split" in runs else None)}
    print(f"\nper step call (median over blocks), {n_leaves} state leaves, one {res['platform']} device")
    print(f"{'variant':14s} {'thread CPU ms':>14s} {'in XLA calls ms':>16s} {'python ms':>10s} {'background ms':>14s}"
          f" {'host added ms':>14s} {'over split ms':>14s}")
    for k in runs:
        over = f"{py[k] - py['split'] + back[k]:14.3f}" if "split" in runs and k != "plain" else f"{'':14s}"
        print(f"{k:14s} {host[k]:14.3f} {exe[k]:16.3f} {py[k]:10.3f} {back[k]:14.3f} {py[k] - py['plain'] + back[k]:14.3f}"
              f" {over}")
    print("arrays handed to executables per step: " + ", ".join(f"{k} {v}" for k, v in handed.items()))
    print("background threads, ms per step: " + "; ".join(
        f"{k}: " + ", ".join(f"{t} {ms:.3f}" for t, ms in v.items()) for k, v in threads.items() if v))
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(os.environ.get("HO_SORT", "tottime")).print_stats(int(os.environ.get("HO_N", "25")))
        if os.environ.get("HO_CALLERS"):
            pstats.Stats(prof, stream=out).print_callers(os.environ["HO_CALLERS"])
        print(out.getvalue())
    return res


if __name__ == "__main__":
    main()
