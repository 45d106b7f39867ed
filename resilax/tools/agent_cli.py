"""`resilax launch --nodes N`: the options of an agent of a job across hosts, its place in
the job from the options or the scheduler's environment (Slurm, a Kubernetes Indexed Job),
and running the `agent.Agent` (or, ``--spare``, a standby host's wait first)."""

from __future__ import annotations

import ipaddress
import os
import pathlib
import socket
import sys

from resilax._src.runtime import rendezvous
from resilax.tools.argtypes import positive_float
from resilax.tools.agent import PROCESSES_JSON, Agent
from resilax.tools.processes import read_json, say


# ---------------------------------------------------------------------- the scheduler's environment
NODE_COUNT_VARS = ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")  # Slurm: the step's node count, else the job's
NODE_RANK_VARS = ("SLURM_NODEID", "JOB_COMPLETION_INDEX")  # Slurm; a Kubernetes Indexed Job (a JobSet's pods)


def _env_int(environ, name: str, low: int) -> int | None:
    v = environ.get(name)
    if v is None or v.strip() == "":
        return None
    try:
        i = int(v)
    except ValueError:
        i = None
    if i is None or i < low:
        raise ValueError(f"{name}={v!r} in the environment is not an integer >= {low} (set by the scheduler, read "
                         f"when --nodes/--node-rank are not given)")
    return i


# tests: this agent's rendezvous clock runs this many seconds off; "@PATH": the number in that
# file, read at every look at the clock (a harness moves a running host's clock)
CLOCK_SKEW_VAR = "RESILAX_TEST_CLOCK_SKEW_S"


def _clock_skew(environ):
    v = environ.get(CLOCK_SKEW_VAR, "").strip()
    if v.startswith("@"):
        path = pathlib.Path(v[1:])

        def skew() -> float:
            try:
                return float(path.read_text().strip() or 0)
            except (OSError, ValueError):
                return 0.0
        return skew
    try:
        return float(v) if v else 0.0
    except ValueError:
        raise ValueError(f"{CLOCK_SKEW_VAR}={v!r} in the environment is not a number of seconds or @FILE") from None


def host_address(environ=os.environ) -> str:
    """This host's address for the other hosts: ``SLURMD_NODENAME`` (Slurm's name for the
    node), else the host name, resolved here (a Kubernetes pod's host name resolves to its IP)."""
    name, what = ((environ["SLURMD_NODENAME"], "SLURMD_NODENAME") if environ.get("SLURMD_NODENAME")
                  else (socket.gethostname(), "the host name"))
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        raise ValueError(f"{what} {name!r} does not resolve to an address ({e}): pass --address") from None


def placement(nodes: int | None, node_rank: int | None, address: str | None, environ=os.environ):
    """``(nodes, node_rank, address)`` of this agent: the flags that were given (they win), the
    rest from the scheduler's environment. ``nodes`` None: not a job across hosts (no
    ``--nodes`` and no Slurm node count, or a one-node Slurm allocation), the single-host
    launch. The node count: ``--nodes``, else ``SLURM_NNODES`` / ``SLURM_JOB_NUM_NODES``
    (Kubernetes has none: the manifest passes ``--nodes``); the rank: ``--node-rank``, else
    ``SLURM_NODEID`` or ``JOB_COMPLETION_INDEX``; the address: ``--address``, else, when the
    count or the rank came from the environment, `host_address`, else loopback.

    Raises:
      ValueError: a malformed value, or values that disagree, naming the variable.
    """
    used = []
    if nodes is None:
        for name in NODE_COUNT_VARS:
            nodes = _env_int(environ, name, 1)
            if nodes is not None:
                used.append(name)
                break
        if nodes in (None, 1):  # one node: the single-host launch, as without a scheduler
            return None, node_rank, address
    if node_rank is None:
        found = {name: v for name in NODE_RANK_VARS if (v := _env_int(environ, name, 0)) is not None}
        if len(set(found.values())) > 1:
            raise ValueError(f"{' and '.join(f'{k}={v}' for k, v in found.items())} disagree on this host's node "
                             f"rank: pass --node-rank")
        if "SLURM_NODEID" in found and environ.get("SLURM_LOCALID", "0").strip() not in ("", "0"):
            raise ValueError(f"SLURM_LOCALID={environ['SLURM_LOCALID']!r}: Slurm started more than one task on this "
                             f"node, but a job needs one agent per host: srun --ntasks-per-node=1")
        for name, v in found.items():
            if v >= nodes:
                raise ValueError(f"{name}={v} is not a node rank of {nodes} nodes ("
                                 f"{f'{used[0]}={nodes}' if used else f'--nodes {nodes}'})")
            node_rank = v
        used += list(found)
    if address is None:
        address = host_address(environ) if used else "127.0.0.1"
    return nodes, node_rank, address


def add_arguments(p) -> None:
    """The options of `resilax launch` that make it one agent of a job across hosts."""
    g = p.add_argument_group("across hosts (one agent per host; see resilax/tools/agent.py)")
    g.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="hosts in the job (one agent on each; default: SLURM_NNODES under Slurm)")
    g.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this host's rank, 0 <= R < --nodes (default: SLURM_NODEID, or JOB_COMPLETION_INDEX in a "
                        "Kubernetes Indexed Job / JobSet)")
    g.add_argument("--spare", action="store_true",
                   help="a standby agent (a spare host; no --node-rank): waits until a host of the running job loses "
                        "its lease (dead or hung), takes its rank and runs as its agent, so the job grows back to "
                        "--nodes without that host's replacement; exits 0 when the job ends first, 1 when no job runs "
                        "for --rendezvous-timeout")
    g.add_argument("--lease", type=positive_float, default=5.0, metavar="S", help="an agent silent for this long is dead (s)")
    g.add_argument("--address", default=None,
                   help="how the other hosts reach this one: the coordination service binds and is advertised there "
                        "when it runs here (default: 127.0.0.1, loopback; when the node count or rank comes from "
                        "the scheduler's environment: SLURMD_NODENAME or the host name, resolved)")
    g.add_argument("--min-nodes", type=int, default=None, metavar="M",
                   help="after a lost host, go on with at least M live nodes (default: half of --nodes, rounded up); "
                        "with fewer, wait for replacements up to --rendezvous-timeout, then exit 1")
    g.add_argument("--rendezvous-timeout", type=positive_float, default=300.0, metavar="S",
                   help="how long the agents wait to agree on a generation (s)")
    g.add_argument("--host-store-dir", default=None, metavar="DIR",
                   help="this host's state store (--host-store-every; served on --address for the mirror of the previous "
                        "host's shards): a directory on this "
                        "host, not the shared run dir (default: a new one on /dev/shm, else in the temp dir; emptied "
                        "when the agent starts, removed when it ends; one agent per directory)")
    g.add_argument("--host-store-mirrors", type=int, default=1, metavar="K",
                   help="mirror each host's shards (the default mode's; a whole copy is on every host) on the next K "
                        "live hosts: any K hosts next to each other may be lost at once and the job still resumes "
                        "from the host stores (default 1; each more costs one more copy's network and memory)")


def main(cmd, args, environ=os.environ) -> int | None:
    """`resilax launch --nodes ...` (or under a scheduler, `placement`): builds and runs the
    `Agent` (exit 2 on bad options). None: not a job across hosts; the caller runs the
    single-host launch."""
    other = [o for o, v in (("--shrink backend", getattr(args, "shrink", "reform") == "backend"),
                            ("--min-in-place (across hosts: --min-nodes)", getattr(args, "min_in_place", None) is not None),
                            ("--standby", bool(getattr(args, "standby", False))))
             if v]
    spare = bool(getattr(args, "spare", False))
    try:
        if spare and args.node_rank is not None:
            raise ValueError("--spare takes the rank of a lost host: leave out --node-rank")
        nodes, rank, address = placement(args.nodes, 0 if spare else args.node_rank, args.address, environ)
        if nodes is None:
            if spare:
                raise ValueError("--spare is a standby agent of a job across hosts: it needs --nodes (> 1)")
            return None
        if rank is None or other:
            raise ValueError("--nodes needs --node-rank (or SLURM_NODEID / JOB_COMPLETION_INDEX from the scheduler)"
                             if rank is None else f"{', '.join(other)} cannot be combined with --nodes yet")

        def make(rank):
            return Agent(cmd, nodes=nodes, node_rank=rank, n=args.n,
                         devices_per_process=args.devices_per_process, run_dir=args.run_dir, lease_s=args.lease,
                         address=address, heartbeat_s=args.heartbeat, heartbeat_timeout_s=args.heartbeat_timeout,
                         collective_timeout_s=args.collective_timeout or 15, startup_timeout_s=args.startup_timeout,
                         min_nodes=args.min_nodes, max_restarts=args.max_restarts,
                         rendezvous_timeout_s=args.rendezvous_timeout, host_store_every=args.host_store_every,
                         host_store_dir=args.host_store_dir, host_store_mirrors=args.host_store_mirrors,
                         spares=args.spares, in_place=args.in_place, clock_skew_s=_clock_skew(environ))

        agent = make(rank)  # (a spare's options are checked before it waits; its rank comes later)
    except ValueError as e:
        print(f"resilax: error: resilax launch: {e}" if not str(e).startswith("resilax") else f"resilax: error: {e}",
              file=sys.stderr)
        return 2
    if nodes > 1 and args.address is None and ipaddress.ip_address(address).is_loopback:
        say(f"{'spare' if spare else f'node {rank}'}: warning: the coordination service binds {address} (loopback) "
            f"when it runs on this node: only agents on this machine reach it; across machines, pass --address")
    if spare:
        got = _stand_by(agent.run_dir, nodes, args.rendezvous_timeout)
        if not isinstance(got, tuple):
            return got
        agent = make(got[0])
    return agent.run()


def _stand_by(run_dir: pathlib.Path, nodes: int, timeout_s: float):
    """A spare agent's wait (`rendezvous.standby`): ``(rank, dead incarnation)`` to stand in
    for, else the exit code (0: the job ended first; 1: no job ran for ``timeout_s``)."""
    def state():
        procs = read_json(run_dir / PROCESSES_JSON) or {}
        return procs.get("status"), procs.get("generation")

    before = state()  # (a relaunch's spare: the run directory may still say how the last launch ended)

    def ended():
        now = state()
        return now[0] in ("done", "preempted", "failed") and now != before

    say(f"spare (pid {os.getpid()}): standing by in {run_dir} for a lost host of the job's {nodes}")
    try:
        got = rendezvous.standby(run_dir, nodes, ended=ended, idle_timeout_s=timeout_s)
    except rendezvous.RendezvousError as e:
        say(f"spare: {e}")
        return 1
    if got is None:
        say(f"spare: the job in {run_dir} ended ({(read_json(run_dir / PROCESSES_JSON) or {}).get('status')}) with no "
            f"host to stand in for")
        return 0
    say(f"spare: node {got[0]}'s agent (incarnation {got[1][:8]}) lost its lease: standing in as node {got[0]}")
    return got
