"""ml_collections config for the example run: `resilax.Config.from_configdict(get_config().resilax)`."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.topology = "cpu-2x4"
    c.steps = 200
    c.resilax = ml_collections.ConfigDict()
    c.resilax.checkpoint = ml_collections.ConfigDict({"directory": "/tmp/resilax-example/ckpt", "every": 25, "keep": 3})
    c.resilax.log = ml_collections.ConfigDict({"mode": "grads", "max_lag": 2})
    c.resilax.peers = ml_collections.ConfigDict({"every": 1})
    c.resilax.anomaly = ml_collections.ConfigDict({"on_anomaly": "skip"})
    c.resilax.seed = 0
    c.resilax.overhead_budget = 0.01
    return c
