"""One variant of `resilax bench multiprocess`, repeated: kill -> back at the step, by phase.

    python benchmarks/mp_one_variant.py --variant in_place --runs 6 --json out.json

Runs the failure-free single-process reference once (kept in ``--workdir``), then the
chosen variant ``--runs`` times with the bench's own settings (4 x 2, ``cpu-4x2``, 40 steps,
a checkpoint every 5, ``--collective-timeout 5``, one random worker SIGKILLed past step 12),
each with its own seed. Variants: ``store`` (path B, host stores), ``restart`` (path B,
``--host-store-every 0``), ``spares`` (path B with 4 warm spares), ``in_place``
(``--in-place --shrink backend``), ``shrink`` (``--in-place``: re-form alone), ``reform``
(``--in-place --spares 1``). A run that fails is counted, with its error, not raised.
Prints one line per run and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import shutil
import subprocess
import sys
import time

import numpy as np

from resilax._src.io import write_json
from resilax.tools import bench_multiprocess as bench

VARIANTS = {
    "store": {"store_every": 1},
    "restart": {"store_every": 0},
    "spares": {"store_every": 1, "spares": 4},
    "standby": {"store_every": 1, "standby": True},
    "in_place": {"store_every": 1, "in_place": True, "shrink": "backend"},
    "shrink": {"store_every": 1, "in_place": True},
    "reform": {"store_every": 1, "in_place": True, "spares": 1},
}
TRAIN = ["resilax", "train", "--topology", "cpu-4x2", "--layout", "sharded", "--steps", "40",
         "--checkpoint-every", "5", "--log-every", "10"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="/tmp/resilax-mp-one-variant")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = pathlib.Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ref_p = work / "ref.npz"
    if not ref_p.exists():
        r = subprocess.run([sys.executable, "-m", *TRAIN, "--no-log", "--no-peers", "--quiet", "--checkpoint-dir",
                            str(work / "ref_ck"), "--out", str(ref_p)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"the reference run failed:\n{r.stderr[-3000:]}")
    ref = np.load(ref_p, allow_pickle=False)
    out = []
    for i in range(a.runs):
        d = work / f"{a.variant}{i}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        with open("/proc/loadavg") as f:
            load = float(f.read().split()[0])
        try:
            r = bench._kill_and_time(d, TRAIN, n=4, devices_per_process=2, kill_after=12,
                                     rng=random.Random(a.seed * 1000 + i), ref=ref, collective_timeout=5,
                                     **VARIANTS[a.variant])
            row = {k: r.get(k) for k in ("kill_to_resume_s", "phases", "lost_steps", "final_max_rel_diff",
                                         "kill_step", "restored_step", "generations",
                                         "marks_after_noticed_s")}
        except RuntimeError as e:
            row = {"error": str(e)}
        row["load_before"] = load
        out.append(row)
        print(json.dumps(row)[:400], flush=True)
        time.sleep(1)
    if a.json:
        write_json(a.json, {"variant": a.variant, "runs": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
