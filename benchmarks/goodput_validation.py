"""Benchmark: simulated vs measured goodput of a real CPU job killed by SIGKILL.

Runs ``resilax._validate.validate`` (three cost-measuring runs of ``resilax train``,
then the job with the kill schedule, then the simulator on the measured costs and
failure times), prints the table and writes JSON (and a PNG with --png).

    PYTHONPATH=$PWD python benchmarks/goodput_validation.py \
        --steps 4000 --checkpoint-every 200 --kills 700,1900,3100 --json out.json --png out.png

Timings are wall-clock on whatever else the machine is doing; run it on an idle one
for numbers you report. Not a test.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resilax.tools.runner import configure_compilation_cache  # noqa: E402
from resilax.tools.validate import validate  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--kills", default="700,1900,3100")
    p.add_argument("--measure-steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1, help="run the whole validation this many times")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default="goodput_validation.json")
    p.add_argument("--png", default=None)
    a = p.parse_args(argv)
    configure_compilation_cache()
    kills = [int(x) for x in a.kills.split(",") if x.strip()]
    runs = []
    for i in range(a.repeats):
        print(f"== validation {i + 1}/{a.repeats}", flush=True)
        runs.append(validate(steps=a.steps, checkpoint_every=a.checkpoint_every, kills=kills,
                             measure_steps=a.measure_steps, workdir=a.workdir,
                             png_path=a.png if i == 0 else None))
    print(f"\n{'run':<5}{'wall s':>8}{'measured':>10}{'simulated':>11}{'rel err':>9}"
          f"{'lost meas':>10}{'lost sim':>9}")
    for i, r in enumerate(runs):
        print(f"{i + 1:<5}{r['wall_s']:>8.1f}{r['measured_goodput']:>10.2%}"
              f"{r['simulated_goodput']:>11.2%}{r['relative_error']:>9.2%}"
              f"{r['lost_steps_measured']:>10.0f}{r['lost_steps_simulated']:>9.1f}")
    if a.json:
        import json

        slim = [{k: v for k, v in r.items() if k not in ("measure", "job", "simulation")}
                for r in runs]
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"runs": slim, "full": runs}, f, indent=1, sort_keys=True)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
