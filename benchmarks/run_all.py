"""Runs every resilax benchmark, printing each table and writing JSON under --out.

    python benchmarks/run_all.py --out benchmarks/results            # all of them (~10 min on 2 cores)
    python benchmarks/run_all.py --only overhead recovery

Each benchmark is the `resilax bench ...` / `resilax simulate` / `resilax validate` command
run in its own process (so each gets a fresh JAX with 8 emulated CPU devices); ratios are
measured interleaved inside one run, because these machines are noisy. Not a test.
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCHES = {
    "overhead": ["bench", "overhead", "--steps", "300"],
    "replay": ["bench", "replay"],
    "recovery": ["bench", "recovery"],
    "protection": ["bench", "protection", "--quiet"],
    "simulate": ["simulate", "--chips", "16384", "--model-params", "405e9", "--failures", "llama3",
                 "--days", "30", "--seed", "0", "--sweep"],
    "validate": ["validate", "--steps", "2000", "--checkpoint-every", "200", "--kills", "700,1500"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--only", nargs="*", choices=sorted(BENCHES), default=None)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    failed = []
    for name in args.only or BENCHES:
        cmd = [sys.executable, "-m", "resilax", *BENCHES[name], "--json", os.path.join(args.out, f"{name}.json")]
        if name in ("simulate", "validate"):
            cmd += ["--png", os.path.join(args.out, f"{name}.png")]
        print(f"\n=== {name}: {' '.join(cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env, cwd=ROOT)
        print(f"=== {name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print(f"\nresults in {args.out}" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
