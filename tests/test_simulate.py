"""Goodput simulator and report: reproducible, agrees with closed forms. No jax."""
import argparse
import json
import math

import numpy as np
import pytest

from resilax.tools.costmodel import CostModel
from resilax.tools.simulate import (PROFILES, custom_profile, daly_interval, draw_failures,
                               expected_goodput_checkpoint_only,
                               expected_goodput_exponential, register_cli, simulate,
                               simulate_strategy, young_daly_interval)

DELTA, RESTART, MTBF = 60.0, 600.0, 4 * 3600.0


def _plain_cost():
    """Costs that make checkpoint-only exactly Daly's model: blocking DELTA,
    restart RESTART (detection+restart+restore+compile), durable at once."""
    return CostModel(blocking_s_measured=DELTA, detection_s=0.0, restart_s=RESTART,
                     restore_fixed_s=0.0, compile_s=0.0, storage_read_bytes_s=1e30,
                     storage_write_bytes_s=1e30, storage_aggregate_bytes_s=1e30)


def _trace(seed, days=2000):
    cm = _plain_cost()
    prof = custom_profile(MTBF / 3600, cm.chips)
    return cm, draw_failures(prof, cm.chips, cm.domains, days * 86400.0,
                             np.random.default_rng(seed)), days * 86400.0


def test_closed_forms():
    assert young_daly_interval(60, 14400) == pytest.approx(math.sqrt(2 * 60 * 14400))
    # Daly's higher-order optimum is close to Young's when delta << M
    assert daly_interval(60, 14400) == pytest.approx(young_daly_interval(60, 14400), rel=0.05)
    assert daly_interval(100, 10) == 10
    g1 = expected_goodput_checkpoint_only(1000, 60, 600, 14400)
    g2 = expected_goodput_exponential(1000, 60, 600, 14400)
    assert 0.85 < g1 < 0.92 and abs(g1 - g2) < 0.01


def test_checkpoint_only_matches_exponential_expectation():
    cm, trace, horizon = _trace(seed=1)
    tau = daly_interval(DELTA, MTBF)
    r = simulate_strategy("checkpoint-only", trace, horizon, cm, mtbf_s=MTBF, interval_s=tau)
    want = expected_goodput_exponential(tau, DELTA, RESTART, MTBF)
    assert r["goodput"] == pytest.approx(want, abs=0.01)
    assert r["goodput"] == pytest.approx(
        expected_goodput_checkpoint_only(tau, DELTA, RESTART, MTBF), abs=0.02)
    assert r["failures"] == len(trace.times)


def test_simulated_best_interval_near_young_daly():
    cm, trace, horizon = _trace(seed=2)
    yd = young_daly_interval(DELTA, MTBF)
    factors = [0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4.0]
    goodputs = [simulate_strategy("checkpoint-only", trace, horizon, cm, mtbf_s=MTBF,
                                  interval_s=f * yd)["goodput"] for f in factors]
    best = factors[int(np.argmax(goodputs))]
    assert 0.6 <= best <= 1.6, (best, goodputs)
    assert goodputs[0] < max(goodputs) - 0.01 and goodputs[-1] < max(goodputs) - 0.01


def test_same_seed_same_json_different_seed_differs():
    a = simulate(chips=4096, seed=7, days=30)
    b = simulate(chips=4096, seed=7, days=30)
    c = simulate(chips=4096, seed=8, days=30)
    dump = lambda r: json.dumps(r, sort_keys=True)
    assert dump(a) == dump(b)
    assert dump(a) != dump(c)


@pytest.mark.parametrize("profile", ["llama3", "meta-cluster"])
def test_resilax_beats_checkpoint_only(profile):
    r = simulate(chips=16384, model_params=405e9, profile=profile, days=30, seed=0)
    s = r["strategies"]
    assert s["resilax"]["goodput"] >= s["checkpoint-only"]["goodput"]
    assert s["in-memory"]["goodput"] >= s["checkpoint-only"]["goodput"] - 0.005
    for name, v in s.items():
        total = sum(v["buckets_hours"].values())
        assert total == pytest.approx(30 * 24), name
        assert abs(v["buckets_hours"]["other"]) < 1e-6, name
        assert 0.0 < v["goodput"] < 1.0


def test_llama3_rate_matches_prior_art():
    p = PROFILES["llama3"]
    assert p.unplanned_per_chip_h == pytest.approx(2.0e-5, rel=0.05)
    assert p.job_mtbf_s(16384) / 3600 == pytest.approx(3.1, rel=0.05)
    assert PROFILES["meta-cluster"].job_mtbf_s(1024) == pytest.approx(8 * 3600)


def test_given_failure_times_small_job():
    cm = CostModel(step_s=0.05, chips=8, devices_per_domain=4, chips_per_replica=4,
                   model_params=1e6)
    times = [100.0, 400.0, 900.0]
    r = simulate(chips=8, model_params=1e6, cost=cm, days=1 / 24, seed=0,
                 failure_times=times, checkpoint_interval_steps=200)
    for name in ("checkpoint-only", "in-memory", "resilax"):
        assert r["strategies"][name]["failures"] == 3
    assert r["strategies"]["checkpoint-only"]["interval_s"] == pytest.approx(10.0)
    assert r["failures"]["hardware"] == 3 and r["config"]["given_failure_times"]
    # no failures at all: nothing lost, goodput is just the overheads
    r0 = simulate(chips=8, model_params=1e6, cost=cm, days=1 / 24, failure_times=[])
    assert r0["strategies"]["resilax"]["lost_hours"] == 0.0
    assert r0["strategies"]["checkpoint-only"]["lost_work_hours"] == 0.0


def test_goodput_falls_with_scale_for_checkpoint_only():
    small = simulate(chips=1024, days=60, seed=0)["strategies"]
    big = simulate(chips=100000, days=60, seed=0)["strategies"]
    assert big["checkpoint-only"]["goodput"] < small["checkpoint-only"]["goodput"] - 0.1
    assert big["resilax"]["goodput"] > big["checkpoint-only"]["goodput"] + 0.2


def test_cost_model_from_bench_json(tmp_path):
    (tmp_path / "overhead.json").write_text(json.dumps(
        {"ratio": 1.004, "step_s": 0.02, "blocking_s": 3.5, "plain_blocking_s": 4.0}))
    (tmp_path / "replay.json").write_text(json.dumps(
        {"results": {"replay_s_per_step": 0.001, "step_s": 0.02}}))
    (tmp_path / "bad.json").write_text("{not json")
    cm = CostModel.from_bench_json(tmp_path / "overhead.json", tmp_path / "replay.json",
                                   tmp_path / "bad.json", tmp_path / "missing.json")
    assert cm.overhead_ratio == 1.004
    assert cm.checkpoint_blocking_s == 3.5
    assert cm.replay_ratio == pytest.approx(0.05)
    assert cm.sources["overhead_ratio"] == "bench:overhead.json:ratio"
    assert "missing.json" in cm.sources["_skipped"] and "bad.json" in cm.sources["_skipped"]
    assert cm.sources["detection_s"].startswith("assumed")


def test_topology_scaling(tmp_path):
    spec = tmp_path / "x.toml"
    spec.write_text('devices_per_slice = 4\n[bandwidth]\ndcn_gbps = 800\nhost_GBps = 10\n')
    r = simulate(chips=4096, model_params=70e9, topology=spec, days=5, seed=0,
                 strategies=["resilax"])
    cm = r["cost_model"]
    assert cm["dcn_bytes_s"] == pytest.approx(100e9)
    assert cm["host_bytes_s"] == pytest.approx(10e9)
    assert cm["devices_per_domain"] == 4
    assert cm["sources"]["dcn_bytes_s"] == "topology:x.toml:dcn_bytes_s"
    assert cm["bytes_per_device"] == pytest.approx(70e9 * 12 / 4096)


def test_cli_writes_json_and_png(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register_cli(sub)
    out, png = tmp_path / "sim.json", tmp_path / "sweep.png"
    args = parser.parse_args(["simulate", "--chips", "16384", "--failures", "llama3",
                              "--days", "10", "--json", str(out), "--png", str(png)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "checkpoint-only" in text and "resilax" in text and "100,000" in text
    data = json.loads(out.read_text())
    assert set(data["strategies"]) == {"checkpoint-only", "in-memory", "resilax"}
    assert len(data["sweep"]["chips"]) == len(data["sweep"]["goodput"]["resilax"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_input_is_one_line_before_any_simulation(tmp_path, capsys):
    """Out-of-range numbers, an option the profile ignores, a cost file that cannot be read
    and an output that cannot be written: a usage line each (they were tracebacks, or
    silently ignored), exit 2."""
    from helpers import cli

    (tmp_path / "file").write_text("")
    for args, said in ((["--chips", "0"], "argument --chips: must be >= 1, got 0"),
                       (["--days", "0"], "argument --days: must be a finite number > 0, got 0"),
                       (["--model-params", "-1"], "argument --model-params: must be a finite number > 0"),
                       (["--pipeline", "--microbatches", "0"], "argument --microbatches: must be >= 1, got 0"),
                       (["--mtbf-hours", "5"], "--mtbf-hours applies to --failures custom"),
                       (["--cost-json", str(tmp_path / "none.json")], "--cost-json: cannot read"),
                       (["--png", str(tmp_path / "no" / "x.png")], "cannot write"),
                       (["--days", "1", "--json", str(tmp_path / "file" / "x.json")], "cannot write")):
        rc, err = cli(["simulate", *args], capsys)
        assert rc == 2 and said in err and "Traceback" not in err, (args, err)
