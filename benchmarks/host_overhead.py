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
persister: threads named ``resilax-*``, read from ``/proc/self/task``) is counted per step
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


def make(layers: int):
    """``(state, step)``: `resilax.tools.models.many_leaves` (``6 * layers + 1`` leaves)."""
    from resilax.tools.models import many_leaves

    return many_leaves(layers, W)


from _clock import ExecutableClock as _ExecutableClock, finish  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="300", help="layers per run, comma-separated (6 * layers + 1 leaves)")
    ap.add_argument("--steps", type=int, default=200, help="timed calls per variant")
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--rows", type=int, default=8, help="batch rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--groups", action="store_true", help="also each protection group of Config() alone")
    ap.add_argument("--profile", nargs="?", const="default", default=None,
                    help="print this variant's top functions by own time (default: default)")
    ap.add_argument("--variants", default=None, help="comma-separated subset of off,default,default_ckpt")
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
    if args.json:
        write_json(args.json, res)
    return res


def _background_ticks() -> int:
    """CPU clock ticks (user + system) so far of this process's threads named ``resilax-*``."""
    import threading

    total = 0
    for t in threading.enumerate():
        if not t.name.startswith("resilax-") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total


def one(args, layers: int) -> dict:
    state, step_fn = make(layers)
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
    }
    if args.variants:
        configs = {k: v for k, v in configs.items() if k in args.variants.split(",")}
    runs, states = {}, {}
    states["plain"] = jax.device_put(state, jax.devices()[0])
    # compiled ahead, like resilax's executables: both are timed by the same clock
    plain = jax.jit(step_fn, donate_argnums=0).lower(states["plain"], batches[0]).compile()
    runs["plain"] = plain
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one failure domain: no peers
        for name, cfg in configs.items():
            w = resilax.wrap(step_fn, topology=topo, state_sharding=P(), batch_sharding=P(), config=cfg)
            states[name] = w.init(state)
            runs[name] = w
    for name in runs:  # compile, first-step work
        for i in range(3):
            states[name], _ = runs[name](states[name], batches[i % 4])
        jax.block_until_ready(states[name])
    times = {k: [] for k in runs}
    inside = {k: [] for k in runs}
    names = list(runs)
    # plain jit puts the host batch on the device inside its executable's call; resilax puts
    # it first (`Program.put_batch`, the same jax.device_put work): counted as in-call for both
    from resilax._src.step.program import Program

    clock = _ExecutableClock(also=[(Program, "put_batch")])
    prof = cProfile.Profile() if args.profile else None
    tick = os.sysconf("SC_CLK_TCK")
    bg = {k: 0 for k in runs}  # background threads' ticks per variant, summed over its blocks
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
            b0 = _background_ticks()
            clock.total = 0.0
            c0 = time.thread_time()
            with clock:
                for i in range(args.block):
                    s, m = f(s, batches[i % 4])
            dt = time.thread_time() - c0
            inside[k].append(clock.total / args.block)
            bg[k] += _background_ticks() - b0
            if prof is not None and k == args.profile:
                prof.disable()
            states[k] = s
            times[k].append(dt / args.block)
        print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True) if (r + 1) % 5 == 0 else None
    host, exe, py = finish(runs, states, times, inside)
    back = {k: bg[k] / tick / (rounds * args.block) * 1e3 for k in runs}
    res = {"leaves": n_leaves, "platform": jax.devices()[0].platform, "steps": args.steps, "gc": not args.no_gc,
           "thread_cpu_ms": host, "xla_call_ms": exe, "python_ms": py, "background_ms": back,
           "host_overhead_ms": {k: py[k] - py["plain"] for k in runs if k != "plain"},
           "host_ms": {k: py[k] - py["plain"] + back[k] for k in runs if k != "plain"},
           "thread_over_plain_ms": {k: host[k] - host["plain"] for k in runs if k != "plain"}}
    print(f"\nper step call (median over blocks), {n_leaves} state leaves, one {res['platform']} device")
    print(f"{'variant':14s} {'thread CPU ms':>14s} {'in XLA calls ms':>16s} {'python ms':>10s} {'background ms':>14s}"
          f" {'host added ms':>14s}")
    for k in runs:
        print(f"{k:14s} {host[k]:14.3f} {exe[k]:16.3f} {py[k]:10.3f} {back[k]:14.3f} {py[k] - py['plain'] + back[k]:14.3f}")
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(os.environ.get("HO_SORT", "tottime")).print_stats(int(os.environ.get("HO_N", "25")))
        print(out.getvalue())
    return res


if __name__ == "__main__":
    main()
