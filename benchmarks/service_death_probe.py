"""What a worker's JAX client does when the process running the coordination service dies.

`resilax launch --nodes N --in-place` keeps the live hosts' workers when another host is
lost (`tools/agent_reform.py`). Whether that can include the host running the service is
JAX's to say: this probe starts a service the way the agents do (its own process, no JAX
compute, ``recoverable=True``: `jaxdist.start_service`), attaches ``--workers`` processes as
resilax's workers do (`jaxdist.initialize_worker`), waits until they are attached, SIGKILLs
the service's process and records, per worker, whether and when it died and how, and
whether a worker still alive could detach (`jaxdist.shutdown`).

    python benchmarks/service_death_probe.py --json benchmarks/results/service_death_probe.json

Measured (jax 0.10.2, CPU): every worker ends by SIGABRT ~0.2 s after the kill (the
client's error poll fails and XLA's coordination agent aborts the process), whatever the
heartbeat timeout; so a lost service host restarts every worker, with ``--in-place`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from resilax._src.io import write_json

SERVICE = r"""
import sys, time
from resilax._src.runtime import jaxdist
svc = jaxdist.start_service(int(sys.argv[1]), int(sys.argv[2]), heartbeat_timeout_s=int(sys.argv[3]))
print("service up", flush=True)
time.sleep(3600)
"""

WORKER = r"""
import json, os, sys, time
pid, n, port, hb, flag, wait_s = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], float(sys.argv[6])
from resilax._src.runtime import jaxdist
jaxdist.initialize_worker(coordinator=f"127.0.0.1:{port}", process_id=pid, num_processes=n, local_devices=1,
                          init_timeout_s=60, heartbeat_timeout_s=hb, collective_timeout_s=5)
import jax
print(json.dumps({"attached": jax.process_index()}), flush=True)
while not os.path.exists(flag):
    time.sleep(0.01)
t = time.time()
try:
    jaxdist.shutdown()
    print(json.dumps({"detached_s": time.time() - t}), flush=True)
except Exception as e:
    print(json.dumps({"detach_error": f"{type(e).__name__}: {str(e)[:200]}", "after_s": time.time() - t}), flush=True)
time.sleep(wait_s)
print(json.dumps({"alive_after_s": wait_s}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(workers: int, heartbeat_s: int, wait_s: float) -> dict:
    port = _free_port()
    flag = os.path.join(tempfile.mkdtemp(prefix="svc-death-"), "killed")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    svc = subprocess.Popen([sys.executable, "-c", SERVICE, str(port), str(workers), str(heartbeat_s)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert svc.stdout.readline().strip() == "service up"
    ws = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(workers), str(port), str(heartbeat_s), flag,
                            str(wait_s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
          for i in range(workers)]
    for w in ws:
        line = w.stdout.readline()
        assert line and "attached" in line, line
    svc.send_signal(signal.SIGKILL)
    svc.wait()
    t_kill = time.time()
    open(flag, "w").close()
    out = []
    for w in ws:
        w.wait(timeout=wait_s + 120)
        lines = [json.loads(ln) for ln in w.stdout.read().splitlines() if ln.startswith("{")]
        rc = w.returncode
        out.append({"exit": (f"signal {signal.Signals(-rc).name}" if rc < 0 else rc),
                    "ended_s_after_kill": round(time.time() - t_kill, 2), "said": lines})
    return {"workers": workers, "heartbeat_timeout_s": heartbeat_s, "results": out,
            "survivors": sum(1 for r in out if r["exit"] == 0)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--heartbeats", default="10,60", help="client heartbeat timeouts to try (s), comma-separated")
    p.add_argument("--wait", type=float, default=5.0, help="how long a worker that survived stays up (s)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import jax

    trials = [trial(args.workers, int(h), args.wait) for h in args.heartbeats.split(",")]
    print(f"{'heartbeat timeout':>18} {'worker':>7} {'exit':>16} {'ended after kill (s)':>21}")
    for t in trials:
        for i, r in enumerate(t["results"]):
            print(f"{t['heartbeat_timeout_s']:>18} {i:>7} {r['exit']:>16} {r['ended_s_after_kill']:>21}")
    res = {"jax": jax.__version__, "trials": trials}
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
