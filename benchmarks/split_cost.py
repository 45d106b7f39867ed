"""What the grad/update split and the in-program skip gate cost on their own.

resilax runs a wrapped step as two executables (the grad part, then the update part on the
recorded values: what replay re-runs bitwise) and applies the update under a ``lax.cond``
on the anomaly verdict (a NaN or a spike skips it inside the program). Both put a barrier
between the backward pass and the optimizer update: the update starts only when every
gradient exists (and, gated, when the verdict over all of them is known). A plain jitted
step has no barrier, so XLA may start a layer's update while the backward pass is still
running. This check separates the two, on executables only (no resilax Python on the
loop, no protection but the anomaly verdict):

- ``plain``: ``jax.jit(train_step)``, state donated (the bench's baseline); ``plain_aa``:
  a second one (the A/A noise floor);
- ``fused``: resilax's own grad and update functions (anomaly verdict, ``cond`` gate) in
  ONE program: the gate without the split;
- ``fused_ungated``: the user's step cut at `resilax.record` and put back together in one
  program, no gate: the cut itself, which should cost nothing;
- ``split_ungated``: the grad part and the update part as two executables, no gate: the
  split without the gate;
- ``split``: resilax's own two executables (`Program.grad`, `Program.update`): what a
  wrapped step runs with every protection but the verdict off.

Same model and layouts as `resilax bench protection` (41 MB of AdamW state; ``sharded``:
over all 8 emulated devices of cpu-2x4; ``replicated``: inside a slice). Steps timed as a
loop runs them, interleaved in blocks (`resilax.tools.bench.interleave`, ``timing="loop"``),
each variant feeding the same batches. Prints a table and writes JSON; not a test.

    python benchmarks/split_cost.py --steps 150 --json benchmarks/results/split_cost.json
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ("plain", "plain_aa", "fused", "fused_ungated", "split_ungated", "split")


def measure(layout_name: str, steps: int, quiet: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import resilax
    from resilax.tools import example as ex
    from resilax.tools.bench import interleave
    from resilax.tools.bench_protection import _layouts

    topo = resilax.Topology.load("cpu-2x4")
    spec = ex.ExampleSpec(hidden=1024, depth=4, features=256, batch=256)
    it = ex.make_iterator(spec)
    batches = [next(it) for _ in range(16)]
    template = ex.make_state(spec)
    specs = _layouts(topo, [layout_name])[layout_name](template)
    # resilax's own executables: a wrapped step with only the anomaly verdict on, run once
    # so that its program exists; its grad and update executables are then called directly
    w = resilax.wrap(ex.train_step, topology=topo, state_sharding=specs, config=resilax.Config(log=None, peers=None))
    s = w.init(template)
    s, _ = w(s, batches[0])
    prog, guard = w._program, w._guard
    split = prog.spec.split
    state_sh, batch_sh, rep = prog.state_sh, prog.batch_sh, prog.rep
    zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), prog.spec.abstract_batch)
    grad_fn, update_fn = prog._grad_fn(1, False), prog._update_fn(None)

    def fused(state, guard, batch, k):
        g = grad_fn(state, guard, batch, k)
        new, _, _ = update_fn(state, g.rec, g.ok, k)
        return new, g.metrics

    def update_ungated(state, rec, k):
        return split.update(state, zeros, k, rec)

    def fused_ungated(state, batch, k):
        rec, _, metrics = split.grad(state, batch, k)
        return update_ungated(state, rec, k), metrics

    plain = jax.jit(ex.train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0)
    plain_aa = jax.jit(ex.train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0)
    f_gated = jax.jit(fused, in_shardings=(state_sh, jax.tree.map(lambda _: rep, guard), batch_sh, rep), out_shardings=(state_sh, None),
                      donate_argnums=0)
    f_ungated = jax.jit(fused_ungated, in_shardings=(state_sh, batch_sh, rep), out_shardings=(state_sh, None),
                        donate_argnums=0)
    g_ungated = jax.jit(lambda st, b, k: split.grad(st, b, k), in_shardings=(state_sh, batch_sh, rep),
                        out_shardings=(prog.rec_sh, None, None))
    u_ungated = jax.jit(update_ungated, in_shardings=(state_sh, prog.rec_sh, rep), out_shardings=state_sh,
                        donate_argnums=0)
    g_exe, u_exe = prog.grad(False), prog.update(None)
    k0 = np.uint32(0)

    def run_split(st, b):
        g = g_exe(st, guard, b, k0)
        new, _, _ = u_exe(st, g.rec, g.ok, k0)
        return new, g.metrics

    def run_split_ungated(st, b):
        rec, _, metrics = g_ungated(st, b, k0)
        return u_ungated(st, rec, k0), metrics

    runs = {"plain": plain, "plain_aa": plain_aa, "fused": lambda st, b: f_gated(st, guard, b, k0),
            "fused_ungated": lambda st, b: f_ungated(st, b, k0), "split_ungated": run_split_ungated, "split": run_split}
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=state_sh)
    states = {k: copy(template) for k in runs}
    dev_batches = [jax.device_put(b, batch_sh) for b in batches]
    times = interleave(runs, states, dev_batches, steps, desc=f"split cost ({layout_name})", quiet=quiet, timing="loop")
    # the cut and the gate must not change the maths: one step of each from the same state
    one = {}
    for k in ("plain", "fused", "fused_ungated", "split_ungated", "split"):
        st, _ = runs[k](copy(template), dev_batches[0])
        one[k] = [np.asarray(x) for x in jax.tree.leaves(st)]
    same = {k: all(np.array_equal(a, b) for a, b in zip(one["plain"], v)) for k, v in one.items() if k != "plain"}
    w.close()
    med = {k: statistics.median(t) for k, t in times.items()}
    return {"step_s": med, "ratio": {k: med[k] / med["plain"] for k in med},
            "bitwise_equal_to_plain_after_one_step": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="timed steps per variant and layout")
    ap.add_argument("--layouts", default="sharded,replicated")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    import jax

    from resilax.tools.bench import write_result

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    t0 = time.time()
    out = {"benchmark": "split_cost", "steps": args.steps, "timing": "loop", "layouts": {}}
    for lay in [x for x in args.layouts.split(",") if x]:
        out["layouts"][lay] = measure(lay, args.steps, args.quiet)
    out["seconds"] = time.time() - t0
    names = list(VARIANTS)
    lays = list(out["layouts"])
    print("\n| variant | " + " | ".join(f"{lay}: ms (ratio)" for lay in lays) + " |")
    print("|---|" + "---|" * len(lays))
    for k in names:
        cells = [f"{out['layouts'][lay]['step_s'][k] * 1e3:.1f} ({out['layouts'][lay]['ratio'][k]:.3f})" for lay in lays]
        print(f"| {k} | " + " | ".join(cells) + " |")
    for lay in lays:
        print(f"{lay}: bitwise equal to plain after one step: {out['layouts'][lay]['bitwise_equal_to_plain_after_one_step']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
