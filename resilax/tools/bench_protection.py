"""``resilax bench protection``: what every protection costs a step, checkpoint blocking
against plain Orbax and the host-copy floor, and a recovery in step-times.

Measured in one process, on one machine, on a model with >= 40 MB of train state (a flax
MLP trained with AdamW: parameters + two moments), in two layouts:

- ``replicated``: the state sharded inside a slice and replicated across slices (each
  slice holds all of it: no peer copy is needed);
- ``sharded``: the state sharded over every device (each shard lives in one slice: peer
  copies and the record log's device entries are made).

Per layout, round-robin with the order rotating every step (machine noise hits all alike),
each step timed to completion (state and metrics): a plain jitted step with no
checkpoints, a second plain one (the A/A control: its ratio is the noise floor), resilax
with every protection on (checkpoint every ``--checkpoint-every`` steps, peers, record
log on disk, NaN/spike skipping), resilax with each protection alone, and every
protection in the bit-exact mode (``deterministic``: `resilax.DeterministicConfig`). Ratios are of
medians (steady steps) and of means (save steps included).

Then: the blocking time of plain Orbax async saves of the same state (first and steady),
the floor (a host copy of every shard a checkpoint needs), and a slice failure on a step
boundary (``fail_slice@N:after_step/1``) with every protection on: seconds by phase, in
step-times, lost steps.

The persistent XLA compilation cache is off here: a recovery must not look fast because
an earlier run compiled its programs.

Prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np


VARIANTS = ("plain", "plain_aa", "all", "checkpoint", "peers", "log", "log_inputs", "anomaly", "deterministic")


def add_arguments(parser) -> None:
    from resilax.tools.bench import option_adder

    opt = option_adder(parser)
    opt("--json", default=None, help="write results here")
    opt("--steps", type=int, default=300, help="timed steps per variant and layout")
    opt("--topology", default="cpu-2x4")
    opt("--checkpoint-every", type=int, default=100)
    opt("--hidden", type=int, default=1024)
    opt("--depth", type=int, default=4)
    opt("--features", type=int, default=256)
    opt("--batch", type=int, default=256)
    opt("--layouts", default="replicated,sharded", help="comma-separated: replicated, sharded")
    opt("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    opt("--fail-at", type=int, default=41, help="steps completed when the slice fails in the recovery run")
    opt("--quiet", action="store_true")


def _layouts(topo, which):
    import jax
    from jax.sharding import PartitionSpec as P

    inner, n_inner, n = topo.axis_names[1], topo.axis_sizes[1], topo.num_devices
    both = (topo.axis_names[0], topo.axis_names[1])

    def rep(st):  # inside a slice only: every slice holds the whole state
        return jax.tree.map(lambda x: P(inner) if np.shape(x) and np.shape(x)[0] % n_inner == 0 else P(), st)

    def shd(st):  # over every device: each shard lives in one slice
        return jax.tree.map(lambda x: P(both) if np.shape(x) and np.shape(x)[0] % n == 0 else P(), st)

    table = {"replicated": rep, "sharded": shd}
    return {k: table[k] for k in which}


def _config(name, tmp, every):
    import resilax

    ck = resilax.CheckpointConfig(os.path.join(tmp, "ckpt"), every=every)
    logdir = os.path.join(tmp, "log")
    if name == "all":
        return resilax.Config(checkpoint=ck)
    if name == "deterministic":  # every protection, in the bit-exact mode
        return resilax.Config(checkpoint=ck, deterministic=resilax.DeterministicConfig())
    if name == "checkpoint":
        return resilax.Config(checkpoint=ck, log=None, peers=None, anomaly=None)
    if name == "peers":
        return resilax.Config(log=None, anomaly=None)
    if name == "log":
        return resilax.Config(log=resilax.LogConfig(directory=logdir), peers=None, anomaly=None)
    if name == "log_inputs":
        return resilax.Config(log=resilax.LogConfig(directory=logdir, mode="inputs"), peers=None, anomaly=None)
    if name == "anomaly":
        return resilax.Config(log=None, peers=None)
    raise ValueError(name)


def _per_device_bytes(arrays, device) -> int:
    n = 0
    for a in arrays:
        for s in a.addressable_shards:
            if s.device == device:
                n += s.data.nbytes
    return n


def _host_copy_s(state, reps=7) -> float:
    """The floor of a checkpoint's blocking time: one host copy of every shard a checkpoint
    needs (replica 0 of each), as numpy arrays."""
    import jax

    leaves = jax.tree.leaves(state)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = [np.array(s.data, copy=True) for x in leaves for s in x.addressable_shards if s.replica_id == 0]
        ts.append(time.perf_counter() - t0)
        del out
    return statistics.median(ts)


def _orbax_blocking(state, directory, saves=5):
    """Plain Orbax async saves of ``state`` (a fresh CheckpointManager, as a user makes it):
    seconds the caller blocked, first and the later ones (each after the previous commit)."""
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    out = []
    for i in range(saves):
        t0 = time.perf_counter()
        mgr.save(i, args=ocp.args.StandardSave(state))
        out.append(time.perf_counter() - t0)
        mgr.wait_until_finished()
    mgr.close()
    return out


def bench_protection(args) -> dict:
    import resilax
    from resilax.tools.runner import configure_cpu_devices

    topo = resilax.Topology.load(args.topology)
    configure_cpu_devices(topo.num_devices)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_enable_compilation_cache", False)
    from resilax.tools import example as ex
    from resilax._src.step.sharding import resolve

    spec = ex.ExampleSpec(hidden=args.hidden, depth=args.depth, features=args.features, batch=args.batch)
    it = ex.make_iterator(spec)
    batches = [next(it) for _ in range(16)]
    template = ex.make_state(spec)
    state_bytes = int(sum(x.nbytes for x in jax.tree.leaves(template)))
    params = int(sum(np.size(x) for x in jax.tree.leaves(template.params)))
    variants = [v for v in args.variants.split(",") if v]
    layouts = _layouts(topo, [x for x in args.layouts.split(",") if x])
    out: dict = {"benchmark": "protection", "topology": topo.name, "devices": jax.device_count(),
                 "platform": jax.devices()[0].platform, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
                 "model": {"hidden": spec.hidden, "depth": spec.depth, "features": spec.features, "batch": spec.batch,
                           "param_count": params, "state_bytes": state_bytes},
                 "layouts": {}}
    tmp_root = tempfile.mkdtemp(prefix="resilax-bench-protection-")
    try:
        for lname, layout in layouts.items():
            out["layouts"][lname] = _measure_layout(args, topo, spec, template, batches, layout, variants,
                                                    os.path.join(tmp_root, lname), ex, resolve, P, NamedSharding)
        lay = out["layouts"]
        worst = max(lay, key=lambda k: lay[k]["ratio"].get("all", 0.0))
        top = lay[worst]
        ck = [lay[k]["checkpoint"] for k in lay if lay[k]["checkpoint"]["blocking_s"]]
        # recovery: a slice failure on a step boundary, every protection on, state sharded over every device
        rec = _recovery(args, topo, template, batches, _layouts(topo, ["sharded"])["sharded"],
                        os.path.join(tmp_root, "recovery"))
        step_s = lay.get("sharded", top)["step_s"]["plain"]
        out.update({
            "overhead_layout": worst,
            "overhead_ratio": top["ratio"].get("all"),
            "overhead_ratio_mean": top["ratio_mean"].get("all"),
            # the bit-exact mode against the default mode, both with every protection on
            "deterministic_overhead_ratio": {k: lay[k]["ratio"]["deterministic"] / lay[k]["ratio"]["all"]
                                             for k in lay if "deterministic" in lay[k]["ratio"] and "all" in lay[k]["ratio"]},
            "aa_ratio": max((abs(lay[k]["ratio"].get("plain_aa", 1.0) - 1) + 1 for k in lay), default=None),
            "checkpoint_blocking_s": max((c["blocking_s"] for c in ck), default=None),
            "checkpoint_first_blocking_s": max((c["first_blocking_s"] for c in ck), default=None),
            "host_copy_s": max(lay[k]["host_copy_s"] for k in lay),
            "orbax_blocking_s": max(lay[k]["orbax"]["blocking_s"] for k in lay),
            "orbax_first_blocking_s": max(lay[k]["orbax"]["first_blocking_s"] for k in lay),
            "recovery_s": rec["recovery_s"],
            "recovery_steps": rec["recovery_s"] / step_s,
            "lost_steps": rec["lost_steps"],
            "recovery": rec,
            "protection_bytes_per_device": max(lay[k]["protection_bytes_per_device"] for k in lay),
            "state_bytes_per_device": max(lay[k]["state_bytes_per_device"] for k in lay),
        })
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return out


def _measure_layout(args, topo, spec, template, batches, layout, variants, tmp, ex, resolve, P, NamedSharding):
    import jax
    import resilax

    specs = layout(template)
    runs, states, wrapped = {}, {}, {}
    mesh = None
    # every variant draws its batches from its own grain iterator (the same sequence), as a
    # training loop does; resilax is given it at init, so its record log may replay inputs
    # entries (`LogConfig.grads_budget`), and pays for get_state() every step
    iters = {v: ex.make_iterator(spec) for v in variants}
    for v in variants:
        if v.startswith("plain"):
            continue
        cfg = _config(v, os.path.join(tmp, v), args.checkpoint_every)
        step = resilax.wrap(ex.train_step, topology=topo, state_sharding=specs, config=cfg)
        states[v] = step.init(template, data=iters[v])
        runs[v] = _feeding(step, iters[v])
        wrapped[v] = step
        mesh = step.mesh
    if mesh is None:
        mesh = topo.mesh([list(d) for d in topo.domains()])
    state_sh = resolve(specs, template, mesh, "state_sharding")
    batch_sh = resolve(P(topo.elastic_axis), batches[0], mesh, "batch_sharding")
    rep = NamedSharding(mesh, P())
    plain = jax.jit(ex.train_step, in_shardings=(state_sh, batch_sh),
                    out_shardings=(state_sh, {"loss": rep, "accuracy": rep}), donate_argnums=(0,))
    for v in variants:
        if v.startswith("plain"):
            runs[v] = _feeding(lambda s, b: plain(s, jax.device_put(b, batch_sh)), iters[v])
            states[v] = jax.tree.map(lambda x, s: jax.device_put(np.array(x), s), template, state_sh)
    from resilax.tools.bench import interleave

    names = list(runs)
    times = interleave(runs, states, batches, args.steps, desc="bench protection", quiet=args.quiet)
    med = {k: statistics.median(t) for k, t in times.items()}
    mean = {k: statistics.fmean(t) for k, t in times.items()}
    base = "plain"
    res = {
        "variants": names,
        "step_s": med, "step_mean_s": mean,
        "ratio": {k: med[k] / med[base] for k in names},
        "ratio_mean": {k: mean[k] / mean[base] for k in names},
        "p90_s": {k: float(np.percentile(t, 90)) for k, t in times.items()},
    }
    # checkpoint blocking (the resilax runs with checkpoints), memory held by protections
    ck_first, ck_rest = [], []
    for v in ("all", "checkpoint"):
        if v in wrapped and wrapped[v].checkpoints is not None:
            b = list(wrapped[v].checkpoints.blocking_s)
            if b:
                ck_first.append(b[0])
                ck_rest += b[1:]
    res["checkpoint"] = {"first_blocking_s": max(ck_first) if ck_first else None,
                         "blocking_s": statistics.median(ck_rest) if ck_rest else (max(ck_first) if ck_first else None),
                         "saves": len(ck_first) + len(ck_rest)}
    dev0 = mesh.devices.flat[0]
    any_state = states[names[0]]
    res["state_bytes_per_device"] = _per_device_bytes(jax.tree.leaves(any_state), dev0)
    res["log_cadence"] = {v: c for v, c in ((v, w.log_cadence()) for v, w in wrapped.items()) if c is not None}
    if "all" in wrapped:
        held = [x for p in wrapped["all"]._protections for x in p.held()]
        res["protection_bytes_per_device"] = _per_device_bytes(held, dev0)
        res["retained"] = {k: v for k, v in wrapped["all"].retained().items() if k != "host_batch_steps"}
    else:
        res["protection_bytes_per_device"] = 0
    res["host_copy_s"] = _host_copy_s(any_state)
    ob = _orbax_blocking(any_state, os.path.join(tmp, "orbax"))
    res["orbax"] = {"first_blocking_s": ob[0], "blocking_s": statistics.median(ob[1:]), "all_s": ob}
    for v in wrapped.values():
        v.close()
    return res


class _feeding:
    """``step(state, _) -> step(state, next(data))``: the interleaving loop's batch is ignored,
    each variant reads its own iterator. Keeps ``wait_compiled`` visible to the loop."""

    def __init__(self, step, data):
        self.step, self.data = step, data
        if hasattr(step, "wait_compiled"):
            self.wait_compiled = step.wait_compiled

    def __call__(self, state, _batch):
        return self.step(state, next(self.data))


def _recovery(args, topo, template, batches, layout, tmp):
    import jax
    import resilax
    from resilax.tools import example as ex

    F = args.fail_at
    cfg = _config("all", tmp, args.checkpoint_every)
    step = resilax.wrap(ex.train_step, topology=topo, state_sharding=layout(template), config=cfg,
                        faults=resilax.FaultPlan([f"fail_slice@{F}:after_step/1"]))
    state = step.init(template)
    n = F + 10
    for i in range(n):
        state, m = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, m))
        if i == 0:  # a failure after the background compiles (one before them waits for the one in flight)
            step.wait_compiled()
    ev = next(e.fields for e in step.events if e.kind == "recovery")
    ahead = [e.fields for e in step.events if e.kind == "compile_ahead"]
    step.close()
    return {"fail_at": F, "source": ev["source"], "restored_step": ev["restored_step"], "target_step": ev["target_step"],
            "lost_steps": ev["lost_steps"], "steps_replayed": ev["steps_replayed"],
            "steps_recomputed": ev["steps_recomputed"], "seconds": ev["seconds"],
            "recovery_s": sum(ev["seconds"].values()), "compiled_ahead": ev["compiled_ahead"],
            "compile_ahead": ahead, "mesh": ev["mesh"]}


def _table(r):
    print(f"\nresilax bench protection  ({r['topology']}, {r['devices']} {r['platform']} devices, "
          f"{r['model']['param_count']:,} params, {r['model']['state_bytes'] / 1e6:.1f} MB state, "
          f"{r['steps']} interleaved steps, checkpoint every {r['checkpoint_every']})")
    for lname, lay in r["layouts"].items():
        print(f"  layout {lname}: plain step {lay['step_s']['plain'] * 1e3:.1f} ms (median)")
        for k in lay["variants"]:
            print(f"    {k:<12} ratio of medians {lay['ratio'][k]:.3f}   ratio of means {lay['ratio_mean'][k]:.3f}")
        c = lay["checkpoint"]
        if c["blocking_s"] is not None:
            print(f"    checkpoint blocking: first {c['first_blocking_s'] * 1e3:.1f} ms, median "
                  f"{c['blocking_s'] * 1e3:.1f} ms; plain Orbax first {lay['orbax']['first_blocking_s'] * 1e3:.1f} ms, "
                  f"steady {lay['orbax']['blocking_s'] * 1e3:.1f} ms; host copy {lay['host_copy_s'] * 1e3:.1f} ms")
        for k, c in lay.get("log_cadence", {}).items():
            if c.get("share") is not None:
                print(f"    record log ({k}): {c['grads_entries']} grads entries, {c['inputs_only_entries']} inputs-only; "
                      f"one grads entry {c['grads_cost_s'] * 1e3:.1f} ms of writer time, {c['share']:.2%} of step time "
                      f"(budget {c['budget']:.0%}: {'met' if c['meets_budget'] else 'NOT met'})")
        print(f"    bytes per device: state {lay['state_bytes_per_device']:,}, protections "
              f"{lay['protection_bytes_per_device']:,}")
    rc = r["recovery"]
    print(f"  recovery (fail_slice@{rc['fail_at']}:after_step/1): {r['recovery_s']:.3f} s = "
          f"{r['recovery_steps']:.2f} step-times, lost steps {r['lost_steps']}, source {rc['source']}; by phase "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rc["seconds"].items()))
    print(f"  overhead_ratio {r['overhead_ratio']:.3f} ({r['overhead_layout']}), mean {r['overhead_ratio_mean']:.3f}, "
          f"A/A {r['aa_ratio']:.3f}")
    if r.get("deterministic_overhead_ratio"):
        print("  deterministic_overhead_ratio (bit-exact mode / default mode, every protection on): "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["deterministic_overhead_ratio"].items()))


def run(args) -> int:
    from resilax.tools.bench import write_result

    r = bench_protection(args)
    _table(r)
    write_result(getattr(args, "json", None), r)
    return 0
