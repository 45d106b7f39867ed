"""`resilax bench replay`: what replay costs and what logging costs.

- replay seconds per step in each mode (grads: update part only; inputs: the whole step
  recomputed from the data position), over the plain step's seconds;
- log bytes per step per mode;
- failure-free overhead of logging at the default policy: the wrapped step with
  ``replay_log="grads"`` over the wrapped step without a log, interleaved in one run,
  medians.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def add_arguments(p) -> None:
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--steps", type=int, default=60, help="steps per timed run")
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
    from . import _example as ex
    from ._checkpoint import decode_data_state
    from ._replay import replay
    from ._runner import configure_cpu_devices

    topo = resilax.Topology.load(topology)
    configure_cpu_devices(topo.num_devices)
    spec = ex.ExampleSpec()
    work = tempfile.mkdtemp(prefix="resilax-bench-replay-")
    out = {"benchmark": "replay", "topology": topology, "steps": steps,
           "platform": jax.devices()[0].platform, "replay_s_per_step": {}, "log_bytes_per_step": {}}

    def make(mode, tag):
        cfg = resilax.Config(replay_log=mode, replay_log_dir=os.path.join(work, tag))
        return resilax.wrap(ex.train_step, topology=topo, config=cfg)

    # Interleaved overhead: wrapped without log vs wrapped with the default grads policy.
    plain, logged = make("off", "off"), make("grads", "ovh")
    data_p, data_l = ex.make_iterator(spec), ex.make_iterator(spec)
    sp, sl = plain.init(ex.make_state(spec)), logged.init(ex.make_state(spec))
    sp, _ = _median_step_s(plain, sp, data_p, 3)
    sl, _ = _median_step_s(logged, sl, data_l, 3)
    tp, tl = [], []
    for _ in range(steps):
        sp, a = _median_step_s(plain, sp, data_p, 1)
        sl, b = _median_step_s(logged, sl, data_l, 1)
        tp.append(a)
        tl.append(b)
    logged.close()
    plain.close()
    out["step_s"] = statistics.median(tp)
    out["logged_step_s"] = statistics.median(tl)
    out["logging_overhead_ratio"] = out["logged_step_s"] / out["step_s"]

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
        rep = make(mode, mode)
        data = ex.make_iterator(spec)
        init_state = ex.make_state(spec)
        host = jax.tree.map(lambda x: np.array(x), init_state)
        rep.init(init_state, data=data)  # compiles and replays (warm-up)
        g = rep._replay
        s0 = jax.tree.map(lambda x, sh: jax.device_put(x, sh), host, rep._state_sh)
        r = replay(s0, g.log, 0, None, update=g._update_fn(rep), full=g._full_fn(rep), data=data,
                   decode_data_state=decode_data_state)
        jax.block_until_ready(r.state)
        out["replay_s_per_step"][mode] = r.seconds / max(r.step, 1)
        out[f"replayed_steps_{mode}"] = r.step
        rep.close()
    out["replay_over_step"] = {m: v / out["step_s"] for m, v in out["replay_s_per_step"].items()}
    return out


def print_table(r: dict) -> None:
    print(f"\nresilax bench replay  ({r['topology']}, {r['platform']}, example MLP, {r['steps']} steps)")
    print(f"  {'':28s}{'grads':>14s}{'inputs':>14s}")
    g, i = r["replay_s_per_step"], r["log_bytes_per_step"]
    print(f"  {'replay ms/step':28s}{g['grads'] * 1e3:14.2f}{g['inputs'] * 1e3:14.2f}")
    print(f"  {'replay / step time':28s}{r['replay_over_step']['grads']:14.3f}{r['replay_over_step']['inputs']:14.3f}")
    print(f"  {'log bytes/step':28s}{i['grads']:14.0f}{i['inputs']:14.0f}")
    print(f"  step time (wrapped, no log)   {r['step_s'] * 1e3:.2f} ms")
    print(f"  step time (grads log)         {r['logged_step_s'] * 1e3:.2f} ms")
    print(f"  logging overhead ratio        {r['logging_overhead_ratio']:.3f} (medians, interleaved)")


def run(args) -> int:
    r = bench_replay(steps=args.steps, topology=args.topology)
    print_table(r)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(r, f, indent=2)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
