"""A second, separate measurement of what resilax costs: end-to-end training throughput.

`resilax bench protection` times single steps (blocked to completion) interleaved in one
process and compares medians. This check shares none of its code and measures the other
way: each configuration trains in its **own fresh process**, as a user's loop does (checkpoints saved and persisted, background threads running), and the
whole wall time of ``--steps`` steps is what counts (the loop reads each step's loss, as
a training loop logs it; XLA:CPU deadlocked in a collective rendezvous when a plain loop
queued steps without ever waiting), calibration and background compiles
finished before the clock starts (both are reported by the run). Runs alternate
(plain, all, all_every_step, plain, ...) ``--reps`` times; the ratio is of the median
wall times, and each run's process CPU per step (every thread) is reported beside it. Only
the public API is used. ``--configs`` adds ``wrap`` (every protection off),
``checkpoint`` (checkpoints alone, every 100 steps) and ``checkpoint_never`` (the same
directory, never saving) to say where the cost goes.

    python benchmarks/throughput_check.py --steps 200 --reps 3 --json benchmarks/results/throughput_check.json
    python benchmarks/throughput_check.py --steps 200 --reps 2 \
        --configs plain,wrap,checkpoint_never,checkpoint,all --json benchmarks/results/throughput_parts.json

Same model and layout as `bench protection` (41 MB of AdamW state sharded over the 8
emulated devices of cpu-2x4, batch 256). Not a test.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("plain", "all", "all_every_step")
# where the end-to-end cost goes (``--configs`` with these too): the wrapper with every
# protection off, and checkpoints alone saved every 100 steps or never
EXTRA = ("wrap", "checkpoint", "checkpoint_never")


def child(name: str, steps: int, out: str) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import resilax
    from resilax.tools import example as ex

    spec = ex.ExampleSpec(hidden=1024, depth=4, features=256, batch=256)
    data = ex.make_iterator(spec)
    state0 = ex.make_state(spec)
    topo = resilax.Topology.load("cpu-2x4")
    axes = tuple(topo.axis_names)
    layout = jax.tree.map(lambda x: P(axes) if np.shape(x) and np.shape(x)[0] % 8 == 0 else P(), state0)
    extra = {}
    with tempfile.TemporaryDirectory() as tmp:
        if name == "plain":
            mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(topo.axis_sizes), axes)
            st_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), layout)
            b_sh = NamedSharding(mesh, P(axes[0]))
            step = jax.jit(ex.train_step, in_shardings=(st_sh, b_sh), donate_argnums=(0,))
            state = jax.device_put(state0, st_sh)

            def run(state):
                return step(state, jax.device_put(next(data), b_sh))

            for _ in range(5):
                state, m = run(state)
            jax.block_until_ready(state)
        else:
            ckpt = resilax.CheckpointConfig(os.path.join(tmp, "ckpt"), every=10 ** 9 if name == "checkpoint_never" else 100)
            off = dict(log=None, peers=None, anomaly=None)
            cfg = {"all": resilax.Config(checkpoint=ckpt, peers=resilax.PeersConfig(every="auto")),
                   "all_every_step": resilax.Config(checkpoint=ckpt, peers=resilax.PeersConfig()),
                   "wrap": resilax.Config(**off),
                   "checkpoint": resilax.Config(checkpoint=ckpt, **off),
                   "checkpoint_never": resilax.Config(checkpoint=ckpt, **off)}[name]
            wrapped = resilax.wrap(ex.train_step, topology=topo, state_sharding=layout, config=cfg)
            state = wrapped.init(state0, data=data)

            def run(state):
                return wrapped(state, next(data))

            state, m = run(state)
            wrapped.wait_compiled()
            for _ in range(200):  # until the peer cadence has calibrated
                if (wrapped.peer_cadence() or {}).get("phase") not in ("wait", "calibrate"):
                    break
                state, m = run(state)
            for _ in range(3):
                state, m = run(state)
            jax.block_until_ready(state)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        losses = []
        for _ in range(steps):
            state, m = run(state)
            losses.append(float(m["loss"]))  # the loop reads its loss, as a training loop logs it
        jax.block_until_ready(state)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        # CPU of every thread of the process (XLA's, the writers', Orbax's): on a 2-core
        # machine background work is paid for by the step, whichever thread does it
        extra["cpu_s_per_step"] = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / steps
        if name != "plain":
            wrapped.close()  # waits for the last save's commit: counted below, not above
            extra |= {"close_s": time.perf_counter() - t0 - wall, "peer_cadence": {
                k: v for k, v in (wrapped.peer_cadence() or {}).items() if k != "decisions"},
                "saves": wrapped.checkpoints.blocking_s.count if wrapped.checkpoints is not None else 0}
    with open(out, "w") as f:
        json.dump({"config": name, "steps": steps, "wall_s": wall, "step_s": wall / steps, **extra}, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, plain first: {', '.join(CONFIGS + EXTRA)}")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a.steps, a.out)
        return 0
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    configs = tuple(c for c in a.configs.split(",") if c)
    bad = [c for c in configs if c not in CONFIGS + EXTRA]
    if bad or not configs or configs[0] != "plain":
        p.error(f"--configs: plain first, then any of {', '.join(CONFIGS[1:] + EXTRA)} (got {a.configs!r})")
    runs = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for i, name in enumerate(configs[rep % len(configs):] + configs[:rep % len(configs)]):
                out = os.path.join(tmp, f"{name}-{rep}.json")
                subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(a.steps), "--out", out],
                               env=env, check=True)
                with open(out) as f:
                    r = json.load(f)
                runs[name].append(r)
                print(f"rep {rep + 1}/{a.reps} {name:<16} {r['step_s'] * 1e3:7.1f} ms/step, "
                      f"{r['cpu_s_per_step'] * 1e3:6.1f} ms of CPU/step, over {a.steps} steps", flush=True)
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_s_per_step"] for r in v) for k, v in runs.items()}
    result = {"check": "throughput", "steps": a.steps, "reps": a.reps, "step_s": med, "cpu_s_per_step": cpu,
              "ratio": {k: med[k] / med["plain"] for k in configs}, "runs": runs}
    print("\nend-to-end throughput, each run its own process (median of %d runs):" % a.reps)
    for k in configs:
        print(f"  {k:<16} {med[k] * 1e3:7.1f} ms/step   ratio {result['ratio'][k]:.3f}   CPU {cpu[k] * 1e3:6.1f} ms/step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
