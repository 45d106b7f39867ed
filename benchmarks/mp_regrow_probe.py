"""Can the live workers of a `jax.distributed` job take in a new process without restarting?

A probe of the JAX runtime as resilax uses it (jax 0.10.2, CPU, gloo), for growing a job in
place (issue 11's rejoin under `resilax launch`; today a replacement joins by a new
generation that restarts every worker). This (parent) process runs the coordination
services and does no JAX compute. Two workers of 2 CPU devices attach to service A
(2 processes), run an all-reduce over their 4 devices and keep a host copy of a value
computed there (the "state"). The parent then starts service B for 3 processes and starts a
third worker; the two workers detach from A (`jax._src.distributed.global_state.shutdown`),
drop their backends (`jax.extend.backend.clear_backends`), attach to B as processes 0 and 1,
and all three run an all-reduce over the 6 devices; the new process receives the state from
process 0 (`multihost_utils.broadcast_one_to_all`). Each worker records how long detaching
and re-attaching took and what it computed.

    python benchmarks/mp_regrow_probe.py --json benchmarks/results/mp_regrow_probe.json

Prints a table and writes JSON. Not a test: it measures what the runtime does.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _allreduce():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("x",))
    x = jax.make_array_from_callback((len(devs) * 4,), NamedSharding(mesh, P("x")),
                                     lambda idx: np.full(4, 1.0 + jax.process_index(), np.float32))
    return float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)), len(devs), jax.process_count()


def worker(i, a):
    from resilax._src.runtime import jaxdist

    kw = dict(local_devices=a.d, heartbeat_timeout_s=5, init_timeout_s=60, collective_timeout_s=10)
    out = {"process": i, "original": a.original}
    import numpy as np

    state = np.zeros(3, np.float32)
    if a.original:
        jaxdist.initialize_worker(coordinator=f"127.0.0.1:{a.port_a}", process_id=i, num_processes=2, **kw)
        out["sum_a"], out["devices_a"], out["processes_a"] = _allreduce()
        state = np.array([out["sum_a"], 7.0, i], np.float32)  # what this worker keeps in host memory
        while not os.path.exists(a.go):
            time.sleep(0.01)
        t0 = time.time()
        jaxdist.shutdown()
        from jax.extend.backend import clear_backends

        clear_backends()
        out["detach_s"] = time.time() - t0
    t1 = time.time()
    jaxdist.initialize_worker(coordinator=f"127.0.0.1:{a.port_b}", process_id=i, num_processes=3, **kw)
    out["attach_s"] = time.time() - t1
    out["sum_b"], out["devices_b"], out["processes_b"] = _allreduce()
    from jax.experimental import multihost_utils

    got = np.asarray(multihost_utils.broadcast_one_to_all(state))
    out["state_from_process_0"] = got.tolist()
    out["first_collectives_s"] = time.time() - t1 - out["attach_s"]
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=2, help="CPU devices per worker")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--original", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port-a", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port-b", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        return worker(a.worker, a)
    from resilax._src.runtime import jaxdist
    from resilax.tools.bench import write_result
    from resilax.tools.launch import free_port

    go = os.path.join(tempfile.mkdtemp(prefix="resilax-regrow-"), "go")
    pa, pb = free_port(), free_port()
    services = [jaxdist.start_service(pa, 2, heartbeat_timeout_s=5)]  # kept alive until the end
    base = [sys.executable, __file__, "--d", str(a.d), "--port-a", str(pa), "--port-b", str(pb), "--go", go]
    procs = [subprocess.Popen(base + ["--worker", str(i), "--original", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for i in range(2)]
    print("2 workers attached to service A; waiting for their all-reduce", flush=True)
    time.sleep(15)  # the originals import JAX, attach and run their all-reduce (they wait for the go file)
    services.append(jaxdist.start_service(pb, 3, heartbeat_timeout_s=5))
    print("service B (3 processes) up; the 2 workers detach and re-attach, a third one joins", flush=True)
    t_go = time.time()
    open(go, "w").close()
    procs.append(subprocess.Popen(base + ["--worker", "2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True))
    rows = []
    for p in procs:
        try:
            outs, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            outs, _ = p.communicate()
        rec = next((json.loads(ln[7:]) for ln in outs.splitlines() if ln.startswith("RESULT ")), {})
        rows.append({"exit_code": p.returncode, **rec})
    wall = time.time() - t_go
    for r in rows:
        print(f"  process {r.get('process')} ({'survivor' if r.get('original') else 'new'}): exit {r['exit_code']}; "
              f"detach {r.get('detach_s', 0):.2f} s, attach {r.get('attach_s', float('nan')):.2f} s; all-reduce over "
              f"{r.get('devices_b')} devices of {r.get('processes_b')} processes = {r.get('sum_b')}; state from "
              f"process 0: {r.get('state_from_process_0')}")
    want = float(sum(a.d * 4 * (1.0 + i) for i in range(3)))
    ok = all(r["exit_code"] == 0 and r.get("sum_b") == want and r.get("processes_b") == 3 for r in rows) and \
        len({tuple(r.get("state_from_process_0") or ()) for r in rows}) == 1
    print(f"grew in place from 2 to 3 processes without restarting the 2: {ok} ({wall:.1f} s from the go)")
    del services
    res = {"benchmark": "mp_regrow_probe", "devices_per_process": a.d, "grew_in_place": ok,
           "expected_sum_b": want, "go_to_all_done_s": wall, "workers": rows, "jax": __import__("jax").__version__}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    write_result(a.json, res)


if __name__ == "__main__":
    main()
