"""The update part's skip gate: the new state where the verdict says so, else the old one,
bitwise, with selects fused into the update (no conditional: XLA:GPU evaluates a
conditional's predicate on the host, so the step would wait for the device).

`gate` selects each output leaf. Alone it makes XLA copy state: Adam's new moment ``mu`` is
an output and also feeds the parameter's update. Once the output is ``select(ok, mu_new,
mu)``, ``mu_new`` has no buffer of its own, so XLA recomputes it inside the parameter's
fusion from the old ``mu``, and with the state donated (``mu``'s output overwrites ``mu``'s
buffer) it first copies every old ``mu`` and ``nu``: 1,201 copy instructions for 1,802 leaves
on XLA:CPU, where plain jit's update has none, and a copy of both moments (twice the
parameters' bytes) live at once.

`gated_update` gates where the value is made instead: it traces the update once and, where a
value the update returns is also read inside it, every reader gets the gated value. Where
the verdict is OK the gated value is the value itself (a select of it, bitwise), so what
the update computes is unchanged; where it is not, every output is the old state anyway.
XLA then writes each moment once, in place, and the parameter's fusion reads it there, as
in plain jit. Values made inside a nested call (a jitted optimizer) keep `gate`'s form.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def gate(ok, new, old):
    """Traced: ``new`` where the verdict ``ok`` is `anomaly.OK` (0), else ``old``, leaf by
    leaf. The update is computed either way; a skipped step's values (NaN included) are
    never selected, so the result is bitwise ``old``."""
    take = ok == 0
    return jax.tree.map(lambda n, o: jnp.where(take, n, o), new, old)


def gated_update(ok, update, state, *args):
    """Traced: ``update(state, *args)`` where ``ok`` is `anomaly.OK` (0), else ``state``,
    bitwise as `gate` gives it, with the outputs the update also reads gated where they are
    made (see the module's doc). ``update`` must return a tree of ``state``'s structure,
    shapes and dtypes; where it does not, this is `gate` (whose tree map then says what
    differs)."""
    from jax.extend import core as jcore

    leaves, tree = jax.tree.flatten((state, args))
    old = jax.tree.leaves(state)

    def flat(*xs):
        s, a = jax.tree.unflatten(tree, xs)
        return update(s, *a)

    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    out_leaves = jax.tree.leaves(out_shape)
    if (jax.tree.structure(out_shape) != jax.tree.structure(state)
            or any((o.shape, o.dtype) != (jnp.shape(x), jnp.result_type(x)) for o, x in zip(out_leaves, old))):
        return gate(ok, update(state, *args), state)
    jaxpr = closed.jaxpr
    take = ok == 0
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    first_out: dict = {}
    for i, v in enumerate(jaxpr.outvars):
        if not isinstance(v, jcore.Literal):
            first_out.setdefault(v, i)
    read_inside = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jcore.Literal)}
    made = set(jaxpr.invars) | set(jaxpr.constvars)
    shared = {v: i for v, i in first_out.items() if v in read_inside and v not in made}
    for v, x in zip(jaxpr.constvars, closed.consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, leaves):
        env[v] = x
    for e in jaxpr.eqns:
        bound = e.primitive.get_bind_params(e.params)  # (a JAX before 0.7: (subfuns, params))
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        with getattr(getattr(e, "ctx", None), "manager", contextlib.nullcontext()):
            ans = e.primitive.bind(*subfuns, *map(read, e.invars), **params)
        ans = ans if e.primitive.multiple_results else [ans]
        for v, x in zip(e.outvars, ans):
            if v in shared:
                x = jnp.where(take, x, old[shared[v]])
            env[v] = x
    outs = []
    for i, v in enumerate(jaxpr.outvars):
        x = read(v)
        outs.append(x if shared.get(v) == i else jnp.where(take, x, old[i]))
    return jax.tree.unflatten(jax.tree.structure(state), outs)
