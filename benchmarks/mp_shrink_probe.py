"""Can the survivors of a SIGKILLed worker go on in place (path A of issue 10)?

A probe of the JAX runtime as resilax uses it (jax 0.10.2, CPU, gloo): the coordination
service runs in this (parent) process, which does no JAX compute (`jaxdist.start_service`,
``recoverable=True``, as `resilax launch` runs it); N workers of D CPU devices attach with
`jaxdist.initialize_worker` (collective timeout ``--collective-timeout``) and loop a jitted
all-reduce over every device. The parent SIGKILLs the last worker. Each survivor records:
how long its in-flight collective took to fail and with what error, what
``get_live_nodes`` says, whether a new jit over the surviving devices runs, and whether it
runs ``--survivor-steps`` collectives on the surviving devices and stays up ``--survive``
seconds after the failure (the coordination client does not terminate it).

    python benchmarks/mp_shrink_probe.py --json benchmarks/results/mp_shrink_probe.json

Prints a table and writes JSON. Not a test: it measures what the runtime does.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def worker(i, port, a):
    from resilax._src.runtime import jaxdist

    jaxdist.initialize_worker(coordinator=f"127.0.0.1:{port}", process_id=i, num_processes=a.n, local_devices=a.d,
                              heartbeat_timeout_s=a.heartbeat_timeout, init_timeout_s=60,
                              collective_timeout_s=a.collective_timeout)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def summed(devs):
        mesh = Mesh(np.array(devs), ("x",))
        x = jax.make_array_from_callback((len(devs) * 4,), NamedSharding(mesh, P("x")),
                                         lambda idx: np.ones(4, np.float32))
        return x, jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))

    out = {"process": i}
    x, f = summed(jax.devices())
    steps, last = 0, time.time()
    while True:
        try:
            f(x).block_until_ready()
            steps, last = steps + 1, time.time()
            if steps == 20:
                out["ready"] = time.time()
                print(json.dumps({"ready": i}), flush=True)
        except Exception as e:  # the in-flight collective of a dead peer
            out.update(error_at=time.time(), last_ok_at=last, steps=steps, error=f"{type(e).__name__}: {str(e)[:200]}")
            break
    live = jaxdist.live_nodes(range(a.n))
    out["live_nodes"] = sorted(live)
    devs = [d for d in jax.devices() if d.process_index in live]
    t0 = time.time()
    y, g = summed(devs)
    v = float(g(y))
    out.update(survivor_devices=len(devs), first_survivor_step_s=time.time() - t0, survivor_sum=v)
    for _ in range(a.survivor_steps):  # a fixed count: every survivor runs the same collectives
        g(y).block_until_ready()
    out.update(survivor_steps=a.survivor_steps, survivor_steps_s=time.time() - t0)
    while time.time() - out["error_at"] < a.survive:  # then idles: does the coordination client end it?
        time.sleep(0.5)
    out["survived_s"] = time.time() - out["error_at"]
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--d", type=int, default=2)
    ap.add_argument("--collective-timeout", type=int, default=5)
    ap.add_argument("--heartbeat-timeout", type=int, default=3)
    ap.add_argument("--survive", type=float, default=30.0, help="seconds each survivor stays up after the failure")
    ap.add_argument("--survivor-steps", type=int, default=2000, help="collectives the survivors run on their own mesh")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        return worker(a.worker, a.port, a)
    from resilax._src.runtime import jaxdist
    from resilax.tools.bench import write_result
    from resilax.tools.launch import reserve_port as free_port

    port = free_port()
    svc = jaxdist.start_service(port, a.n, heartbeat_timeout_s=a.heartbeat_timeout)  # noqa: F841 (kept alive)
    args = ["--n", str(a.n), "--d", str(a.d), "--collective-timeout", str(a.collective_timeout),
            "--heartbeat-timeout", str(a.heartbeat_timeout), "--survive", str(a.survive),
            "--survivor-steps", str(a.survivor_steps), "--port", str(port)]
    procs = [subprocess.Popen([sys.executable, __file__, *args, "--worker", str(i)], stdout=subprocess.PIPE,
                              stderr=open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mp_shrink_probe.w{i}.log"), "w"), text=True)
             for i in range(a.n)]
    ready = 0
    while ready < a.n:  # every worker past 20 collectives
        for p in procs:
            line = p.stdout.readline()
            if '"ready"' in line:
                ready += 1
        print(f"workers ready: {ready}/{a.n}", flush=True)
    time.sleep(1.0)
    victim = procs[-1]
    t_kill = time.time()
    victim.send_signal(signal.SIGKILL)
    print(f"SIGKILL process {a.n - 1}; waiting up to {a.survive + 60:.0f} s for the survivors", flush=True)
    results = []
    for p in procs[:-1]:
        try:
            outs, _ = p.communicate(timeout=a.survive + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            outs, _ = p.communicate()
        rec = next((json.loads(ln) for ln in outs.splitlines() if ln.startswith('{"process"')), None)
        results.append({"exit_code": p.returncode, **(rec or {"process": None})})
    victim.wait()
    rows = []
    for r in results:
        if "error_at" in r:
            r["error_after_kill_s"] = r["error_at"] - t_kill
        rows.append(r)
        print(f"  process {r.get('process')}: exit {r['exit_code']}; in-flight collective failed "
              f"{r.get('error_after_kill_s', float('nan')):.1f} s after the kill ({r.get('error', '-')[:90]}); "
              f"live nodes {r.get('live_nodes')}; a new jit over {r.get('survivor_devices')} surviving devices: "
              f"{r.get('survivor_steps', 0)} collectives in {r.get('survivor_steps_s', 0):.1f} s; still up "
              f"{r.get('survived_s', 0):.0f} s after the failure")
    ok = all(r["exit_code"] == 0 and r.get("survived_s", 0) >= a.survive for r in results)
    print(f"survivors went on in place: {ok}")
    res = {"benchmark": "mp_shrink_probe", "processes": a.n, "devices_per_process": a.d,
           "collective_timeout_s": a.collective_timeout, "heartbeat_timeout_s": a.heartbeat_timeout,
           "survive_s": a.survive, "survivors_went_on": ok, "survivors": rows,
           "jax": __import__("jax").__version__}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    write_result(a.json, res)


if __name__ == "__main__":
    main()
