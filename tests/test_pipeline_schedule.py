"""Pipeline schedule tables (resilax._src.pipeline.schedule), `resilax bench pipeline` and
`resilax simulate --pipeline`. Pure Python: no JAX, no devices."""

import dataclasses
import json
import types

import pytest

from resilax._src.pipeline import schedule as ps
from resilax._src.pipeline.schedule import Op

SHAPES = [(2, 4, 8, {(1, 1)}), (4, 2, 16, {(1, 1)}), (8, 4, 8, {(1, 1)}), (16, 4, 8, {(1, 1)}),
          (4, 4, 8, {(0, 1), (2, 3)})]  # the last: two failures in different replicas


def _tables(schedule, D, S, M, lost):
    return {"healthy": ps.healthy(schedule, D, S, M), "rerouted": ps.rerouted(schedule, D, S, M, lost),
            "dropped": ps.dropped(schedule, D, S, M, lost)}


@pytest.mark.parametrize("schedule", ps.SCHEDULES)
@pytest.mark.parametrize("D,S,M,lost", SHAPES)
def test_every_table_is_valid(schedule, D, S, M, lost):
    for name, t in _tables(schedule, D, S, M, lost).items():
        ps.validate(t)
        n_kinds = 3 if schedule == "zb-h1" else 2
        assert len(t.dispatch_order()) == D * M * S * n_kinds, name
        assert not set(t.order) & lost if name != "healthy" else set(t.order) == {(r, s) for r in range(D)
                                                                                 for s in range(S)}
    assert t.dropped == {r for r, _ in lost}
    assert all(d[0] not in t.dropped for d in t.order)


def _broken(t, d, ops=None, start=None):
    order, starts = dict(t.order), dict(t.start)
    if ops is not None:
        order[d] = tuple(ops)
    if start is not None:
        starts[d] = tuple(start)
    return dataclasses.replace(t, order=types.MappingProxyType(order), start=types.MappingProxyType(starts))


def test_validate_catches_broken_tables():
    t = ps.rerouted("zb-h1", 2, 4, 8, {(1, 1)})
    ps.validate(t)
    d = (0, 2)
    ops, st = list(t.order[d]), list(t.start[d])
    # a dependency broken in the per-domain order: B(0,0,2) before F(0,0,2)
    i_f, i_b = ops.index(Op("F", 0, 0, 2)), ops.index(Op("B", 0, 0, 2))
    swapped = ops[:]
    swapped[i_f], swapped[i_b] = swapped[i_b], swapped[i_f]
    with pytest.raises(ValueError, match="before"):
        ps.validate(_broken(t, d, swapped))
    with pytest.raises(ValueError, match="expects one Op"):  # an op missing
        ps.validate(_broken(t, d, ops[:-1], st[:-1]))
    with pytest.raises(ValueError, match="twice"):  # an op repeated
        ps.validate(_broken(t, d, ops[:-1] + [ops[0]]))
    with pytest.raises(ValueError, match="lost domain"):  # work on the lost domain
        ps.validate(_broken(t, (1, 1), [Op("W", 9, 9, 1)], [0.0]))
    with pytest.raises(ValueError, match="strictly increasing"):
        ps.validate(_broken(t, d, ops, [0.0] * len(ops)))
    # a W moved away from its F/B (the residuals live where F ran)
    w = Op("W", 0, 3, 2)
    moved = _broken(t, d, [o for o in ops if o != w], [x for o, x in zip(ops, st) if o != w])
    moved = _broken(moved, (1, 2), list(t.order[(1, 2)]) + [w], list(t.start[(1, 2)]) + [99.0])
    with pytest.raises(ValueError, match="expected where its F ran"):
        ps.validate(moved)
    # a stage-2 op on a stage-3 domain
    with pytest.raises(ValueError, match="of stage 3"):
        ps.validate(_broken(t, (0, 3), list(t.order[(0, 3)]) + [Op("W", 0, 0, 2)], list(t.start[(0, 3)]) + [99.0]))
    # a dispatch order that breaks a cross-domain dependency: F(0,0,3) starts before F(0,0,2) ends
    d3 = (0, 3)
    early = list(t.start[d3])
    early[t.order[d3].index(Op("F", 0, 0, 3))] = -1.0
    with pytest.raises(ValueError, match="before"):
        ps.validate(_broken(t, d3, start=early))


def test_op_counts_and_peers():
    D, S, M = 16, 4, 8
    h = ps.healthy("zb-h1", D, S, M)
    assert all(c == {"F": M, "B": M, "W": M, "BW": 0} for c in h.ops_per_domain().values())
    r = ps.rerouted("zb-h1", D, S, M, {(1, 1)})
    counts = r.ops_per_domain()
    assert (1, 1) not in counts
    peers = {d for d, c in counts.items() if c["F"] == M + 1}
    assert len(peers) == M and all(s == 1 for _, s in peers)  # 8 micro-batches over 8 of the 15 peers
    assert all(counts[d]["F"] == M for d in counts if d not in peers)
    assert sum(c["B"] for d, c in counts.items() if d[1] == 1) == D * M
    for m in range(M):  # replica 1's micro-batches leave only stage 1
        assert r.domain_of(1, m, 1) in peers
        assert [r.domain_of(1, m, s) for s in (0, 2, 3)] == [(1, 0), (1, 2), (1, 3)]
    assert r.rerouted_ops() == {d: (3 if d in peers else 0) for d in counts}
    g = ps.dropped("1f1b", D, S, M, {(1, 1)})
    assert all(c["BW"] == (M + 1 if c["F"] == M + 1 else M) for c in g.ops_per_domain().values())
    assert sum(c["F"] == M + 1 for c in g.ops_per_domain().values()) == M * S


@pytest.mark.parametrize("S,M", [(4, 8), (2, 16), (3, 5)])
def test_healthy_closed_forms(S, M):
    # GPipe and 1F1B (F = 1, BW = 2): the last micro-batch's F leaves stage S-1 at M+S-1 and
    # its backward chain takes 2(S-1) more after 2M on the last stage: (M+S-1)*3
    for schedule in ("gpipe", "1f1b"):
        t = ps.simulate(ps.healthy(schedule, 2, S, M))
        assert t.makespan == (M + S - 1) * 3
        assert t.step_time == t.makespan + 1  # global update U = 1
        assert t.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    # ZB-H1 (F = B = W = 1): stage 0 runs 3M ops and idles S-1 slots (its first B waits for
    # S-1 forward and S-1 backward hops, of which its own W ops fill none before the first B):
    # 3M + S - 1, 27 at S=4, M=8; with the staggered update stage 0 finishes last: + 1 = 28
    t = ps.simulate(ps.healthy("zb-h1", 2, S, M))
    assert t.makespan == 3 * M + S - 1
    assert t.step_time == 3 * M + S
    if (S, M) == (4, 8):
        assert (t.makespan, t.step_time) == (27, 28)  # PIPELINE.md §3.3's healthy ZB t = 28


def test_dropped_is_a_longer_healthy_pipeline():
    # the busiest survivor runs M + ceil(M / (D - 1)) micro-batches as an ordinary pipeline
    D, S, M = 16, 4, 8
    assert ps.simulate(ps.dropped("zb-h1", D, S, M, {(1, 1)})).step_time == 3 * (M + 1) + S
    assert ps.simulate(ps.dropped("1f1b", D, S, M, {(1, 1)})).step_time == (M + 1 + S - 1) * 3 + 1
    assert ps.simulate(ps.dropped("zb-h1", 2, S, M, {(1, 1)})).step_time == 3 * 2 * M + S


def test_16x4_reroute_targets():
    D, S, M = 16, 4, 8
    zb_drop = ps.throughput_ratio(ps.dropped("zb-h1", D, S, M, {(1, 1)}))
    zb_rr = ps.throughput_ratio(ps.rerouted("zb-h1", D, S, M, {(1, 1)}))
    assert zb_drop == pytest.approx(28 / 31)  # PIPELINE.md §3.3: 0.903
    assert zb_rr >= 0.95 and zb_rr > zb_drop  # §3.3: 0.955
    # where rerouting loses: with the fused backward the extra BW (2 ticks) on a peer delays
    # the whole 1F1B chain, more than one extra micro-batch per survivor does
    f_drop = ps.throughput_ratio(ps.dropped("1f1b", D, S, M, {(1, 1)}))
    f_rr = ps.throughput_ratio(ps.rerouted("1f1b", D, S, M, {(1, 1)}))
    assert f_rr < f_drop
    # and at D=2 both about halve throughput
    assert ps.throughput_ratio(ps.rerouted("zb-h1", 2, S, M, {(1, 1)})) < 0.6


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_activation_peak_under_cap(schedule):
    D, S, M = 8, 4, 8
    h = ps.simulate(ps.healthy(schedule, D, S, M))
    assert dict(h.peak_inflight) == {(r, s): S - s for r in range(D) for s in range(S)}
    t = ps.rerouted(schedule, D, S, M, {(1, 1)})
    peak = ps.simulate(t).peak_inflight
    for d, p in peak.items():
        assert p <= S - d[1] + t.rerouted_ops()[d] // (3 if schedule == "zb-h1" else 2)
    capped = ps.rerouted(schedule, D, S, M, {(1, 1)}, activation_cap=2)
    ps.validate(capped)
    assert max(ps.simulate(capped).peak_inflight.values()) == 2
    assert ps.simulate(ps.healthy("gpipe", D, S, M)).peak_inflight[(0, 0)] == M
    with pytest.raises(ValueError, match="gpipe"):
        ps.rerouted("gpipe", D, S, M, {(1, 1)}, activation_cap=2)


def test_deterministic_cached_and_replayed():
    args = ("zb-h1", 4, 4, 8, {(0, 1), (2, 3)})
    a = ps.rerouted(*args)
    assert ps.rerouted(*args) is a  # cached
    ps._build.cache_clear()
    b = ps.rerouted(*args)
    assert b is not a and dict(a.order) == dict(b.order) and dict(a.start) == dict(b.start)
    assert a.dispatch_order() == b.dispatch_order()
    # replaying the fixed orders under the planner's costs gives the planner's start times
    assert dict(ps.simulate(a, steps=1, optimizer=None).start) == dict(a.start)
    # a cross-domain hop cost makes the step longer, never shorter
    assert ps.simulate(a, comm=0.25).step_time > ps.simulate(a).step_time


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="rerouting cannot help"):
        ps.rerouted("zb-h1", 2, 4, 8, {(0, 1), (1, 1)})
    with pytest.raises(ValueError, match="every one of the 2"):
        ps.dropped("zb-h1", 2, 4, 8, {(0, 1), (1, 2)})
    with pytest.raises(ValueError, match="one of"):
        ps.healthy("interleaved", 2, 4, 8)
    with pytest.raises(ValueError, match="within 2 replicas x 4 stages"):
        ps.rerouted("1f1b", 2, 4, 8, {(2, 0)})
    with pytest.raises(ValueError, match="microbatches"):
        ps.healthy("1f1b", 2, 4, 0)
    with pytest.raises(ValueError, match="comm"):
        ps.simulate(ps.healthy("1f1b", 2, 4, 8), comm=-1)


def test_bench_pipeline_cli(tmp_path, capsys):
    """The bench's tables, and its executor check on the 2x4 config (8 CPU devices): rerouted,
    dropped, rejoined and resumed runs bitwise the healthy one, per-op times measured."""
    from resilax.tools.cli import main

    out = tmp_path / "pipe.json"
    assert main(["bench", "pipeline", "--configs", "2x4x2,16x4x8", "--measure-schedules", "zb-h1,1f1b",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bitwise vs the healthy run" in printed and "measured 2x4 M=2 zb-h1" in printed
    r = json.loads(out.read_text())
    assert r["bitwise"] == {"rerouted": True, "dropped": True, "rejoined": True, "resumed": True}
    assert len(r["bitwise_runs"]) == 2  # the 2x4 config, each schedule asked for; 16x4 has more domains than devices
    assert len(r["configs"]) == 6
    keys = {"replicas", "stages", "microbatches", "schedule", "healthy_ticks", "bubble_fraction", "drop_ratio",
            "reroute_ratio", "activation_bytes", "dispatches"}
    assert all(keys <= set(c) for c in r["configs"])
    small = next(c for c in r["configs"] if c["schedule"] == "zb-h1" and c["replicas"] == 2)
    assert small["dispatches"] == 2 * 4 * 2 * 3 + 8 and set(small["op_seconds"]) == {"F", "B", "W", "BW"}
    assert 0 < small["measured_reroute_ratio"] <= 1.5
    big = next(c for c in r["configs"] if c["schedule"] == "zb-h1" and c["replicas"] == 16)
    assert big["reroute_ratio"] >= 0.95 > big["drop_ratio"] and "op_seconds" not in big
    assert big["activation_bytes"] == 4 * r["activation_bytes_per_microbatch"]
    assert (tmp_path / "pipe.png").stat().st_size > 10_000


def test_simulate_pipeline_cli(tmp_path, capsys):
    import itertools

    from resilax.tools.cli import main
    from resilax.tools.simulate_pipeline import PipelineJob, Rates

    out = tmp_path / "sim.json"
    argv = ["simulate", "--pipeline", "--jobs", "16x4x16", "--days", "60", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "16x4" in printed and "checkpoint-restart" in printed
    r = json.loads(out.read_text())
    job = r["jobs"][0]
    assert job["chips"] == 1024 and sum(job["failures"].values()) > 0
    g = {k: v["goodput"] for k, v in job["strategies"].items()}
    assert set(g) == {"reroute", "drop", "repartition", "checkpoint-restart"}
    assert all(0 < x <= 1 for x in g.values())
    # the same trace for all: rerouting keeps more throughput than dropping at the same pauses, and
    # re-partitioning pays a reconfiguration on each failure and rejoin
    assert g["reroute"] > g["drop"] > g["repartition"] and g["reroute"] > g["checkpoint-restart"]
    assert job["strategies"]["reroute"]["degraded_hours"] > 0
    # the reduced tables the simulator plans give the full mesh's ratios
    one = job["single_loss_ratio"]
    assert one["reroute_by_stage"] == pytest.approx(
        [ps.throughput_ratio(ps.rerouted("zb-h1", 16, 4, 8, {(1, s)})) for s in range(4)])
    assert one["drop"] == pytest.approx(28 / 31)
    # losses in several stages: the least per-stage ratio is within 0.01 of the exact table
    rates = Rates(PipelineJob(16, 4, 16))
    for s1, s2 in itertools.combinations(range(4), 2):
        exact = ps.throughput_ratio(ps.rerouted("zb-h1", 16, 4, 8, {(0, s1), (1, s2)}))
        assert rates.reroute({(0, s1), (1, s2)}) == pytest.approx(exact, abs=0.011)
    assert rates.reroute({(r, 2) for r in range(16)}) is None  # stage 2 gone everywhere: fall back
    assert rates.drop({(r, 0) for r in range(16)}) is None
    assert main(argv) == 0 and json.loads(out.read_text()) == r  # same seed, same result
