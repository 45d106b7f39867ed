"""``resilax report RUN_DIR``: goodput table, the run's failures and recoveries, and a timeline PNG
from goodput.json."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from resilax._src.runtime.goodput import BUCKETS, GOODPUT_FILE, ML_GOODPUT_NAMES, GoodputFileError, load_goodput

__all__ = ["report", "format_report", "format_events", "format_generations", "plot_timeline", "plot_sweep", "register_cli"]

COLORS = {
    "productive": "#2ca02c", "protection": "#98df8a", "checkpoint_save": "#1f77b4",
    "checkpoint_restore": "#aec7e8", "detection": "#d62728", "recovery": "#ff7f0e",
    "replay": "#ffbb78", "compile": "#9467bd", "lost": "#8c564b", "idle": "#c7c7c7",
    "other": "#7f7f7f",
}


def format_report(totals: dict[str, float], wall: float) -> str:
    """Table: bucket, seconds, share of wall, ml-goodput name."""
    rows = [f"{'bucket':<20}{'seconds':>12}{'share':>9}  ml-goodput name"]
    for b in BUCKETS:
        share = totals[b] / wall if wall > 0 else 0.0
        rows.append(f"{b:<20}{totals[b]:>12.3f}{share:>9.2%}  {ML_GOODPUT_NAMES[b]}")
    good = totals["productive"] / wall if wall > 0 else 0.0
    rows.append(f"{'wall':<20}{wall:>12.3f}{1.0 if wall > 0 else 0.0:>9.2%}")
    rows.append(f"goodput {good:.2%}")
    return "\n".join(rows)


def _cumulative_goodput(segments: list[dict], wall: float, n: int = 200):
    """(times, productive-so-far / time) sampled at n points; 'added' pieces
    count at their recorded end."""
    import numpy as np

    ts = np.linspace(wall / n, wall, n) if wall > 0 else np.zeros(0)
    prod = np.zeros_like(ts)
    for s in segments:
        if s["bucket"] != "productive" or s["labels"].get("added"):
            continue
        prod += np.clip(ts - s["start"], 0.0, s["end"] - s["start"])
    return ts, (prod / ts if len(ts) else prod)


def plot_timeline(rec, path: str) -> str:
    """Spans as coloured bars on a time axis, events as labelled markers,
    and cumulative goodput over time. Writes a PNG; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    segs, events, wall = rec.segments(), rec.events, rec.wall()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True,
                                   gridspec_kw={"height_ratios": [1.2, 1]})
    rows = {b: i for i, b in enumerate(BUCKETS)}
    by_bucket: dict[str, list[tuple[float, float]]] = {}
    for s in segs:
        by_bucket.setdefault(s["bucket"], []).append((s["start"], s["end"] - s["start"]))
    for b, bars in by_bucket.items():
        ax1.broken_barh(bars, (rows[b] - 0.4, 0.8), facecolors=COLORS[b])
    ax1.set_yticks(range(len(BUCKETS)))
    ax1.set_yticklabels(BUCKETS, fontsize=7)
    ax1.invert_yaxis()
    for e in events:
        ax1.axvline(e["t"], color="k", lw=0.8, ls="--", alpha=0.6)
        ax1.annotate(str(e.get("kind", "")), (e["t"], -0.6), fontsize=7, rotation=30,
                     ha="left", va="bottom", annotation_clip=False)
    ax1.set_title("goodput timeline", pad=18)
    ax1.legend(handles=[Patch(color=COLORS[b], label=b) for b in BUCKETS if b in by_bucket],
               fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ts, gp = _cumulative_goodput(segs, wall)
    ax2.plot(ts, 100 * gp, color=COLORS["productive"])
    for e in events:
        ax2.axvline(e["t"], color="k", lw=0.8, ls="--", alpha=0.6)
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("cumulative goodput (%)")
    ax2.set_xlabel("wall time (s)")
    ax2.grid(alpha=0.3)
    ax2.set_xlim(0, max(wall, 1e-9))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def label_levels(steps: list, axis_steps: list, width: float = 0.06) -> list[int]:
    """The level (0: lowest) of each event label at ``steps``, in order: the lowest level
    that no earlier label within ``width`` of the axis's step range uses."""
    near = width * max(max(axis_steps or [0]) - min(axis_steps or [0]), 1)
    placed: list = []
    for s in steps:
        taken = {lv for t, lv in placed if abs(t - s) < near}
        placed.append((s, min(lv for lv in range(len(placed) + 1) if lv not in taken)))
    return [lv for _, lv in placed]


def plot_demo(curve: dict, ref_curve: dict, events: list[dict], rec, path: str) -> str:
    """`resilax demo`'s picture: loss over steps (the faulted run and its failure-free
    reference) with the events marked, step time, and cumulative goodput of the faulted run
    over wall time. Writes a PNG; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), gridspec_kw={"height_ratios": [1.4, 1, 1]})
    ax1.plot(ref_curve["step"], ref_curve["loss"], color="0.6", lw=3, label="failure-free run")
    ax1.plot(curve["step"], curve["loss"], color="tab:blue", lw=1.2, label="run with the faults")
    marks = {"recovery": "tab:red", "sdc": "tab:purple", "rejoin": "tab:green", "anomaly": "tab:orange",
             "bitflip": "tab:pink", "hang": "tab:brown"}
    # labels of events at or near one step go one above the other (a label is ~6% of the
    # axis wide: "bitflip" at step 120 and "sdc" at 125 of 300 overlapped when only events at
    # the very same step were stacked)
    shown = [e for e in events if e["kind"] in marks]
    for e, n in zip(shown, label_levels([e["step"] for e in shown], list(curve["step"]))):
        for ax in (ax1, ax2):
            ax.axvline(e["step"], color=marks[e["kind"]], lw=1, ls="--")
        ax1.annotate(e["kind"], (e["step"], 1.01 + 0.07 * n), xycoords=("data", "axes fraction"), fontsize=8,
                     ha="left", va="bottom", color=marks[e["kind"]], annotation_clip=False)
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(curve["step"], [1e3 * t for t in curve["step_s"]], color="tab:blue", lw=1)
    ax2.set_ylabel("step time (ms)")
    ax2.set_xlabel("step")
    ax2.set_yscale("log")
    ax2.grid(alpha=0.3)
    ts, gp = _cumulative_goodput(rec.segments(), rec.wall())
    ax3.plot(ts, 100 * gp, color=COLORS["productive"])
    ax3.set_ylim(0, 100)
    ax3.set_ylabel("cumulative goodput (%)")
    ax3.set_xlabel("wall time (s)")
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(sw: dict, path: str, title: str = "") -> str:
    """Goodput vs chip count (log x) to a PNG; returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strat, vals in sw["goodput"].items():
        ax.plot(sw["chips"], [100 * v for v in vals], marker="o", label=strat)
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_title(title or "simulated goodput vs chip count")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_events(events: list[dict]) -> list[str]:
    """The run's failures, injected faults and recoveries, one line each, in the words
    `resilax train` printed them (`messages.describe`), each after its time and step:
    ``"  12.3 s  step 40: <line>"`` (``t``: seconds since the run's process started). Bookkeeping
    events have no line."""
    from resilax._src.messages import describe

    rows = []
    for e in events:
        line = describe(e)
        if line is not None:
            rows.append(f"{float(e.get('t', 0.0)):8.1f} s  step {e.get('step')}: {line}")
    return rows


def format_generations(history: list[dict]) -> list[str]:
    """A `resilax launch` job's generations that did not simply end (``launch_history.json``),
    one line each, in the supervisor's words: ``"generation 0 failed: process 1 (pid 7) exited
    with signal SIGKILL"``; a re-form, a grow-back or a shrink in place with the reason it
    gave."""
    rows = []
    for g in history:
        if g.get("outcome") in ("done", None):
            continue
        rows.append(f"generation {g.get('generation')} {g['outcome']}: {g.get('why') or '(no reason recorded)'}")
    return rows


def _launch_history(run_dir) -> list[dict] | None:
    import json

    path = os.path.join(os.fspath(run_dir), "launch_history.json")
    try:
        with open(path) as f:
            return list(json.load(f)["generations"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GoodputFileError(f"{path} is not a resilax launch history: {type(e).__name__}: {e}") from e


def report(run_dir: str | os.PathLike, *, png: bool = True, out=None) -> dict:
    """Print the goodput table of ``run_dir/goodput.json`` and the run's failures and
    recoveries (`format_events`; a run resumed by a new process covers every process of it,
    each event after its process's number; for a `resilax launch` run directory, its generations'
    failures too, `format_generations`, and the goodput of ``run_dir/checkpoints``, where
    its workers write it); write goodput.png.

    Returns ``{"totals", "wall_s", "goodput", "table", "events", "png"}`` (events: the
    lines printed; png is None when not written). Raises GoodputFileError for a missing or
    bad file.
    """
    history = _launch_history(run_dir)
    src = run_dir
    if history is not None and not os.path.exists(os.path.join(os.fspath(run_dir), GOODPUT_FILE)):
        src = os.path.join(os.fspath(run_dir), "checkpoints")  # (`resilax train`'s default under launch)
    rec = load_goodput(src)
    # a resumed run: every process of it, the earlier ones' totals and events too
    totals, wall = rec.run_totals(), rec.run_wall()
    table = format_report(totals, wall)
    events = format_generations(history or [])
    runs = [e["events"] for e in rec.earlier] + [rec.events]
    for k, evs in enumerate(runs, 1):
        events += [row if len(runs) == 1 else f"process {k} of {len(runs)}: {row}" for row in format_events(evs)]
    print(table, file=out or sys.stdout)
    print(f"failures and recoveries: {len(events) or 'none'}", file=out or sys.stdout)
    for line in events:
        print(line, file=out or sys.stdout)
    path = None
    if png:
        path = plot_timeline(rec, os.path.join(os.fspath(src), "goodput.png"))
    return {"totals": totals, "wall_s": wall, "goodput": rec.goodput(),
            "table": table, "events": events, "png": path}


def register_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``report RUN_DIR [--no-png]`` to an argparse subparsers object."""
    p = subparsers.add_parser("report", help="goodput table, failures and recoveries, and timeline of a run")
    p.add_argument("run_dir")
    p.add_argument("--no-png", dest="png", action="store_false", help="table only")
    p.set_defaults(func=_cli_main, compiles=False)
    return p


def _cli_main(args: argparse.Namespace) -> int:
    try:
        r = report(args.run_dir, png=args.png)
    except GoodputFileError as e:
        print(f"resilax report: {e}", file=sys.stderr)
        return 1
    if r["png"]:
        print(f"wrote {r['png']}")
    return 0
