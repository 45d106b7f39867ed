"""`resilax launch` checks the JAX runtime's behaviour, not its version number: the probes
pass on the installed JAX (and the pass is remembered), and a JAX without a behaviour gets
an error naming it."""

import json
import os
import subprocess
import sys

import pytest

from resilax._src.runtime import jaxprobe


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the test session's speed flags aside
    return {**env, "JAX_PLATFORMS": "cpu"}


def test_the_installed_jax_shows_every_behaviour_and_the_pass_is_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(jaxprobe.SKIP_ENV, raising=False)
    monkeypatch.setattr(jaxprobe, "_passed", False)
    jaxprobe.ensure()
    (cached,) = (tmp_path / "resilax").glob("jax-behaviour-*.json")
    assert json.loads(cached.read_text())["ok"] is True
    monkeypatch.setattr(jaxprobe, "_passed", False)
    monkeypatch.setattr(jaxprobe.subprocess, "run", lambda *a, **k: pytest.fail("probed again"))
    jaxprobe.ensure()  # from the cache


def test_a_missing_behaviour_is_named(tmp_path):
    """An XLA that does not know the collective timeout flag: the probe says which behaviour."""
    r = subprocess.run([sys.executable, "-m", "resilax._src.runtime.jaxprobe", "--flag", "--xla_cpu_no_such_flag"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and out["behaviour"] == "collective_timeout_flag", out
    err = jaxprobe.JaxBehaviourError(out["behaviour"], out["detail"])
    assert "--xla_cpu_collective_timeout_seconds" in str(err) and "collective_timeout_flag" in str(err)
    assert "version" not in str(err)
