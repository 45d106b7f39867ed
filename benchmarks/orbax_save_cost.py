"""What one Orbax save costs the process, by number of leaves (issue 26, item 2).

A resilax save blocks its caller for a dispatch; the copy to host, the checksums and Orbax's
write run on background threads. Those threads still take the host's CPU and the GIL, so
the steps beside them slow down: on one H100 the 110 M GPT's later saves slowed the next
steps by 0.8-0.9 s in all (docs/performance.md), against a 0.22 s host copy of the state.
This bench measures the part that grows with the leaves: Orbax's own Python per save.

It saves trees of N small arrays (N = ``--leaves``; each replicated on the mesh, or sharded
over its 8 emulated CPU devices) through the CheckpointManager resilax's store builds
(`orbax_warm.manager`; synchronous, so each save is timed whole), ``--saves`` times each,
and reports the median wall time per save and the process CPU time per save. The arrays are
a few hundred bytes: what is left is Orbax's fixed and per-leaf work. Prints a table and
writes JSON.

    python benchmarks/orbax_save_cost.py --json benchmarks/results/orbax_save_cost.json

2026-11-27, this machine (2 cores), orbax-checkpoint 0.12.8: ~40 ms per save plus ~3 ms per
replicated leaf and ~5.5 ms per leaf sharded over 8 devices, nearly all of it CPU time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", default="1,8,32,62,128", help="comma-separated leaf counts")
    p.add_argument("--saves", type=int, default=8, help="timed saves per case (after one untimed)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from resilax._src.io import write_json
    from resilax._src.protect import orbax_warm

    mesh = Mesh(np.array(jax.devices()), ("d",))
    rows = []
    for layout, spec in (("replicated", P()), ("sharded x8", P("d"))):
        leaf = jax.device_put(np.arange(64, dtype=np.float32), NamedSharding(mesh, spec))
        for n in [int(x) for x in args.leaves.split(",")]:
            tree = {f"a{i:04d}": leaf for i in range(n)}
            d = tempfile.mkdtemp(prefix="resilax-orbax-cost-")
            try:
                opts = ocp.CheckpointManagerOptions(max_to_keep=3, create=True, cleanup_tmp_directories=True,
                                                    enable_async_checkpointing=False)
                mgr = orbax_warm.manager(d, opts, ("state",))[0]
                mgr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))  # Orbax's start-up
                walls = []
                c0 = time.process_time()
                for i in range(1, args.saves + 1):
                    t0 = time.perf_counter()
                    mgr.save(i, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
                    mgr.wait_until_finished()
                    walls.append(time.perf_counter() - t0)
                cpu = (time.process_time() - c0) / args.saves
                mgr.close()
            finally:
                shutil.rmtree(d, ignore_errors=True)
            rows.append({"layout": layout, "leaves": n, "wall_ms": statistics.median(walls) * 1e3,
                         "cpu_ms": cpu * 1e3})
            print(f"  {layout:<11} {n:>5} leaves: {rows[-1]['wall_ms']:7.1f} ms wall, {rows[-1]['cpu_ms']:7.1f} ms CPU "
                  f"per save", file=sys.stderr, flush=True)
    fits = {}
    for layout in ("replicated", "sharded x8"):
        r = [x for x in rows if x["layout"] == layout]
        if len(r) >= 2:  # least squares: wall = fixed + per_leaf * leaves
            xs, ys = [x["leaves"] for x in r], [x["wall_ms"] for x in r]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            per = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
            fits[layout] = {"fixed_ms": my - per * mx, "per_leaf_ms": per}
    import orbax.checkpoint

    out = {"bench": "orbax_save_cost", "orbax_checkpoint": orbax.checkpoint.__version__, "devices": len(jax.devices()),
           "cpu_count": os.cpu_count(), "saves": args.saves, "rows": rows, "fit": fits}
    print(f"\n{'layout':<12}{'leaves':>8}{'wall ms':>10}{'CPU ms':>10}")
    for x in rows:
        print(f"{x['layout']:<12}{x['leaves']:>8}{x['wall_ms']:>10.1f}{x['cpu_ms']:>10.1f}")
    for k, f in fits.items():
        print(f"{k}: ~{f['fixed_ms']:.0f} ms per save + {f['per_leaf_ms']:.2f} ms per leaf")
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
