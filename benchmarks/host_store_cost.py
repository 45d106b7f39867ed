"""The failure-free cost of host stores across hosts: step time with each worker storing its
shards every step and mirroring them to the next host's store server, against the same job
with host stores off (``--host-store-every 0``), interleaved in one run.

Runs ``--nodes`` agents on loopback (each its own process group, as a host) x 1 worker x
``--devices`` CPU devices, ``resilax train --layout sharded --no-deterministic --curve``
(the default mode: each process holds its own shards, so the mirror is sent every step),
no checkpoints, no failure. Each job's process 0 reports every step's seconds (``--curve``)
and what storing cost its step loop (the summary's ``host_store``: the time each stored
step spent on the loop's path, of which waiting for the previous step's mirror). The
median step after ``--warmup`` steps is compared, store on over store off, per pair of
jobs and over all. Prints a table and writes JSON.

    python benchmarks/host_store_cost.py --nodes 2 --steps 80 --repeat 2 --json benchmarks/results/host_store_cost.json

On this machine host and "devices" share 2 cores, so the store's copy competes with the
step's compute; on a GPU the device-to-host copy and the send run beside the device.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from resilax._src.io import write_json
from resilax.tools.bench_multihost import _topology


def run_job(work: pathlib.Path, nodes: int, devices: int, steps: int, every: int, timeout: float) -> dict:
    run, summ = work / "run", work / "summary.json"
    train = ["resilax", "train", "--topology", _topology(work, 1, devices, nodes), "--layout", "sharded",
             "--no-deterministic", "--batch", "48", "--steps", str(steps), "--checkpoint-every", "0", "--curve",
             "--log-every", str(steps), "--summary", str(summ)]
    agents = []
    for r in range(nodes):
        log = open(work / f"agent{r}.log", "wb")
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "resilax", "launch", "--nodes", str(nodes), "--node-rank", str(r), "--run-dir",
             str(run), "-n", "1", "--devices-per-process", str(devices), "--host-store-every", str(every), "--",
             *train], env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
        log.close()
    try:
        rcs = [a.wait(timeout=timeout) for a in agents]
    finally:
        for a in agents:
            try:
                os.killpg(a.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if any(rcs):
        raise RuntimeError(f"agents exited {rcs}; logs in {work}")
    return json.loads(summ.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=2, help="pairs of jobs (store on, store off), interleaved")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.steps <= args.warmup + 5:
        p.error("--steps must exceed --warmup by more than 5")
    root = pathlib.Path(tempfile.mkdtemp(prefix="resilax-store-cost-"))
    pairs = []
    t0 = time.time()
    for i in range(args.repeat):
        pair = {}
        for every in (1, 0) if i % 2 == 0 else (0, 1):
            work = root / f"r{i}.every{every}"
            work.mkdir()
            print(f"[{i + 1}/{args.repeat}] host stores {'on (every step, mirrored)' if every else 'off'} ...",
                  flush=True)
            s = run_job(work, args.nodes, args.devices, args.steps, every, args.timeout)
            step_s = s["curve"]["step_s"][args.warmup:]
            pair["on" if every else "off"] = {"median_step_s": statistics.median(step_s),
                                              "steps_timed": len(step_s), "host_store": s.get("host_store")}
        pair["ratio"] = pair["on"]["median_step_s"] / pair["off"]["median_step_s"]
        pairs.append(pair)
    hs = [x["on"]["host_store"] for x in pairs]
    res = {
        "benchmark": "host_store_cost",
        "setup": {"nodes": args.nodes, "workers_per_node": 1, "devices_per_process": args.devices, "steps": args.steps,
                  "warmup": args.warmup, "repeat": args.repeat, "mode": "default (--no-deterministic)",
                  "layout": "sharded", "cpu_count": os.cpu_count(), "loopback": True},
        "pairs": pairs,
        "ratio_median": statistics.median(x["ratio"] for x in pairs),
        "store_s_per_write_median": statistics.median(h["median_s"] for h in hs),
        "waited_s_per_write": statistics.median(h["waited_s"] / max(h["writes"], 1) for h in hs),
        "mirror_errors": [h["mirror_error"] for h in hs if h["mirror_error"]],
        "wall_s": time.time() - t0,
    }
    print(f"\nhost stores across hosts, failure-free ({args.nodes} agents x 1 worker x {args.devices} CPU devices on "
          f"loopback, default mode, {args.steps} steps, median after {args.warmup}; {os.cpu_count()} cores)")
    print(f"{'pair':<6}{'off ms/step':>13}{'on ms/step':>12}{'on/off':>8}{'store ms/write':>16}{'of it waited ms':>16}")
    for i, x in enumerate(pairs):
        h = x["on"]["host_store"]
        print(f"{i:<6}{x['off']['median_step_s'] * 1e3:>13.1f}{x['on']['median_step_s'] * 1e3:>12.1f}"
              f"{x['ratio']:>8.3f}{h['median_s'] * 1e3:>16.2f}{h['waited_s'] / max(h['writes'], 1) * 1e3:>16.2f}")
    print(f"median on/off {res['ratio_median']:.3f}; mirror errors: {res['mirror_errors'] or 'none'}")
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
