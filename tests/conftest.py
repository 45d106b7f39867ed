"""Test set-up: 8 CPU devices (two or four emulated slices), requested once, before JAX starts."""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def child_env():
    """Environment for `python -m resilax ...` subprocesses: the repo importable, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


@pytest.fixture
def python():
    return sys.executable
