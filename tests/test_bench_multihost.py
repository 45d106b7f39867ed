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
    assert (res["setup"]["workers_per_node"], res["setup"]["devices_per_process"], res["setup"]["topology"]) == \
        (1, 2, "cpu-3x2") and res["setup"]["second_kill_at"] is None
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


def test_double_kill_picks_the_reforming_generation_and_expects_its_end(tmp_path):
    """The double case's second kill waits for the first generation after 0 without the dead
    host (a proposal still naming it, or an abandoned one, is skipped) at the point asked
    for; the generation the second kill ends is not a fallback in the soak's accounting. No
    processes: the rendezvous records and heartbeats written here."""
    from resilax._src.runtime import rendezvous
    from resilax.tools import bench_multihost as bm

    run = tmp_path / "run"
    gens = run / rendezvous.RENDEZVOUS / "generations"
    gens.mkdir(parents=True)
    (run / "heartbeats").mkdir()

    def propose(g, members, outcome=None):
        rendezvous.create_record(gens / f"g{g}.proposal.json", {
            "generation": g, "members": members, "incarnations": {str(r): f"i{r}" for r in members},
            "service_node": members[0], "coordinator": "127.0.0.1:1",
            "process_ids": {str(r): [2 * i, 2 * i + 1] for i, r in enumerate(members)},
            "num_processes": 2 * len(members), "t": 0.0})
        if outcome:
            rendezvous.create_record(gens / f"g{g}.outcome.json", {"generation": g, "outcome": outcome})

    propose(0, [0, 1, 2], rendezvous.COMMITTED)
    assert bm._reforming(run, [0], "proposed") is None
    propose(1, [0, 1, 2], rendezvous.ABANDONED)  # node 0's lease had not expired yet
    propose(2, [1, 2])
    g, gen, outcome, _ = bm._reforming(run, [0], "proposed")
    assert (g, gen.service_node, outcome) == (2, 1, None)
    assert bm._reforming(run, [0], "committed") is None
    rendezvous.create_record(gens / "g2.outcome.json", {"generation": 2, "outcome": rendezvous.COMMITTED})
    assert bm._reforming(run, [0], "committed")[0] == 2 and bm._reforming(run, [0], "attached") is None
    for p in range(4):
        (run / "heartbeats" / f"g2.p{p}.json").write_text(json.dumps({"process_id": p, "joined_t": 1.0 + (p != 3)}))
    assert bm._reforming(run, [0], "attached")[0] == 2
    (run / "heartbeats" / "g2.p3.json").write_text(json.dumps({"process_id": 3, "joined_t": None}))
    assert bm._reforming(run, [0], "attached") is None

    ends = [{"node": 1, "generation": 0, "why": "killed"}, {"node": 2, "generation": 2, "why": "node 1 lost"},
            {"node": 2, "generation": 3, "why": "node(s) [0, 1] joined; the workers saved their step and exited"}]
    res = {"generation_back": 3, "generation_ends": ends, "second_kill": {"generation": 2},
           "grow_back": {"generation": 4, "drained": True}}
    assert bm.soak_fallbacks(res) == []
    res["generation_back"] = 4  # a generation after the second kill's that ended too: a fallback
    del res["grow_back"]
    assert bm.soak_fallbacks(res) == ["generation 3 ended: node(s) [0, 1] joined; the workers saved their step and "
                                      "exited"]
