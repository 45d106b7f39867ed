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
``||a - b|| > tol * max(||b||, s * ||all of b||)`` with ``s = max(1e-3, sqrt(size of the
leaf / size of the tree))``: a leaf whose gradient is identically zero in exact arithmetic
(a bias before BatchNorm, an attention key bias) is pure noise made by terms as large as
its neighbours' (its rounding scales with the magnitudes summed, not with its own ~0
result), so it is judged against the norm its share of the elements would have if the
tree's norm were spread evenly, not against its own. A miscompile is still caught on any
leaf whose gradient is not far below that share: a 4x gradient (relative difference 3)
fails wherever ``||b|| > tol / 3`` of it.

A difference is confirmed at a second point before it is called a miscompile: the same
step on both programs at the state with each float leaf scaled by ``1 + 2^-6 r`` (``r``
standard normal, a fixed key). A gradient through a ReLU (``max``, ``abs``, a sort) jumps
where the ReLU's input crosses 0, and an input within rounding of 0 has its sign set by the
summation order: the two programs then differ by a whole example's share of the gradient.
`resilax train`, resumed after a SIGKILL at such a state, raised here (every hidden leaf of
the demo MLP 1.3% apart; both programs 1.3-1.6% from float64). The perturbation moves every
kink far off the rounding band; a miscompile is in the program and shows at both points.
A difference seen at the first point only is named in the event (``unconfirmed``); one at
both, or a non-finite second point, raises.

A mesh of one device is not checked (an event says so): nothing is partitioned, and what
differs between its program and the reference is fusion alone (an H100 showed 1.7e-3 on
bf16 attention gradients that way: rounding, not a miscompile).

The tolerance: where the two programs may legitimately differ
----------------------------------------------------------------
The partitioned program and the reference compute the same sums in other orders (each
device sums its shard, then the partial sums are combined; XLA fuses differently), and
round intermediates at other places. Neither changes the maths; both change the rounding.
Model (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J.
Sci. Comput. 2019): each addition of a sum of ``n`` terms carried out in a float format
with unit roundoff ``u`` (half its machine epsilon: bf16 ``2^-8``, f16 ``2^-11``, f32
``2^-24``, f64 ``2^-53``) makes an independent error of at most ``u`` times the partial sum,
so the computed sum is off by ``u * sqrt(n)`` times ``sum |x_i|`` in the mean square
(times ``1/sqrt(3)`` for errors uniform in ``[-u, u]``), and two orders differ by
``sqrt(2/3) * u * sqrt(n) * sum |x_i| ~= 0.8 * u * sqrt(n) * sum |x_i|``. A leaf holds
many elements, so its norm of differences is that mean square, not a tail. Hence

    tol = max(rtol, c * u(d) * sqrt(n(d)))        over every float dtype d the grad part computes in

where ``n(d)`` is the longest reduction whose result has dtype ``d`` (a ``reduce_sum``,
including the transposes of broadcasts that sum a bias's gradient over the batch, the
contracted size of a ``dot_general`` or convolution, a ``cumsum``; 1 if none), read from
the grad part's jaxpr. Every reduction counts, not only those over sharded axes, since
XLA may reorder any of them when it fuses. Dots count although XLA accumulates them in f32
on CPU, GPU and TPU: nothing promises it, and their result is rounded to ``d`` either way.
The dtype that matters is the one the gradients are *computed* in, not the recorded one:
a flax model with bf16 ``dtype`` and f32 parameters records f32 gradients summed from
bf16 products and bf16 reductions, so the jaxpr is read, not the recorded leaves.

``c = 2``: 2.4x the ``0.8`` above, headroom for the cancellation inside a gradient (its
per-example terms have ``sum |x_i|`` larger than ``|sum x_i|``). Measured: a bf16 flax
transformer (`nn.MultiHeadDotProductAttention`, bf16 ``dtype``, f32 parameters) on the
``cpu-2x4`` mesh with FSDP differs by at most 0.63 of ``u * sqrt(n)`` at ``n = 512``
(0.055); at ``n = 2048`` a query bias reached 0.88 of it (0.156), the rest less, all
inside ``c = 2`` but for the leaf below; f32 steps differ by ~1e-6, far inside ``rtol``.

A known gap: a leaf whose gradient is zero in exact arithmetic is pure noise, and in bf16
its noise grows faster than ``sqrt(n)``: the bf16 transformer's attention *key* bias (softmax
ignores a shift shared by a row's logits) differed by 0.055 at ``n = 512`` and 0.229 at
``n = 2048`` (judged against 1e-3 of the tree's norm; 0.63 and 1.3 of ``u * sqrt(n)``),
nearly linear in ``n``. Judged against 1e-3 of the tree's norm it failed the GPT of
`resilax bench gpt --size tiny` at ``n = 128`` (0.0886 against 0.0884) in a resumed run;
judged against its share of the tree (above) it is far inside the tolerance.

What is still caught: for f32 (``u * sqrt(n)`` is 1.5e-5 even at ``n = 16k``) ``rtol``
(1e-3) rules, and the miscompile below (a 4x gradient, relative difference 3) is caught
with a wide margin. For bf16 the tolerance grows with the reductions: for the ``n = 16k``
token sums of a GPT with batch 32 x 512 it is ``2 * 2^-8 * 128 = 1.0``, so a quadrupled
partial sum (relative difference 3) is still caught, a doubled one sits at the edge and a
dropped shard of 8 is not. In low precision the check finds gross partitioning errors
only; it is never a bound on rounding. The event of a checked mesh names the dtype, the
reduction length and the tolerance used.

Cost: one single-device compile (shared by every mesh) and one run, once per mesh, plus
a host copy of the recorded values (and, after a first-point difference only, one more run
of both programs); skipped (an event says so) when the state and batch
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
from jax.sharding import Mesh

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
        self._tol = None  # (tolerance, compute dtype, reduction length): the same for every mesh

    def before_update(self, run, state, batch, step_no: int, gout, prog) -> None:
        if prog in self._done:
            return
        mesh = dict(prog.mesh.shape)
        if prog.mesh.devices.size == 1:
            self._done.add(prog)
            run._event("crosscheck", step_no, mesh=mesh, checked=False,
                      reason="a mesh of one device: nothing is partitioned, only fusion differs")
            return
        if jax.process_count() > 1:  # one device cannot read the other processes' shards
            self._done.add(prog)
            run._event("crosscheck", step_no, mesh=mesh, checked=False,
                      reason="multi-process run: the single-device reference is not built for it yet")
            return
        if prog.m != 1:
            self._done.add(prog)
            run._event("crosscheck", step_no, mesh=mesh, checked=False,
                      reason=f"{prog.m} microbatches: their random streams differ from the full batch's by design")
            return
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes")) + sum(
            np.asarray(x).nbytes for x in jax.tree.leaves(batch))
        if self.cfg.max_bytes is not None and nbytes > self.cfg.max_bytes:
            self._done.add(prog)
            run._event("crosscheck", step_no, mesh=mesh, checked=False,
                      reason=f"state + batch {nbytes} bytes > VerifyConfig.max_bytes {self.cfg.max_bytes}")
            return
        split = prog.spec.split
        full = batch  # the step's whole batch (the bit-exact branch below keeps replica 0's slice)
        if prog.deterministic:
            # the bit-exact mode: replica 0's values (one domain's executable) against the
            # same replica on one device: its slice of the batch, its random stream
            got = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(prog.last_replica0))]
            n = np.shape(jax.tree.leaves(batch)[0])[0] // prog.V
            batch = jax.tree.map(lambda x: np.asarray(x)[:n], batch)
            key = jax.random.fold_in(split.key(np.uint32(step_no)), np.uint32(0)) if split.rng else None
        else:
            got = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(prog.rec_tree(gout.rec)))]
            key = None
        if not all(np.all(np.isfinite(x)) for x in got if np.issubdtype(x.dtype, np.inexact)):
            return  # a NaN step (real or injected) says nothing about the compiler: check the next one
        # the programs are built from the state's abstract tree, which has no weak types; a
        # weakly typed leaf here (a step counter made from a Python int, before the first
        # update) gave the step another trace key: the model was traced once more per process
        state = jax.tree.map(lambda x: x.astype(x.dtype) if getattr(x, "weak_type", False) else x, state)
        def rec(s, b, n, k):  # called as the programs call it (no key argument without one): one trace
            return (split.grad(s, b, n) if k is None else split.grad(s, b, n, k))[0]

        dev = prog.mesh.devices.flat[0]
        # a step that reads the mesh in context (a pipeline) runs on one device as on a mesh
        # of one device with the same axes (a pipeline of one stage: the same maths)
        one_mesh = Mesh(np.array([dev]).reshape((1,) * len(prog.mesh.axis_names)), prog.mesh.axis_names)
        if self._single is None:
            self._single = jax.jit(rec)
        if self._tol is None:
            with split.on(one_mesh):
                self._tol = tolerance(rec, self.cfg.rtol, state, batch, jax.ShapeDtypeStruct((), np.uint32), key)
        tol, dtype, length = self._tol
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(prog.abstract_rec)[0]]

        def single(s):
            one = jax.device_put((s, batch, key), dev)
            with split.on(one_mesh):
                out = self._single(one[0], one[1], jnp.uint32(step_no), one[2])
            return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(out))]

        bad = _differing(got, single(state), tol, names)
        self._done.add(prog)
        unconfirmed = []
        if bad:
            # A second point before a verdict: the gradient of a ReLU (max, abs, a sort) jumps where
            # its input crosses 0, and an input within rounding of 0 makes two summation orders
            # disagree by a whole example's share (a resumed demo MLP: 1.3% on every hidden leaf,
            # both programs 1.3-1.6% from float64). A miscompile is in the program, not the point.
            pert = _perturbed(state)
            out = prog.grad(gout.rec_ring is not None, None)(pert, run._guard, prog.put_batch(full), np.uint32(step_no))
            got2 = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(
                prog.last_replica0 if prog.deterministic else prog.rec_tree(out.rec)))]
            finite = all(np.all(np.isfinite(x)) for x in got2 if np.issubdtype(x.dtype, np.inexact))
            again = _differing(got2, single(pert), tol, names) if finite else bad
            del pert, out
            if not again:
                unconfirmed, bad = [b[0] for b in bad], []
        run._event("crosscheck", step_no, mesh=mesh, checked=True, differing=[b[0] for b in bad], rtol=tol,
                  compute_dtype=dtype, reduction_length=length, unconfirmed=unconfirmed)
        if not bad:
            return
        detail = "; ".join(f"recorded{name}: relative difference {d:.3g}" for name, d in bad[:6])
        msg = (f"resilax: the compiled gradient part on mesh {mesh} disagrees with the same step run on one device "
               f"with no partitioning ({detail}; tolerance {tol:.3g}, from {dtype} reductions of length {length} and "
               f"VerifyConfig.rtol {self.cfg.rtol:g}), at the step's state and again at a perturbed one (a "
               f"gradient's jump at a ReLU's kink does not survive that). This is not rounding: XLA's SPMD "
               f"partitioner compiled this sharding wrongly (seen with JAX 0.10.2 on CPU: a convolution's kernel "
               f"gradient when a later weight is sharded over the batch axis), and training on would give silently "
               f"wrong results. Shard the leaves named differently (state_sharding / batch_sharding), or, to accept "
               f"it, Config(verify=VerifyConfig(on_mismatch='warn')) or Config(verify=None)")
        if self.cfg.on_mismatch == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            return
        raise ProgramMismatchError(msg)


#: ``c`` of the tolerance (module docstring): 2.4x the mean-square difference of two orders
C_ORDER = 2.0


def unit_roundoff(dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding to ``dtype``."""
    return float(jnp.finfo(dtype).eps) / 2


def reductions(closed_jaxpr) -> dict:
    """``{float dtype name: longest reduction with a result of that dtype}`` over a jaxpr
    and every jaxpr nested in it (jit, remat, custom_vjp, scan, cond bodies); every float
    dtype that appears has an entry (1 where it is never reduced)."""
    out: dict = {}

    def note(dtype, n):
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # typed PRNG keys
            return
        dtype = np.dtype(dtype)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            dtype = np.dtype(jnp.finfo(dtype).dtype)
        if jnp.issubdtype(dtype, jnp.floating):  # bf16 and the fp8s are not np.floating
            out[dtype.name] = max(out.get(dtype.name, 1), int(n))

    def walk(jaxpr):
        for v in list(jaxpr.invars) + list(jaxpr.constvars):
            if hasattr(v.aval, "dtype"):
                note(v.aval.dtype, 1)
        for eqn in jaxpr.eqns:
            n = _reduction_length(eqn)
            for v in eqn.outvars:
                if hasattr(v.aval, "dtype"):
                    note(v.aval.dtype, n)
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # ClosedJaxpr
                        walk(sub.jaxpr)
                    elif hasattr(sub, "eqns"):  # Jaxpr
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return out


def _reduction_length(eqn) -> int:
    name = eqn.primitive.name
    shape = lambda i: tuple(getattr(eqn.invars[i].aval, "shape", ()))  # noqa: E731
    if name in ("reduce_sum", "reduce_prod", "argmax", "argmin"):
        axes = eqn.params.get("axes", ())
        return int(np.prod([shape(0)[a] for a in axes])) if axes else 1
    if name in ("cumsum", "cumprod", "cumlogsumexp"):
        return shape(0)[eqn.params["axis"]] if shape(0) else 1
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        return int(np.prod([shape(0)[a] for a in lc])) if lc else 1
    if name == "conv_general_dilated":
        rhs = shape(1)  # kernel: every dim but its output-feature one is contracted
        out_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        return int(np.prod([d for i, d in enumerate(rhs) if i != out_dim])) or 1
    if name == "psum":
        return 1  # across devices: its order is in the partial sums' count, not the jaxpr's
    return 1


def tolerance(fn, rtol: float, *args) -> tuple[float, str, int]:
    """``(tol, dtype, n)``: the relative tolerance for ``fn``'s outputs computed in two
    summation orders (module docstring), the float dtype and reduction length that set it.

    Traces ``fn`` once (``jax.make_jaxpr``) on ``args`` (arrays or ShapeDtypeStructs);
    nothing is compiled or run."""
    red = reductions(jax.make_jaxpr(fn)(*args))
    best = (float(rtol), "none", 1)
    for name, n in red.items():
        t = C_ORDER * unit_roundoff(jnp.dtype(name)) * np.sqrt(n)
        if t > best[0]:
            best = (float(t), name, n)
    if best[1] == "none" and red:  # rtol rules: name the lowest precision present anyway
        name = max(red, key=lambda k: unit_roundoff(jnp.dtype(k)))
        best = (best[0], name, red[name])
    return best


#: relative size of the second point's perturbation of every float state leaf: far above any
#: dtype's rounding (it must move a kink off the rounding band), small enough to stay a state
#: the model is defined at
PERTURBATION = 2.0 ** -6


def _perturbed(state):
    """``state`` with each float leaf ``x`` made ``x * (1 + PERTURBATION * r)``, ``r`` standard
    normal (a fixed key): signs and zeros kept; integer leaves (a step counter) unchanged.
    Each leaf keeps its sharding (the programs take their arguments as laid out, and the
    bit-exact mode reads a domain's part from the buffers). Compiled on the rare path only."""
    return jax.jit(_perturb, out_shardings=jax.tree.map(lambda x: x.sharding, state))(state)


def _perturb(state):
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(0x5EC0D), max(len(leaves), 1))
    out = [x * (1 + PERTURBATION * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else x for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def _differing(got, want, rtol, names):
    """``[(leaf name, relative difference)]`` of the leaves that differ beyond noise."""
    floats = [w for w in want if np.issubdtype(w.dtype, np.inexact)]
    total = float(np.sqrt(sum(np.sum(np.square(w.astype(np.float64))) for w in floats))) if floats else 0.0
    size = max(sum(w.size for w in floats), 1)
    out = []
    for name, a, b in zip(names, got, want):
        if not np.issubdtype(b.dtype, np.inexact):
            if not np.array_equal(a, b):
                out.append((name, float("inf")))
            continue
        eps = float(np.finfo(b.dtype).eps)
        tol = max(rtol, 50 * eps)  # bf16/f16 reduce with their own, coarser rounding
        diff = float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)))
        # a leaf is judged against its own norm, or the norm its share of the elements would
        # have if the tree's norm were spread evenly (module docstring), whichever is larger
        share = max(1e-3, float(np.sqrt(b.size / size)))
        scale = max(float(np.linalg.norm(b.astype(np.float64))), share * total, 1e-30)
        if diff > tol * scale:
            out.append((name, diff / scale))
    return sorted(out, key=lambda t: -t[1])
