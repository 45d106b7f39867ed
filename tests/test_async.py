"""The failure-free step is asynchronous, as on an accelerator: no program resilax runs
holds a conditional, a loop or a host callback (XLA:GPU evaluates a conditional's
predicate on the host, so the step would wait for the device), and a call returns while
the device still computes."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ROOT, child_env, default_codegen_env

from resilax.tools.hlo_scan import host_sync_ops, scan_dump


def test_host_sync_pattern_finds_what_it_looks_for():
    """The scan below can fail: a program with a cond, a while and a callback is caught."""
    def f(x):
        y = jax.lax.cond(x.sum() > 0, lambda v: v + 1, lambda v: v - 1, x)
        y = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, y))[1]
        return jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(x.shape, x.dtype), y)

    text = jax.jit(f).lower(jnp.ones(4)).compile().as_text()
    found = host_sync_ops(text)
    assert any("conditional" in f for f in found) and any("while" in f for f in found), found
    assert any("callback" in f for f in found), found


def test_no_program_of_a_failure_free_run_waits_on_the_host(tmp_path):
    """Every program compiled in failure-free runs (every protection on with saves, peer
    copies and log entries, every protection off, the bit-exact mode, the degraded meshes
    compiled ahead; an MLP with dropout and one with BatchNorm; a pipelined transformer), dumped by XLA after
    optimisation, has no conditional, loop or host callback."""
    dump = tmp_path / "hlo"
    # XLA:CPU's default code generation: the suite's test-speed emitters (conftest) lower some
    # ops to loops that the default pipeline does not
    env = default_codegen_env(child_env())
    # A compilation cache of its own, empty at the start: every distinct program is compiled
    # (and dumped) once, and the same program for another set of devices (each degraded mesh
    # compiled ahead: the mesh without domain 0, the one without domain 1, ...) loads the
    # first one's executable (the suite's device-free cache key, tests/site), whose HLO is
    # the one already dumped (88 -> 76 CPU-s). Not the suite's shared cache: a program loaded
    # from it is not compiled here, so never dumped.
    env = dict(env, XLA_FLAGS=f"{env['XLA_FLAGS']} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip(),
               JAX_ENABLE_COMPILATION_CACHE="true", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "hlo_probe.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("all_on_fsdp", "all_off", "bit_exact"):
        assert f"{name} ok 5" in proc.stdout, proc.stdout
    assert "pipeline ok 3" in proc.stdout, proc.stdout
    files, bad = scan_dump(str(dump), skip=(".jit_create.",))  # the test's own flax init is not a step
    names = " ".join(os.path.basename(f) for f in files)
    # the programs it must have seen: grad and update parts, a ring copy, checksums, the user's plain step
    for part in ("jit_fn", "jit__dropout_step", "jit__bn_step", "checksum", "snapshot"):
        assert part in names, (part, sorted(os.path.basename(f) for f in files)[:50])
    assert len(files) > 20, len(files)
    assert not bad, bad


@pytest.mark.parametrize("config,devices", [("default", 1), ("checkpoint", 1), ("default", 8)])
def test_calls_return_while_the_device_computes(config, devices, tmp_path):
    """Four calls of a heavy step in a row return long before the device is done with them,
    as plain jit's do: nothing on the step path waits for a device value (verdicts, losses
    and counters are read late). ``checkpoint``: a save is due on none of these steps, but
    the checkpoint protection is on. ``8``: two emulated slices of 4 (peer copies on), the
    batch over every device, devices requested with `resilax.request_cpu_devices`: with
    XLA:CPU's default client pool (one thread per device on 2 cores) the update part's call
    waited for the whole grad part (fractions 0.5-1.0, measured)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "queue_probe.py"), config, str(tmp_path),
                           str(devices)], env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fractions = json.loads(proc.stdout.strip().splitlines()[-1])
    # plain jit returns at once; resilax must too (before: the verdict read one step late made
    # each call wait for the previous step: four calls returned after ~76% of their run time).
    # With a checkpoint directory the record log is on disk too, and its entries (data
    # position and verdict: known once the step is computed) may trail the loop by at most
    # LogConfig.max_lag = 2 steps, so the fourth call waits for the second step: ~1/2.
    assert min(fractions["plain"]) < 0.25, fractions
    assert min(fractions["resilax"]) < (0.25 if config == "default" else 0.62), fractions


@pytest.fixture(scope="module")
def leaf_models():
    """``{layers: (state, train_step)}``, built once for the three parametrisations below:
    the same step function and state tree in each, so a later wrap reuses the first one's
    traces and executables (resilax's trace cache and jit's, keyed on the tree), where a
    new `many_leaves` closure each time traced, lowered and checksummed 301 leaves again."""
    from resilax.tools.models import many_leaves

    return {n: many_leaves(n) for n in (2, 50)}


def _python_lines_per_step(model, config, steps=8):
    """Python lines executed by the calling thread per failure-free call (after 6 calls:
    compiles and first-step work), on two emulated slices (peer copies on)."""
    import resilax
    from jax.sharding import PartitionSpec as P

    state, fn = model
    state = jax.tree.map(jnp.array, state)  # buffers of this run's own (a run may donate them), the same tree
    step = resilax.wrap(fn, topology=resilax.Topology.emulated(2, 4), state_sharding=P(),
                        batch_sharding=P(("data", "fsdp")), config=config)
    s = step.init(state)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(8, 4)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
               for _ in range(2)]
    for i in range(6):
        s, _ = step(s, batches[i % 2])
    jax.block_until_ready(s)
    lines = 0

    def count(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return count

    sys.settrace(count)
    try:
        for i in range(steps):
            s, _ = step(s, batches[i % 2])
    finally:
        sys.settrace(None)
    jax.block_until_ready(s)
    step.close()
    return lines / steps


@pytest.mark.parametrize("checkpoints", [None, "inputs", "grads"])
def test_python_work_per_step_does_not_grow_with_the_leaves(checkpoints, tmp_path, leaf_models):
    """The Python a failure-free call runs (resilax's and JAX's dispatch, counted in lines
    executed) is the same for 13 state leaves and for 301: treedefs, shardings and the
    recorded values' packing are made once, and nothing on the step path loops over the
    leaves in Python (measured: ~1,220 lines a call for both; ~1,400 with a checkpoint
    directory, whose disk log writes an inputs entry every step). A loop over the leaves
    would add at least a line event per leaf: 288 a call, over the 15% allowed (it was 601
    leaves until 2026-11-29; 301 halve the traces and compiles and still catch a one-line
    comprehension). ``grads``: a disk grads entry every step, which holds the packed buffers
    as they are (it was unpacked and copied leaf by leaf: 3x the lines)."""
    import resilax

    def config(tag):
        if checkpoints is None:
            return resilax.Config()
        log = resilax.LogConfig(grads_budget=None) if checkpoints == "grads" else resilax.LogConfig()
        return resilax.Config(checkpoint=resilax.CheckpointConfig(str(tmp_path / tag), every=1000), log=log)

    few, many = _python_lines_per_step(leaf_models[2], config("few")), _python_lines_per_step(leaf_models[50], config("many"))
    assert many < 1.15 * few, (few, many)
