"""Small shared pieces for tests: the example model at test size, and state comparison."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np

from resilax.tools import example as ex

SMALL = ex.ExampleSpec(hidden=64, depth=2, batch=32, features=16, examples=1024)


def state_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def load_npz(path) -> dict:
    """``{name: array}`` of a ``.npz`` a run wrote (``--out``), read without pickle."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def flat_equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(argv, capsys) -> tuple[int, str]:
    """``resilax ARGV`` in this process: the console script's own function
    (`resilax.tools.cli.main`, which `test_cli` also runs as the installed script) for
    commands that must stop at their arguments. Returns ``(exit code, stderr)``; a process
    per case cost ~3 s of imports and start-up each.

    The environment is put back as it was: ``train`` adds ``--xla_gpu_deterministic_ops`` to
    ``XLA_FLAGS`` for its own process, and JAX puts ``XLA_FLAGS`` (read at each compile) into
    its persistent-cache keys, so leaving it changed made every later compile of this test
    worker, and of the processes it starts, miss the cache (+195 CPU-s in a CI run)."""
    from resilax.tools import cli as _cli

    env = dict(os.environ)
    capsys.readouterr()
    try:
        rc = _cli.main(list(argv))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    finally:
        os.environ.clear()
        os.environ.update(env)
    return rc, capsys.readouterr().err


def child_env() -> dict:
    """Environment for `python -m resilax ...` subprocesses: this checkout importable, unbuffered
    output, and none of a scheduler's placement variables (`resilax launch` reads SLURM_* and
    JOB_COMPLETION_INDEX: run inside a multi-node allocation, the single-host launch tests would
    become agents waiting for other nodes; the recipe test sets its own)."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("SLURM") or k == "JOB_COMPLETION_INDEX")}
    return dict(env, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")


TEST_SPEED_CODEGEN = "--xla_cpu_use_fusion_emitters=false"  # set by conftest for the suite's processes


def default_codegen_env(env: dict) -> dict:
    """``env`` with XLA:CPU's default code generation (conftest's test-speed emitter setting
    removed; the backend optimisation level stays), for the tests whose assertion is about
    the code XLA generates by default: the optimised HLO, bitwise equality to a differently
    split program, the time one compile takes."""
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] != TEST_SPEED_CODEGEN.split("=")[0])
    return dict(env, XLA_FLAGS=flags)


def kill_tree(p) -> None:
    """SIGKILLs the process group a test started (``start_new_session=True``) and reaps its leader."""
    import signal

    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


_REFERENCE_RUNS: dict = {}


def shared_tmp(tmp_path_factory):
    """A directory of this test session shared by its pytest-xdist workers."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def shared_topology(tmp_path_factory, domains: int, devices: int = 2) -> str:
    """The path of a topology spec of ``domains`` emulated CPU slices x ``devices`` (one failure
    domain per worker process, as `resilax bench multihost` writes it), at the same path for
    every test of the session: a `reference_run` keyed on a command that names it is shared by
    the tests that run that program."""
    import tempfile

    from resilax.tools.bench_multihost import _topology

    d = shared_tmp(tmp_path_factory) / "topologies"
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d) as t:  # written aside, then renamed: xdist workers may race
        made = _topology(pathlib.Path(t), workers=1, devices=devices, nodes=domains)
        path = d / os.path.basename(made)
        os.replace(made, path)
    return str(path)


def reference_run(tmp_path_factory, *args, env: dict | None = None) -> dict:
    """The final state (``{name: array}``) of a failure-free ``python -m resilax train *args``
    run (with a checkpoint directory of its own; ``env``: variables set for it), made once per
    test session for each argument list and ``env``: the crash tests of several modules that
    compare their restarts with the same program share it (a reference run costs a process
    start, ~7 s of CPU), and so do pytest-xdist's workers (the first makes it under a file lock
    in their common temporary directory, the others read its ``.npz``)."""
    import fcntl
    import hashlib

    key = tuple(str(a) for a in args) + tuple(f"{k}={v}" for k, v in sorted((env or {}).items()))
    if key not in _REFERENCE_RUNS:
        root = shared_tmp(tmp_path_factory)
        d = root / ("reference-" + hashlib.sha256("\0".join(key).encode()).hexdigest()[:16])
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (d / "done").exists():
                cmd = [sys.executable, "-m", "resilax", "train", *map(str, args), "--checkpoint-dir", str(d / "ckpt"),
                       "--out", str(d / "ref.npz")]
                r = subprocess.run(cmd, env=dict(child_env(), **(env or {})), capture_output=True, text=True)
                assert r.returncode == 0, r.stderr[-2000:]
                (d / "done").write_text("")
        _REFERENCE_RUNS[key] = load_npz(d / "ref.npz")
    return _REFERENCE_RUNS[key]


def agree_together(rdvs, after=-1, min_nodes=1):
    """``Rendezvous.agree`` of every one of ``rdvs`` at once (threads): the generation they all
    agreed on (an AssertionError if one did not, or they disagree)."""
    import threading

    got = {}
    threads = [threading.Thread(target=lambda r=r: got.setdefault(r.incarnation, r.agree(
        after=after, min_nodes=min_nodes, timeout_s=10))) for r in rdvs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == len(rdvs) and len({g.sha256 for g in got.values()}) == 1, got
    return next(iter(got.values()))
