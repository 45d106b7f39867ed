"""Goodput accounting: buckets sum to wall time, nesting, files. No jax."""
import json
import os

import pytest

from resilax._src.runtime.goodput import (BUCKETS, ML_GOODPUT_NAMES, GoodputFileError,
                              GoodputRecorder, load_goodput)


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t

    def tick(self, dt):
        self.t += dt


def _recorder():
    clock = FakeClock()
    return GoodputRecorder(clock=clock), clock


def test_buckets_sum_to_wall_with_fake_clock():
    rec, clock = _recorder()
    clock.tick(2.0)                       # unattributed -> other
    with rec.span("compile"):
        clock.tick(5.0)
    for step in range(3):
        with rec.span("productive", step=step):
            clock.tick(1.0)
    with rec.span("checkpoint_save", step=3):
        clock.tick(0.5)
    clock.tick(0.25)
    tot = rec.totals()
    assert set(tot) == set(BUCKETS)
    assert tot["compile"] == 5.0
    assert tot["productive"] == 3.0
    assert tot["checkpoint_save"] == 0.5
    assert tot["other"] == pytest.approx(2.25)
    assert sum(tot.values()) == pytest.approx(rec.wall()) == pytest.approx(10.75)
    assert rec.goodput() == pytest.approx(3.0 / 10.75)


def test_nested_spans_count_innermost_only():
    rec, clock = _recorder()
    with rec.span("productive", step=1):
        clock.tick(1.0)
        with rec.span("protection"):
            clock.tick(0.2)
            with rec.span("checkpoint_save"):
                clock.tick(0.3)
            clock.tick(0.1)
        clock.tick(1.0)
    tot = rec.totals()
    assert tot["productive"] == pytest.approx(2.0)
    assert tot["protection"] == pytest.approx(0.3)
    assert tot["checkpoint_save"] == pytest.approx(0.3)
    assert tot["other"] == pytest.approx(0.0)
    assert sum(tot.values()) == pytest.approx(rec.wall())
    segs = sorted(rec.segments(), key=lambda s: s["start"])
    assert [s["bucket"] for s in segs] == [
        "productive", "protection", "checkpoint_save", "protection", "productive"]
    for a, b in zip(segs, segs[1:]):           # pieces never overlap
        assert a["end"] <= b["start"] + 1e-12


def test_open_span_counts_up_to_now():
    rec, clock = _recorder()
    with rec.span("recovery", phase="restore"):
        clock.tick(4.0)
        assert rec.totals()["recovery"] == 4.0
        assert sum(rec.totals().values()) == pytest.approx(4.0)


def test_add_moves_time_and_keeps_sum():
    rec, clock = _recorder()
    with rec.span("productive"):
        clock.tick(1.0)
        rec.add("protection", 0.25)            # carved out of productive
    clock.tick(3.0)
    rec.add("recovery", 2.0, phase="plan")     # carved out of the remainder
    tot = rec.totals()
    assert tot["productive"] == pytest.approx(0.75)
    assert tot["protection"] == pytest.approx(0.25)
    assert tot["recovery"] == pytest.approx(2.0)
    assert tot["other"] == pytest.approx(1.0)
    assert sum(tot.values()) == pytest.approx(rec.wall())
    with pytest.raises(ValueError, match="seconds >= 0"):
        rec.add("replay", -1.0)
    with pytest.raises(ValueError, match="bucket"):
        rec.add("nonsense", 1.0)
    with pytest.raises(ValueError, match="bucket"):
        with rec.span("nonsense"):
            pass


def test_a_thrown_away_step_is_taken_from_productive_never_below_zero():
    """A step whose result was thrown away is known only later, inside another bucket's span
    (the next call's protection work): its time comes back out of ``productive``, where it
    was booked, not out of the small bucket that happens to be open."""
    rec, clock = _recorder()
    with rec.span("productive"):
        clock.tick(1.0)
    with rec.span("protection"):
        clock.tick(0.1)
        rec.add("lost", 0.5, source="productive")
        rec.add("lost", 5.0, source="productive")  # more than productive holds: only what it has
    tot = rec.totals()
    assert tot["protection"] == pytest.approx(0.1)
    assert tot["productive"] == pytest.approx(0.0) and tot["lost"] == pytest.approx(1.0)
    assert min(tot.values()) >= 0 and sum(tot.values()) == pytest.approx(rec.wall())
    with pytest.raises(ValueError, match="bucket"):
        rec.add("lost", 1.0, source="nonsense")


def test_events_are_timestamped():
    rec, clock = _recorder()
    clock.tick(7.0)
    rec.event("failure", domain=1, step=40)
    ev = rec.events
    assert ev == [{"t": 7.0, "kind": "failure", "domain": 1, "step": 40}]


def test_ml_goodput_names_cover_buckets():
    assert set(ML_GOODPUT_NAMES) == set(BUCKETS)
    assert ML_GOODPUT_NAMES["checkpoint_save"].endswith("UNPRODUCTIVE_CHECKPOINT_SAVE_TIME")


def test_json_round_trip_and_save_load(tmp_path):
    rec, clock = _recorder()
    with rec.span("productive", step=0):
        clock.tick(1.5)
    rec.event("failure", domain=0)
    with rec.span("detection"):
        clock.tick(0.5)
    rec.add("recovery", 0.0, phase="plan")
    clock.tick(1.0)
    back = GoodputRecorder.from_json(json.loads(json.dumps(rec.to_json())))
    assert back.totals() == rec.totals()
    assert back.wall() == rec.wall()
    assert back.events == rec.events
    path = rec.save(tmp_path)
    assert os.path.basename(path) == "goodput.json"
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    loaded = load_goodput(tmp_path)
    assert loaded.totals() == rec.totals()
    assert loaded.goodput() == pytest.approx(1.5 / 3.0)
    with pytest.raises(RuntimeError, match="frozen"):
        with loaded.span("productive"):
            pass


def test_truncated_file_is_detected(tmp_path):
    rec, clock = _recorder()
    with rec.span("productive"):
        clock.tick(1.0)
    path = rec.save(tmp_path)
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[: len(raw) // 2])
    with pytest.raises(GoodputFileError, match="goodput.json.*not valid JSON"):
        load_goodput(tmp_path)


def test_corrupt_value_fails_checksum(tmp_path):
    rec, clock = _recorder()
    with rec.span("productive"):
        clock.tick(1.0)
    path = rec.save(tmp_path)
    doc = json.load(open(path))
    doc["body"]["totals"]["productive"] = 999.0      # still valid JSON
    json.dump(doc, open(path, "w"))
    with pytest.raises(GoodputFileError, match="checksum"):
        load_goodput(tmp_path)


def test_missing_file_and_wrong_format(tmp_path):
    with pytest.raises(GoodputFileError, match="does not"):
        load_goodput(tmp_path)
    (tmp_path / "goodput.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(GoodputFileError, match="not a resilax goodput file"):
        load_goodput(tmp_path)
    assert issubclass(GoodputFileError, ValueError)


def test_report_writes_png_and_table(tmp_path, capsys):
    import argparse

    from resilax.tools.report import register_cli, report

    rec, clock = _recorder()
    with rec.span("compile"):
        clock.tick(3.0)
    for step in range(5):
        with rec.span("productive", step=step):
            clock.tick(1.0)
    rec.event("failure", domain=1)
    with rec.span("detection"):
        clock.tick(0.5)
    with rec.span("recovery", phase="restore"):
        clock.tick(0.5)
    with rec.span("replay"):
        clock.tick(0.2)
    rec.event("recovered")
    with rec.span("productive", step=5):
        clock.tick(1.0)
    rec.save(tmp_path)
    r = report(tmp_path)
    out = capsys.readouterr().out
    assert "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME" in out and "goodput 58.82%" in out
    assert r["goodput"] == pytest.approx(6.0 / 10.2)
    assert (tmp_path / "goodput.png").read_bytes()[:4] == b"\x89PNG"
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "goodput.json").write_text('{"format": "resilax.goodput", "ver')
    args = parser.parse_args(["report", str(bad)])
    assert args.func(args) == 1
    assert "not valid JSON" in capsys.readouterr().err


def test_demo_plot_stacks_the_labels_of_events_at_or_near_one_step():
    """demo.png's event labels: one above the other where they would overlap (events at one
    step, or a few steps apart: "bitflip" at 120 and "sdc" at 125 of 300 steps were drawn over
    each other), side by side at the lowest level where they are far apart."""
    from resilax.tools.report import label_levels

    axis = list(range(1, 301))
    # the demo's phase 5 at 300 steps: recovery 61; bitflip 120, sdc 125, recovery 125;
    # rejoin 180; anomaly 240; hang 270, recovery 270
    assert label_levels([61, 120, 125, 125, 180, 240, 270, 270], axis) == [0, 0, 1, 2, 0, 0, 0, 1]
    assert label_levels([10, 40], list(range(1, 41))) == [0, 0]  # 30 steps apart on a 40-step axis: 75% of it
    assert label_levels([10, 11], list(range(1, 41))) == [0, 1]
    assert label_levels([5, 50, 6], axis) == [0, 0, 1]  # a level freed by distance is reused
    assert label_levels([], axis) == []


def test_a_long_run_keeps_a_bounded_timeline_with_exact_totals(tmp_path):
    """Two pieces a step (the loop and its protection work) grew the timeline without bound:
    memory, and the goodput.json written at every save (at 1M steps, ~2M pieces). The
    recorder keeps at most `MAX_SEGMENTS`, coarsening older unlabelled pieces; totals stay
    exact, labelled pieces (saves) all stay, pieces never overlap, and per bucket the pieces
    still sum to the totals."""
    from resilax._src.runtime import goodput
    from resilax.tools.report import _cumulative_goodput

    rec, clock = _recorder()
    steps, want = 20_000, {"productive": 0.0, "protection": 0.0, "checkpoint_save": 0.0}
    with rec.span("productive"):
        for k in range(steps):
            dt = 0.01 + 0.001 * (k % 7)
            clock.tick(dt)
            want["productive"] += dt
            with rec.span("protection"):
                clock.tick(0.002)
                want["protection"] += 0.002
            if k % 100 == 99:
                with rec.span("checkpoint_save", step=k + 1):
                    clock.tick(0.05)
                    want["checkpoint_save"] += 0.05
    segs = rec.segments()
    assert len(segs) <= goodput.MAX_SEGMENTS
    tot = rec.totals()
    for b, v in want.items():
        assert tot[b] == pytest.approx(v, rel=1e-9), b
        assert sum(s["end"] - s["start"] for s in segs if s["bucket"] == b) == pytest.approx(v, rel=1e-9), b
    assert sum(tot.values()) == pytest.approx(rec.wall())
    saves = [s for s in segs if s["bucket"] == "checkpoint_save"]
    assert [s["labels"]["step"] for s in saves] == list(range(100, steps + 1, 100))
    for a, b in zip(segs, segs[1:]):
        assert a["start"] < a["end"] <= b["start"] + 1e-9
    ts, gp = _cumulative_goodput(segs, rec.wall())
    assert gp[-1] == pytest.approx(want["productive"] / rec.wall(), rel=1e-6)
    rec.save(tmp_path)
    back = load_goodput(tmp_path)
    assert back.totals() == pytest.approx(rec.totals())
    assert len(back.segments()) == len(segs)
    assert os.path.getsize(tmp_path / "goodput.json") < 1_000_000


def test_report_lists_failures_and_recoveries_in_the_words_train_prints(tmp_path, capsys):
    """`resilax report`'s failure list: one line per failure, injected fault or recovery, made
    by `messages.describe` (the function `resilax train` prints with), after its time and
    step; bookkeeping events have none; an event missing a field its line names (another
    version's) still gets a line, never an error."""
    from resilax._src import messages
    from resilax.tools.report import report

    rec, clock = _recorder()
    events = [
        dict(kind="restore", step=10, source="checkpoint", skipped=[{"step": 15, "reason": (
            'ValueError: DATA_LOSS: Error opening "zarr" driver: Error reading "a/.zarray": Error decoding b-tree node: '
            'CRC-32C checksum verification failed [tensorstore_spec=\'{"driver": "zarr", "kvstore": "x"}\']')}],
             directory="/d", quarantined=["/d/quarantine/15.20260101T000000"]),
        dict(kind="anomaly", step=12, cause="nonfinite", value=1.5, action="skip"),
        dict(kind="peer_cadence", step=13, every=2),  # bookkeeping: no line
        dict(kind="hang", step=14, domain=3, detected_s=5.25, reason="probe"),
        dict(kind="recovery", step=14, failed_domains=[3], source="live", restored_step=14, mesh={"data": 3},
             seconds={"detect": 5.2, "restore": 0.01}, steps_replayed=0, steps_recomputed=0),
        dict(kind="sdc", step=16),  # malformed (no domains): still a line
    ]
    for e in events:
        clock.tick(1.0)
        rec.event(e["kind"], **{k: v for k, v in e.items() if k != "kind"})
    rec.save(tmp_path)
    r = report(tmp_path, png=False)
    out = capsys.readouterr().out
    assert "failures and recoveries: 5" in out and len(r["events"]) == 5, out
    for e in events:
        line = messages.describe(e)
        assert (line is None) == (e["kind"] == "peer_cadence"), e
        if line is not None:
            assert f"step {e['step']}: {line}" in out, (line, out)
    restore = messages.describe(events[0])
    assert "checkpoint(s) [15] in '/d' failed verification" in restore and "CRC-32C" in restore
    assert "tensorstore_spec" not in restore and "restored the previous good checkpoint 10" in restore
    assert "quarantine/15.20260101T000000" in restore
    assert "slice(s) [3] lost (found after 5.2 s); state from live copies" in out and "nothing lost" in out
    assert "sdc at step 16" in out  # the fallback line of a malformed event
    assert set(messages.FAILURE_KINDS) == set(messages._LINES)  # every failure kind has its line


def test_report_of_a_launch_run_dir_lists_its_generations_in_the_supervisors_words(tmp_path, capsys):
    """`resilax report RUN_DIR` of a `resilax launch` run directory: the goodput of its
    workers (``checkpoints/``, `resilax train`'s default there) and, before the events, each
    generation that did not simply end, as the supervisor said it."""
    import json

    from resilax.tools.report import report

    rec, clock = _recorder()
    clock.tick(1.0)
    rec.event("restore", step=5, source="host_store", copy="host0/own")
    rec.save(tmp_path / "checkpoints")
    (tmp_path / "launch_history.json").write_text(json.dumps({"generations": [
        {"generation": 0, "outcome": "failed", "why": "process 1 (pid 7) exited with signal SIGKILL", "processes": [0, 1]},
        {"generation": 1, "outcome": "done", "why": "", "processes": [0, 1]}]}))
    r = report(tmp_path, png=False)
    assert r["events"][0] == "generation 0 failed: process 1 (pid 7) exited with signal SIGKILL", r["events"]
    assert len(r["events"]) == 2 and "restored step 5 from the host store (host0/own)" in r["events"][1]
    assert "failures and recoveries: 2" in capsys.readouterr().out


def test_only_process_0_of_a_multi_process_job_writes_the_runs_goodput(tmp_path, monkeypatch):
    """Every process of a launched job shares the run directory: process 0 writes
    goodput.json, the others leave it alone (each wrote its own timings to the same file
    before, and the last to finish decided the report)."""
    import jax

    import resilax
    from resilax._src.step import saving
    from resilax.tools import example as ex

    step = resilax.wrap(ex.train_step, topology=resilax.Topology.load("cpu-2x4"),
                        config=resilax.Config(run_dir=str(tmp_path), log=None, peers=None))
    monkeypatch.setattr(jax, "process_index", lambda *a: 1)
    saving.save_goodput(step)
    assert not (tmp_path / "goodput.json").exists()
    monkeypatch.setattr(jax, "process_index", lambda *a: 0)
    saving.save_goodput(step)
    assert (tmp_path / "goodput.json").exists()
    step.close()
