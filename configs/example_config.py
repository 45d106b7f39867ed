"""ml_collections config for the example run: `resilax.Config.from_configdict(get_config().resilax)`.

Each protection is a nested group: present means on, ``None`` means off (e.g.
``c.resilax.peers = None``). Groups left out keep their defaults (record log, peer copies,
anomaly skipping: all on).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.topology = "cpu-2x4"
    c.steps = 200
    c.resilax = ml_collections.ConfigDict()
    c.resilax.checkpoint = ml_collections.ConfigDict()
    c.resilax.checkpoint.directory = "/tmp/resilax-example/ckpt"
    c.resilax.checkpoint.every = 25
    c.resilax.checkpoint.keep = 3
    c.resilax.checkpoint.async_save = True
    c.resilax.log = ml_collections.ConfigDict()
    c.resilax.log.mode = "grads"  # the record log's disk entries (in <checkpoint dir>/record_log)
    c.resilax.peers = ml_collections.ConfigDict()
    c.resilax.peers.every = 1
    c.resilax.anomaly = ml_collections.ConfigDict()
    c.resilax.anomaly.on_anomaly = "skip"
    c.resilax.health = ml_collections.ConfigDict()  # replica checksums, liveness watchdog, stragglers
    c.resilax.health.sdc_every = 1
    c.resilax.health.hang_detect_s = 5.0
    c.resilax.health.straggler_factor = 4.0
    c.resilax.seed = 0
    return c
