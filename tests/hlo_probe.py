"""Run by tests/test_async.py in a subprocess with ``XLA_FLAGS=--xla_dump_to=DIR`` and an
empty compilation cache of its own (a program is dumped when it is compiled; its copies for
other devices load it): a failure-free run of each configuration below compiles every
program such a run needs (grad and update variants, peer copies, record-log entries,
checkpoint checksums, the cross-check, replica checks, the bit-exact mode's programs, the
degraded meshes compiled ahead), and XLA writes each one's optimised HLO to DIR.

Usage: python tests/hlo_probe.py RUN_DIR
"""

import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import PartitionSpec as P  # noqa: E402

import resilax  # noqa: E402
from resilax.tools import example as ex  # noqa: E402
from resilax.tools import pipeline_models  # noqa: E402
from resilax.tools.models import CASES  # noqa: E402

# data x pipeline as in cpu-2x4-pp, but 4 replicas of 2 stages: a pipeline of 2 blocks has the
# same kinds of program as one of 4 (the same ticks, selects, ring permutes and bubbles), and
# compiles in about half the time (each tick is unrolled)
PP_4X2 = resilax.Topology.from_dict({"name": "cpu-4x2-pp", "platform": "cpu", "domain": "slice", "emulated": True,
                                     "domains": 4, "devices_per_domain": 2,
                                     "mesh": {"axes": {"data": 4, "stage": 2}, "elastic_axis": "data"}})
OFF = dict(checkpoint=None, log=None, peers=None, anomaly=None, verify=None)


def run(name, case, cfg, layout, steps=5):
    t0 = time.perf_counter()
    state = case.make_state(0)
    if layout == "pipeline":  # data x pipeline: stacked blocks over the stage axis
        specs, topo, bsh = case.state_sharding(state), PP_4X2, P("data")
    else:
        specs = ex.fsdp_specs(state) if layout == "fsdp" else P()
        topo, bsh = "cpu-2x4", P(("data", "fsdp")) if layout == "fsdp" else P("data")
    topo = topo if isinstance(topo, resilax.Topology) else resilax.Topology.load(topo)
    step = resilax.wrap(case.train_step, topology=topo, state_sharding=specs,
                        batch_sharding=bsh, config=cfg, rng=True, metric_reductions=case.metric_reductions)
    s = step.init(state)
    for b in case.make_batches(steps):
        s, m = step(s, b)
    jax.block_until_ready(s)
    step.wait_compiled()
    step.close()
    print(name, "ok", step.step, f"{time.perf_counter() - t0:.1f} s", flush=True)


def main(run_dir):
    dm, bn = CASES["dropout_mlp"], CASES["batchnorm_mlp"]
    # every protection on: checkpoints (a save at steps 2 and 4), log entries, peer copies
    # every 2 steps (ring+local copy variants), the replica checks, the cross-check, and the
    # degraded meshes' programs compiled ahead
    full = resilax.Config(checkpoint=resilax.CheckpointConfig(os.path.join(run_dir, "a"), every=2),
                          peers=resilax.PeersConfig(every=2), health=resilax.HealthConfig(sdc_every=1, hang_detect_s=None))
    run("all_on_fsdp", dm, full, "fsdp")
    run("all_off", bn, resilax.Config(**OFF), "replicated")
    run("bit_exact", bn, resilax.Config(deterministic=resilax.DeterministicConfig(), peers=resilax.PeersConfig(compile_ahead=False),
                                        checkpoint=resilax.CheckpointConfig(os.path.join(run_dir, "c"), every=2)),
        "replicated")
    # a pipelined transformer (resilax.pipeline inside the loss): every default protection, saves
    run("pipeline", pipeline_models.linen_case(layers=2, microbatches=2),
        resilax.Config(checkpoint=resilax.CheckpointConfig(os.path.join(run_dir, "p"), every=2)), "pipeline", steps=3)
    # the user's own step under plain jit: the baseline the programs above are compared with
    for case in (dm, bn):
        st = case.make_state(0)
        b = case.make_batches(1)[0]
        jax.block_until_ready(jax.jit(case.train_step)(st, b, jax.random.key(0)))


if __name__ == "__main__":
    main(sys.argv[1])
