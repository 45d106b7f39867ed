"""The ``resilax`` command: train, demo, bench (and simulate, report)."""

from __future__ import annotations

import argparse
import os
import sys


def _example_spec(batch: int | None):
    """The example model's spec with ``--batch`` (None: the default spec)."""
    if batch is None:
        return None
    from resilax.tools import example as ex

    if batch < 1:
        import resilax

        raise resilax.ConfigError(f"resilax train: --batch must be >= 1, got {batch}")
    return ex.ExampleSpec(batch=batch)


def _cmd_train(args) -> int:
    from resilax._src.runtime import xlaflags

    # before any backend starts (XLA reads the flags once): bitwise on GPU needs it
    os.environ["XLA_FLAGS"] = xlaflags.with_deterministic(os.environ.get("XLA_FLAGS"))
    from resilax._src.runtime import membership, worker
    from resilax.tools.runner import train

    while True:
        try:
            summary = train(
                steps=args.steps, topology=args.topology, checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=args.checkpoint_every, faults=tuple(args.fault), out=args.out,
                log_every=args.log_every, progress=not args.quiet, log=not args.no_log, log_mode=args.log_mode,
                peers=not args.no_peers, peers_every=args.peers_every, anomaly=not args.no_anomaly,
                layout=args.layout, deterministic=not args.no_deterministic, health=not args.no_health,
                curve=args.curve, spec=_example_spec(args.batch),
            )
            break
        except membership.Reform:  # under `resilax launch --in-place`: the job re-forms; join it in this process
            pass  # (outside the handler: the traceback would keep the old backend's arrays alive)
        e = worker.reattach()
        print(f"re-attached as process {e.process_id} of {e.num_processes} (generation {e.generation})", flush=True)

    if args.summary and worker.is_primary():  # one summary per job, from process 0
        from resilax._src.io import write_json

        write_json(args.summary, summary)
    start = summary.get("resumed_from") or 0  # (resumed at the last step: no step ran, no loss was read)
    ran = start == 0 or summary["steps"] > start
    print(f"done: {summary['steps']} steps, " + (f"loss {summary['final_loss']:.4f}" if ran else
          "resumed at the last step (none ran in this process)") + f", {summary['wall_s']:.1f} s", flush=True)
    worker.exit_if_shrunk(0)
    return 0


def _cmd_demo(args) -> int:
    from resilax.tools.runner import demo

    return demo(steps=args.steps, topology=args.topology, checkpoint_every=args.checkpoint_every,
                workdir=args.workdir, kill_at=args.kill_at, seed=args.seed)


def _cmd_bench(args) -> int:
    from resilax.tools.bench import run_bench

    return run_bench(args)


_BENCHES = (
    ("replay", "bench_replay", "replay cost per mode, log bytes per step, logging overhead"),
    ("recovery", "bench_recovery", "slice failure mid-run: recovery by phase vs restart + checkpoint"),
    ("multiprocess", "bench_multiprocess", "a worker SIGKILLed under resilax launch: kill to resume by phase"),
    ("multihost", "bench_multihost", "a host SIGKILLed under resilax launch --nodes (3 agents on loopback): death "
                                     "to back-at-the-step by phase, vs relaunching the job; a second host during "
                                     "the recovery (--cases double); --soak N"),
    ("health", "bench_health", "bit-exact mode and health-check cost (interleaved), bit-flip detection, rejoin"),
    ("gpt", "bench_gpt", "a GPT (bf16, AdamW, dropout) on the devices present: plain jit, jit + Orbax, "
                         "resilax off / defaults / defaults + checkpoints; save blocking, bitwise runs and resume"),
    ("protection", "bench_protection", "each protection's cost per step (>= 40 MB state, two layouts, A/A), "
                                       "checkpoint blocking vs Orbax and the host copy, recovery in step-times"),
    ("pipeline", "bench_pipeline", "pipeline schedule tables (GPipe, 1F1B, ZB-H1): healthy ticks, bubbles, drop the "
                                   "replica vs ReCycle reroute after a domain loss; pure Python, no devices"),
)
# each registers its own subcommand: command -> module of resilax.tools
_TOOLS = {"simulate": "simulate", "report": "report", "validate": "validate", "campaign": "campaign",
          "launch": "launch_cli"}


def _wanted(argv) -> tuple | None:
    """``(command, bench)`` named by ``argv`` (bench None unless ``command`` is ``bench`` and one
    is named), or None when no known command comes first (``--help``, a typo): the parser then
    has every command. A command's parser imports only its own tool's module: every worker,
    agent and supervisor process starts through here, and importing all of them cost each
    ~0.3 CPU-s."""
    if not argv or argv[0] not in {"train", "demo", "bench", *_TOOLS}:
        return None
    if argv[0] != "bench":
        return argv[0], None
    names = {b[0] for b in _BENCHES}
    return "bench", argv[1] if len(argv) > 1 and argv[1] in names else None


# What ``resilax --help`` lists: the commands a user runs, apart from the tools that measure
# and test resilax itself.
_USER_COMMANDS = (
    ("demo", "train, crash (SIGKILL), resume and compare bitwise with an uninterrupted run; lose a slice"),
    ("train", "train the example model with every protection on; run it again to resume"),
    ("launch", "run a training command as supervised worker processes, one agent per host with --nodes"),
    ("report", "a run's goodput table and timeline (RUN_DIR/goodput.json)"),
    ("simulate", "goodput of checkpointing strategies under failures, at scale"),
)
_DEV_COMMANDS = (
    ("bench", "benchmarks: overhead, replay, recovery, gpt, protection, health, multiprocess, multihost"),
    ("campaign", "random seeded fault schedules, each checked against a failure-free run"),
    ("validate", "a real CPU job with SIGKILLs against the goodput simulator"),
)
_TRAIN_DESCRIPTION = """\
Trains resilax's example model (a flax MLP on generated data, grain input) on a topology,
resuming from --checkpoint-dir when it holds checkpoints.

On top of resilax.Config()'s defaults (record log, peer copies, NaN/spike skipping, the
first-step cross-check) it adds:
  - the bit-exact mode, DeterministicConfig()          (--no-deterministic: the default mode)
  - HealthConfig(): replica checks and the liveness watchdog        (--no-health)
  - checkpoints every 10 steps (the library's default is 100) when --checkpoint-dir is given
  - XLA_FLAGS=--xla_gpu_deterministic_ops=true for bitwise results on GPU
Under `resilax launch` it turns peer copies and HealthConfig off (single-process only) and
checkpoints to RUN_DIR/checkpoints by default."""


class _Parser(argparse.ArgumentParser):
    """The top-level parser: its help lists the user commands apart from the developer tools."""

    def format_help(self) -> str:
        width = max(len(n) for n, _ in _USER_COMMANDS + _DEV_COMMANDS) + 2

        def rows(cmds):
            return "".join(f"  {n:<{width}}{h}\n" for n, h in cmds)

        return (f"{self.format_usage()}\n{self.description}\n\ncommands:\n{rows(_USER_COMMANDS)}"
                f"\ndeveloper tools:\n{rows(_DEV_COMMANDS)}\n"
                f"`resilax COMMAND --help` shows a command's options.\n")


def build_parser(argv=None) -> argparse.ArgumentParser:
    from resilax.tools.argtypes import int_at_least, output_path

    """The ``resilax`` parser (every command); given ``argv``, only the command it names has
    its tool imported."""
    wanted = None if argv is None else _wanted(argv)
    p = _Parser(prog="resilax", description="Failure-resilient JAX training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=argparse.ArgumentParser)

    t = sub.add_parser("train", help="train the example model (resumes from checkpoints)",
                       description=_TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--steps", type=int_at_least(0), default=200)
    t.add_argument("--topology", default="cpu-2x4", help="spec name in slices/ or a .toml path")
    t.add_argument("--checkpoint-dir", default=None)
    t.add_argument("--checkpoint-every", type=int_at_least(0), default=10,
                   help="save every this many steps (0: no periodic saves)")
    t.add_argument("--fault", action="append", default=[], help="inject a fault: kind@step[:phase][/target]")
    t.add_argument("--out", type=output_path, default=None, help="write the final state here (.npz)")
    t.add_argument("--summary", type=output_path, default=None, help="write a JSON summary here")
    t.add_argument("--log-every", type=int_at_least(1), default=10)
    t.add_argument("--quiet", action="store_true")
    t.add_argument("--layout", choices=["fsdp", "sharded"], default="fsdp",
                   help="fsdp: state sharded within a slice, replicated across slices; sharded: over every device")
    # every protection is on unless turned off (checkpoints: with --checkpoint-dir)
    t.add_argument("--log-mode", choices=["grads", "inputs"], default=None,
                   help="what the record log's disk entries hold (default grads: the recorded values; inputs: the "
                        "data position). On disk (CHECKPOINT_DIR/record_log) a restart resumes where it died")
    t.add_argument("--no-log", action="store_true",
                   help="no record log: a crash loses the steps since the newest checkpoint")
    t.add_argument("--no-peers", action="store_true", help="no peer copies of state that lives in one slice only")
    t.add_argument("--peers-every", type=int, default=None, metavar="K",
                   help="make the peer copy every K steps (default 1; the record log covers the steps between)")
    t.add_argument("--no-deterministic", action="store_true",
                   help="the default mode instead of the bit-exact one: state sharded as --layout says (also across "
                        "slices), the same maths on a smaller mesh up to reduction order (drifts over many steps)")
    t.add_argument("--no-health", action="store_true",
                   help="no silent-data-corruption check (default: the state's replicas across slices are compared "
                        "before each step; an outvoted slice is dropped)")
    t.add_argument("--batch", type=int, default=None, metavar="B",
                   help="the example model's global batch (default 64); the bit-exact mode needs it divisible by the "
                        "topology's failure domains (e.g. 48 for 3 or 6)")
    t.add_argument("--curve", action="store_true", help="put every step's loss and seconds in the --summary JSON")
    t.add_argument("--no-anomaly", action="store_true",
                   help="apply every update (default: steps with NaN/Inf values or a loss spike are skipped)")
    t.set_defaults(func=_cmd_train)

    d = sub.add_parser("demo", help="train, crash (SIGKILL), resume, compare bitwise with an uninterrupted run")
    d.add_argument("--steps", type=int_at_least(1), default=300)
    d.add_argument("--topology", default="cpu-2x4")
    d.add_argument("--checkpoint-every", type=int_at_least(1), default=25)
    d.add_argument("--kill-at", type=int, default=None, help="step after which the process is killed")
    d.add_argument("--workdir", default=None, help="keep files here (default: a temporary directory)")
    d.add_argument("--seed", type=int, default=None)
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="benchmarks: overhead, replay, recovery (print a table, write JSON)")
    bsub = b.add_subparsers(dest="which", required=True)
    o = bsub.add_parser("overhead", help="wrapped vs plain jitted step, interleaved; checkpoint blocking vs plain Orbax")
    o.add_argument("--json", type=output_path, default=None, help="write results here")
    o.add_argument("--steps", type=int_at_least(1), default=300)
    o.add_argument("--topology", default="cpu-2x4")
    o.add_argument("--checkpoint-every", type=int_at_least(1), default=None, help="default: resilax.Config's default")
    o.set_defaults(func=_cmd_bench)
    for name, mod, help_ in _BENCHES:
        sp = bsub.add_parser(name, help=help_)
        if wanted in (None, ("bench", None), ("bench", name)):
            # every tool ships with the package: a module that fails to import is a bug to show, not to skip
            m = __import__(f"resilax.tools.{mod}", fromlist=["add_arguments", "run"])
            m.add_arguments(sp)
            sp.set_defaults(func=m.run)

    for name, mod in _TOOLS.items():
        if wanted is None or wanted[0] == name:
            __import__(f"resilax.tools.{mod}", fromlist=["register_cli"]).register_cli(sub)
    return p


def _one_line_warnings() -> None:
    """resilax's own warnings print as their message alone, on one line (a failure handled is
    one line a person reads: which file and source line raised the warning is noise to them);
    every other warning prints as Python prints it."""
    import warnings

    shown = warnings.showwarning
    if getattr(shown, "resilax_one_line", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not text.startswith("resilax"):
            return shown(message, category, filename, lineno, file, line)
        out = sys.stderr if file is None else file
        try:
            out.write(" ".join(text.split()) + "\n")
        except (OSError, ValueError):  # a closed stream, as Python's own showwarning tolerates
            pass

    show.resilax_one_line = True
    warnings.showwarning = show


def _config_refused_exit(e: BaseException | None = None) -> int | None:
    """`worker.EXIT_CONFIG` for a launched worker whose command refused its configuration (``e``: a
    resilax configuration, topology, wrap or pipeline error; None: a malformed command line)
    before this process completed a step; None otherwise (outside a launch, another error,
    or after a step: a later refusal may come from the failure being recovered from, and a
    restart may help)."""
    from resilax._src import errors
    from resilax._src.runtime import worker

    if os.environ.get(worker.ENV_PREFIX + "COORDINATOR") is None and os.environ.get(worker.SPARE_ENV) is None:
        return None
    if e is not None and (not isinstance(e, (errors.ConfigError, errors.TopologyError, errors.WrapError,
                                             errors.PipelineError)) or isinstance(e, errors.StepBrokenError)):
        return None
    return None if worker.stepped() else worker.EXIT_CONFIG


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as e:  # argparse's usage error: under `resilax launch`, one that no restart mends
        if e.code == 2:
            raise SystemExit(_config_refused_exit() or 2) from None
        raise
    _one_line_warnings()
    from resilax._src.errors import ResilaxError
    from resilax.tools.runner import configure_compilation_cache

    if getattr(args, "compiles", True):  # (a supervisor, an agent or a report does not import JAX)
        configure_compilation_cache()

    try:
        return int(args.func(args) or 0)
    except ResilaxError as e:
        print(f"resilax: error: {e}", file=sys.stderr)
        from resilax._src.runtime import worker

        if worker.collective_broke(e) or worker.storage_failed(e):  # (no waiting on the other processes)
            worker.exit_after_broken_collective(2)
        return _config_refused_exit(e) or 2
    except Exception as e:
        from resilax._src.runtime import worker

        where = worker.collective_broke(e)
        if where is None:
            raise
        from resilax._src.messages import short_reason

        print(f"resilax: this worker's collective with another process broke ({short_reason(where, 300)}); it "
              f"exits for the supervisor to act (`resilax launch` names the process that failed; the traceback: "
              f"{_save_traceback(e)})", file=sys.stderr, flush=True)
        worker.exit_after_broken_collective(1)
        return 1


def _save_traceback(e: BaseException) -> str:
    """Writes ``e``'s traceback to the job's run directory (``logs/g<generation>.p<process>.error.txt``);
    returns its path, or why it could not be written."""
    import traceback

    from resilax._src.runtime import worker

    env = worker.env()
    path = os.path.join(env.run_dir, "logs", f"g{env.generation}.p{env.process_id}.error.txt")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(traceback.format_exception(e)))
    except OSError as err:
        return f"not written: {err}"
    return path


if __name__ == "__main__":
    sys.exit(main())
