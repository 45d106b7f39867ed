"""The table `resilax bench multihost` prints from its result (`bench_multihost.bench_multihost`)."""

PHASES = ("detect", "agree", "start", "restore", "setup", "redo")
DOUBLE_PHASES = ("detect", "recovering", "detect2", "agree", "start", "restore", "setup", "redo")


def print_table(r: dict) -> None:
    s = r["setup"]
    wk = s.get("workers_per_node", 1)
    print(f"\nresilax bench multihost  ({s['nodes']} agents x {wk} worker{'s' if wk > 1 else ''} x "
          f"{s['devices_per_process']} CPU device{'s' if s['devices_per_process'] > 1 else ''} on "
          f"loopback, {s['mode']}, {s['steps']} steps, checkpoint every {s['checkpoint_every']}, lease "
          f"{s['lease_s']:g} s, {s['cpu_count']} cores)")
    if "soak" in r:
        print(f"{'run':<8}{'outcome':<13}{'death->back s':>14}{'2nd kill at s':>14}{'lost':>6}"
              f"{'grow-back redone':>18}  fallbacks")
        for i, x in enumerate(r["runs"]):
            gb = (x.get("grow_back") or {}).get("redone_steps")
            d = x.get("death_to_back_s")
            k2 = (x.get("second_kill") or {}).get("after_first_kill_s")
            print(f"{i:<8}{x['outcome']:<13}{'-' if d is None else format(d, '.2f'):>14}"
                  f"{'-' if k2 is None else format(k2, '.2f'):>14}"
                  f"{x.get('lost_steps', '-')!s:>6}{gb if gb is not None else '-'!s:>18}  "
                  f"{'; '.join(x.get('fallbacks') or []) or x.get('error', '-')}")
        k = r["soak"]
        print(f"{k['bitwise']}/{k['runs']} bitwise ({k['ok']} within {s.get('tolerance', 0):g}), {k['not_bitwise']} "
              f"off, {k['hang']} hang, {k['failed']} "
              f"failed; {k['fell_back_to_checkpoint']} fell back to a checkpoint restart")
        return
    heads = list(r["cases"])
    rep = s["repeat"] > 1

    def cell(st, fmt):
        if st is None:
            return "-"
        return f"{st['median']:{fmt}}" + (f" [{st['min']:{fmt}}-{st['max']:{fmt}}]" if rep else "")

    w = 24 if rep else 12
    print(f"{'':<26}" + "".join(f"{h:>{w}}" for h in heads))
    keys = DOUBLE_PHASES if "double" in heads else PHASES
    rows = [("death -> back (s)", "death_to_back_s", ".2f")] + [(f"  {k}", k, ".2f") for k in keys] + \
        [("lost (redone) steps", "lost_steps", ".0f")]
    for label, key, fmt in rows:
        vals = [r["cases"][c]["phases"].get(key) if key in keys else r["cases"][c][key] for c in heads]
        print(f"{label:<26}" + "".join(f"{cell(v, fmt):>{w}}" for v in vals))
    print(f"{'bitwise':<26}" + "".join(f"{r['cases'][c]['bitwise']!s:>{w}}" for c in heads))
    if s.get("tolerance"):
        print(f"{'max relative difference':<26}" + "".join(f"{r['cases'][c]['distance']:>{w}.1e}" for c in heads))
    print("(service: the coordination service's host killed; other: another host; relaunch: every host killed and "
          "the job started again; double: the service's host, then during the recovery the next service's host ("
          f"{s.get('second_kill_at')}), the last host alone;" + (" median [min-max]" if rep else "")
          + " vs a failure-free single-process run)")
    for x in r["runs"]:
        k2 = x.get("second_kill")
        if k2:
            print(f"{x['dir']}: second kill {k2['after_first_kill_s']:.2f} s after the first, generation "
                  f"{k2['generation']} {k2['outcome'] or 'proposed'} (nodes {k2['members']}), "
                  f"{k2['workers_attached']}/{k2['workers']} workers attached, {k2['workers_resumed']} resumed; "
                  f"back {k2['death_to_back_s']:.2f} s after it; restored step {x['restored_step']} from "
                  f"{x['restored_from']}, {x['lost_steps']} lost")
