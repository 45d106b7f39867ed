"""What a checkpoint save costs the step loop on this machine, save by save: the tiny GPT of
`resilax bench gpt` under `Config()` + checkpoints every ``--every`` steps, each step waited
on, and for each save the loop's time above the median step in the ``--every`` steps after
it. Run it under py-spy to see which threads held the GIL meanwhile:

    py-spy record -r 200 --gil --threads --nonblocking --format raw -o /tmp/save_raw.txt -- \\
        python benchmarks/save_profile.py --json benchmarks/results/save_profile.json
    python benchmarks/pyspy_threads.py /tmp/save_raw.txt --top 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--per-leaf", action="store_true", help="one array per leaf instead of packed (the default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from resilax.tools.runner import configure_cpu_devices

    configure_cpu_devices(8)
    import jax

    from resilax._src.io import write_json
    from resilax.tools import bench_gpt, gpt

    sz = gpt.SIZES["tiny"]
    variant = bench_gpt.PER_LEAF if args.per_leaf else "default_ckpt"
    step, state = bench_gpt._wrapped(variant, sz, bench_gpt._topology(), tempfile.mkdtemp(prefix="resilax-save-"), args.every)
    batches = gpt.batches(sz, 8)
    ts = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, m))
        ts.append((step.step, time.perf_counter() - t0))
        if (i + 1) % 50 == 0:
            print(f"  step {i + 1}/{args.steps}", file=sys.stderr, flush=True)
    step.close()
    med = statistics.median(t for _, t in ts)
    windows: dict[int, float] = {}
    for k, t in ts:
        if k > args.every:  # the steps after save s (saved at the end of step s * every)
            s = (k - 1) // args.every
            windows[s] = windows.get(s, 0.0) + max(0.0, t - med)
    res = {"variant": variant, "steps": args.steps, "every": args.every, "median_step_ms": med * 1e3,
           "save_cost_ms": [v * 1e3 for v in windows.values()]}
    print(f"{variant}: median step {med * 1e3:.1f} ms; each save cost the loop (ms above the median, "
          f"{args.every} steps after it): {[round(v) for v in res['save_cost_ms']]}; median "
          f"{statistics.median(res['save_cost_ms']):.0f} ms")
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
