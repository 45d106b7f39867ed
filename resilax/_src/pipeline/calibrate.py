"""Measured costs for the protection plan of a `PipelineExecutor`: a short timing of each
stage's programs (F, B, W, BW and the update) on one micro-batch and of each stage's
protection copies (to the host, to its peer copy's keeper), turned into the plan's cost
units (one forward op = 1), so the plan places pieces by what this hardware does instead of
by the units a user gave.

Each figure is the median of ``repeats`` timed calls, each blocked to completion, after one
untimed call (compiled and warm). A host copy is timed on fresh device copies of the state
(a JAX array keeps its host copy once made). Everything runs on the devices of one live
replica of each stage; nothing here runs inside a step.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def _median(call, repeats: int) -> float:
    jax.block_until_ready(call())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def _host_copy(state, repeats: int) -> float:
    fresh = [jax.block_until_ready(jax.tree.map(jnp.copy, state)) for _ in range(repeats + 1)]
    out = []
    for tree in fresh:
        t0 = time.perf_counter()
        jax.device_get(tree)
        out.append(time.perf_counter() - t0)
    return float(np.median(out[1:]))


def measure(ex, batch, repeats: int = 5) -> dict:
    """Times ``ex``'s programs and copies on ``batch``'s first micro-batch. Returns
    ``{"seconds": {"F": [per stage], "B", "W", "BW", "U", "snapshot", "peer"}, "costs":
    {"F": 1.0, "B", "W", "BW", "U"} (means over stages, over F's), "work": {stage:
    {"snapshot", "peer"}} (in units of F)}``. Cost: about ``repeats x 7 x S`` blocked calls."""
    S, exe = ex.S, ex._exe
    src = {s: min(d for d in ex.state if d[1] == s) for s in range(S)}
    mb = ex._microbatches(batch)[(0, 0)]
    key = jax.random.fold_in(jax.random.key(ex.seed), 0)
    sec = {k: [None] * S for k in ("F", "B", "W", "BW", "U", "snapshot", "peer")}
    vjps, x, ct = {}, None, None
    for s in range(S):
        d = src[s]
        dev, (p, _) = ex.devices[d], ex.state[d]
        xs = jax.device_put(x, dev) if x is not None else None
        b = jax.device_put(mb, dev) if s in (0, S - 1) else None
        k = jax.device_put(key, dev)

        def fwd(s=s, p=p, xs=xs, b=b, k=k):
            return exe.fwd(s)(p, xs, b, k, np.int32(s * ex.k))

        sec["F"][s] = _median(fwd, repeats)
        out, vjps[s] = fwd()
        x = out if s < S - 1 else None
        if s == S - 1:
            ct = jax.device_put(jnp.ones((), out[0].dtype), dev)
    for s in reversed(range(S)):
        d = src[s]
        dev, (p, o) = ex.devices[d], ex.state[d]
        vjp, ct = vjps[s], jax.device_put(ct, dev)
        sec["W"][s] = _median(lambda: exe.bwd_w(vjp, ct), repeats)
        sec["BW"][s] = _median(lambda: exe.bwd(vjp, ct), repeats)
        dw = exe.bwd_w(vjp, ct)
        sec["U"][s] = _median(lambda: exe.update(p, o, dw), repeats)
        sec["snapshot"][s] = _host_copy((ex.state[d], ex.guard[d]), repeats)
        keeper = ex.peer_copies._keeper(d) if ex.peer_copies is not None else None
        if keeper is None:  # no peer copies: the neighbour domain a copy would go to
            keeper = next((q for q in sorted(ex.state) if q[1] != s), None)
        if keeper is not None:
            kdev = ex.devices[keeper]
            sec["peer"][s] = _median(lambda: jax.device_put((ex.state[d], ex.guard[d]), kdev), repeats)
        if s > 0:
            sec["B"][s] = _median(lambda: exe.bwd_x(vjp, ct), repeats)
            ct = exe.bwd_x(vjp, ct)
    f = float(np.mean(sec["F"]))
    mean = {k: float(np.mean([v for v in sec[k] if v is not None])) for k in ("B", "W", "BW", "U")
            if any(v is not None for v in sec[k])}
    costs = {"F": 1.0, **{k: v / f for k, v in mean.items()}}
    work = {s: {k: sec[k][s] / f for k in ("snapshot", "peer") if sec[k][s] is not None} for s in range(S)}
    return {"seconds": sec, "costs": costs, "work": work}
