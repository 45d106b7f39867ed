"""`resilax bench`: failure-free overhead of the wrapped step vs the plain jitted step.

Both run the same model on the same mesh, interleaved step by step (the order alternates)
so machine noise hits both alike; each step is timed to completion. The plain loop saves
with a plain Orbax ``CheckpointManager`` at the same cadence, so checkpoint blocking can be
compared too. Results: a table on stdout and JSON.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from resilax._src.io import write_json


def option_adder(parser):
    """``opt(name, **kw)``: adds an option unless the parser already has it (the bench
    subcommands share ``--json``, ``--steps``, ... with their parent parser)."""
    have = set(getattr(parser, "_option_string_actions", {}))

    def opt(name, **kw):
        if name not in have:
            parser.add_argument(name, **kw)

    return opt


def interleave(runs: dict, states: dict, batches, steps: int, *, desc: str, quiet: bool, warm: int = 3,
               block: int = 4, max_settle: int = 200, timing: str = "step") -> dict:
    """Times ``runs`` (name -> ``step(state, batch) -> (state, metrics)``) in rounds: each
    round runs every variant for ``block`` consecutive steps, the order of the variants
    rotating every round so slow drifts of the machine hit all alike, each step timed to
    completion. The first step of each block is run but not timed: it is where the previous
    variant's background work (a record-log writer, a checkpoint persister) still runs, so
    each variant is charged for its own background work and not its neighbour's (with one
    step per variant, whichever ran after the variant with a writer thread looked ~10%
    slower, an A/A pair included: measured). ``warm`` untimed rounds first, then the
    background compiles of the degraded meshes (``wait_compiled``) are waited for, then
    untimed rounds go on (at most ``max_settle``) until every run that has ``settled()``
    says it is (a calibrating peer cadence: a one-time cost, reported by the run itself).
    Updates ``states`` in place; returns ``{name: [seconds per timed step]}`` (``steps``
    each).

    ``timing``: ``"step"`` blocks on each step's state and metrics and times it alone;
    ``"loop"`` times the block's steps after the first as a training loop runs them (each
    step's first metric read to the host, as a loop logs its loss; the state waited for once,
    after the last step) and gives each the block's mean: what a loop pays per step,
    including dispatch and host work that overlap the previous step's device work (a wrapped
    step's update runs while the next step's host work does) and the last step's device work
    in full. One sample per block then (``block - 1`` steps)."""
    import jax

    names = list(runs)
    times: dict = {k: [] for k in names}
    block = max(2, int(block))
    need = -(-steps // (block - 1))
    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=need, desc=desc, unit="round", file=sys.stderr, mininterval=2.0)
    n = i = done = settle = 0
    while done < need:
        timed = i >= warm and (settle >= max_settle or all(runs[k].settled() for k in names
                                                          if hasattr(runs[k], "settled")))
        if i == warm:
            for k in names:
                if hasattr(runs[k], "wait_compiled"):
                    runs[k].wait_compiled()
        r = i % len(names)
        for k in names[r:] + names[:r]:
            if timing == "loop":
                states[k], m = runs[k](states[k], batches[n % len(batches)])
                jax.block_until_ready((states[k], m))
                t0 = time.perf_counter()
                for j in range(1, block):
                    states[k], m = runs[k](states[k], batches[(n + j) % len(batches)])
                    float(np.asarray(jax.tree.leaves(m)[0]).reshape(-1)[0])
                jax.block_until_ready(states[k])
                if timed and len(times[k]) < steps:
                    dt = (time.perf_counter() - t0) / (block - 1)
                    times[k] += [dt] * min(block - 1, steps - len(times[k]))
                continue
            for j in range(block):
                b = batches[(n + j) % len(batches)]
                t0 = time.perf_counter()
                states[k], m = runs[k](states[k], b)
                jax.block_until_ready((states[k], m))
                if timed and j > 0 and len(times[k]) < steps:
                    times[k].append(time.perf_counter() - t0)
        n += block
        i += 1
        if timed:
            done += 1
            if bar is not None:
                bar.update(1)
        elif i > warm:
            settle += 1
    if bar is not None:
        bar.close()
    return times


def write_result(path, obj):
    """Writes a benchmark's JSON to ``path`` (when given) and says where."""
    if path:
        write_json(path, obj)
        print(f"wrote {path}")


def bench_overhead(*, steps: int = 300, topology: str = "cpu-2x4", checkpoint_every: int | None = None,
                   progress: bool = True) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import resilax
    from resilax.tools import example as ex
    from resilax.tools.runner import configure_cpu_devices
    from resilax._src.protect.checkpoints import ORBAX_LOCK, exclusive_orbax_save
    from resilax._src.step.sharding import resolve

    topo = resilax.Topology.load(topology)
    configure_cpu_devices(topo.num_devices)
    default_every = {f.name: f.default for f in dataclasses.fields(resilax.CheckpointConfig)}["every"]
    every = checkpoint_every if checkpoint_every is not None else default_every
    spec = ex.ExampleSpec(hidden=512, depth=4, batch=256, features=128)
    data = ex.make_iterator(spec)
    batches = [next(data) for _ in range(16)]
    template = ex.make_state(spec)  # one template: its optimizer is static pytree metadata
    specs = ex.fsdp_specs(template, topo.axis_names[1], topo.axis_sizes[1])
    tmp = tempfile.mkdtemp(prefix="resilax-bench-")

    # resilax, as a user gets it: every protection on (record log on disk in grads mode, peer
    # copies where state lives in one slice, anomaly skipping) plus checkpoints
    config = resilax.Config(checkpoint=resilax.CheckpointConfig(os.path.join(tmp, "resilax"), every=every))
    wrapped = resilax.wrap(ex.train_step, topology=topo, state_sharding=specs, config=config)
    w_state = wrapped.init(template)

    # plain: jit on the same mesh and shardings, plain Orbax at the same cadence
    mesh = wrapped.mesh
    p_state0 = template
    state_sh = resolve(specs, p_state0, mesh, "state_sharding")
    batch_sh = resolve(P(topo.elastic_axis), batches[0], mesh, "batch_sharding")
    rep = NamedSharding(mesh, P())
    plain = jax.jit(ex.train_step, in_shardings=(state_sh, batch_sh),
                    out_shardings=(state_sh, {"loss": rep, "accuracy": rep}), donate_argnums=(0,))
    p_state = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), p_state0, state_sh)
    mgr = ocp.CheckpointManager(os.path.join(tmp, "plain"), options=ocp.CheckpointManagerOptions(max_to_keep=3))
    plain_blocking: list[float] = []

    def run_plain(i):
        nonlocal p_state
        t0 = time.perf_counter()
        b = jax.device_put(batches[i % len(batches)], batch_sh)
        p_state, m = plain(p_state, b)
        m["loss"].block_until_ready()
        if every and (i + 1) % every == 0:  # the save blocks the plain loop too: count it in its step
            # one Orbax save at a time in a process (checkpoints.exclusive_orbax_save): the wait
            # for resilax's save in flight and for this one's commit is left out of the step
            blocked, waited = exclusive_orbax_save(mgr, i + 1, ocp.args.StandardSave(p_state))
            plain_blocking.append(blocked)
            return time.perf_counter() - t0 - waited
        return time.perf_counter() - t0

    def run_wrapped(i):
        nonlocal w_state
        t0 = time.perf_counter()
        w_state, m = wrapped(w_state, batches[i % len(batches)])
        m["loss"].block_until_ready()
        return time.perf_counter() - t0

    for i in range(3):  # compile and warm both
        run_plain(i), run_wrapped(i)
    p_times, w_times = [], []
    iterator = range(steps)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="bench overhead", unit="step", file=sys.stderr, mininterval=1.0)
    for i in iterator:
        i += 3
        if i % 2:
            p_times.append(run_plain(i)); w_times.append(run_wrapped(i))
        else:
            w_times.append(run_wrapped(i)); p_times.append(run_plain(i))
    with ORBAX_LOCK:  # (each plain save was committed when it returned)
        mgr.close()
    blocking = list(wrapped.checkpoints.blocking_s)
    wrapped.close()
    shutil.rmtree(tmp, ignore_errors=True)
    med_p, med_w = statistics.median(p_times), statistics.median(w_times)
    return {
        "benchmark": "overhead",
        "topology": topo.name,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "steps": steps,
        "checkpoint_every": every,
        "param_count": int(sum(np.size(x) for x in jax.tree.leaves(p_state0.params))),
        "ratio": med_w / med_p,
        "mean_ratio": statistics.fmean(w_times) / statistics.fmean(p_times),
        "step_s": med_p,
        "wrapped_step_s": med_w,
        "blocking_s": statistics.fmean(blocking) if blocking else 0.0,
        "plain_blocking_s": statistics.fmean(plain_blocking) if plain_blocking else 0.0,
        "checkpoints": len(blocking),
        "config": config.to_dict(),
    }


def print_overhead(r: dict) -> None:
    print(f"\nresilax bench overhead  ({r['topology']}, {r['devices']} {r['platform']} devices, "
          f"{r['param_count']:,} params, {r['steps']} interleaved steps, checkpoint every {r['checkpoint_every']})")
    c = r.get("config") or {}
    on = [g + (f" ({c['log']['mode']})" if g == "log" else "") for g in ("checkpoint", "log", "peers", "anomaly")
          if c.get(g) is not None]
    print(f"  protections on: {', '.join(on) or 'none'}")
    rows = [
        ("plain jitted step (median)", f"{r['step_s'] * 1e3:.2f} ms"),
        ("resilax wrapped step (median)", f"{r['wrapped_step_s'] * 1e3:.2f} ms"),
        ("ratio (median wrapped / median plain)", f"{r['ratio']:.3f}"),
        ("ratio of means (includes checkpoint steps)", f"{r['mean_ratio']:.3f}"),
        ("checkpoint blocking, resilax (mean)", f"{r['blocking_s'] * 1e3:.1f} ms"),
        ("checkpoint blocking, plain Orbax (mean)", f"{r['plain_blocking_s'] * 1e3:.1f} ms"),
    ]
    w = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"  {a:<{w}}  {b:>10}")


def run_bench(args) -> int:
    if args.which == "overhead":
        r = bench_overhead(steps=args.steps, topology=args.topology, checkpoint_every=args.checkpoint_every)
        print_overhead(r)
        write_result(args.json, r)
        return 0
    raise SystemExit(f"resilax bench: unknown benchmark {args.which!r}")
