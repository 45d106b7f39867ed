"""The executor's part of `resilax bench pipeline`: for configs of at most 8 domains it runs
`resilax.PipelineExecutor` on emulated CPU devices (one per domain) and reports

- ``bitwise``: whether a rerouted run (the bench's lost domain from step 1), a
  replica-dropped run, a rejoined run (lost at step 1, back at step 2) and a resumed run
  (checkpoint at step 2, restored by a new executor on the remaining hardware) end with the
  healthy run's parameters, bit for bit;
- per-op times measured on those devices (F, B, W, BW of a middle stage of the same model
  256 wide, the median of repeated calls), and the throughput ratios the tables give with those costs instead of unit ones.

8 CPU devices share the host's cores, so the op times say how the ops compare, not how fast a
pipeline runs: a real overlap of stages needs accelerators.
"""

from __future__ import annotations

import tempfile
import time

STEPS = 4


def executor_check(healthy, rerouted, dropped) -> dict:
    """``measured`` for `bench_pipeline.bench_pipeline`: runs the executor on the tables'
    shape and schedule and returns ``{"rerouted", "dropped", "rejoined", "resumed"}`` (bools)
    plus ``op_seconds`` and ``measured_reroute_ratio`` / ``measured_drop_ratio``."""
    import jax
    import numpy as np
    import optax

    from resilax._src.pipeline import schedule as ps
    from resilax._src.pipeline.executor import PipelineExecutor
    from resilax.tools.pipeline_models import executor_case

    D, S, M, sched = healthy.replicas, healthy.stages, healthy.microbatches, healthy.schedule
    lost = sorted(rerouted.lost)[0]
    model, params, make_batches = executor_case(layers=2 * S)
    batches = make_batches(STEPS, batch=D * M * 2)
    tx = optax.adam(1e-2)

    def run(on_failure="reroute", events=(), lost_from_start=(), start=None):
        ex = PipelineExecutor(model, tx, params, replicas=D, stages=S, microbatches=M, schedule=sched,
                              on_failure=on_failure, lost=lost_from_start)
        if start is not None:
            ex.restore(start)
        while ex.step_no < STEPS:
            for at, what in events:
                if at == ex.step_no:
                    what(ex)
            jax.block_until_ready(ex(batches[ex.step_no]))
        ex.close()
        return jax.tree.leaves(ex.params())

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a, b))

    ref = run()
    out = {"rerouted": same(ref, run(events=[(1, lambda ex: ex.fail_domain(lost))])),
           "dropped": same(ref, run("drop", events=[(1, lambda ex: ex.fail_domain(lost))])),
           "rejoined": same(ref, run(events=[(1, lambda ex: ex.fail_domain(lost)),
                                             (2, lambda ex: ex.rejoin(lost))]))}
    with tempfile.TemporaryDirectory() as tmp:
        run(events=[(2, lambda ex: ex.save(tmp))])
        out["resumed"] = same(ref, run(lost_from_start=[lost], start=tmp))
    wide, wide_params, wide_batches = executor_case(width=256, layers=2 * S)  # ops of milliseconds, not microseconds
    costs = op_seconds(wide, tx, wide_params, wide_batches(1, batch=D * M * 32)[0], D, S, M)
    out["op_seconds"] = costs
    unit = {k: v / costs["F"] for k, v in costs.items()}
    unit["U"] = unit["W"]
    base = ps.simulate(healthy, costs=unit).step_time
    out["measured_reroute_ratio"] = round(base / ps.simulate(rerouted, costs=unit).step_time, 4)
    out["measured_drop_ratio"] = round(base / ps.simulate(dropped, costs=unit).step_time, 4)
    return out


def op_seconds(model, tx, params, batch, D, S, M, repeats: int = 30) -> dict:
    """Median seconds of F, B, W and BW of stage 1 (a middle stage) on its device."""
    import jax
    import numpy as np

    from resilax._src.pipeline.executor import PipelineExecutor

    ex = PipelineExecutor(model, tx, params, replicas=D, stages=S, microbatches=M)
    ex(batch)  # compiles every program
    s = 1 if S > 2 else S - 1
    dev = ex.devices[(0, s)]
    p = ex.state[(0, s)][0]
    width = np.shape(params["first"]["emb"])[1]
    rows = np.shape(jax.tree.leaves(batch)[0])[0] // (D * M)
    x = jax.device_put(np.ones((rows, width), np.float32), dev) if s > 0 else None
    mb = jax.device_put(jax.tree.map(lambda a: a[:rows], batch), dev)
    key = jax.device_put(jax.random.key(0), dev)
    fwd = ex._exe.fwd(s)
    out, vjp = fwd(p, x, mb, key, np.int32(s * ex.k))
    ct = jax.device_put(np.ones((), np.float32), dev) if s == S - 1 else jax.tree.map(lambda a: a * 0 + 1, out)
    calls = {"F": lambda: fwd(p, x, mb, key, np.int32(s * ex.k)), "B": lambda: ex._exe.bwd_x(vjp, ct),
             "W": lambda: ex._exe.bwd_w(vjp, ct), "BW": lambda: ex._exe.bwd(vjp, ct)}
    times = {}
    for name, call in calls.items():
        jax.block_until_ready(call())
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            samples.append(time.perf_counter() - t0)
        times[name] = float(np.median(samples))
    ex.close()
    return times


def protection_check(D: int, S: int, M: int, schedule: str, work: dict, steps: int = 3) -> dict:
    """The executor with a checkpoint and a peer copy of every stage every step, ``work``
    (``{"snapshot": u, "peer": u}`` per stage, as the protection row) as its units: whether
    every piece each domain dispatched in the last step went where the plan put it (the
    executed order, before which op, how many pieces), and whether the run ended with the
    same bits as one without protection."""
    import jax
    import numpy as np
    import optax

    from resilax._src.pipeline.executor import PipelineExecutor
    from resilax.tools.pipeline_models import executor_case

    model, params, make_batches = executor_case(layers=2 * S)
    batches = make_batches(steps, batch=D * M * 2)
    tx = optax.adam(1e-2)
    with tempfile.TemporaryDirectory() as tmp:
        ex = PipelineExecutor(model, tx, params, replicas=D, stages=S, microbatches=M, schedule=schedule,
                              checkpoint_dir=tmp, checkpoint_every=1, checkpoint_units=work["snapshot"],
                              peer_every=1, peer_units=work["peer"])
        for b in batches:
            ex(b)
        plan = ex.protection_plan()
        placed, ok = 0, True
        for d, ops in ex.executed.items():
            got = [(sum(o[0] == "op" for o in ops[:i]), o[0], o[3]) for i, o in enumerate(ops) if o[0] != "op"]
            src = {ex.bubbles._source(d[1]), ex.peer_copies._source(d[1])}
            want = [(o.before, o.kind, o.chunks) for o in plan.steady(d, 0)] if d in src else []
            ok = ok and got == want
            placed += sum(n for _, _, n in got)
        ex.close()
    plain = PipelineExecutor(model, tx, params, replicas=D, stages=S, microbatches=M, schedule=schedule)
    for b in batches:
        plain(b)
    same = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ex.params()), jax.tree.leaves(plain.params())))
    return {"executed_as_planned": bool(ok), "pieces_per_step": placed, "bitwise_with_protection": bool(same),
            "spilled_pieces": sum(o.chunks for ops in plan.ops.values() for o in ops if o.spill)}
