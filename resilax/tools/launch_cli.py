"""`resilax launch`'s command line: its options, and the choice between one supervisor of N
workers on this machine (`resilax.tools.launch.Supervisor`) and one agent of a job across
hosts (`resilax.tools.agent`, with ``--nodes`` or a scheduler's environment)."""

from __future__ import annotations

import argparse
import sys

from resilax.tools import agent_cli, launch
from resilax.tools.argtypes import int_at_least, positive_float


def register_cli(sub) -> None:
    p = sub.add_parser("launch", help="run N JAX worker processes under a supervisor that restarts the job on failures",
                       description=launch.__doc__.split("\n\n")[0])
    p.add_argument("-n", "--num-processes", type=int, required=True, dest="n")
    p.add_argument("--devices-per-process", type=int, default=1, help="CPU devices each worker asks JAX for")
    p.add_argument("--run-dir", required=True, help="processes.json, heartbeats, worker logs (and the default "
                                                    "checkpoint directory of `resilax train`)")
    p.add_argument("--max-restarts", type=int_at_least(0), default=3,
                   help="give up after this many new generations in a row that fail without getting past the newest "
                        "step completed before (a job that makes progress between failures restarts as often as it "
                        "fails)")
    p.add_argument("--heartbeat", type=positive_float, default=0.5, metavar="S", help="worker heartbeat interval (s)")
    p.add_argument("--heartbeat-timeout", type=positive_float, default=5.0, metavar="S",
                   help="a worker whose heartbeat is older is hung and gets SIGKILLed (s)")
    p.add_argument("--step-deadline-factor", type=positive_float, default=20.0,
                   help="step deadline = max(--min-step-deadline, this x measured step time)")
    p.add_argument("--min-step-deadline", type=positive_float, default=30.0, metavar="S")
    p.add_argument("--collective-timeout", type=int_at_least(1), default=None, metavar="S",
                   help="XLA CPU collective timeout in the workers (default: half of --min-step-deadline)")
    p.add_argument("--startup-timeout", type=positive_float, default=300.0, metavar="S")
    p.add_argument("--host-store-every", type=int_at_least(0), default=1, metavar="K",
                   help="workers copy their shards to the host state store (RAM) every K steps; a new generation "
                        "restores from there (0: off, restore from checkpoints only). On one machine each host's "
                        "copy is mirrored to the next; with --nodes each host keeps its own, no mirror")
    p.add_argument("--spares", type=int, default=0, metavar="S",
                   help="keep S processes of the command warm (JAX imported, waiting); a new generation takes its "
                        "workers from them first (0: every worker starts fresh). With --nodes: S on each host")
    p.add_argument("--standby", action="store_true",
                   help="keep the next generation set up ahead: -n processes attached to its own coordination "
                        "service, backends up, programs built, parked before the restore; a generation that fails "
                        "is replaced by it, so a new generation waits only for the restore and its first step. "
                        "Doubles the processes (and their memory) on this machine; not with --in-place or --nodes",
                   )
    p.add_argument("--in-place", action="store_true",
                   help="when a worker dies and every other one can (the bit-exact mode with one failure domain per "
                        "process, host store on), the others go on in place on their own devices instead of a new "
                        "generation restarting all of them; once enough warm spares (--spares) are ready for the "
                        "dead places, the job grows back to -n without restarting the survivors")
    p.add_argument("--shrink", choices=launch.SHRINK_MODES, default="reform",
                   help="--in-place, a death with no warm spare ready for every dead place: 'reform' (default): the "
                        "survivors re-form as a smaller job on a new backend in their own processes (checkpoints and "
                        "preemption keep working; it grows back when spares are ready); 'backend': they go on at once "
                        "on the backend the failure broke (faster; falls back to a restart when a broken "
                        "communicator is reused; checkpoints pause until the job grows back)")
    p.add_argument("--min-in-place", type=int, default=None, metavar="M",
                   help="go on in place only while at least M workers are left (default: half of -n, rounded up); "
                        "below that a new generation brings the job back to -n workers")
    agent_cli.add_arguments(p)  # --nodes, --node-rank: one agent of a job across hosts (tools/agent.py)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the worker command")
    # a supervisor or an agent compiles nothing: no JAX, no compilation cache (its workers set theirs)
    p.set_defaults(func=_cmd_launch, compiles=False)


def _cmd_launch(args) -> int:
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if cmd and cmd[0] == "resilax":  # the same interpreter and resilax as the supervisor
        cmd = [sys.executable, "-m", "resilax", *cmd[1:]]
    if (rc := agent_cli.main(cmd, args)) is not None:  # --nodes, or a scheduler's: one agent of a job across hosts
        return rc
    try:
        sup = launch.Supervisor(cmd, n=args.n, devices_per_process=args.devices_per_process, run_dir=args.run_dir,
                         max_restarts=args.max_restarts, heartbeat_s=args.heartbeat,
                         heartbeat_timeout_s=args.heartbeat_timeout, step_deadline_factor=args.step_deadline_factor,
                         min_step_deadline_s=args.min_step_deadline, collective_timeout_s=args.collective_timeout,
                         startup_timeout_s=args.startup_timeout, host_store_every=args.host_store_every,
                         spares=args.spares, in_place=args.in_place, min_in_place=args.min_in_place,
                         shrink=args.shrink, standby=args.standby)
    except ValueError as e:
        print(f"resilax: error: {e}", file=sys.stderr)
        return 2
    return sup.run()
