"""Topology specs and Config: loading, validation, clear errors."""

import importlib.util
import os

import gin
import jax
import ml_collections
import pytest

import resilax
from resilax._src.runtime.topology import available_specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_emulated_axes_and_domains():
    t = resilax.Topology.emulated(slices=2, devices_per_slice=4)
    assert t.axis_names == ("data", "fsdp") and t.axis_sizes == (2, 4)
    assert t.elastic_axis == "data"
    doms = t.domains()
    assert [len(d) for d in doms] == [4, 4]
    assert set(doms[0]).isdisjoint(doms[1])
    mesh = t.mesh(doms[1:])  # survivors only
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4}
    assert set(mesh.devices.flat) == set(doms[1])


@pytest.mark.parametrize("name", ["cpu-2x4", "cpu-4x2", "tpu-v4-2x32", "tpu-v5e-4x256", "tpu-v5p-2x128",
                                  "tpu-v6e-2x256", "gpu-h100-8", "gpu-h100-4x8"])
def test_shipped_specs_load(name):
    t = resilax.Topology.load(name)
    assert t.name == name
    assert t.axis_sizes[0] == t.num_domains
    assert set(t.bandwidth) >= {"ici", "dcn", "host", "storage"}
    assert all(t.bandwidth_sources.get(k) for k in t.bandwidth), "every bandwidth names its source"


def test_all_specs_listed():
    assert {"cpu-2x4", "cpu-4x2", "gpu-h100-8"} <= set(available_specs())


def test_spec_that_does_not_fit_the_devices_names_both():
    t = resilax.Topology.load("tpu-v4-2x32")
    with pytest.raises(resilax.TopologyError, match=r"needs tpu devices, but the devices present are on \['cpu'\]"):
        t.domains()
    t = resilax.Topology.emulated(slices=4, devices_per_slice=4)
    with pytest.raises(resilax.TopologyError, match=r"needs 16 cpu devices \(4 slices x 4\), but 8 are present"):
        t.domains()


@pytest.mark.parametrize("body,msg", [
    ("name='x'\nplatform='cpu'\ndomains=2\n[mesh]\naxes={data=2, fsdp=4}\n", "missing required field 'devices_per_domain'"),
    ("name='x'\nplatform='cpu'\ndomains=2\ndevices_per_domain=4\n[mesh]\naxes={data=2, fsdp=3}\n", "hold 3 devices"),
    ("name='x'\nplatform='cpu'\ndomains=2\ndevices_per_domain=4\n[mesh]\naxes={fsdp=4, data=2}\n", "one entry per failure"),
    ("name='x'\nplatform='abacus'\ndomains=2\ndevices_per_domain=4\n[mesh]\naxes={data=2, fsdp=4}\n", "platform must be one of"),
    ("name = = 'x'\n", "cannot read topology spec"),
])
def test_malformed_spec(tmp_path, body, msg):
    p = tmp_path / "bad.toml"
    p.write_text(body)
    with pytest.raises(resilax.TopologyError, match=msg):
        resilax.Topology.load(p)


def test_unknown_spec_lists_known():
    with pytest.raises(resilax.TopologyError, match="known specs: .*cpu-2x4"):
        resilax.Topology.load("no-such-spec")


def test_config_from_configdict_example():
    spec = importlib.util.spec_from_file_location("example_config", os.path.join(ROOT, "configs", "example_config.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = resilax.Config.from_configdict(mod.get_config().resilax)
    assert cfg.checkpoint.every == 25 and cfg.checkpoint.keep == 3
    assert cfg.checkpoint.directory == "/tmp/resilax-example/ckpt"
    assert cfg.log.mode == "grads" and cfg.peers.every == 1 and cfg.anomaly.on_anomaly == "skip"
    assert cfg.health == resilax.HealthConfig(sdc_every=1, hang_detect_s=5.0, straggler_factor=4.0)
    assert resilax.Config.from_configdict(cfg.to_dict()) == cfg
    off = resilax.Config.from_configdict({"peers": None, "anomaly": None})
    assert off.peers is None and off.anomaly is None and off.log is not None


def test_config_errors():
    with pytest.raises(resilax.ConfigError, match=r"unknown key\(s\) \['checkpoint_evry'\] for Config; known keys are"):
        resilax.Config.from_configdict(ml_collections.ConfigDict({"checkpoint_evry": 3}))
    with pytest.raises(resilax.ConfigError, match=r"unknown key\(s\) \['evry'\] for CheckpointConfig"):
        resilax.Config.from_configdict({"checkpoint": {"directory": "/tmp/x", "evry": 3}})
    with pytest.raises(resilax.ConfigError, match="every must be int, but got str '5'"):
        resilax.CheckpointConfig("/tmp/x", every="5")
    with pytest.raises(resilax.ConfigError, match="peers must be a resilax.PeersConfig or None"):
        resilax.Config(peers=True)
    with pytest.raises(resilax.ConfigError, match="keep must be >= 1"):
        resilax.CheckpointConfig("/tmp/x", keep=0)
    with pytest.raises(resilax.ConfigError, match="unknown field.*overhead_budget|overhead_budget"):
        resilax.Config.from_configdict({"overhead_budget": 0.01})  # removed: it steered nothing
    with pytest.raises(resilax.ConfigError, match="async_save must be bool"):
        resilax.CheckpointConfig("/tmp/x", async_save=1)
    for bad, msg in (({"sdc_every": "often"}, "sdc_every must be an int >= 1 or 'auto'"),
                     ({"sdc_every": 0}, "sdc_every must be an int >= 1 or 'auto'"),
                     ({"sdc_every": True}, "sdc_every must be int or str"),
                     ({"sdc_budget": 0}, r"sdc_budget must be in \(0, 1\]"),
                     ({"sdc_max_every": 0}, "sdc_max_every must be >= 1")):
        with pytest.raises(resilax.ConfigError, match=msg):
            resilax.HealthConfig(**bad)


def test_config_from_gin():
    gin.clear_config()
    try:
        cfg = resilax.Config.from_gin([os.path.join(ROOT, "configs", "example.gin")])
        assert isinstance(cfg, resilax.Config)
        assert cfg.checkpoint.every == 25 and cfg.checkpoint.directory == "/tmp/resilax-example/ckpt"
        assert cfg.health.hang_detect_s == 5.0 and cfg.health.straggler_factor == 4.0
        gin.clear_config()
        cfg = resilax.Config.from_gin(bindings=["resilax.Config.peers = None", "resilax.Config.seed = 7"])
        assert cfg.peers is None and cfg.seed == 7
        gin.clear_config()
        with pytest.raises(resilax.ConfigError, match="seed must be int"):
            resilax.Config.from_gin(bindings=["resilax.Config.seed = 'often'"])
        gin.clear_config()
        with pytest.raises(resilax.ConfigError, match="from_gin"):
            resilax.Config.from_gin(bindings=["resilax.Config.no_such_field = 1"])
    finally:
        gin.clear_config()


def test_eight_cpu_devices():
    assert jax.device_count() == 8


def test_emulated_devices_get_a_client_pool_for_two_programs(monkeypatch):
    """`request_cpu_devices` sizes XLA:CPU's client thread pool (NPROC) for a running
    program plus the next one's dispatch (two per device), never below the cores, and keeps
    a value the user set; one device needs nothing."""
    from resilax._src.runtime import cpu_devices

    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setattr(cpu_devices.os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
    assert cpu_devices.dispatch_threads(8) == 16
    monkeypatch.setattr(cpu_devices.os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    assert cpu_devices.dispatch_threads(8) == 64  # a big machine's pool is not shrunk
    cpu_devices.reserve_dispatch_threads(1)
    assert "NPROC" not in os.environ
    cpu_devices.reserve_dispatch_threads(8)
    assert os.environ["NPROC"] == "64"
    monkeypatch.setenv("NPROC", "5")
    cpu_devices.reserve_dispatch_threads(8)
    assert os.environ["NPROC"] == "5"
