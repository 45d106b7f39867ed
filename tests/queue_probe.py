"""Run by tests/test_async.py: how soon four calls of a heavy step return, as a fraction of
the time until the device is done with them, for plain jit and for resilax (interleaved
twice). Prints one JSON line. With DEVICES > 1: two emulated slices (peer copies on), the
batch sharded over every device, the devices requested as `resilax.request_cpu_devices`
does (a call of a multi-device program returns while the previous one runs).

Usage: python tests/queue_probe.py {default|checkpoint} TMP_DIR [DEVICES]
"""

import json
import os
import sys
import time
import warnings

import jax

import resilax

DEVICES = int(sys.argv[3]) if len(sys.argv) > 3 else 1
resilax.request_cpu_devices(DEVICES)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def heavy_step(state, batch):
    def loss_fn(w):
        x = batch["x"]
        for _ in range(6):
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    g = resilax.record(g)
    return {"w": state["w"] - 1e-3 * g, "n": state["n"] + 1}, {"loss": loss}


def main(config, tmp):
    topo = resilax.Topology.emulated(slices=1 if DEVICES == 1 else 2, devices_per_slice=max(1, DEVICES // 2))
    bspec = P() if DEVICES == 1 else P(("data", "fsdp"))
    cfg = resilax.Config(checkpoint=resilax.CheckpointConfig(os.path.join(tmp, "ck"), every=100)
                         if config == "checkpoint" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one failure domain: no peers
        step = resilax.wrap(heavy_step, topology=topo, state_sharding=P(), batch_sharding=bspec, config=cfg)
    rng = np.random.default_rng(0)
    state = {"w": jnp.asarray(rng.normal(size=(512, 512)) * 0.03, jnp.float32), "n": jnp.zeros((), jnp.int32)}
    batch = {"x": rng.normal(size=(512, 512)).astype(np.float32)}
    s = step.init(state)
    for _ in range(3):  # compile, and the first step's one-off work
        s, m = step(s, batch)
    jax.block_until_ready(s)
    plain = jax.jit(heavy_step, in_shardings=(step._program.state_sh, NamedSharding(step.mesh, bspec)),
                    donate_argnums=0)  # resilax.record outside a wrapped step: identity
    ps = jax.device_put(dict(state), step._program.state_sh)
    ps, _ = plain(ps, batch)
    jax.block_until_ready(ps)
    fractions = {"plain": [], "resilax": []}
    for name in ("plain", "resilax", "plain", "resilax"):
        t0 = time.perf_counter()
        for _ in range(4):
            if name == "plain":
                ps, m = plain(ps, batch)
            else:
                s, m = step(s, batch)
        t1 = time.perf_counter()
        jax.block_until_ready(ps if name == "plain" else s)
        fractions[name].append((t1 - t0) / (time.perf_counter() - t0))
    step.close()
    print(json.dumps(fractions))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
