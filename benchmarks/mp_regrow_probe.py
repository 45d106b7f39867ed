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

``--after-death`` asks the same after a worker died: 3 workers attach to A; the parent
SIGKILLs process 2 while the others are idle (``--scenario idle``) or looping an all-reduce
over the 6 devices (``in-collective``: it fails after the collective timeout, 5 s), starts B
and a new process 2; the survivors detach from A (A still counts the dead task), re-attach to
B, and all three run the all-reduce, the broadcast, and 10 more all-reduces over 20 s with A
still up (does A's client end the survivors later?). Both scenarios by default:

    python benchmarks/mp_regrow_probe.py --after-death --json benchmarks/results/mp_regrow_after_death.json

Prints a table and writes JSON. Not a test: it measures what the runtime does.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _summed():
    """A 4-element shard per device, each process's filled with 1 + its index, and a jitted sum
    over every device (an all-reduce)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    x = jax.make_array_from_callback((mesh.size * 4,), NamedSharding(mesh, P("x")),
                                     lambda idx: np.full(4, 1.0 + jax.process_index(), np.float32))
    return x, jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))


def _allreduce():
    import jax

    x, f = _summed()
    return float(f(x)), x.size // 4, jax.process_count()


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


SCENARIOS = ("idle", "in-collective")
LATER = 10  # all-reduces on B, 2 s apart: are the survivors still up ~20 s after attaching?


def worker_after_death(i, a):
    """--after-death: as `worker`, but 3 processes on A, of which the parent SIGKILLs process 2."""
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.extend.backend import clear_backends

    from resilax._src.runtime import jaxdist

    kw = dict(local_devices=a.d, heartbeat_timeout_s=5, init_timeout_s=60, collective_timeout_s=5)
    out, t = {"process": i, "original": a.original}, {}
    tmp = os.path.dirname(a.go)

    def emit():  # after each phase, so that a hung or crashed worker still tells how far it got
        print("RESULT " + json.dumps({**out, "t": t}), flush=True)

    state = np.zeros(3, np.float32)
    if a.original:
        jaxdist.initialize_worker(coordinator=f"127.0.0.1:{a.port_a}", process_id=i, num_processes=3, **kw)
        out["sum_a"] = _allreduce()[0]
        state = np.array([out["sum_a"], 7.0, i], np.float32)  # what this worker keeps in host memory
        if a.scenario == "idle":
            open(os.path.join(tmp, f"ready{i}"), "w").close()
        else:  # loops the all-reduce until the parent's SIGKILL of process 2 makes it fail
            import jax

            x, f = _summed()
            n = 0
            try:
                while True:
                    f(x).block_until_ready()
                    n += 1
                    if n == 20:
                        open(os.path.join(tmp, f"ready{i}"), "w").close()
            except jax.errors.JaxRuntimeError as e:
                t["error"] = time.time()
                out.update(steps_a=n, error=f"{type(e).__name__}: {e}")
        emit()
        while not os.path.exists(a.go):
            time.sleep(0.01)
        t["go_seen"] = t0 = time.time()
        try:
            jaxdist.shutdown()
        except Exception as e:  # noqa: BLE001 (recorded: what detaching from A says about the dead task)
            out["shutdown_error"] = f"{type(e).__name__}: {e}"
        out["shutdown_s"] = time.time() - t0
        clear_backends()
        out["detach_s"] = time.time() - t0
        t["detached"] = time.time()
        emit()
    t1 = time.time()
    jaxdist.initialize_worker(coordinator=f"127.0.0.1:{a.port_b}", process_id=i, num_processes=3, **kw)
    t["attached"] = time.time()
    out["attach_s"] = t["attached"] - t1
    out["sum_b"], out["devices_b"], out["processes_b"] = _allreduce()
    out["state_from_process_0"] = np.asarray(multihost_utils.broadcast_one_to_all(state)).tolist()
    t["broadcast"] = time.time()
    emit()
    out["later_sums"] = []
    for _ in range(LATER):  # the same count in every process: they are collectives
        time.sleep(2.0)
        out["later_sums"].append(_allreduce()[0])
    t["done"] = time.time()
    out["up_after_attach_s"] = t["done"] - t["attached"]
    emit()


def _scenario(a, name):
    """One --after-death run: A with 3 workers, SIGKILL process 2, B with the 2 survivors + a new one."""
    from resilax._src.runtime import jaxdist
    from resilax.tools.launch import reserve_port as free_port

    tmp = tempfile.mkdtemp(prefix=f"resilax-regrow-{name}-")
    go = os.path.join(tmp, "go")
    pa, pb = free_port(), free_port()
    base = [sys.executable, __file__, "--after-death", "--scenario", name, "--d", str(a.d), "--port-a", str(pa),
            "--port-b", str(pb), "--go", go]

    def spawn(i, original):
        log = os.path.join(tmp, f"w{i}{'' if original else 'new'}")
        with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
            return subprocess.Popen(base + ["--worker", str(i), "--original", str(original)], stdout=out,
                                    stderr=err), log

    services = [jaxdist.start_service(pa, 3, heartbeat_timeout_s=5)]  # A: kept up until the end
    procs = [spawn(i, 1) for i in range(3)]
    ev = {}
    try:
        deadline = time.time() + 180
        while not all(os.path.exists(os.path.join(tmp, f"ready{i}")) for i in range(3)):
            if time.time() > deadline or any(p.poll() is not None for p, _ in procs):
                raise RuntimeError(f"{name}: the 3 workers did not all get ready (logs in {tmp})")
            time.sleep(0.05)
        time.sleep(1.0)
        ev["kill"] = time.time()
        procs[2][0].kill()
        procs[2][0].wait(timeout=10)
        time.sleep(a.go_delay)
        services.append(jaxdist.start_service(pb, 3, heartbeat_timeout_s=5))
        ev["service_b_up"] = time.time()
        open(go, "w").close()
        procs.append(spawn(2, 0))
        ev["go_and_new_worker_started"] = time.time()
        deadline = time.time() + a.timeout
        for p, _ in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p, _ in procs:  # every worker ends here, one still running is killed
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for s in services:
            s.shutdown()
    t_kill = ev["kill"]
    rows = []
    for (p, log), (i, role) in zip(procs, ((0, "survivor"), (1, "survivor"), (2, "killed"), (2, "new"))):
        rec = {"process": i}
        with open(log + ".out") as f:
            for ln in f:
                if ln.startswith("RESULT "):
                    rec = json.loads(ln[7:])
        rec["t"] = {k: round(v - t_kill, 3) for k, v in rec.get("t", {}).items()}  # seconds from the kill
        row = {"role": role, "exit_code": p.returncode, **rec}
        if role != "killed" and p.returncode != 0:
            with open(log + ".err") as f:
                row["stderr_tail"] = f.read().splitlines()[-8:]
        rows.append(row)
    want = float(sum(a.d * 4 * (1.0 + i) for i in range(3)))
    grown = [r for r in rows if r["role"] != "killed"]
    ok = all(r["exit_code"] == 0 and r.get("sum_b") == want and r.get("processes_b") == 3 and
             r.get("later_sums") == [want] * LATER and r.get("state_from_process_0") == [want, 7.0, 0.0]
             for r in grown)
    print(f"scenario {name}: SIGKILL process 2 at t=0 (times below: seconds from the kill); "
          f"service B up at {ev['service_b_up'] - t_kill:.2f}, go + new worker at "
          f"{ev['go_and_new_worker_started'] - t_kill:.2f}")
    for r in grown:
        err = f"in-flight all-reduce failed at {r['t']['error']:.2f} ({r['error'][:100]}); " if "error" in r else ""
        det = (f"shutdown() {r['shutdown_s']:.2f} s ({r.get('shutdown_error', 'no error')[:100]}), detach "
               f"{r['detach_s']:.2f} s; " if "detach_s" in r else "")
        print(f"  process {r.get('process')} ({r['role']}): {err}{det}attach {r.get('attach_s', float('nan')):.2f} s "
              f"(at {r['t'].get('attached', float('nan')):.2f}); all-reduce over {r.get('devices_b')} devices of "
              f"{r.get('processes_b')} processes = {r.get('sum_b')}; state from process 0: "
              f"{r.get('state_from_process_0')}; later all-reduces right: "
              f"{sum(v == want for v in r.get('later_sums', []))}/{LATER}, up {r.get('up_after_attach_s', 0):.1f} s "
              f"after attaching; exit {r['exit_code']}")
    print(f"  re-formed with a new process 2 without restarting the survivors: {ok}"
          + ("" if ok else f" (worker logs in {tmp})"))
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"scenario": name, "ok": ok, "expected_sum": want,
            "parent_t": {k: round(v - t_kill, 3) for k, v in ev.items()}, "workers": rows}


def after_death(a):
    from resilax.tools.bench import write_result

    names = SCENARIOS if a.scenario == "both" else (a.scenario,)
    res = {"benchmark": "mp_regrow_after_death", "devices_per_process": a.d, "collective_timeout_s": 5,
           "heartbeat_timeout_s": 5, "go_delay_s": a.go_delay, "scenarios": [_scenario(a, n) for n in names],
           "jax": __import__("jax").__version__}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    write_result(a.json, res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=2, help="CPU devices per worker")
    ap.add_argument("--json", default=None)
    ap.add_argument("--after-death", action="store_true",
                    help="3 workers on A, one SIGKILLed, then the survivors + a new process on B")
    ap.add_argument("--scenario", choices=(*SCENARIOS, "both"), default="both",
                    help="--after-death: what the survivors do when process 2 is killed")
    ap.add_argument("--go-delay", type=float, default=0.0,
                    help="--after-death: seconds between the kill and starting B (A sees the death after 5 s)")
    ap.add_argument("--timeout", type=float, default=150.0, help="--after-death: seconds from the kill to give up")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--original", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port-a", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port-b", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--go", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        return (worker_after_death if a.after_death else worker)(a.worker, a)
    if a.after_death:
        return after_death(a)
    from resilax._src.runtime import jaxdist
    from resilax.tools.bench import write_result
    from resilax.tools.launch import reserve_port as free_port

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
