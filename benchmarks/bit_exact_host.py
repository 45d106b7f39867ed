"""Host time per step call in the bit-exact mode: the calling thread's CPU time in one call,
resilax's bit-exact mode vs its default mode vs plain jit, on the example MLP over the
cpu-2x4 mesh (two failure domains of 4 devices), every other protection off, interleaved
blocks.

The bit-exact mode runs one gradient executable per replica and a combine and an update
per domain, each on its own domain's mesh, so its Python per step grows with leaves x
domains. As in host_overhead.py, the thread's CPU time inside each executable's call is
counted apart (``xla_call_ms``: on CPU XLA runs small programs inline, so it includes their
compute) and ``python_ms`` is the rest. Plain jit moves the host batch to the devices inside
its executable's call; resilax does the same ``jax.device_put`` just before its calls
(`sharding.put`: the whole batch in the default mode, each replica's part in the bit-exact
mode), so that is counted as in-call time too, as host_overhead.py counts `Program.put_batch`
(until 2026-11-27 this bench charged it to resilax's Python). Prints a table and writes JSON.

    python benchmarks/bit_exact_host.py --depth 3 --steps 150 --json benchmarks/results/bit_exact_host.json
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import resilax  # noqa: E402
from resilax._src.io import write_json  # noqa: E402
from resilax.tools import example as ex  # noqa: E402

from _clock import ExecutableClock, finish  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP (8 state leaves each)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=150, help="timed calls per variant")
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    spec = ex.ExampleSpec(depth=args.depth, hidden=args.hidden)
    state = ex.make_state(spec)
    x, y = ex.make_data(spec)
    batches = [{"x": x[i * 64:(i + 1) * 64], "y": y[i * 64:(i + 1) * 64]} for i in range(8)]
    topo = resilax.Topology.emulated(2, 4)
    off = dict(checkpoint=None, log=None, peers=None, anomaly=None, verify=None)
    runs, states = {}, {}
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), topo.axis_names)
    st_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), ex.fsdp_specs(state, "fsdp", 4))
    states["plain"] = jax.device_put(state, st_sh)
    b_sh = NamedSharding(mesh, P("data"))
    # host batches, as resilax gets them: the transfer is in every variant's call
    runs["plain"] = jax.jit(ex.train_step, donate_argnums=0, in_shardings=(st_sh, b_sh),
                            out_shardings=(st_sh, None)).lower(states["plain"], batches[0]).compile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, det in (("default", None), ("bit_exact", resilax.DeterministicConfig())):
            w = resilax.wrap(ex.train_step, topology=topo, state_sharding=ex.fsdp_specs(state, "fsdp", 4),
                             batch_sharding=P("data"), config=resilax.Config(deterministic=det, **off))
            states[name], runs[name] = w.init(state), w

    def call(k, s, i):
        return runs[k](s, batches[i % 8])

    for k in runs:  # compile, first-step work
        for i in range(3):
            states[k], _ = call(k, states[k], i)
        jax.block_until_ready(states[k])
    from resilax._src.step import sharding as _sh  # every batch transfer of both modes goes through `put`

    clock = ExecutableClock(also=[(_sh, "put")])
    times, inside, names = {k: [] for k in runs}, {k: [] for k in runs}, list(runs)
    rounds = -(-args.steps // args.block)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            s = states[k]
            jax.block_until_ready(s)
            clock.total = 0.0
            c0 = time.thread_time()
            with clock:
                for i in range(args.block):
                    s, _ = call(k, s, i)
            times[k].append((time.thread_time() - c0) / args.block)
            inside[k].append(clock.total / args.block)
            states[k] = s
        if (r + 1) % 5 == 0:
            print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    host, exe, py = finish(runs, states, times, inside)
    n_leaves = len(jax.tree.leaves(state))
    res = {"leaves": n_leaves, "mesh": "cpu-2x4", "steps": args.steps, "thread_cpu_ms": host, "xla_call_ms": exe,
           "python_ms": py, "python_over_plain_ms": {k: py[k] - py["plain"] for k in runs if k != "plain"}}
    print(f"\nper step call (median over blocks), {n_leaves} state leaves, cpu-2x4 (2 domains x 4 devices)")
    print(f"{'variant':10s} {'thread CPU ms':>14s} {'in XLA calls ms':>16s} {'python ms':>10s} {'python over plain':>18s}")
    for k in runs:
        print(f"{k:10s} {host[k]:14.3f} {exe[k]:16.3f} {py[k]:10.3f} {py[k] - py['plain']:18.3f}")
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
