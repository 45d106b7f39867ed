"""Deterministic XLA on GPU (issue 26): the flag `resilax train`/`launch` add and `wrap` checks.

The decision is a pure function of the platform and the XLA_FLAGS string, so it is tested
here without a GPU; `wrap` on a GPU topology is built (not initialised) on CPU.
"""

import warnings

import jax.numpy as jnp
import pytest

import resilax
from resilax._src.runtime import xlaflags

F = "--xla_gpu_deterministic_ops"


@pytest.mark.parametrize("flags,want", [
    ("", f"{F}=true"),
    (None, f"{F}=true"),
    ("--xla_dump_to=/tmp/d", f"--xla_dump_to=/tmp/d {F}=true"),  # the user's flags are kept, in order
    (f"--xla_dump_to=/tmp/d {F}=true", f"--xla_dump_to=/tmp/d {F}=true"),  # present: not repeated
    (f"{F}=false", f"{F}=false"),  # the user's explicit choice stands (wrap warns)
    (f"{F}", f"{F}"),
])
def test_with_deterministic_adds_the_flag_without_clobbering(flags, want):
    assert xlaflags.with_deterministic(flags) == want


@pytest.mark.parametrize("platform,flags,warns", [
    ("gpu", "", True),
    ("gpu", "--xla_gpu_autotune_level=0", True),
    ("gpu", f"{F}=false", True),
    ("gpu", f"{F}=true --xla_dump_to=x", False),
    ("gpu", f"{F}", False),
    ("gpu", f"{F}=true {F}=false", True),  # the last occurrence wins, as in XLA's parser
    ("cpu", "", False),
    ("tpu", "", False),
])
def test_determinism_warning_decision(platform, flags, warns):
    msg = xlaflags.determinism_warning(platform, flags)
    assert (msg is not None) == warns
    if warns:
        assert F + "=true" in msg and "within tolerance" in msg and "resume after a crash" in msg


def _step(state, batch):
    g = resilax.record(jnp.zeros_like(state))
    return state - g, {"loss": jnp.sum(state)}


def test_wrap_on_a_gpu_topology_warns_once_without_the_flag(monkeypatch):
    monkeypatch.setattr(xlaflags, "_gpu_warned", False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nothing")
    gpu = resilax.Topology.load("gpu-h100-8")
    cfg = resilax.Config(peers=None)
    with pytest.warns(RuntimeWarning, match=r"xla_gpu_deterministic_ops=true.*within tolerance"):
        resilax.wrap(_step, topology=gpu, config=cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        resilax.wrap(_step, topology=gpu, config=cfg)  # once per process
        monkeypatch.setattr(xlaflags, "_gpu_warned", False)
        monkeypatch.setenv("XLA_FLAGS", f"{F}=true")
        resilax.wrap(_step, topology=gpu, config=cfg)  # with the flag: silent
        monkeypatch.delenv("XLA_FLAGS")
        resilax.wrap(_step, topology=resilax.Topology.load("cpu-2x4"), config=cfg)  # not a GPU: silent


def test_resilax_train_and_launch_start_their_workers_with_the_flag(monkeypatch, python):
    """`resilax train` sets it in its own environment before JAX starts (the training runs in
    that process); `resilax launch` puts it in every worker's environment. The user's flags stay."""
    import os
    import types

    from resilax.tools import cli, launch, runner

    seen = {}

    def fake_train(**kw):
        seen["train"] = os.environ.get("XLA_FLAGS")
        return {"steps": 0, "final_loss": 0.0, "wall_s": 0.0}

    monkeypatch.setattr(runner, "train", fake_train)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nothing")
    assert cli.main(["train", "--steps", "1", "--quiet"]) == 0
    assert seen["train"] == f"--xla_dump_to=/tmp/nothing {F}=true"

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nothing")
    fake = types.SimpleNamespace(cmd=[python, "-c", "import os; print(os.environ['XLA_FLAGS'])"])
    proc = launch.Supervisor._popen(fake, {"RESILAX_TEST": "1"})
    out, _ = proc.communicate(timeout=60)
    assert out.decode().strip() == f"--xla_dump_to=/tmp/nothing {F}=true"
