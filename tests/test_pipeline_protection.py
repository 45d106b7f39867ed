"""Protection in the bubbles: each stage's snapshot and peer copy placed into its idle time,
checked on the replayed order (not only the plan), against end-of-step placement."""

import dataclasses
import json

import pytest

from resilax._src.pipeline import protection as pp
from resilax._src.pipeline import schedule as ps
from resilax.tools import bench_pipeline_protection as bpp

WORK = {"snapshot": 0.2, "peer": 0.8}  # one unit per stage per step


def _same(xs, ys):
    return len(xs) == len(ys) and all(x[:2] == y[:2] and abs(x[2] - y[2]) < 1e-9 and abs(x[3] - y[3]) < 1e-9
                                      for x, y in zip(xs, ys))


def _replayed(plan, spills=True):
    ins = {d: [(o.cycle, o.before, o.units) for o in ops if spills or not o.spill] for d, ops in plan.ops.items()}
    return pp.replay(plan.table, plan.costs, steps=plan.steps, optimizer=plan.optimizer, inserts=ins)


@pytest.mark.parametrize("schedule,shape,costs", [
    ("zb-h1", (2, 4, 8), None), ("1f1b", (2, 4, 8), None), ("zb-h1", (4, 2, 16), None), ("gpipe", (2, 4, 4), None),
    ("zb-h1", (2, 4, 8), {"F": 1.0, "B": 1.2, "W": 0.7, "U": 0.5})])
def test_protection_runs_in_idle_slots_only(schedule, shape, costs):
    table = ps.healthy(schedule, *shape)
    plan = pp.place(table, WORK, costs=costs, chunk=0.1)
    pp.validate_plan(plan)
    base = pp.replay(table, costs, steps=plan.steps)
    # the replay is simulate's event model: the same step time
    assert base["u_end"][-1] / plan.steps == pytest.approx(ps.simulate(table, costs, steps=plan.steps).step_time)
    got = _replayed(plan)
    assert not any(plan.spill.values()) and plan.bubble_overhead == 0 < plan.end_overhead
    for d in table.order:
        # every F/B/W/BW/U of every domain starts and ends as without protection
        assert _same(got["items"][d], base["items"][d])
        busy = [(a, b) for _, _, a, b in got["items"][d]]
        runs = got["protection"][d]
        assert len(runs) == len(plan.ops[d]) and sum(b - a for a, b in runs) == pytest.approx(
            (plan.steps - 1) * sum(WORK.values()))
        n = len(table.order[d])
        u_end = {st: b for st, i, _, b in got["items"][d] if i == n}
        u = plan.costs["U"]
        for o, (a, b) in zip(plan.ops[d], runs):
            assert all(b <= x + 1e-9 or a >= y - 1e-9 for x, y in busy)  # in a gap of its domain
            assert a >= u_end[o.step] - 1e-9 and b <= u_end[o.cycle + 1] - u + 1e-9  # after U_k, before U_{k+1}
            assert (a, b) == pytest.approx((o.start, o.end))


def test_validator_catches_a_delaying_op():
    table = ps.healthy("zb-h1", 2, 4, 8)
    plan = pp.place(table, WORK)
    d = (0, 1)
    ops = list(plan.ops[d])
    ops[0] = dataclasses.replace(ops[0], units=ops[0].units + 2.5)  # longer than its gap
    bad = dataclasses.replace(plan, ops={**plan.ops, d: tuple(ops)})
    with pytest.raises(ValueError, match="delays domain"):
        pp.validate_plan(bad)


def test_work_beyond_the_window_is_deferred_and_the_cadence_says_so():
    table = ps.healthy("zb-h1", 2, 4, 8)
    plan = pp.place(table, {"snapshot": 1.4, "peer": 5.6})  # 7 units, 3 idle units per domain per step
    assert set(plan.capacity.values()) == {3.0}
    assert dict(plan.deferred) == {d: 3 for d in table.order}
    # forced every step, what does not fit spills onto the critical path, and the replay shows it
    # (whole pieces of 0.25 fill each gap greedily: up to a piece per gap stays out)
    assert all(4.0 <= s <= 4.0 + 0.25 * len(plan.windows[d]) for d, s in plan.spill.items())
    assert plan.bubble_overhead == pytest.approx(max(plan.spill.values()) / 28)
    assert not _same(_replayed(plan)["items"][(0, 0)], pp.replay(table, steps=plan.steps)["items"][(0, 0)])
    c = pp.cadence(plan)
    assert c.every == 3 and c.overhead == 0 and c.bubbles
    every3 = pp.place(table, {"snapshot": 1.4, "peer": 5.6}, every=3)
    pp.validate_plan(every3)
    assert every3.bubble_overhead == 0 and not any(every3.spill.values())
    assert pp.cadence(plan, bubbles=False).every == 25  # 7 / 28 = 25% at the end: every 25 steps for 1%
    # no idle time at all: no cadence of the bubbles alone
    full = pp.place(table, WORK, costs={"U": 0.0}, chunk=5.0)
    assert all(v is None for v in full.deferred.values())


def test_one_replica_stands_for_a_healthy_table():
    """simulate --pipeline plans one replica's table: with no transfer cost a healthy table's
    replicas run alike, so the costs are those of the full table."""
    for schedule in ps.SCHEDULES:
        one, four = (pp.place(ps.healthy(schedule, d, 8, 8), {"snapshot": 1.0, "peer": 9.0}) for d in (1, 4))
        assert (one.end_overhead, one.bubble_overhead, one.base_ticks) == (
            four.end_overhead, four.bubble_overhead, four.base_ticks)
        assert pp.cadence(one) == pp.cadence(four)


def test_last_stage_work_starts_first_when_freed_first():
    table = ps.healthy("1f1b", 1, 4, 8)
    plan = pp.place(table, WORK, optimizer="staggered")  # stage S-1 finishes its backward first
    pp.validate_plan(plan)
    first = [min(o.start for o in plan.dispatch((0, s))) for s in range(4)]
    assert first[3] < first[2] < first[1] < first[0]


def test_work_units_from_topology_bandwidth():
    from resilax._src.runtime.topology import Topology

    topo = Topology.load("gpu-h100-4x8")
    bw = topo.bandwidth
    w = pp.work_units(2e9, bandwidth=topo, unit_s=0.1, host_bytes=0.25e9)
    assert w == pytest.approx({"snapshot": 0.25e9 / 64e9 / 0.1, "peer": 2e9 / 50e9 / 0.1})
    per = pp.work_units([1e9, 2e9], bandwidth=bw, unit_s=0.1, peer_link="ici", log_bytes=1e6)
    assert per[1]["peer"] == pytest.approx(2e9 / 450e9 / 0.1) and set(per[0]) == {"snapshot", "peer", "log"}
    with pytest.raises(ValueError, match="bandwidth\\['dcn'\\]"):
        pp.work_units(1e9, bandwidth={"host": 1.0}, unit_s=0.1)


def test_bad_arguments_name_what_was_expected():
    table = ps.healthy("zb-h1", 2, 4, 8)
    with pytest.raises(ValueError, match="work kinds from"):
        pp.place(table, {"checkpoint": 1.0})
    with pytest.raises(ValueError, match="chunk > 0"):
        pp.place(table, WORK, chunk=0)
    with pytest.raises(ValueError, match="stages 0..3"):
        pp.place(table, {7: WORK})
    with pytest.raises(ValueError, match="follows each domain's update"):
        pp.place(table, WORK, optimizer=None)


@pytest.mark.parametrize("shape", [(2, 4, 8), (4, 2, 16)])
def test_one_percent_target_with_zb_h1(shape):
    """Snapshot + peer copy every step, at the cost model's 405B / 16,384-GPU sizes: about 1% of
    the step at the end, nothing in the bubbles; and the largest work the bubbles hold every step
    (the bench's max_fit_units) still stays within 1%."""
    row = bpp.protection_row(*shape, "zb-h1")
    assert row["bubble_overhead"] <= 0.01 and row["bubble_overhead"] == 0
    assert row["end_overhead"] == pytest.approx(row["work_share_of_step"], rel=0.02)
    assert row["cadence_bubbles"] == 1
    fit = row["max_fit_units"]
    assert fit == {(2, 4, 8): 3.0, (4, 2, 16): 1.0}[shape]
    share = {k: v / sum(row["work_units"].values()) for k, v in row["work_units"].items()}
    big = bpp.protection_row(*shape, "zb-h1", work={k: fit * v for k, v in share.items()})
    assert big["bubble_overhead"] <= 0.01 < big["end_overhead"]


def test_bench_cli_writes_protection(tmp_path, capsys):
    from resilax.tools.cli import main

    out = tmp_path / "pipe.json"
    assert main(["bench", "pipeline", "--protection", "--no-measure", "--configs", "2x4x8,8x4x8",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "protection every step" in printed and "bubbles" in printed
    r = json.loads(out.read_text())
    rows = r["protection"]
    shapes = {(x["replicas"], x["stages"], x["microbatches"]) for x in rows}
    assert shapes == {(2, 4, 8), (4, 2, 16), (8, 4, 8)} and len(rows) == 9
    keys = {"replicas", "stages", "schedule", "end_overhead", "bubble_overhead", "work_units", "max_fit_units"}
    assert all(keys <= set(x) for x in rows)
    assert "CostModel" in r["protection_assumptions"]["work_sources"]["peer_s"]
    assert (tmp_path / "pipe.png").stat().st_size > 10_000


def test_simulate_pipeline_protection(tmp_path, capsys):
    """The goodput simulator's pipeline jobs gain protection every step vs every N, at the step's
    end vs in the bubbles; the bubbles never cost more and need a cadence no longer."""
    from resilax.tools.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "--pipeline", "--jobs", "32x8x64", "--days", "5", "--quiet", "--strategy", "reroute",
                 "--json", str(out)]) == 0
    assert "protection (snapshot + peer copy" in capsys.readouterr().out
    job = json.loads(out.read_text())["jobs"][0]
    p = job["protection"]
    assert job["chips"] == 16_384 and p["bytes_per_chip"] == pytest.approx(405e9 * 12 / (8 * 64))
    assert p["bubble_overhead"] < p["end_overhead"] and p["cadence_bubbles"] <= p["cadence_end"]
    v = {(x["placement"], x["every"]): x for x in p["variants"]}
    assert set(v) == {("end", 1), ("bubbles", 1), ("end", p["cadence_end"]), ("bubbles", p["cadence_bubbles"])}
    assert v[("bubbles", p["cadence_bubbles"])]["overhead"] <= 0.01 and v[("end", p["cadence_end"])]["overhead"] <= 0.01
    assert all(0 < x["goodput"] <= 1 for x in p["variants"])
    assert v[("bubbles", 1)]["goodput"] > v[("end", 1)]["goodput"]  # same trace, less added time
