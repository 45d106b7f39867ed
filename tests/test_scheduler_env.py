"""`resilax launch` under a scheduler: the node count, rank and address from the scheduler's
environment (`agent_cli.placement`), and the recipes in examples/ (no JAX compute, no agents run:
tests/test_agent.py runs the Slurm recipe's command as two agents on loopback).

There is no Slurm or Kubernetes here: these tests set the variables they set (Slurm's
SLURM_NNODES, SLURM_JOB_NUM_NODES, SLURM_NODEID, SLURM_LOCALID, SLURMD_NODENAME; an Indexed
Job's JOB_COMPLETION_INDEX) and read the recipes as text / YAML.
"""

import shlex
import socket

import pytest

import recipes
from resilax.tools import agent_cli as agent, cli

SLURM = {"SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_LOCALID": "0",
         "SLURMD_NODENAME": "localhost"}


def test_without_a_scheduler_nothing_changes():
    assert agent.placement(None, None, None, {}) == (None, None, None)  # the single-host launch
    assert agent.placement(None, 1, None, {}) == (None, 1, None)
    assert agent.placement(2, 1, None, {}) == (2, 1, "127.0.0.1")
    assert agent.placement(2, 1, "10.1.2.3", {}) == (2, 1, "10.1.2.3")


def test_slurm_gives_the_node_count_rank_and_address():
    assert agent.placement(None, None, None, SLURM) == (2, 1, "127.0.0.1")  # SLURMD_NODENAME, resolved
    # the step's node count (SLURM_NNODES) before the job's, which may be larger
    assert agent.placement(None, None, None, {**SLURM, "SLURM_JOB_NUM_NODES": "4"})[0] == 2
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NNODES"}
    assert agent.placement(None, None, None, {**env, "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2"}) == \
        (3, 2, "127.0.0.1")
    # a one-node allocation: the single-host launch, as without Slurm
    assert agent.placement(None, None, None, {**SLURM, "SLURM_NNODES": "1", "SLURM_NODEID": "0"})[0] is None


def test_flags_win_over_the_environment():
    assert agent.placement(3, 0, "10.0.0.9", SLURM) == (3, 0, "10.0.0.9")
    assert agent.placement(None, 0, None, SLURM) == (2, 0, "127.0.0.1")
    assert agent.placement(4, None, "h", SLURM) == (4, 1, "h")
    # values a flag replaces are not read, malformed or not
    assert agent.placement(2, 1, "h", {"SLURM_NNODES": "x", "SLURM_NODEID": "y", "SLURM_LOCALID": "3"}) == (2, 1, "h")


def test_an_indexed_job_gives_the_rank_and_the_host_name_the_address(monkeypatch):
    # no node count in a JobSet's environment: without --nodes, the single-host launch
    assert agent.placement(None, None, None, {"JOB_COMPLETION_INDEX": "1"})[0] is None
    assert agent.placement(2, None, "10.0.0.7", {"JOB_COMPLETION_INDEX": "1"}) == (2, 1, "10.0.0.7")
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")  # a pod's host name resolves to its IP
    assert agent.placement(2, None, None, {"JOB_COMPLETION_INDEX": "0"}) == (2, 0, "127.0.0.1")
    # both schedulers' ranks set (unusual): fine while they agree
    assert agent.placement(None, None, None, {**SLURM, "JOB_COMPLETION_INDEX": "1"})[:2] == (2, 1)


@pytest.mark.parametrize("env, want", [
    ({"SLURM_NNODES": "two"}, "SLURM_NNODES='two' in the environment is not an integer >= 1"),
    ({"SLURM_NNODES": "0"}, "SLURM_NNODES='0' in the environment is not an integer >= 1"),
    ({"SLURM_JOB_NUM_NODES": "2.5"}, "SLURM_JOB_NUM_NODES='2.5'"),
    ({**SLURM, "SLURM_NODEID": "-1"}, "SLURM_NODEID='-1' in the environment is not an integer >= 0"),
    ({**SLURM, "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not a node rank of 2 nodes (SLURM_NNODES=2)"),
    ({**SLURM, "JOB_COMPLETION_INDEX": "0"}, "SLURM_NODEID=1 and JOB_COMPLETION_INDEX=0 disagree on this host's node "
                                             "rank: pass --node-rank"),
    ({**SLURM, "SLURM_LOCALID": "3"}, "SLURM_LOCALID='3': Slurm started more than one task on this node"),
])
def test_malformed_or_conflicting_values_are_errors_naming_the_variable(env, want):
    with pytest.raises(ValueError) as e:
        agent.placement(None, None, None, env)
    assert want in str(e.value)


def test_a_job_completion_index_beyond_nodes_is_an_error():
    with pytest.raises(ValueError, match=r"JOB_COMPLETION_INDEX=2 is not a node rank of 2 nodes \(--nodes 2\)"):
        agent.placement(2, None, "a", {"JOB_COMPLETION_INDEX": "2"})


def test_a_node_name_that_does_not_resolve_is_an_error(monkeypatch):
    def fail(name):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", fail)
    with pytest.raises(ValueError, match="SLURMD_NODENAME 'localhost' does not resolve to an address .*: pass --address"):
        agent.placement(None, None, None, SLURM)


def _launch_args(argv):
    args = cli.build_parser().parse_args(["launch", *argv])
    return args, args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd


def test_launch_cli_reports_environment_errors_and_keeps_the_single_host_launch(tmp_path, capsys):
    args, cmd = _launch_args(["-n", "1", "--run-dir", str(tmp_path), "--", "true"])
    assert agent.main(cmd, args, {}) is None  # the caller runs the single-host supervisor
    assert agent.main(cmd, args, {"SLURM_NNODES": "2", "SLURM_NODEID": "x"}) == 2
    assert "resilax: error: resilax launch: SLURM_NODEID='x' in the environment" in capsys.readouterr().err
    assert agent.main(cmd, args, {"SLURM_NNODES": "2"}) == 2
    assert "--nodes needs --node-rank (or SLURM_NODEID / JOB_COMPLETION_INDEX" in capsys.readouterr().err


def test_the_sbatch_recipe():
    """What the Slurm recipe asks Slurm for, and that its srun line parses as `resilax launch`
    with the script's variables (tests/test_agent.py runs it)."""
    directives = recipes.sbatch_directives()
    for want in ("--ntasks-per-node=1", "--signal=TERM@60", "--requeue"):
        assert want in directives, directives
    assert any(d.startswith("--nodes=") for d in directives)
    line = recipes.sbatch_launch()
    assert line.endswith(' -- "$@"') and '--run-dir "$RUN_DIR"' in line, line
    words = shlex.split(line.replace('"$PROCS_PER_NODE"', "8").replace('"$DEVICES_PER_PROCESS"', "1")
                        .replace('"$RUN_DIR"', "/shared/run").replace('"$@"', "resilax train"))
    assert words[:2] == ["resilax", "launch"]
    args, cmd = _launch_args(words[2:])
    assert (args.n, args.devices_per_process, args.run_dir, cmd) == (8, 1, "/shared/run", ["resilax", "train"])
    assert args.nodes is args.node_rank is args.address is None  # all three from Slurm's environment


def test_the_jobset_recipe_gives_every_pod_its_place():
    """The JobSet's container command, expanded as Kubernetes does (``$(POD_IP)``), parsed by
    `resilax launch`'s parser, and placed with each pod's JOB_COMPLETION_INDEX."""
    pytest.importorskip("yaml")
    job, pod, container = recipes.jobset_container()
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert pod["terminationGracePeriodSeconds"] > 60  # the agent's grace for its workers after SIGTERM
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    words = recipes.k8s_expand(container["command"] + container.get("args", []), {"POD_IP": "10.0.0.7"})
    assert words[:2] == ["resilax", "launch"]
    args, cmd = _launch_args(words[2:])
    assert cmd[:2] == ["resilax", "train"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "persistentVolumeClaim" in volumes[mounts[args.run_dir]]  # the run dir is the PVC
    hosts = job["parallelism"]
    for i in range(hosts):
        assert agent.placement(args.nodes, args.node_rank, args.address, {"JOB_COMPLETION_INDEX": str(i)}) == \
            (hosts, i, "10.0.0.7")
    with pytest.raises(ValueError, match=f"JOB_COMPLETION_INDEX={hosts} is not a node rank"):
        agent.placement(args.nodes, args.node_rank, args.address, {"JOB_COMPLETION_INDEX": str(hosts)})
