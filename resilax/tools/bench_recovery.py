"""``resilax bench recovery``: a slice failure mid-run, peers vs what users do today.

Measured in one run, on one machine:

1. failure-free overhead of peer protection: the wrapped step with peers
   (``PeersConfig(every=--peers-every)``) vs the same wrapped step with ``peers=None`` (two
   runs: their ratio is the noise floor), round-robin with a rotating order; the record log
   (device/host, no disk) and anomaly skipping are on in all three. Whether the measured
   overhead fits ``--budget`` is reported (the cadence is not chosen by it);
2. a slice failure mid-run (``fail_slice@F:mid_step/T``) with peers: lost steps, recovery
   seconds by phase (from the ``recovery`` event), recovery in step-times;
3. the same failure handled the way users do today: restart the process, restore the
   newest Orbax checkpoint (saved at the interval whose measured blocking cost fits the
   same budget), recompute the lost steps; checkpoints only (``log``, ``peers`` and
   ``anomaly`` off). The replacement slice is assumed to be there at once (its
   provisioning time is not counted, which favours the baseline);
4. device vs host copy of the protected leaves: seconds per copy. Device: the mesh's own
   peer-copy executable (`Program.snapshot`: the packed ring permute of every leaf that
   lives in one domain, ``program.state_pack``); host: a device-to-host copy of the
   same leaves' shards.

Prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from resilax._src.io import write_json
from resilax.tools.argtypes import int_at_least, output_path


def add_arguments(parser) -> None:
    """Adds this benchmark's options (skipping ones the parser already has)."""
    from resilax.tools.bench import option_adder

    opt = option_adder(parser)
    opt("--json", type=output_path, default=None, help="write results here")
    opt("--steps", type=int_at_least(1), default=300)
    opt("--topology", default="cpu-2x4")
    opt("--fail-at", type=int_at_least(1), default=None, help="steps completed when the slice fails (default: 60%% of --steps)")
    opt("--fail-slice", type=int_at_least(0), default=1)
    opt("--budget", type=float, default=0.01, help="failure-free overhead budget (share of step time)")
    opt("--peers-every", type=int_at_least(1), default=1, help="peer copy every K steps (PeersConfig.every)")
    opt("--hidden", type=int_at_least(1), default=256)
    opt("--batch", type=int_at_least(1), default=96)


def _setup(args):
    import resilax
    from resilax.tools.runner import configure_cpu_devices

    topo = resilax.Topology.load(args.topology)
    configure_cpu_devices(topo.num_devices)
    import jax
    from jax.sharding import PartitionSpec as P

    from resilax.tools.example import ExampleSpec, make_iterator
    spec = ExampleSpec(hidden=args.hidden, batch=args.batch)
    it = make_iterator(spec)
    batches = [next(it) for _ in range(args.steps)]
    n = topo.num_devices

    def layout(st):
        return jax.tree.map(lambda x: P(("data", "fsdp")) if np.shape(x) and np.shape(x)[0] % n == 0 else P(), st)

    return topo, spec, batches, layout


def _config(*, peers_every=None, compile_ahead=False, checkpoint_dir=None, checkpoint_every=0):
    """Peers (``peers_every``), or checkpoints only (``checkpoint_dir``), or neither; the
    record log (device/host, no disk) and anomaly skipping stay on except for checkpoints."""
    import resilax

    if checkpoint_dir is not None:  # today's way: checkpoints and nothing else
        return resilax.Config(checkpoint=resilax.CheckpointConfig(checkpoint_dir, every=checkpoint_every),
                              log=None, peers=None, anomaly=None)
    peers = None if peers_every is None else resilax.PeersConfig(every=peers_every, compile_ahead=compile_ahead)
    return resilax.Config(peers=peers)


def _wrapped(topo, spec, layout, config, faults=()):
    import resilax
    from resilax.tools.example import make_state, train_step

    st = make_state(spec)
    step = resilax.wrap(train_step, topology=topo, state_sharding=layout(st), config=config,
                        faults=resilax.FaultPlan(faults))
    return step, step.init(st)


def run(args) -> int:
    if getattr(args, "fail_at", None) is None:
        args.fail_at = int(args.steps * 0.6)
    topo, spec, batches, layout = _setup(args)
    import jax

    from resilax._src.protect import ring as _ring
    out: dict = {"topology": topo.name, "steps": args.steps, "budget": args.budget, "model": {
        "hidden": spec.hidden, "depth": spec.depth, "batch": spec.batch}}

    # ---- 1. failure-free overhead: peers on vs two runs with peers off (their ratio, A/A, is
    # the noise floor), round-robin in one process with the order rotating every step; each
    # step blocks.
    plain, s_plain = _wrapped(topo, spec, layout, _config())
    plain2, s_plain2 = _wrapped(topo, spec, layout, _config())
    prot, s_prot = _wrapped(topo, spec, layout, _config(peers_every=args.peers_every))
    runs = {"plain": plain, "plain2": plain2, "peers": prot}
    states = {"plain": s_plain, "plain2": s_plain2, "peers": s_prot}
    times: dict = {k: [] for k in runs}
    names = list(runs)
    for i, b in enumerate(batches):
        r = i % len(names)
        for k in names[r:] + names[:r]:
            t0 = time.perf_counter()
            states[k], m = runs[k](states[k], b)
            jax.block_until_ready(states[k])
            if i >= 12:  # after compiles and the first steps
                times[k].append(time.perf_counter() - t0)
    s_plain, s_prot = states["plain"], states["peers"]
    t_plain = times["plain"] + times["plain2"]
    step_s = statistics.median(t_plain)
    ratio = statistics.median(times["peers"]) / step_s
    out["failure_free"] = {
        "step_s": step_s, "protected_step_s": statistics.median(times["peers"]),
        "overhead_ratio": ratio,
        "mean_overhead_ratio": statistics.mean(times["peers"]) / statistics.mean(t_plain),
        "aa_ratio": statistics.median(times["plain2"]) / statistics.median(times["plain"]),
        "peer_every": prot.config.peers.every, "protects": bool(prot.program.protects),
        "within_budget": ratio - 1 <= args.budget,
    }
    plain2.close()
    # ---- 4. device copy (the mesh's peer-copy executable: packed ring permute) vs host copy
    # of the protected leaves (those that live in one domain only)
    prog = prot._program
    ring = [x for x, p in zip(jax.tree.leaves(s_prot), jax.tree.leaves(prog.places)) if p == _ring.RING]
    copy_fn = prog.snapshot(local=False)
    jax.block_until_ready(copy_fn(s_prot))
    td, th = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(copy_fn(s_prot))
        td.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        [np.array(s.data, copy=True) for x in ring for s in x.addressable_shards]
        th.append(time.perf_counter() - t0)
    out["copy"] = {"protected_bytes": int(sum(x.nbytes for x in ring)), "protected_leaves": len(ring),
                   "device_ring_s": statistics.median(td), "host_copy_s": statistics.median(th)}
    plain.close()
    prot.close()
    del s_plain, s_prot, ring

    # ---- 2. slice failure mid-run with peers
    F, T = args.fail_at, args.fail_slice
    step, state = _wrapped(topo, spec, layout, _config(peers_every=args.peers_every, compile_ahead=True),
                           faults=[f"fail_slice@{F}:mid_step/{T}"])
    t_after = []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        state, m = step(state, b)
        jax.block_until_ready(state)
        if i > F + 2:
            t_after.append(time.perf_counter() - t0)
    rec = next(e.fields for e in step.events if e.kind == "recovery")
    total = sum(rec["seconds"].values())
    out["peers"] = {
        "fail_at": F, "failed_slice": T, "source": rec["source"], "restored_step": rec["restored_step"],
        "target_step": rec["target_step"], "lost_steps": rec["lost_steps"], "steps_replayed": rec["steps_replayed"],
        "steps_recomputed": rec["steps_recomputed"],
        "recovery_s": total, "seconds": rec["seconds"], "recovery_steps": total / step_s,
        "bytes_moved": rec["bytes_moved"],
        "degraded_step_s": statistics.median(t_after) if t_after else None, "microbatches": rec["microbatches"],
        "mesh": rec["mesh"], "peer_every": step.config.peers.every, "compiled_ahead": rec["compiled_ahead"],
    }
    step.close()

    # ---- 3. today's way: checkpoints at the interval that fits the budget, restart, restore, recompute
    with tempfile.TemporaryDirectory() as d:
        ck, st = _wrapped(topo, spec, layout, _config(checkpoint_dir=d, checkpoint_every=0))
        for b in batches[:3]:
            st, _ = ck(st, b)
        jax.block_until_ready(st)
        blocks = []
        for _ in range(3):
            blocks.append(ck.save(st))
            ck.checkpoints.wait()
        block_s = statistics.median(blocks)
        interval = max(1, math.ceil(block_s / (args.budget * step_s)))
        ck.close()
        for f in os.listdir(d):
            import shutil

            shutil.rmtree(os.path.join(d, f), ignore_errors=True)
        ck, st = _wrapped(topo, spec, layout, _config(checkpoint_dir=d, checkpoint_every=interval))
        for b in batches[:F]:
            st, _ = ck(st, b)
        ck.close()
        last = (F // interval) * interval
        del st
        # restart: a fresh interpreter with JAX (measured), then restore + compile + recompute in this one
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import jax, orbax.checkpoint, flax; jax.devices()"], check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
        t_proc = time.perf_counter() - t0
        t0 = time.perf_counter()
        ck, st = _wrapped(topo, spec, layout, _config(checkpoint_dir=d, checkpoint_every=interval))
        t_restore = time.perf_counter() - t0
        restored = ck.step
        t0 = time.perf_counter()
        st, _ = ck(st, batches[restored])
        jax.block_until_ready(st)
        t_first = time.perf_counter() - t0  # compile + one step
        t0 = time.perf_counter()
        for b in batches[restored + 1: F + 1]:
            st, _ = ck(st, b)
        jax.block_until_ready(st)
        t_rest = time.perf_counter() - t0
        ck.close()
    base_total = t_proc + t_restore + t_first + t_rest
    out["checkpoint_restart"] = {
        "checkpoint_block_s": block_s, "interval": interval, "restored_step": restored, "expected_last": last,
        "lost_steps": F + 1 - restored,
        "seconds": {"process_start": t_proc, "restore": t_restore, "compile_and_first_step": t_first,
                    "recompute": t_rest},
        "recovery_s": base_total, "recovery_steps": base_total / step_s,
    }
    out["speedup"] = base_total / out["peers"]["recovery_s"]
    _table(out)
    if getattr(args, "json", None):
        write_json(args.json, out)
    return 0


def _table(out):
    ff, pe, cr, cp = out["failure_free"], out["peers"], out["checkpoint_restart"], out["copy"]
    print(f"resilax bench recovery — {out['topology']}, {out['steps']} steps, budget {out['budget']:.1%}")
    print(f"  step {ff['step_s'] * 1e3:.2f} ms; with peers {ff['protected_step_s'] * 1e3:.2f} ms "
          f"(overhead ratio {ff['overhead_ratio']:.3f}, {'within' if ff['within_budget'] else 'over'} the budget); "
          f"peer copy every {ff['peer_every']} step(s)")
    print(f"  noise floor: A/A ratio of two peers-off runs {ff['aa_ratio']:.3f}; mean overhead ratio "
          f"{ff['mean_overhead_ratio']:.3f}")
    print(f"  copy of {cp['protected_bytes']} protected bytes ({cp['protected_leaves']} leaves): device ring "
          f"{cp['device_ring_s'] * 1e3:.3f} ms, host {cp['host_copy_s'] * 1e3:.3f} ms")
    print(f"  slice {pe['failed_slice']} lost during step {pe['target_step']}: recovered from {pe['source']} "
          f"(step {pe['restored_step']}), {pe['bytes_moved']} bytes moved, {pe['steps_replayed']} logged steps "
          f"replayed, {pe['steps_recomputed']} recomputed; continued on mesh {pe['mesh']}")
    rows = [("", "peers", "checkpoint+restart")]
    rows.append(("lost steps", str(pe["lost_steps"]), str(cr["lost_steps"])))
    for ph in ("detect", "plan", "restore", "compile", "replay"):
        rows.append((f"{ph} s", f"{pe['seconds'][ph]:.4f}", ""))
    for ph, v in cr["seconds"].items():
        rows.append((f"{ph} s", "", f"{v:.4f}"))
    rows.append(("recovery s", f"{pe['recovery_s']:.3f}", f"{cr['recovery_s']:.3f}"))
    rows.append(("recovery steps", f"{pe['recovery_steps']:.1f}", f"{cr['recovery_steps']:.1f}"))
    rows.append(("checkpoint interval", "", str(cr["interval"])))
    w = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"  {r[0]:<{w}}  {r[1]:>12}  {r[2]:>20}")
    print(f"  recovery speedup vs checkpoint+restart: {out['speedup']:.1f}x "
          f"(degraded mesh compiled ahead: {pe['compiled_ahead']})")
