"""What zstd compression costs a checkpoint: `CheckpointConfig.compress` (on by default, as Orbax).

Orbax compresses every array it writes with zstd unless told not to. Float train state
(weights, AdamW moments) barely compresses, and the compressor runs on the host's CPU,
beside the step loop, and again (decompressing) while a recovery waits for its restore.

This bench trains a GPT-style model (`resilax.tools.gpt`, a mid size: ``--d``, ``--layers``,
``--vocab``) for two steps so its AdamW moments are real, then saves that state through
resilax's own `CheckpointStore` (async, as a wrapped step saves) with compression off and
on, alternating, ``--saves`` times each. Per save: the process CPU seconds from the save
call to its commit, the commit's wall time, the bytes on disk; then a restore of the newest
checkpoint (wall time), checked bitwise against the state saved. Prints a table and writes
JSON.

    python benchmarks/compression_cost.py --json benchmarks/results/compression_cost.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _bytes_under(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16_000)
    p.add_argument("--saves", type=int, default=4, help="saves per setting (alternating; after one untimed each)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import resilax

    resilax.request_cpu_devices(8)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from resilax._src.io import write_json
    from resilax._src.protect.checkpoints import CheckpointStore
    from resilax.tools import gpt

    size = gpt.GPTSize(d=args.d, layers=args.layers, heads=8, seq=32, batch=8, vocab=args.vocab)
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()).reshape(1, n), ("data", "fsdp"))
    st = gpt.make_state(size)
    st = jax.device_put(st, jax.tree.map(lambda s: NamedSharding(mesh, s), gpt.fsdp_spec(st, "fsdp", n)))
    step = jax.jit(lambda s, b, i: gpt.plain_step(s, b, jax.random.fold_in(jax.random.key(0), i))[0])
    for i, b in enumerate(gpt.batches(size, 2)):
        st = step(st, b, i)
    state = {"state": st}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    print(f"{sum(x.size for x in jax.tree.leaves(st.params)) / 1e6:.1f} M params, {nbytes / 2**20:.0f} MB of state, "
          f"{len(jax.tree.leaves(state))} leaves, {n} devices", file=sys.stderr, flush=True)

    root = tempfile.mkdtemp(prefix="resilax-compression-")
    rows = {False: [], True: []}
    try:
        stores = {c: CheckpointStore(os.path.join(root, f"compress_{c}"), keep=1, compress=c) for c in (False, True)}
        for c, store in stores.items():  # Orbax's start-up and the compiles, untimed
            store.save(0, state, {})
            store.wait()
        for i in range(1, args.saves + 1):
            for c in (False, True):
                store = stores[c]
                c0, t0 = time.process_time(), time.perf_counter()
                store.save(i, state, {})
                store.wait()
                rows[c].append({"cpu_s": time.process_time() - c0, "commit_s": time.perf_counter() - t0})
                print(f"  save {i}, compress={c}: {rows[c][-1]['commit_s']:.2f} s to commit, "
                      f"{rows[c][-1]['cpu_s']:.2f} CPU-s", file=sys.stderr, flush=True)
        out = {"bench": "compression_cost", "state_bytes": nbytes, "leaves": len(jax.tree.leaves(state)),
               "devices": n, "cpu_count": os.cpu_count(), "saves": args.saves, "settings": {}}
        for c, store in stores.items():
            t0 = time.perf_counter()
            got = store.restore_newest(abstract)
            restore_s = time.perf_counter() - t0
            equal = got is not None and all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(state)))
            store.close()
            out["settings"]["on" if c else "off"] = {
                "cpu_s_per_save": statistics.median(r["cpu_s"] for r in rows[c]),
                "commit_s": statistics.median(r["commit_s"] for r in rows[c]),
                "disk_bytes": _bytes_under(os.path.join(root, f"compress_{c}")), "restore_s": restore_s,
                "restored_bitwise": bool(equal)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s = out["settings"]
    print(f"\n{'compression':<12}{'CPU-s/save':>11}{'commit s':>10}{'restore s':>11}{'disk MB':>9}  bitwise")
    for k in ("off", "on"):
        r = s[k]
        print(f"{k:<12}{r['cpu_s_per_save']:>11.2f}{r['commit_s']:>10.2f}{r['restore_s']:>11.2f}"
              f"{r['disk_bytes'] / 2**20:>9.1f}  {r['restored_bitwise']}")
    out["ratio_on_to_off"] = {k: s["on"][k] / s["off"][k] for k in ("cpu_s_per_save", "commit_s", "restore_s", "disk_bytes")}
    print("on / off: " + ", ".join(f"{k} {v:.2f}x" for k, v in out["ratio_on_to_off"].items()))
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0 if all(r["restored_bitwise"] for r in s.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
