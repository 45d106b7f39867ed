"""Anomalies: NaN/Inf and loss spikes are detected (lagged, off the critical path), the
run rolls back to the newest good state, skips the batch and goes on."""

import json

import numpy as np
import pytest

import resilax
from resilax.tools import example as ex
from resilax._src.protect.anomaly import SpikeDetector, robust_zscore
from test_replay import SPEC, TOPO, assert_bitwise, flat


def test_robust_zscore_and_spike_detector():
    hist = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 50.0]  # one outlier barely moves median/MAD
    assert robust_zscore(1.0, hist) == pytest.approx(0.0, abs=0.1)
    assert robust_zscore(5.0, hist) > 20
    d = SpikeDetector(zscore=6.0, window=20, min_history=5)
    for x in [2.0, 1.9, 1.95, 1.85, 1.9, 1.8]:
        assert d.check(x) is None
    assert "spike" in d.check(30.0)
    assert d.check(1.8) is None  # the spike did not enter the window


def run(tmp, steps, *, faults=(), skip_batches=(), on_anomaly="skip"):
    cfg = resilax.Config(checkpoint_dir=str(tmp), checkpoint_every=5, replay_log="grads", anomaly=True,
                         on_anomaly=on_anomaly)
    step = resilax.wrap(ex.train_step, topology=TOPO, config=cfg, faults=resilax.FaultPlan(faults))
    data = ex.make_iterator(SPEC)
    with step:
        state = step.init(ex.make_state(SPEC), data=data)
        while step.step < steps:
            if data.get_state()["next_index"] in skip_batches:
                next(data)
            state, _ = step(state, next(data))
    return flat(state), step


@pytest.mark.parametrize("at", [12, 14])  # 14: detected at once, before checkpoint 15
def test_nan_rolls_back_and_skips_the_batch(tmp_path, at):
    got, step = run(tmp_path / "run", 20, faults=[f"nan@{at}"])
    assert all(np.isfinite(v).all() for v in got.values())
    rb = [e for e in step.events if e.kind == "rollback"]
    assert len(rb) == 1 and rb[0].step == at and rb[0].fields["cause"] == "nonfinite"
    assert rb[0].fields["batches_skipped"] == [{"step": at, "data_state": {"next_index": at}}]
    assert rb[0].fields["from_step"] == 10
    json.dumps(rb[0].to_json())
    # Reference: a failure-free run that leaves out the same batch.
    ref, _ = run(tmp_path / "ref", 20, skip_batches=(at,))
    assert_bitwise(got, ref)


def test_stop_policy_raises(tmp_path):
    with pytest.raises(resilax.AnomalyError, match="step 7 is anomalous") as e:
        run(tmp_path, 12, faults=["nan@7"], on_anomaly="stop")
    assert e.value.step == 7 and e.value.cause == "nonfinite"


def test_config_validation():
    with pytest.raises(resilax.ConfigError, match="needs replay_log"):
        resilax.Config(anomaly=True)
    with pytest.raises(resilax.ConfigError, match="on_anomaly must be one of"):
        resilax.Config(replay_log="grads", anomaly=True, on_anomaly="ignore")
    with pytest.raises(resilax.ConfigError, match="replay_log must be one of"):
        resilax.Config(replay_log="all")


def test_cli_nan_fault(tmp_path, child_env, python):
    import subprocess

    r = subprocess.run([python, "-m", "resilax", "train", "--steps", "16", "--checkpoint-every", "5", "--quiet",
                        "--checkpoint-dir", str(tmp_path / "ck"), "--replay-log", "grads", "--anomaly",
                        "--fault", "nan@12", "--summary", str(tmp_path / "s.json")], env=child_env)
    assert r.returncode == 0
    summ = json.loads((tmp_path / "s.json").read_text())
    rb = [e for e in summ["events"] if e["kind"] == "rollback"]
    assert [e["step"] for e in rb] == [12] and np.isfinite(summ["final_loss"])
