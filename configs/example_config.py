"""ml_collections config for the example run: `resilax.Config.from_configdict(get_config().resilax)`."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.topology = "cpu-2x4"
    c.steps = 200
    c.resilax = ml_collections.ConfigDict()
    c.resilax.checkpoint_dir = "/tmp/resilax-example/ckpt"
    c.resilax.checkpoint_every = 25
    c.resilax.checkpoint_keep = 3
    c.resilax.async_checkpointing = True
    c.resilax.seed = 0
    c.resilax.overhead_budget = 0.01
    return c
