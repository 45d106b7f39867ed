"""The command line: the demo (README's main job) and the overhead benchmark's JSON."""

import json
import subprocess
import sys

from helpers import child_env as _env, cli


def test_demo_kills_resumes_and_matches_bitwise(tmp_path):
    """The README's main job: SIGKILL + resume is bitwise; a lost slice recovers from peers; slice
    health (loss, bit flip, rejoin, NaN, hang) ends bitwise; demo.png is written."""
    import re

    r = subprocess.run([sys.executable, "-m", "resilax", "demo", "--steps", "30", "--checkpoint-every", "10",
                        "--kill-at", "17", "--workdir", str(tmp_path)], env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "process exited with SIGKILL" in r.stdout
    resumed = int(re.search(r"resumed at step +(\d+)", r.stdout)[1])
    assert 14 <= resumed <= 17, "the log brings the restart back to (nearly) where it died"
    assert "final state vs uninterrupted run: BITWISE IDENTICAL" in r.stdout
    assert "recovered from           peer copies" in r.stdout
    rel = float(re.search(r"max relative difference ([0-9.e+-]+)", r.stdout)[1])
    assert rel < 1e-4, rel  # same program with and without the failure: reassociation only
    # phase 5: slice loss, bit flip, rejoin and NaN on 4 slices in the bit-exact mode
    timeline = r.stdout.split("event timeline")[1]
    for kind in ("recovery", "bitflip", "sdc", "rejoin", "anomaly", "hang_slice", "hang"):
        assert f": {kind} " in timeline, kind
    assert "outvoted by [0, 3]" in timeline
    assert re.search(r"liveness watchdog: slice 3 silent for [5-9]\.\d s", timeline), timeline
    assert "final state vs the same run without the failures: BITWISE IDENTICAL" in r.stdout
    # what a user reads while the runs recover (issue 53): no traceback, and each fault and
    # what resilax did about it as one line from the child that met it
    text = r.stdout + r.stderr
    assert "Traceback" not in text, text[-4000:]
    lines = text.splitlines()
    for said in ("slice(s) [1] lost; state from peer copies",  # phase 4: sharded state from the peer copies
                 "fault injected: a bit of", "replica checksums: slice(s) [2] outvoted by [0, 3]",
                 "slice 1 rejoined: mesh", "NaN/Inf in the step's values: its update was skipped",
                 "fault injected: slice 3 stops answering", "liveness watchdog: slice 3 silent for"):
        assert [ln for ln in lines if ln.startswith("step ") and said in ln], (said, text[-4000:])
    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_bench_overhead_writes_json(tmp_path):
    out = tmp_path / "ov.json"
    r = subprocess.run([sys.executable, "-m", "resilax", "bench", "overhead", "--steps", "10", "--checkpoint-every", "5",
                        "--json", str(out)], env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["checkpoints"] == 2
    for k in ("ratio", "step_s", "blocking_s", "plain_blocking_s"):
        assert res[k] > 0, k
    assert "ratio (median wrapped / median plain)" in r.stdout


def test_cli_reports_bad_input_clearly(capsys):
    rc, err = cli(["train", "--steps", "2", "--topology", "no-such"], capsys)
    assert rc == 2 and "resilax: error: resilax.Topology.load: no topology spec named 'no-such'" in err, err
    rc, err = cli(["train", "--steps", "2", "--fault", "explode@3"], capsys)
    assert rc == 2 and "kind must be one of" in err, err
    # counts out of range: a usage line naming the bound (--log-every 0 was a ZeroDivisionError, --steps -1 ran 0 steps)
    for args, said in ((["train", "--steps", "-1"], "argument --steps: must be >= 0, got -1"),
                       (["train", "--log-every", "0"], "argument --log-every: must be >= 1, got 0"),
                       (["train", "--checkpoint-every", "x"], "argument --checkpoint-every: invalid int value: 'x'"),
                       (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
                       (["train", "--summary", "/no-such-dir/s.json"], "argument --summary: cannot write"),
                       (["demo", "--steps", "30", "--kill-at", "30"], "--kill-at must be in [1, --steps - 1]"),
                       (["demo", "--workdir", "/proc/no-such-dir"], "cannot use --workdir '/proc/no-such-dir'"),
                       # the developer tools alike: counts, outputs that cannot be written, a kill list
                       (["campaign", "--trials", "0"], "argument --trials: must be >= 1, got 0"),
                       (["bench", "gpt", "--json", "/nonexistent-dir/x.json"], "'/nonexistent-dir' is not a directory"),
                       (["bench", "multiprocess", "-n", "0"], "argument -n: must be >= 1, got 0"),
                       (["validate", "--kills", "abc"], "--kills expects step numbers separated by commas"),
                       (["validate", "--steps", "400", "--kills", "500"], "distinct ascending kill steps in (0, 400)")):
        rc, err = cli(args, capsys)
        assert rc == 2 and said in err, (args, err)


def test_cli_protection_flags_are_checked(capsys):
    # a flag for a protection that is turned off, or a bad cadence, is a clear error before any step
    rc, err = cli(["train", "--steps", "2", "--no-log", "--log-mode", "inputs"], capsys)
    assert rc == 2 and "resilax: error: --log-mode inputs" in err and "--no-log" in err, err
    rc, err = cli(["train", "--steps", "2", "--peers-every", "0"], capsys)
    assert rc == 2 and "resilax: error: resilax.PeersConfig: every must be >= 1" in err, err


def test_console_script_entry_point_resolves():
    """The README's main command is the `resilax` script: its entry point must import (0.1's
    layout change left it pointing at a removed module, so `resilax demo` failed)."""
    import importlib
    import os
    import tomllib

    from helpers import ROOT

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["resilax"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), target
    script = os.path.join(os.path.dirname(sys.executable), "resilax")
    if os.path.exists(script):  # installed (the README's and CI's venv): run it as a user would
        r = subprocess.run([script, "--help"], env=_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "demo" in r.stdout, r.stderr[-2000:]


def test_bench_health_writes_json(tmp_path):
    """`resilax bench health`: the bit flip is found at once and its slice named; a rejoin is
    timed; a hang is found within the probe cadence + timeout and its slice named; the overhead ratios are measured (their size is the benchmark's business)."""
    out = tmp_path / "h.json"
    r = subprocess.run([sys.executable, "-m", "resilax", "bench", "health", "--steps", "3", "--hidden", "64",
                        "--batch", "64", "--checkpoint-every", "4", "--quiet", "--json", str(out)], env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["sdc_detect_steps"] == 0 and res["sdc_domain_identified"] is True
    assert res["rejoin_s"] > 0 and res["deterministic_overhead_ratio"] > 0 and res["health_overhead_ratio"] > 0
    assert res["health_every_step_ratio"] > 0
    cad = res["sdc_cadence"]["deterministic_health"]  # timed once the auto cadence was chosen
    assert cad["phase"] == "set" and cad["every"] == cad["decision"]["every"] >= 1 and cad["rebuildable"]
    # default HealthConfig: a silent domain gets the whole 5 s probe timeout, probes every 1 s
    assert 5.0 <= res["hang_detect_s"] <= 5.0 + 1.0 + 3.0 and res["hang_domain_identified"] is True
    assert res["step_deadline_s"] >= 5.0


def test_a_command_imports_only_its_own_tool():
    """Every worker, agent and supervisor starts through `resilax.tools.cli.main`: a command's
    parser imports its own tool only (importing every bench and tool cost each process ~0.3
    CPU-s), while ``resilax --help`` and ``resilax bench --help`` still list every command."""
    code = ("import sys\nfrom resilax.tools import cli\n"
            "cli.build_parser(['train', '--steps', '1']).parse_args(['train', '--steps', '1'])\n"
            "print(sorted(m for m in sys.modules if m.startswith('resilax.tools.')\n"
            "             and m not in ('resilax.tools.cli', 'resilax.tools.argtypes')))\n"
            "cli.build_parser(['bench', 'gpt']).parse_args(['bench', 'gpt', '--help'])\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    first, rest = r.stdout.split("\n", 1)
    assert first == "[]", first
    assert "--size" in rest  # bench gpt's own options
    r = subprocess.run([sys.executable, "-m", "resilax", "bench", "--help"], env=_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and all(n in r.stdout for n in ("multihost", "protection", "gpt", "health")), r.stdout
    r = subprocess.run([sys.executable, "-m", "resilax", "--help"], env=_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and all(n in r.stdout for n in ("train", "launch", "campaign", "validate")), r.stdout


def test_help_lists_the_user_commands_apart_from_the_developer_tools():
    """`resilax --help` leads with what a user runs; `resilax train --help` says which settings
    it adds to `resilax.Config()`'s defaults."""
    import argparse

    from resilax.tools import cli

    p = cli.build_parser()
    user, dev = p.format_help().split("developer tools:")
    assert all(f"\n  {n} " in user for n in ("demo", "train", "launch", "report", "simulate")), user
    assert all(f"\n  {n} " in dev for n in ("bench", "campaign", "validate")), dev
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    listed = {n for n, _ in cli._USER_COMMANDS + cli._DEV_COMMANDS}
    assert listed == set(sub.choices), "every command is listed in --help once"
    train = sub.choices["train"].format_help()
    assert "DeterministicConfig()" in train and "HealthConfig()" in train and "every 10 steps" in train
    assert "developer tools:" not in train


def test_only_a_refused_configuration_before_a_step_exits_78_under_launch(monkeypatch):
    """Under `resilax launch` a resilax command exits 78 (the job ends) for a configuration,
    topology, wrap or pipeline error, or a malformed command line, before its first step; a
    step called again after a failed call, a storage error, or any error outside a launch
    keeps exit 2 (a restart may mend it, or there is no supervisor)."""
    from resilax._src import errors
    from resilax._src.runtime import worker
    from resilax.tools import cli as _cli

    monkeypatch.delenv("RESILAX_COORDINATOR", raising=False)
    assert _cli._config_refused_exit(errors.TopologyError("t")) is None
    monkeypatch.setenv("RESILAX_COORDINATOR", "127.0.0.1:1")
    for e in (errors.TopologyError("t"), errors.ConfigError("c"), errors.WrapError("w"), errors.PipelineError("p"), None):
        assert _cli._config_refused_exit(e) == worker.EXIT_CONFIG == 78, e
    for e in (errors.StepBrokenError("an earlier call failed"), errors.StorageError("s"), errors.StateLostError("l")):
        assert _cli._config_refused_exit(e) is None, e
    monkeypatch.setattr(worker, "stepped", lambda: True)  # after this process completed a step
    assert _cli._config_refused_exit(errors.TopologyError("t")) is None
