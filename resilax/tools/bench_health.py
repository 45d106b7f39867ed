"""``resilax bench health``: what the slice health checks and the bit-exact mode cost and
how fast they act, on the example MLP (every protection on).

- ``deterministic_overhead_ratio``: the bit-exact mode against the default mode, step time
  (median), interleaved round-robin in one process (cpu-2x4, state sharded inside a slice);
- ``health_overhead_ratio``: the bit-exact mode with `HealthConfig` (defaults: the replica
  checksums at the auto cadence, the liveness watchdog, straggler timing) against without,
  interleaved the same way, timed once the cadence is chosen and a checkpoint committed
  (every variant checkpoints every ``--checkpoint-every`` steps); ``health_every_step_ratio``
  the same with ``sdc_every=1`` (checked before every step);
- ``sdc_detect_steps`` / ``sdc_domain_identified``: a ``bitflip`` on slice 2 of cpu-4x2:
  steps between the flip and the ``sdc`` event, and whether the flipped slice was named;
- ``rejoin_s``: slice 1 lost then back: seconds of the ``rejoin`` (copy + protections).
- ``hang_detect_s``: a ``hang_slice`` on slice 3 of the same run, default `HealthConfig`
  (probes every 1 s, 5 s probe timeout): seconds from the hang to the domain declared hung;
  ``step_deadline_s``: the step deadline in force then (``max(5 s, 10 x median call)``).
  The hang is emulated at resilax's dispatch (``runtime/health.py``); under ``resilax
  launch`` the supervisor's step deadline finds real hung workers (``bench multiprocess``).

Prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from resilax.tools.argtypes import int_at_least, output_path



def add_arguments(parser) -> None:
    from resilax.tools.bench import option_adder

    opt = option_adder(parser)
    opt("--json", type=output_path, default=None, help="write results here")
    opt("--steps", type=int_at_least(1), default=100, help="timed steps per variant")
    opt("--hidden", type=int_at_least(1), default=512)
    opt("--batch", type=int_at_least(1), default=256)
    opt("--quiet", action="store_true")
    opt("--checkpoint-every", type=int_at_least(1), default=100, help="every variant saves a checkpoint this often")


def _wrap(topo, state, cfg, faults=()):
    import resilax
    from resilax.tools import example as ex

    step = resilax.wrap(ex.train_step, topology=topo, config=cfg, faults=resilax.FaultPlan(list(faults)),
                        state_sharding=ex.fsdp_specs(state, topo.axis_names[1], topo.axis_sizes[1]))
    return step, step.init(state)


class _Settling:
    """A wrapped step whose ``settled()`` says the replica-check cadence is chosen and a
    checkpoint committed (what the interleaving loop waits for before timing)."""

    def __init__(self, step):
        self.step = step
        self.wait_compiled = step.wait_compiled

    def settled(self) -> bool:
        c = self.step.sdc_cadence()
        return c is None or (c["phase"] in ("set", "fixed") and c["rebuildable"])

    def __call__(self, state, batch):
        return self.step(state, batch)


def _interleaved(topo, template, batches, configs: dict, steps: int, quiet: bool):
    from resilax.tools.bench import interleave

    runs = {k: _wrap(topo, template, c) for k, c in configs.items()}
    steps_, states = {k: _Settling(r[0]) for k, r in runs.items()}, {k: r[1] for k, r in runs.items()}
    times = interleave(steps_, states, batches, steps, desc="bench health", quiet=quiet)
    cadence = {k: s.step.sdc_cadence() for k, s in steps_.items() if s.step.sdc_cadence() is not None}
    for s in steps_.values():
        s.step.close()
    return {k: statistics.median(t) for k, t in times.items()}, cadence


def bench_health(args) -> dict:
    import resilax
    from resilax.tools.runner import configure_cpu_devices

    configure_cpu_devices(8)
    import jax

    from resilax.tools import example as ex

    spec = ex.ExampleSpec(hidden=args.hidden, batch=args.batch)
    it = ex.make_iterator(spec)
    batches = [next(it) for _ in range(16)]
    template = ex.make_state(spec)
    det = resilax.DeterministicConfig()
    topo = resilax.Topology.load("cpu-2x4")
    tmp = tempfile.mkdtemp(prefix="resilax-bench-health-")

    def ck(name):
        return resilax.CheckpointConfig(os.path.join(tmp, name), every=args.checkpoint_every)

    try:
        med, cadence = _interleaved(topo, template, batches, {
            "default": resilax.Config(checkpoint=ck("default")),
            "deterministic": resilax.Config(deterministic=det, checkpoint=ck("det")),
            "deterministic_health": resilax.Config(deterministic=det, health=resilax.HealthConfig(),
                                                   checkpoint=ck("det_health")),
            "deterministic_health_every_step": resilax.Config(
                deterministic=det, health=resilax.HealthConfig(sdc_every=1), checkpoint=ck("det_health1")),
        }, args.steps, args.quiet)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict = {"benchmark": "health", "platform": jax.devices()[0].platform, "steps": args.steps,
                 "checkpoint_every": args.checkpoint_every,
                 "model": {"hidden": spec.hidden, "batch": spec.batch,
                           "state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(template)))},
                 "step_s": med,
                 "deterministic_overhead_ratio": med["deterministic"] / med["default"],
                 "health_overhead_ratio": med["deterministic_health"] / med["deterministic"],
                 "health_every_step_ratio": med["deterministic_health_every_step"] / med["deterministic"],
                 "sdc_cadence": {k: {kk: vv for kk, vv in c.items() if kk != "decisions"} | {
                     "decision": c["decisions"][-1] if c["decisions"] else None} for k, c in cadence.items()},
                 }
    # silent data corruption on 4 slices: flip at 6 on slice 2
    topo4 = resilax.Topology.load("cpu-4x2")
    step, state = _wrap(topo4, template, resilax.Config(deterministic=det, health=resilax.HealthConfig()),
                        ["bitflip@6/2", "fail_slice@10:mid_step/1", "rejoin@14/1", "hang_slice@16/3"])
    for i in range(20):
        state, _ = step(state, batches[i % len(batches)])
    step.close()
    flip = next(e for e in step.events if e.kind == "bitflip")
    sdc = [e for e in step.events if e.kind == "sdc"]
    rejoin = next(e for e in step.events if e.kind == "rejoin")
    hang = next(e for e in step.events if e.kind == "hang")
    deadline = step._step_deadline_s
    out.update({
        "sdc_detect_steps": (sdc[0].step - flip.step) if sdc else None,
        "sdc_domain_identified": bool(sdc) and sdc[0].fields["bad_domains"] == [flip.fields["domain"]],
        "rejoin_s": rejoin.fields["seconds"]["total"],
        "rejoin_bytes": rejoin.fields["bytes_moved"],
        "hang_detect_s": hang.fields["detected_s"], "hang_found_by": hang.fields["reason"],
        "hang_domain_identified": hang.fields["domain"] == 3,
        "step_deadline_s": deadline,
    })
    return out


def _table(r) -> None:
    print(f"\nresilax bench health  ({r['platform']}, MLP hidden {r['model']['hidden']}, batch {r['model']['batch']}, "
          f"{r['model']['state_bytes'] / 1e6:.1f} MB state, {r['steps']} interleaved steps)")
    for k, v in r["step_s"].items():
        print(f"  {k:<22} {v * 1e3:8.2f} ms/step (median)")
    print(f"  deterministic_overhead_ratio  {r['deterministic_overhead_ratio']:.3f}  (bit-exact / default mode)")
    c = r["sdc_cadence"].get("deterministic_health", {})
    d = c.get("decision") or {}
    print(f"  health_overhead_ratio         {r['health_overhead_ratio']:.3f}  (health checks on / off; replica "
          f"checks every {c.get('every')} steps: check {d.get('check_s', float('nan')) * 1e3:.2f} ms, "
          f"share {d.get('share', float('nan')):.3%})")
    print(f"  health_every_step_ratio       {r['health_every_step_ratio']:.3f}  (replica checks before every step)")
    print(f"  sdc_detect_steps              {r['sdc_detect_steps']}  (domain identified: {r['sdc_domain_identified']})")
    print(f"  rejoin_s                      {r['rejoin_s']:.3f}  ({r['rejoin_bytes']:,} bytes copied)")
    print(f"  hang_detect_s                 {r['hang_detect_s']:.3f}  (found by {r['hang_found_by']}, "
          f"domain identified: {r['hang_domain_identified']})")
    print(f"  step_deadline_s               {r['step_deadline_s']:.3f}")


def run(args) -> int:
    from resilax.tools.bench import write_result

    r = bench_health(args)
    _table(r)
    write_result(getattr(args, "json", None), r)
    return 0
