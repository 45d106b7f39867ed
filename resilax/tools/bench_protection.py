"""``resilax bench protection``: what every protection costs a step, checkpoint blocking
against plain Orbax and the host-copy floor, and a recovery in step-times.

Measured in one process, on one machine, on a model with >= 40 MB of train state (a flax
MLP trained with AdamW: parameters + two moments), in two layouts:

- ``replicated``: the state sharded inside a slice and replicated across slices (each
  slice holds all of it: no peer copy is needed);
- ``sharded``: the state sharded over every device (each shard lives in one slice: peer
  copies and the record log's device entries are made).

Per layout, round-robin in blocks of 4 steps with the order rotating every round (machine
noise hits all alike), timed as a training loop runs them (``--timing loop``, default: loss
read each step, the state waited for after the block; ``--timing step``: each step timed
alone to completion; `resilax.tools.bench.interleave`): a plain jitted step with no
checkpoints, a second plain one (the A/A control: its ratio is the noise floor), resilax
with every protection off (``wrap``: the grad/update split alone), resilax
with every protection on (``all``: checkpoint every ``--checkpoint-every`` steps, peer
copies at the cadence calibrated to 1% of a step, ``PeersConfig(every="auto")``, record
log on disk, NaN/spike skipping; ``all_every_step``: the same with a peer copy every
step), resilax with each protection alone, and every protection in the bit-exact mode
(``deterministic``: `resilax.DeterministicConfig`). Ratios are of medians (steady steps)
and of means (save steps included). Steps are timed once the auto cadence has
calibrated (a one-time cost; its measured costs are reported).

Then: the blocking time of plain Orbax async saves of the same state (first and steady),
the floor (a host copy of every shard a checkpoint needs), and a slice failure on a step
boundary with every protection on, for both peer cadences (with the auto cadence at its
worst step, right before the next copy): seconds by phase, in step-times, lost steps.

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
from resilax.tools.argtypes import int_at_least, output_path


VARIANTS = ("plain", "plain_aa", "wrap", "all", "all_every_step", "checkpoint", "peers", "peers_every_step", "log", "log_inputs",
            "anomaly", "deterministic")


def add_arguments(parser) -> None:
    from resilax.tools.bench import option_adder

    opt = option_adder(parser)
    opt("--json", type=output_path, default=None, help="write results here")
    opt("--steps", type=int_at_least(1), default=300, help="timed steps per variant and layout")
    opt("--topology", default="cpu-2x4")
    opt("--checkpoint-every", type=int_at_least(1), default=100)
    opt("--hidden", type=int_at_least(1), default=1024)
    opt("--depth", type=int_at_least(1), default=4)
    opt("--features", type=int_at_least(1), default=256)
    opt("--batch", type=int_at_least(1), default=256)
    opt("--layouts", default="replicated,sharded", help="comma-separated: replicated, sharded")
    opt("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    opt("--timing", choices=("loop", "step"), default="loop",
        help="loop: the steps of a block timed as a loop runs them (loss read each step, state waited for "
             "after the last); step: each step blocked on and timed alone (see resilax.tools.bench.interleave)")
    opt("--fail-at", type=int_at_least(1), default=41, help="steps completed when the slice fails in the recovery run")
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
    auto = resilax.PeersConfig(every="auto")  # the cadence calibrated to 1% of a step
    if name == "all":
        return resilax.Config(checkpoint=ck, peers=auto)
    if name == "all_every_step":  # peer copies every step: the shortest recovery
        return resilax.Config(checkpoint=ck)
    if name == "deterministic":  # every protection, in the bit-exact mode
        return resilax.Config(checkpoint=ck, deterministic=resilax.DeterministicConfig())
    if name == "wrap":  # the wrapper alone, every protection off: what the grad/update split costs
        return resilax.Config(log=None, peers=None, anomaly=None)
    if name == "checkpoint":
        return resilax.Config(checkpoint=ck, log=None, peers=None, anomaly=None)
    if name == "peers":  # the auto cadence covers the steps between copies with the log's batches
        return resilax.Config(log=resilax.LogConfig(directory=None), anomaly=None, peers=auto)
    if name == "peers_every_step":
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


def host_copy_s(state, reps=7) -> float:
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

    from resilax._src.protect.checkpoints import ORBAX_LOCK, exclusive_orbax_save

    mgr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    out = [exclusive_orbax_save(mgr, i, ocp.args.StandardSave(state))[0] for i in range(saves)]
    with ORBAX_LOCK:
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
                 "timing": getattr(args, "timing", "loop"),
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
        shd = _layouts(topo, ["sharded"])["sharded"]
        rec = _recovery(args, topo, template, batches, shd, os.path.join(tmp_root, "recovery"), "all")
        rec1 = _recovery(args, topo, template, batches, shd, os.path.join(tmp_root, "recovery"), "all_every_step")
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
            # the same with peer copies every step: the shortest recovery, at the copies' cost
            "every_step_copies": {
                "overhead_ratio": top["ratio"].get("all_every_step"),
                "overhead_ratio_mean": top["ratio_mean"].get("all_every_step"),
                "recovery_s": rec1["recovery_s"], "recovery_steps": rec1["recovery_s"] / step_s,
                "lost_steps": rec1["lost_steps"], "recovery": rec1},
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
    times = interleave(runs, states, batches, args.steps, desc="bench protection", quiet=args.quiet,
                       timing=getattr(args, "timing", "loop"))
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
    res["peer_cadence"] = {v: c for v, c in ((v, w.peer_cadence()) for v, w in wrapped.items())
                           if c is not None and c.get("mode") == "auto"}
    if "all" in wrapped:
        held = [x for p in wrapped["all"]._protections for x in p.held()]
        res["protection_bytes_per_device"] = _per_device_bytes(held, dev0)
        res["retained"] = {k: v for k, v in wrapped["all"].retained().items() if k != "host_batch_steps"}
    else:
        res["protection_bytes_per_device"] = 0
    res["host_copy_s"] = host_copy_s(any_state)
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
        if hasattr(step, "peer_cadence"):  # the auto cadence calibrates before steps are timed
            self.settled = lambda: (step.peer_cadence() or {}).get("phase") not in ("wait", "calibrate")

    def __call__(self, state, _batch):
        return self.step(state, next(self.data))


def _recovery(args, topo, template, batches, layout, tmp, variant):
    """A slice lost on a step boundary with every protection on (``variant``: ``all``, the
    auto peer cadence, or ``all_every_step``). With the auto cadence the loss is put at the
    worst step: the last one before the next copy (``every - 1`` steps to recompute)."""
    import jax
    import resilax
    from resilax.tools import example as ex

    F = args.fail_at
    cfg = _config(variant, os.path.join(tmp, variant), args.checkpoint_every)
    auto = cfg.peers is not None and cfg.peers.every == "auto"
    faults = resilax.FaultPlan([] if auto else [f"fail_slice@{F}:after_step/1"])
    step = resilax.wrap(ex.train_step, topology=topo, state_sharding=layout(template), config=cfg, faults=faults)
    state = step.init(template)
    failed_at, cadence, i = None, None, 0
    while not any(e.kind == "recovery" for e in step.events):
        if i > F + 400:
            raise RuntimeError("bench protection: the recovery run never recovered")
        state, m = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, m))
        i += 1
        if i == 1:  # a failure after the background compiles (one before them waits for the one in flight)
            step.wait_compiled()
        if auto and failed_at is None:
            c = step.peer_cadence()
            if c["phase"] == "set" and step.step >= F:
                cad = step._peers.cadence
                # the anchor (the cadence's first whole copy) is set by the step after the decision
                if cad.anchor is not None and (step.step - cad.anchor) % cad.every == cad.every - 1:
                    cadence, failed_at = dict(c), step.step
                    step._fail_domain(1, "after_step")
    ev = next(e.fields for e in step.events if e.kind == "recovery")
    ahead = [e.fields for e in step.events if e.kind == "compile_ahead"]
    step.close()
    return {"variant": variant, "fail_at": failed_at if auto else F, "source": ev["source"],
            "restored_step": ev["restored_step"], "target_step": ev["target_step"],
            "lost_steps": ev["lost_steps"], "steps_replayed": ev["steps_replayed"],
            "steps_recomputed": ev["steps_recomputed"], "seconds": ev["seconds"],
            "recovery_s": sum(ev["seconds"].values()), "compiled_ahead": ev["compiled_ahead"],
            "compile_ahead": ahead, "mesh": ev["mesh"],
            "peer_cadence": {k: v for k, v in (cadence or {}).items() if k != "decisions"} or None}


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
        for k, c in lay.get("peer_cadence", {}).items():
            d = c["decisions"][-1] if c["decisions"] else None
            if d is None:
                print(f"    peer cadence ({k}): {c['phase']}" + (f" ({c['why']})" if c.get("why") else ""))
                continue
            cs = d["cost_s"]
            print(f"    peer cadence ({k}): every {d['every']} steps, log entries between: "
                  f"{'yes' if d['log_entries_between'] else 'no (recompute)'}; measured per step: ring copy "
                  f"{cs['ring'] * 1e3:.2f} ms, ring+local {cs['ring+local'] * 1e3:.2f} ms, log entry "
                  f"{cs['log'] * 1e3:.2f} ms ({d['samples']} samples each); {d['share']:.2%} of step time "
                  f"(budget {d['budget']:.0%}: {'met' if d['meets_budget'] else 'NOT met'})")
        print(f"    bytes per device: state {lay['state_bytes_per_device']:,}, protections "
              f"{lay['protection_bytes_per_device']:,}")
    rc = r["recovery"]
    print(f"  recovery (slice 1 lost after {rc['fail_at']} steps, the worst step for the cadence): {r['recovery_s']:.3f} s = "
          f"{r['recovery_steps']:.2f} step-times, lost steps {r['lost_steps']}, source {rc['source']}; by phase "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rc["seconds"].items()))
    rc1 = r["every_step_copies"]
    print(f"  with peer copies every step: recovery {rc1['recovery_s']:.3f} s = {rc1['recovery_steps']:.2f} step-times, "
          f"lost steps {rc1['lost_steps']}")
    f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731  (a --variants subset may lack 'all' or 'plain_aa')
    print(f"  overhead_ratio {f(r['overhead_ratio'])} ({r['overhead_layout']}), mean {f(r['overhead_ratio_mean'])}, "
          f"A/A {f(r['aa_ratio'])}; with peer copies every step {f(rc1['overhead_ratio'])}")
    if r.get("deterministic_overhead_ratio"):
        print("  deterministic_overhead_ratio (bit-exact mode / default mode, every protection on): "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["deterministic_overhead_ratio"].items()))


def run(args) -> int:
    from resilax.tools.bench import write_result

    r = bench_protection(args)
    _table(r)
    write_result(getattr(args, "json", None), r)
    return 0
