#!/bin/bash
# Issue 26's GPU check, as one call of the device tool (a GPU machine of this workplace: JAX
# with CUDA, flax, optax, orbax and tensorstore installed; nothing can be fetched there):
#
#   here, once: pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#                 gin-config==0.5.0 ml-collections==1.1.0 orbax-checkpoint==0.12.8
#               (for PYSPY=1 also py-spy==0.4.3, with --platform manylinux1_x86_64)
#   there:      bash benchmarks/gpu_bench.sh        (carry .whl; results land in $OUT)
#
# What it runs: `resilax bench gpt --size small` (the 110 M GPT of the report) with
# --xla_gpu_deterministic_ops=true (what `resilax train`/`launch` give their workers; without
# it the bitwise keys cannot hold on a GPU), XLA dumping every optimised program, then
# `resilax.tools.hlo_scan` over the dump: no program of the bench may hold a conditional, a
# loop or a host callback.
#
# BENCH_ARGS replaces "--size small" (e.g. "--size small --per-leaf --no-resume"; "--no-split" leaves
# out the two-plain-jits reference, a sixth of the interleaved time); TIMEOUT bounds the bench
# (seconds; 441 s for five variants on an H100, 2026-11-27). PYSPY=1 records the bench's process with py-spy (--gil --threads, non-blocking:
# the samples of whichever thread holds the GIL) and summarizes them by thread
# (benchmarks/pyspy_threads.py): which threads kept the step loop from running Python.
set -o pipefail
OUT=${OUT:-/tmp/resilax-gpu-out}
mkdir -p "$OUT"
BENCH_ARGS=${BENCH_ARGS:-"--size small"}
TIMEOUT=${TIMEOUT:-540}
# the carried wheels; orbax only where the machine's own is older than the one resilax is tested with
pip_in() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
pip_in .whl/gin_config-*.whl .whl/ml_collections-*.whl || exit 1
if python3 -c "import orbax.checkpoint as o, sys; v=tuple(int(x) for x in o.__version__.split('.')[:3]); sys.exit(v >= (0, 12, 8))"; then
  pip_in .whl/orbax_checkpoint-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the resume check runs two processes beside this one on the GPU: none may take 75% of its memory up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, jax; from importlib.metadata import version as v
print(sys.version.split()[0], *(f'{p} {v(p)}' for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint',
      'tensorstore', 'numpy')), jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
rm -rf /tmp/hlo
export XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text ${XLA_FLAGS:-}"
BENCH=(python3 -c "import sys; from resilax.tools.cli import main; sys.exit(main())" bench gpt $BENCH_ARGS
       --json "$OUT/gpt.json")
if [ "${PYSPY:-0}" = 1 ] && ls .whl/py_spy-*.whl >/dev/null 2>&1; then
  pip_in .whl/py_spy-*.whl || exit 1
  BENCH=(/tmp/site/bin/py-spy record -r 100 --gil --threads --nonblocking --format raw -o /tmp/pyspy.txt -- "${BENCH[@]}")
fi
timeout "$TIMEOUT" "${BENCH[@]}" 2>&1 | tee "$OUT/bench.log"
echo "bench rc $?"
if [ -s /tmp/pyspy.txt ]; then
  python3 benchmarks/pyspy_threads.py /tmp/pyspy.txt --top 25 > "$OUT/pyspy_threads.txt" 2>&1
  head -30 "$OUT/pyspy_threads.txt"
fi
python3 -m resilax.tools.hlo_scan /tmp/hlo 2>&1 | tee "$OUT/hlo_scan.txt"
# PROBE=1: benchmarks/first_save_probe.py on a state-sized buffer, keeping each try's result and freeing it
# (does Orbax's pinned pool, once grown, make later copies free? what the store's pinned warm-up relies on)
if [ "${PROBE:-0}" = 1 ]; then
  for free in "" "--free"; do
    timeout 60 python3 benchmarks/first_save_probe.py --mb 1320 --n 4096 --reps 16 $free \
      --json "$OUT/probe${free:+_free}.json" 2>&1 | tee -a "$OUT/probe.txt"
  done
fi
# the update's skip gate, three forms: does XLA:GPU copy Adam's moments under a select of every output? (GATE=0: not run)
[ "${GATE:-1}" = 1 ] && XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 120 python3 benchmarks/gate_memory.py \
  --json "$OUT/gate_memory_gpu.json" 2>&1 | tee "$OUT/gate_memory.txt"
ls /tmp/hlo | grep after_optimizations.txt | sed -E 's/^module_[0-9]+\.//; s/\.[^.]*after_optimizations.txt$//' \
  | sort | uniq -c > "$OUT/hlo_programs.txt"
