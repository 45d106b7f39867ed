"""Cross-check of each mesh's compiled gradient part against the same step on one device.

resilax's promise is the maths of the user's step: the same on the full mesh, on a
smaller mesh after a failure, and in replay. Reduction order may differ between them;
nothing else may. XLA's SPMD partitioner can break that promise on its own: with JAX
0.10.2 on CPU, the kernel gradient of a convolution on activations comes out 4x too large on a
2x4 mesh when a later Dense kernel is sharded over the batch axis (the partitioner
reduces over the ``fsdp`` axis once too often; `tests/test_crosscheck.py` has it). Both
a failure-free run and a faulted one then train on wrong gradients, differently on each
mesh, and nothing looks wrong: a silent wrong result.

So the first step each mesh's program runs (the full mesh at the first call, a smaller
mesh at its first step after a recovery) also runs the user's gradient part once on a
single device, with no partitioning at all, on the same state, batch and key, and
compares the recorded values leaf by leaf. A leaf differs when
``||a - b|| > rtol * max(||b||, 1e-3 * ||all of b||)``: reduction-order noise is ~1e-6 of
a leaf, and a leaf whose gradient is identically zero in exact arithmetic (a bias before
BatchNorm) is pure noise, judged against the whole tree's norm instead of its own.

Cost: one single-device compile (shared by every mesh) and one run, once per mesh, plus
a host copy of the recorded values; skipped (an event says so) when the state and batch
exceed ``VerifyConfig.max_bytes`` or when the mesh runs microbatches (their random streams
differ from the full batch's by design). Raised before the update runs, so the state the
step was given is untouched: `ResilientStep.state` still holds it.
"""

from __future__ import annotations

import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from resilax._src.errors import ProgramMismatchError
from resilax._src.protect.base import Protection


class CrossCheck(Protection):
    name = "crosscheck"

    def __init__(self, cfg):
        self.cfg = cfg
        # programs already checked (or skipped for good): weak, never by id(), since a dead
        # program's id can be reused by the next mesh's, which would then go unchecked
        self._done = weakref.WeakSet()
        self._single = None  # the jitted single-device grad part, shared by every mesh

    def before_update(self, run, state, batch, step_no: int, gout, prog) -> None:
        if prog in self._done:
            return
        mesh = dict(prog.mesh.shape)
        if jax.process_count() > 1:  # one device cannot read the other processes' shards
            self._done.add(prog)
            run.event("crosscheck", step_no, mesh=mesh, checked=False,
                      reason="multi-process run: the single-device reference is not built for it yet")
            return
        if prog.m != 1:
            self._done.add(prog)
            run.event("crosscheck", step_no, mesh=mesh, checked=False,
                      reason=f"{prog.m} microbatches: their random streams differ from the full batch's by design")
            return
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes")) + sum(
            np.asarray(x).nbytes for x in jax.tree.leaves(batch))
        if self.cfg.max_bytes is not None and nbytes > self.cfg.max_bytes:
            self._done.add(prog)
            run.event("crosscheck", step_no, mesh=mesh, checked=False,
                      reason=f"state + batch {nbytes} bytes > VerifyConfig.max_bytes {self.cfg.max_bytes}")
            return
        split = prog.spec.split
        if prog.deterministic:
            # the bit-exact mode: replica 0's values (one domain's executable) against the
            # same replica on one device: its slice of the batch, its random stream
            got = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(prog.last_replica0))]
            n = np.shape(jax.tree.leaves(batch)[0])[0] // prog.V
            batch = jax.tree.map(lambda x: np.asarray(x)[:n], batch)
            key = jax.random.fold_in(split.key(np.uint32(step_no)), np.uint32(0)) if split.rng else None
        else:
            got = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(gout.rec))]
            key = None
        if not all(np.all(np.isfinite(x)) for x in got if np.issubdtype(x.dtype, np.inexact)):
            return  # a NaN step (real or injected) says nothing about the compiler: check the next one
        if self._single is None:
            self._single = jax.jit(lambda s, b, n, k: split.grad(s, b, n, k)[0])
        dev = prog.mesh.devices.flat[0]
        one = jax.device_put((state, batch, key), dev)
        want = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(self._single(one[0], one[1], jnp.uint32(step_no), one[2])))]
        del one
        self._done.add(prog)
        bad = _differing(got, want, self.cfg.rtol,
                         [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(gout.rec)[0]])
        run.event("crosscheck", step_no, mesh=mesh, checked=True, differing=[b[0] for b in bad])
        if not bad:
            return
        detail = "; ".join(f"recorded{name}: relative difference {d:.3g}" for name, d in bad[:6])
        msg = (f"resilax: the compiled gradient part on mesh {mesh} disagrees with the same step run on one device "
               f"with no partitioning ({detail}; tolerance {self.cfg.rtol:g}). This is not rounding: XLA's SPMD "
               f"partitioner compiled this sharding wrongly (seen with JAX 0.10.2 on CPU: a convolution's kernel "
               f"gradient when a later weight is sharded over the batch axis), and training on would give silently "
               f"wrong results. Shard the leaves named differently (state_sharding / batch_sharding), or, to accept "
               f"it, Config(verify=VerifyConfig(on_mismatch='warn')) or Config(verify=None)")
        if self.cfg.on_mismatch == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            return
        raise ProgramMismatchError(msg)


def _differing(got, want, rtol, names):
    """``[(leaf name, relative difference)]`` of the leaves that differ beyond noise."""
    floats = [w for w in want if np.issubdtype(w.dtype, np.inexact)]
    total = float(np.sqrt(sum(np.sum(np.square(w.astype(np.float64))) for w in floats))) if floats else 0.0
    out = []
    for name, a, b in zip(names, got, want):
        if not np.issubdtype(b.dtype, np.inexact):
            if not np.array_equal(a, b):
                out.append((name, float("inf")))
            continue
        eps = float(np.finfo(b.dtype).eps)
        tol = max(rtol, 50 * eps)  # bf16/f16 reduce with their own, coarser rounding
        diff = float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)))
        scale = max(float(np.linalg.norm(b.astype(np.float64))), 1e-3 * total, 1e-30)
        if diff > tol * scale:
            out.append((name, diff / scale))
    return sorted(out, key=lambda t: -t[1])
