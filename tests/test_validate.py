"""Validation: the simulator replays a real SIGKILLed CPU job within 10% of its goodput."""

import math

import pytest

from resilax.tools.simulate import simulate
from resilax.tools.validate import cost_model, validate


def _measured(**over):
    vals = dict(step_s=0.01, blocking_s_measured=0.1, persist_s_measured=0.3, detection_s=0.0,
                restore_s_measured=0.4, compile_s=0.25, restart_s=2.5, launch_s=3.0,
                shutdown_s=0.7)
    vals.update(over)
    return {"topology": "cpu-2x4",
            "costs": {k: {"value": v, "source": f"measured: {k} test"} for k, v in vals.items()}}


def test_cost_mapping_keeps_measured_numbers_through_simulate():
    cm = cost_model(_measured())
    assert (cm.chips, cm.devices_per_domain, cm.domains) == (8, 4, 2)
    # the simulator's checkpoint-only terms are the measured numbers, not byte-derived ones
    assert cm.checkpoint_blocking_s == 0.1 and cm.persist_s == 0.3
    assert cm.restore_persistent_s == 0.4
    assert cm.sources["restart_s"] == "measured: restart_s test"
    assert cm.sources["chips"].startswith("set:")
    # simulate() calls scaled(): with chips and model_params left out it changes nothing
    out = simulate(strategies=["checkpoint-only"], cost=cm, failure_times=[], days=60 / 86400,
                   checkpoint_interval_steps=100)
    d = out["cost_model"]
    for k in ("step_s", "checkpoint_blocking_s", "persist_s", "restore_persistent_s",
              "restart_s", "compile_s", "launch_s", "shutdown_s", "chips"):
        assert d[k] == getattr(cm, k), k
    # no failures: 60 s = launch 3 + shutdown 0.7 + cycles of (1 s compute + 0.1 s save)
    train = 60 - 3.0 - 0.7
    n = math.floor(train / 1.1)
    compute = n * 1.0 + min(train - n * 1.1, 1.0)
    assert out["strategies"]["checkpoint-only"]["goodput"] == pytest.approx(compute / 60)


def test_negative_restart_from_noise_is_clamped():
    assert cost_model(_measured(restart_s=-0.05)).restart_s == 0.0
    cm = cost_model(_measured(blocking_s_measured=-0.01))
    assert cm.checkpoint_blocking_s == 0.0  # not a math domain error in young_daly_interval
    simulate(strategies=["checkpoint-only"], cost=cm, failure_times=[], days=60 / 86400,
             checkpoint_interval_steps=100)


def _lost_steps(t_fail):
    cm = cost_model(_measured(launch_s=0.0, shutdown_s=0.0))
    out = simulate(strategies=["checkpoint-only"], cost=cm, failure_times=[t_fail],
                   days=30 / 86400, checkpoint_interval_steps=100)
    return out["strategies"]["checkpoint-only"]["lost_work_hours"] * 3600 / cm.step_s


def test_a_save_not_yet_persisted_is_no_save():
    # cycles: 1 s compute, 0.1 s save; the save of step 100 returns at 1.1 s and is
    # durable 0.3 s later. Killed 0.05 s after it returned, the run loses 105 steps
    # (back to step 0); killed 0.5 s after, it loses only the 50 steps since step 100.
    assert _lost_steps(1.15) == pytest.approx(105)
    assert _lost_steps(1.6) == pytest.approx(50)


def test_real_job_goodput_matches_simulation(tmp_path):
    """A 480-step job killed twice, simulated on the costs measured on its own lives (the
    separate-run prediction is left to `resilax validate`: on a shared machine its error
    also carries the load changing between runs). Saves every 80 steps: each life makes two
    saves, so the per-save cost has a sample past each life's first (which is excluded)."""
    # Kills half-way between saves: the simulator places a failure by its wall time at one
    # mean step rate, so a kill near a save could land on the other side of it in the model
    # (a 40-step margin either side, over a second of steps, also outlasts the persist).
    r = validate(steps=480, checkpoint_every=80, kills=[200, 360], predict=False,
                 workdir=str(tmp_path), json_path=str(tmp_path / "v.json"))
    assert len(r["failure_times_s"]) == 2
    # each kill loses the 40 steps since the last save
    assert r["lost_steps_measured"] == 80
    # the job is short, so its three process starts weigh: goodput 0.26-0.33 measured at
    # loads 4-16; the bound says only that the run trained and lost time (neither 0 nor 1)
    assert 0.1 < r["measured_goodput"] < 0.95, r["measured_goodput"]
    assert r["relative_error"] < 0.10, (r["measured_goodput"], r["simulated_goodput"])
