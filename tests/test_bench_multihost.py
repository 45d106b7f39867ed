"""`resilax bench multihost` in its smallest form: one case (a host without the coordination
service SIGKILLed), few steps, host stores on (the default). The JSON has the documented keys, the case came back at the
step the job had reached and ended bitwise equal to a failure-free single-process run."""

import json
import subprocess
import sys

PHASES = {"detect", "agree", "start", "restore", "setup", "redo"}


def test_bench_multihost_smallest_form_ends_bitwise(tmp_path, child_env):
    out = tmp_path / "mh.json"
    r = subprocess.run([sys.executable, "-m", "resilax", "bench", "multihost", "--cases", "other", "--steps", "10",
                        "--kill-after", "5", "--checkpoint-every", "5", "--timeout", "150", "--workdir",
                        str(tmp_path / "work"), "--json", str(out)],
                       env=child_env, capture_output=True, text=True, timeout=200, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[2/2] other0: SIGKILL a host without the service" in r.stdout and "death -> back (s)" in r.stdout
    res = json.loads(out.read_text())
    assert res["ok"] and res["benchmark"] == "multihost" and set(res["cases"]) == {"other"}
    assert {"nodes", "steps", "checkpoint_every", "kill_after", "lease_s"} <= set(res["setup"])
    case = res["cases"]["other"]
    assert case["bitwise"] and case["runs"] == 1 and set(case["phases"]) == PHASES
    (run,) = res["runs"]
    assert run["outcome"] == "bitwise" and run["bitwise"] and run["fallbacks"] == []
    assert run["killed"] == [2] and run["service_node_before"] == run["service_node_after"] == 0
    assert run["death_to_back_s"] > 0 and run["phases"]["agree"] > 0 and run["phases"]["start"] > 0
    # the survivors resume from their own hosts' stores (bit-exact: whole copies), at most the step being stored
    # at the kill redone (the kill's step is read from heartbeats: the restored step may be past it)
    assert run["restored_from"] == "host store" and run["restored_step"] >= run["kill_step"] - 1, run
    assert run["lost_steps"] == max(0, run["kill_step"] - run["restored_step"]) <= 1
    assert {e["node"] for e in run["generation_ends"] if e["generation"] == 0} == {0, 1}
