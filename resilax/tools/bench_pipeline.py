"""`resilax bench pipeline`: schedule tables costed, healthy vs drop-the-replica vs ReCycle.

For each shape D x S (M micro-batches per replica) and each schedule (gpipe, 1f1b, zb-h1) it
builds the healthy table, the ReCycle table after losing one domain (default (1, 1), as
shared/PIPELINE.md §3.3) and the drop-the-replica table, replays each for 3 back-to-back
steps with unit costs (F = B = W = 1, BW = 2, update U = 1; zb-h1 with a staggered update,
the others a global one) and reports per-step ticks and throughput relative to healthy.
Pure Python: no JAX, no devices. Results: a table on stdout, JSON (``--json``) and a PNG
next to it (ratios per config; per-domain Gantt charts of the 2x4 zb-h1 healthy and
rerouted tables).

``bitwise`` comes from the executor: :func:`bench_pipeline` takes ``measured(healthy,
rerouted, dropped) -> dict``, called for each config with at most ``measured_max_domains``
domains; the command passes `bench_pipeline_measure.executor_check` (JAX on emulated CPU
devices, one per domain) unless ``--no-measure``. Each such config's row gains the measured
per-op times and the ratios the tables give with them; ``bitwise`` holds, for each of
``rerouted``, ``dropped``, ``rejoined`` and ``resumed``, whether every measured config ended
bitwise the healthy run (``bitwise_runs``: per config).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Sequence

from resilax._src.pipeline import schedule as ps
from resilax.tools.argtypes import int_at_least, output_path

# (replicas, stages, microbatches); 4x2 with M=16 as in PIPELINE.md §3.3
CONFIGS = ((2, 4, 8), (4, 2, 16), (8, 4, 8), (16, 4, 8), (32, 4, 8))
# Stage-input activation of one micro-batch of resilax.tools.gpt SIZES["small"] (d=768, seq=512,
# global batch 32 as 8 micro-batches of 4 sequences, bf16): 4 * 512 * 768 * 2 bytes. The stage
# input is what the planned executor keeps per in-flight micro-batch with stage-input remat
# (PIPELINE.md §6.2); residuals a stage saves beyond it scale this number.
ACTIVATION_BYTES = 4 * 512 * 768 * 2
BITWISE_NOTE = "bitwise: null -- not measured (--no-measure)"
BITWISE_KEYS = ("rerouted", "dropped", "rejoined", "resumed")


def add_arguments(parser) -> None:
    from resilax.tools.bench import option_adder

    opt = option_adder(parser)
    opt("--json", type=output_path, default=None, help="write results here (a PNG goes next to it)")
    opt("--configs", default=",".join(f"{d}x{s}x{m}" for d, s, m in CONFIGS),
        help="comma-separated DxSxM shapes (replicas x stages x micro-batches per replica)")
    opt("--lost", default="1,1", help="the lost domain as r,s (default 1,1)")
    opt("--activation-bytes", type=int_at_least(1), default=ACTIVATION_BYTES,
        help="bytes per in-flight micro-batch (default: the small GPT's stage input, 4x512x768 bf16)")
    opt("--png", type=output_path, default=None, help="plot path (default: the --json path with .png)")
    opt("--protection", action="store_true",
        help="also place each stage's snapshot and peer copy (every step) at the step's end vs in its bubbles "
             "(JSON key 'protection'; resilax.tools.bench_pipeline_protection)")
    opt("--no-measure", action="store_true",
        help="tables only: skip running the executor on emulated CPU devices (bitwise checks, per-op times)")
    opt("--measure-schedules", default=",".join(ps.SCHEDULES),
        help="comma-separated schedules the executor runs (default: all three)")


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            d, s, m = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"resilax bench pipeline: --configs expects DxSxM items like 16x4x8, but got {part!r}")
        out.append((d, s, m))
    return out


def _row(D, S, M, schedule, lost, act_bytes) -> dict:
    t0 = time.perf_counter()
    h = ps.healthy(schedule, D, S, M)
    r = ps.rerouted(schedule, D, S, M, lost)
    d = ps.dropped(schedule, D, S, M, lost)
    plan_s = time.perf_counter() - t0
    th, tr, td = ps.simulate(h), ps.simulate(r), ps.simulate(d)
    peak_h, peak_r = max(th.peak_inflight.values()), max(tr.peak_inflight.values())
    return {
        "replicas": D, "stages": S, "microbatches": M, "schedule": schedule,
        "healthy_ticks": th.step_time, "healthy_makespan": th.makespan, "bubble_fraction": th.bubble_fraction,
        "drop_ticks": td.step_time, "reroute_ticks": tr.step_time,
        "drop_ratio": th.step_time / td.step_time, "reroute_ratio": th.step_time / tr.step_time,
        "peak_inflight": peak_h, "reroute_peak_inflight": peak_r,
        "activation_bytes": peak_h * act_bytes, "reroute_activation_bytes": peak_r * act_bytes,
        # one dispatch per F/B/W/BW op plus one update per live domain
        "dispatches": len(h.dispatch_order()) + len(h.order),
        "reroute_dispatches": len(r.dispatch_order()) + len(r.order),
        "most_rerouted_ops_on_a_peer": max(r.rerouted_ops().values()),
        "plan_s": plan_s,
    }, (h, r, d)


def bench_pipeline(configs: Sequence[tuple[int, int, int]] = CONFIGS, *, lost=((1, 1),),
                   activation_bytes: int = ACTIVATION_BYTES,
                   measured: Callable[[ps.Table, ps.Table, ps.Table], dict] | None = None,
                   measured_max_domains: int = 8, protection: bool = False,
                   measured_schedules: Sequence[str] = ps.SCHEDULES) -> dict:
    """Rows for every config x schedule (see the module docstring); ``measured`` (the executor
    check, optional) runs on configs with at most ``measured_max_domains`` domains and the
    schedules ``measured_schedules``;
    ``protection``: add the key ``protection`` (bench_pipeline_protection, the rows of its
    ``rows`` with the assumptions beside them under ``protection_assumptions``)."""
    lost = frozenset(tuple(x) for x in lost)
    rows, bitwise = [], ([] if measured else None)
    for D, S, M in configs:
        for schedule in ps.SCHEDULES:
            row, tables = _row(D, S, M, schedule, lost, activation_bytes)
            rows.append(row)
            if measured is not None and D * S <= measured_max_domains and schedule in measured_schedules:
                got = measured(*tables)
                bitwise.append({"replicas": D, "stages": S, "microbatches": M, "schedule": schedule,
                                **{k: got[k] for k in BITWISE_KEYS}})
                row.update({k: got[k] for k in ("op_seconds", "measured_reroute_ratio", "measured_drop_ratio")})
    extra = {}
    if protection:
        from resilax.tools.bench_pipeline_protection import bench_protection

        check = None
        if measured is not None:  # the executor is measured: it also runs the protection rows it fits
            from resilax.tools.bench_pipeline_measure import protection_check as check
        p = bench_protection(configs, check=check, check_max_domains=measured_max_domains,
                             check_schedules=measured_schedules)
        extra = {"protection": p.pop("rows"), "protection_assumptions": p}
    return {
        **extra,
        "benchmark": "pipeline",
        "lost": sorted(lost),
        "costs": dict(ps.DEFAULT_COSTS),
        "optimizer": {"zb-h1": "staggered", "1f1b": "global", "gpipe": "global"},
        "steps_averaged": 3,
        "activation_bytes_per_microbatch": activation_bytes,
        "activation_note": "peak in-flight micro-batches (F started, backward not finished) on the busiest domain "
                           "x activation_bytes_per_microbatch",
        "dispatches_note": "F/B/W/BW ops of one step plus one optimizer update per live domain",
        "configs": rows,
        "bitwise": None if bitwise is None else {k: bool(bitwise) and all(b[k] for b in bitwise)
                                                 for k in BITWISE_KEYS},
        "bitwise_runs": bitwise,
        "bitwise_note": None if measured else BITWISE_NOTE,
    }


def print_table(r: dict) -> None:
    print(f"\nresilax bench pipeline  (lost domain {r['lost']}, unit costs F=B=W=U=1 BW=2, per-step ticks "
          f"averaged over {r['steps_averaged']} steps; ratios = throughput vs healthy)")
    head = (f"{'D x S':>7} {'M':>3} {'schedule':>8} {'healthy t':>9} {'bubble':>7} {'drop':>6} {'reroute':>7} "
            f"{'act MB':>7} {'rr act MB':>9} {'dispatches':>10}")
    print(head)
    for x in r["configs"]:
        print(f"{x['replicas']:>3} x {x['stages']:<2} {x['microbatches']:>3} {x['schedule']:>8} "
              f"{x['healthy_ticks']:>9.2f} {x['bubble_fraction']:>7.3f} {x['drop_ratio']:>6.3f} "
              f"{x['reroute_ratio']:>7.3f} {x['activation_bytes'] / 1e6:>7.1f} "
              f"{x['reroute_activation_bytes'] / 1e6:>9.1f} {x['dispatches']:>10d}")
    for x in r["configs"]:
        if "op_seconds" in x:
            ops = " ".join(f"{k}={v * 1e3:.2f}ms" for k, v in x["op_seconds"].items())
            print(f"measured {x['replicas']}x{x['stages']} M={x['microbatches']} {x['schedule']}: {ops}; with these "
                  f"costs drop {x['measured_drop_ratio']:.3f}, reroute {x['measured_reroute_ratio']:.3f}")
    print(r["bitwise_note"] or f"bitwise vs the healthy run (every measured config): {r['bitwise']}")
    if "protection" in r:
        from resilax.tools.bench_pipeline_protection import print_protection

        print_protection({"rows": r["protection"], **r["protection_assumptions"]})


def _gantt(ax, table: ps.Table, title: str) -> None:
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "BW": "tab:red"}
    timing = ps.simulate(table, steps=1, optimizer=None)
    doms = sorted(set(table.order) | set(table.lost), key=lambda d: (d[1], d[0]))
    for y, d in enumerate(doms):
        if d in table.lost:
            ax.text(0.2, y, "lost", va="center", fontsize=7, color="gray")
            continue
        for op, t in zip(table.order[d], timing.start[d]):
            w = ps.DEFAULT_COSTS[op.kind]
            moved = op.replica != d[0]
            ax.barh(y, w, left=t, color=colors[op.kind], edgecolor="black" if moved else "white",
                    hatch="//" if moved else None, linewidth=0.5)
    ax.set_yticks(range(len(doms)), [f"r{r} s{s}" for r, s in doms], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ticks (hatched: a rerouted micro-batch of another replica)")
    ax.set_title(title, fontsize=9)


def plot(r: dict, path: str, lost) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 4 if "protection" in r else 3
    fig, axes = plt.subplots(panels, 1, figsize=(12, 3.7 * panels),
                             gridspec_kw={"height_ratios": [1.2] + [1] * (panels - 1)})
    rows = r["configs"]
    xs = range(len(rows))
    axes[0].bar([x - 0.2 for x in xs], [x["drop_ratio"] for x in rows], 0.4, label="drop the replica")
    axes[0].bar([x + 0.2 for x in xs], [x["reroute_ratio"] for x in rows], 0.4, label="ReCycle reroute")
    axes[0].set_xticks(list(xs), [f"{x['replicas']}x{x['stages']} M{x['microbatches']}\n{x['schedule']}"
                                  for x in rows], fontsize=6)
    axes[0].set_ylabel("throughput / healthy")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"after losing domain {sorted(lost)}", fontsize=9)
    _gantt(axes[1], ps.healthy("zb-h1", 2, 4, 8), "2x4 M=8 zb-h1, healthy")
    _gantt(axes[2], ps.rerouted("zb-h1", 2, 4, 8, lost if all(d[0] < 2 and d[1] < 4 for d in lost) else {(1, 1)}),
           "2x4 M=8 zb-h1, rerouted")
    if "protection" in r:
        from resilax.tools.bench_pipeline_protection import gantt

        gantt(axes[3])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from resilax.tools.bench import write_result

    try:
        lost = [tuple(int(x) for x in args.lost.split(","))]
    except ValueError:
        raise SystemExit(f"resilax bench pipeline: --lost expects r,s, but got {args.lost!r}")
    measured = None
    if not args.no_measure:
        from resilax.tools.bench_pipeline_measure import executor_check
        from resilax.tools.runner import configure_cpu_devices

        configure_cpu_devices(8)
        measured = executor_check
    try:
        r = bench_pipeline(parse_configs(args.configs), lost=lost, activation_bytes=args.activation_bytes,
                           measured=measured, protection=args.protection,
                           measured_schedules=tuple(x.strip() for x in args.measure_schedules.split(",") if x.strip()))
    except ValueError as e:
        print(f"resilax bench pipeline: {e}", file=sys.stderr)
        return 2
    print_table(r)
    write_result(args.json, r)
    png = args.png or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        plot(r, png, frozenset(lost))
        print(f"wrote {png}")
    return 0
