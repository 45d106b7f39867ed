"""The CPU a checkpoint save takes from the process, on the tiny GPT (issue 26, item 2).

On emulated CPU devices the "device" is the same 2 cores as the host, so whatever CPU a save
uses beside the loop shows up as save blocking (the steps' time above the median). This
bench runs, per variant, ``--steps`` steps of `resilax bench gpt`'s tiny GPT with a save
every ``--every`` (none for the variants without checkpoints), and reads the process's CPU
time (user + system, every thread) around them: plain `jax.jit`, jit + Orbax async saves,
resilax `Config()`, `Config()` + checkpoints (packed, the default), the same per leaf. The CPU per save
is a variant's CPU minus its base's (plain for Orbax, `Config()` for resilax), over the
number of saves. Prints a table and writes JSON.

    python benchmarks/save_cpu_cost.py --json benchmarks/results/save_cpu_cost.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from resilax._src.io import write_json

VARIANTS = ("plain", "orbax", "default", "default_ckpt", "default_ckpt_per_leaf")
BASE = {"orbax": "plain", "default_ckpt": "default", "default_ckpt_per_leaf": "default"}


def _one(variant: str, steps: int, every: int, directory: str) -> dict:
    import jax

    from resilax.tools import bench_gpt, gpt

    sz = gpt.SIZES["tiny"]
    topo = bench_gpt._topology()
    if variant in ("plain", "orbax"):
        mesh = topo.mesh([list(d) for d in topo.domains()])
        step = bench_gpt._Plain(sz, mesh, topo.num_devices, directory if variant == "orbax" else None, every,
                                split=False)
        state = step.state
    else:
        step, state = bench_gpt._wrapped(variant, sz, topo, directory, every)
    batches = gpt.batches(sz, 8)
    for i in range(every + 5):  # compiles and a first save (its own, separately measured cost)
        state, m = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    bench_gpt._finish(step)
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(steps):
        state, m = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    bench_gpt._finish(step)
    out = {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}
    step.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="each variant this many times, interleaved")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import resilax

    resilax.request_cpu_devices(8)
    tmp = tempfile.mkdtemp(prefix="resilax-save-cpu-")
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        for r in range(args.rounds):
            for v in VARIANTS:  # (per leaf: `bench_gpt._wrapped` switches the store's PACK off for it)
                runs[v].append(_one(v, args.steps, args.every, os.path.join(tmp, f"{v}-{r}")))
                print(f"  round {r + 1}/{args.rounds} {v}: {runs[v][-1]['cpu_s']:.2f} CPU-s", file=sys.stderr,
                      flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    saves = args.steps // args.every
    cpu = {v: min(x["cpu_s"] for x in runs[v]) for v in VARIANTS}  # the least disturbed run of each
    per_save = {v: (cpu[v] - cpu[b]) / saves for v, b in BASE.items()}
    print(f"\nsave CPU cost, tiny GPT, {args.steps} steps, a save every {args.every} ({saves} saves), "
          f"best of {args.rounds}")
    print(f"{'variant':<22}{'CPU s':>8}{'CPU ms per save':>17}")
    for v in VARIANTS:
        extra = f"{per_save[v] * 1e3:>17.0f}" if v in per_save else ""
        print(f"{v:<22}{cpu[v]:>8.2f}{extra}")
    res = {"bench": "save_cpu_cost", "steps": args.steps, "every": args.every, "saves": saves,
           "rounds": runs, "cpu_s": cpu, "cpu_per_save_s": per_save}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_json(args.json, res, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
