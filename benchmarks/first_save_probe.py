"""What makes a checkpoint's FIRST save stall a GPU's step loop (issue 26) when later ones do not.

On one H100 (the 110 M GPT, 1.32 GB of state) a save's first copy blocked the loop 1.3-1.8 s,
later ones 0.09 s (packed). This probe runs a steady jitted loop (blocking on each step, as
the bench times it) while a background thread does, three times each on fresh buffers of the
state's size, one thing a save does:

  alloc    a new device buffer of the size (the snapshot / the packed copy)
  to_host  ``copy_to_host_async`` + ``np.asarray`` (JAX's own copy to host)
  pinned   ``device_put`` to the ``pinned_host`` memory kind (Orbax's GPU copy to host)

and reports, per try, the background op's time and the loop's blocking (the steps' time
above the median step, summed over the steps the op overlaps). A first try far above the
later ones names what a warm-up must do. Run it under both allocator settings:

  XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/first_save_probe.py --mb 1320
  python benchmarks/first_save_probe.py --mb 1320
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from resilax._src.io import write_json


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64, help="size of the buffers copied (MB)")
    p.add_argument("--n", type=int, default=2048, help="the loop's matmul size (sets its step time)")
    p.add_argument("--reps", type=int, default=8, help="matmuls per step")
    p.add_argument("--free", action="store_true",
                   help="free each try's result before the next (a pinned memory pool may reuse it: if the later "
                        "tries then cost the loop nothing, the first save's stall is the pool's first growth, what "
                        "CheckpointStore's warm-up, orbax_warm.warm_pinned, now does ahead)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    dev = jax.devices()[0]
    n_el = a.mb * 2**20 // 4

    @jax.jit
    def step(m):
        for _ in range(a.reps):
            m = jnp.tanh(m @ m) * 0.5
        return m

    m = jax.random.normal(jax.random.key(0), (a.n, a.n), jnp.float32)
    src = jnp.arange(n_el, dtype=jnp.float32)
    jax.block_until_ready(step(m))
    times: list[float] = []
    stop = threading.Event()

    def loop():
        x = m
        while not stop.is_set():
            t0 = time.perf_counter()
            x = jax.block_until_ready(step(x))
            times.append(time.perf_counter() - t0)

    th = threading.Thread(target=loop)
    th.start()
    time.sleep(1.0)

    def alloc():
        return jax.block_until_ready(src + 1.0)

    def to_host(y):
        y.copy_to_host_async()
        return np.asarray(y)

    def pinned(y):
        try:
            kind = y.sharding.with_memory_kind("pinned_host")
        except Exception as e:  # not on this platform
            return f"no pinned_host: {e}"
        return jax.block_until_ready(jax.device_put(y, kind))

    results = []
    keep = []
    for name in ("alloc", "to_host", "pinned"):
        for i in range(3):
            y = alloc() if name != "alloc" else None  # the fresh buffer the op copies (made before the clock)
            time.sleep(0.5)
            k0 = len(times)
            t0 = time.perf_counter()
            out = alloc() if name == "alloc" else to_host(y) if name == "to_host" else pinned(y)
            op_s = time.perf_counter() - t0
            time.sleep(0.5)
            k1 = len(times)
            if not a.free:
                keep.append(out)  # alive to the end: a new try cannot reuse its memory
            span = times[max(0, k0 - 1):k1]
            med = float(np.median(times[:k0] if k0 > 5 else times))
            blocking = float(sum(max(0.0, t - med) for t in span))
            results.append({"op": name, "try": i + 1, "op_s": round(op_s, 4), "blocking_s": round(blocking, 4),
                            "max_step_ms": round(1e3 * max(span), 2) if span else None,
                            "median_step_ms": round(1e3 * med, 2)})
            print(f"{name:8s} try {i + 1}: op {op_s * 1e3:8.1f} ms  loop blocked {blocking * 1e3:8.1f} ms "
                  f"(max step {results[-1]['max_step_ms']} ms, median {med * 1e3:.1f})", flush=True)
            del y, out
    stop.set()
    th.join()
    out = {"device": dev.device_kind, "platform": dev.platform, "mb": a.mb, "free": a.free,
           "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default"), "results": results}
    if a.json:
        write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
