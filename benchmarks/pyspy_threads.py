"""Where a process's Python time went, by thread: a summary of a ``py-spy record --threads
--format raw`` file (benchmarks/gpu_bench.sh makes one with ``PYSPY=1``; with ``--gil`` the
samples are those of the thread holding the GIL, so the table says which threads kept the
step loop's thread from running Python).

    python benchmarks/pyspy_threads.py RAW [--top N] [--thread NAME ...]

Prints samples per thread (the numeric suffixes Python and Orbax give their pools' threads
folded into one name), then for each ``--thread`` the functions its samples were in
(inclusive).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def summarize(path: str):
    per_thread: collections.Counter = collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or " " not in line:
                continue
            stack, n = line.rsplit(" ", 1)
            frames = stack.split(";")
            name = re.sub(r"\(\d+\)", "", frames[0]).split(": ", 1)[-1].strip()
            name = re.sub(r"_\d+$", "", name) or "?"
            per_thread[name] += int(n)
            seen = set()
            for fr in frames[1:]:
                key = fr.split(" (")[0] + " [" + fr.split("(")[-1].split(":")[0].split("/")[-1] + "]"
                if key not in seen:
                    seen.add(key)
                    inclusive[name][key] += int(n)
    return per_thread, inclusive


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--thread", action="append", default=[])
    a = p.parse_args(argv)
    per_thread, inclusive = summarize(a.raw)
    total = sum(per_thread.values())
    print(f"{total} samples")
    for name, n in per_thread.most_common(a.top):
        print(f"{n:>8} {100 * n / max(total, 1):5.1f}%  {name}")
    for t in a.thread or [n for n, _ in per_thread.most_common(3)]:
        print(f"\n== {t}")
        for k, n in inclusive[t].most_common(a.top):
            print(f"{n:>8}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
