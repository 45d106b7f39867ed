"""`resilax bench replay`: what replay costs and what logging costs.

- replay seconds per step in each mode (grads: update part only; inputs: the whole step
  recomputed from the data position), over the plain step's seconds;
- log bytes per step per mode;
- failure-free overhead of logging: the wrapped step with the record log on disk in
  ``inputs`` and in ``grads`` mode (every step) over the wrapped step without a record log
  (``Config(log=None)``); the other protections are the defaults in every run. All runs step
  round-robin in one process (each step timed to completion, the order rotated every
  round), so load from elsewhere on the machine hits them alike. Baseline: two runs
  without a log, pooled; their ratio (A/A) is the noise floor. Reported as the ratio of
  medians and the ratio of means.
- replay runs alone after the overhead runs, dispatching asynchronously, while the step
  time above is timed step by step: on a loaded CPU the two are not strictly comparable.
  It is what ``init`` does after a crash (`ResilientStep.init` replays the disk log), timed
  by the run's goodput ``replay`` bucket (compilation is its own bucket, not counted), on a
  second ``init`` over the same log (the first one warms up).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time


from resilax._src.io import write_json
from resilax.tools.argtypes import int_at_least, output_path


def add_arguments(p) -> None:
    p.add_argument("--json", type=output_path, default=None, help="write results here")
    p.add_argument("--steps", type=int_at_least(1), default=60, help="steps per timed run")
    p.add_argument("--topology", default="cpu-2x4")


def _median_step_s(step, state, data, n):
    import jax

    times = []
    for _ in range(n):
        b = next(data)
        t0 = time.perf_counter()
        state, m = step(state, b)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return state, statistics.median(times)


def bench_replay(*, steps: int = 60, topology: str = "cpu-2x4") -> dict:
    import jax

    import resilax
    from resilax.tools import example as ex
    from resilax.tools.runner import configure_cpu_devices

    topo = resilax.Topology.load(topology)
    configure_cpu_devices(topo.num_devices)
    spec = ex.ExampleSpec()
    work = tempfile.mkdtemp(prefix="resilax-bench-replay-")
    out = {"benchmark": "replay", "topology": topology, "steps": steps,
           "platform": jax.devices()[0].platform, "replay_s_per_step": {}, "log_bytes_per_step": {}}

    def make(mode, tag):
        log = None if mode == "off" else resilax.LogConfig(directory=os.path.join(work, tag), mode=mode)
        return resilax.wrap(ex.train_step, topology=topo, config=resilax.Config(log=log))

    # Interleaved overhead: round-robin, one timed step of each run per round.
    runs = {"off": make("off", "off"), "off_control": make("off", "off2"), "inputs": make("inputs", "ovh-inputs"),
            "grads": make("grads", "ovh-grads")}
    datas = {k: ex.make_iterator(spec) for k in runs}
    states = {k: r.init(ex.make_state(spec), data=None if k.startswith("off") else datas[k]) for k, r in runs.items()}
    times = {k: [] for k in runs}
    order = list(runs)
    for i in range(steps + 3):
        # Rotate who goes first: a run right after the grads run shares the CPU with its
        # writer thread (a fixed order biased the A/A control by ~6%).
        for k in order[i % len(order):] + order[: i % len(order)]:
            r = runs[k]
            states[k], dt = _median_step_s(r, states[k], datas[k], 1)
            if i >= 3:  # compile and first steps
                times[k].append(dt)
    for r in runs.values():
        r.close()
    # Baseline: both runs without a log pooled; their ratio (A/A) is the noise floor.
    pooled = times["off"] + times["off_control"]
    base_med, base_mean = statistics.median(pooled), statistics.mean(pooled)
    out["step_s"] = base_med
    out["overhead"] = {
        k: {"median_s": statistics.median(t), "mean_s": statistics.mean(t),
            "ratio_of_medians": statistics.median(t) / base_med, "ratio_of_means": statistics.mean(t) / base_mean}
        for k, t in times.items() if not k.startswith("off")
    }
    aa = times["off_control"], times["off"]
    out["overhead"]["off_control"] = {
        "median_s": statistics.median(aa[0]), "mean_s": statistics.mean(aa[0]),
        "ratio_of_medians": statistics.median(aa[0]) / statistics.median(aa[1]),
        "ratio_of_means": statistics.mean(aa[0]) / statistics.mean(aa[1]),
    }
    out["logged_step_s"] = out["overhead"]["grads"]["median_s"]
    out["logging_overhead_ratio"] = out["overhead"]["grads"]["ratio_of_medians"]

    # Replay cost per mode: record `steps` steps, then time init (which replays them all).
    for mode in ("grads", "inputs"):
        rec = make(mode, mode)
        data = ex.make_iterator(spec)
        s = rec.init(ex.make_state(spec), data=data)
        for _ in range(steps):
            s, _ = rec(s, next(data))
        rec.close()
        log_dir = os.path.join(work, mode)
        kinds = ("grads", "inputs") if mode == "grads" else ("inputs",)
        nbytes = sum(os.path.getsize(os.path.join(log_dir, f)) for f in os.listdir(log_dir)
                     if f.endswith(".rxl") and f.split(".")[1] in kinds)
        out["log_bytes_per_step"][mode] = nbytes / steps
        for attempt in ("warm-up", "timed"):  # a fresh process's init on the log, twice
            rep = make(mode, mode)
            s = rep.init(ex.make_state(spec), data=ex.make_iterator(spec))
            jax.block_until_ready(s)
            ev = [e.fields for e in rep.events if e.kind == "replay"]
            replay_s = rep.goodput()["replay"]
            rep.close()
            if not ev or ev[-1]["steps"] != steps:
                break  # init could not replay the whole log (it quarantines what it cannot replay)
        ev = dict(ev[-1]) if ev else {"steps": 0, "unreplayable": [{"step": 0, "reason": "no replay event"}]}
        out[f"replayed_steps_{mode}"] = ev["steps"]
        out[f"replay_event_{mode}"] = ev
        if ev["steps"] == steps:
            out["replay_s_per_step"][mode] = replay_s / steps
        else:  # reported, not hidden: the table says n/a and why
            out["replay_s_per_step"][mode] = None
            out.setdefault("replay_errors", {})[mode] = (
                f"init replayed {ev['steps']} of {steps} logged steps ({attempt}): {ev.get('unreplayable')}")
    out["replay_over_step"] = {m: None if v is None else v / out["step_s"] for m, v in out["replay_s_per_step"].items()}
    shutil.rmtree(work, ignore_errors=True)
    return out


def print_table(r: dict) -> None:
    print(f"\nresilax bench replay  ({r['topology']}, {r['platform']}, example MLP, {r['steps']} steps)")
    print(f"  {'':28s}{'grads':>14s}{'inputs':>14s}")
    g, i, o = r["replay_s_per_step"], r["log_bytes_per_step"], r["replay_over_step"]

    def cell(v, scale, fmt):
        return f"{'n/a':>14s}" if v is None else f"{v * scale:14{fmt}}"

    print(f"  {'replay ms/step':28s}{cell(g['grads'], 1e3, '.2f')}{cell(g['inputs'], 1e3, '.2f')}")
    print(f"  {'replay / step time':28s}{cell(o['grads'], 1, '.3f')}{cell(o['inputs'], 1, '.3f')}")
    print(f"  {'log bytes/step':28s}{i['grads']:14.0f}{i['inputs']:14.0f}")
    print(f"  step time (wrapped, no log)   {r['step_s'] * 1e3:.2f} ms (median)")
    print("  failure-free overhead, wrapped step / wrapped step without a log (two runs pooled; interleaved):")
    print(f"  {'':28s}{'ratio of medians':>18s}{'ratio of means':>16s}")
    labels = {"inputs": "inputs log, every step", "grads": "grads log, every step", "off_control": "A/A: no log / no log"}
    for k in ("inputs", "grads", "off_control"):
        o = r["overhead"][k]
        print(f"  {labels[k]:28s}{o['ratio_of_medians']:18.3f}{o['ratio_of_means']:16.3f}")
    for m, why in (r.get("replay_errors") or {}).items():
        print(f"  replay n/a ({m}): {why}")


def run(args) -> int:
    r = bench_replay(steps=args.steps, topology=args.topology)
    print_table(r)
    if args.json:
        write_json(args.json, r)
    return 0


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
