"""Which of XLA's optimised programs make the host wait for the device (issue 26, item 1).

``python -m resilax.tools.hlo_scan DUMP_DIR`` reads the ``*after_optimizations.txt`` files a
run wrote under ``XLA_FLAGS="--xla_dump_to=DUMP_DIR --xla_dump_hlo_as_text"`` and prints
each program holding a conditional, a loop or a host callback (exit status 1 if any). XLA:GPU
evaluates a conditional's predicate and a loop's condition on the host, so such a program
makes the next dispatch wait for the device. `tests/test_async.py` runs it over the CPU
programs of failure-free runs; `benchmarks/gpu_bench.sh` over the GPU ones of the GPT bench.
"""

from __future__ import annotations

import glob
import os
import re
import sys

# ops that make the host wait for the device: a conditional, a loop, a call back into Python
HOST_SYNC = re.compile(r"\b(conditional|while)\(|custom_call_target=\"[^\"]*callback[^\"]*\"")

JAX_PRNG = re.compile(r'op_name="[^"]*jit\((_threefry\w*|_random_bits|_uniform|_bernoulli|_normal\w*|_randint)\)')


def host_sync_ops(hlo_text: str) -> list[str]:
    """The instructions of an optimised HLO module that make the host wait for the device.

    Loops of JAX's own PRNG are not counted: on CPU threefry lowers to a loop over its
    rounds (on a GPU it is one kernel, ``cu_threefry2x32``), and the user's step has them
    under plain jit just as much (dropout masks); resilax adds none of its own."""
    out = set()
    for line in hlo_text.splitlines():
        m = HOST_SYNC.search(line)
        if m and not (m.group(0) == "while(" and JAX_PRNG.search(line)):
            out.add(m.group(0))
    return sorted(out)


def scan_dump(directory: str, skip: tuple[str, ...] = ()) -> tuple[list[str], dict[str, list[str]]]:
    """``(files scanned, {file name: host-sync ops})`` over the optimised programs in
    ``directory``; a file whose name contains one of ``skip`` is left out."""
    files = sorted(glob.glob(os.path.join(directory, "*after_optimizations.txt")))
    files = [f for f in files if not any(s in os.path.basename(f) for s in skip)]
    bad = {}
    for f in files:
        with open(f) as fh:
            ops = host_sync_ops(fh.read())
        if ops:
            bad[os.path.basename(f)] = ops
    return files, bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        raise SystemExit("usage: python -m resilax.tools.hlo_scan DUMP_DIR (a directory XLA dumped into)")
    files, bad = scan_dump(argv[0])
    for name, ops in sorted(bad.items()):
        print(f"HOST SYNC {name}: {' '.join(ops)}")
    print(f"{len(files)} optimised programs scanned, {len(bad)} with a conditional, loop or host callback")
    return 1 if bad or not files else 0


if __name__ == "__main__":
    sys.exit(main())
