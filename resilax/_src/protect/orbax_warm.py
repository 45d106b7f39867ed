"""Compiles ahead what Orbax's first save of a layout would compile on the persister thread.

Orbax saves a shard that several devices hold (replicated) cooperatively by default
(replica-parallel): each replica writes a slice of it, cut on the device by
`lax.slice_in_dim`, which JAX compiles once per shape on first use. On the tiny GPT over 8
CPU devices that is 16 programs, 0.55 s of a first save's 2.0 s on the persister (later saves
0.6 s), during which the loop ran slower and the next save waited for it. `plan` asks
Orbax's own planner which slices its array handler will cut (no device work; it reads the
live arrays' shardings, so it runs where they are alive); `run` cuts each distinct one from
zeros of the shard's shape on its device (one leaf's shard at a time), off the loop. It uses
Orbax's private serialization module: where that has moved or changed, `plan` returns []
and the first save compiles them, as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def plan(tree) -> list:
    """``(index, slice args, shape, dtype, device)`` per distinct slice program Orbax's save of
    ``tree`` would compile (``tree``'s arrays must be alive). [] in a multi-process job: there
    a compile may wait for another process's binary (``JAX_SHARE_BINARY_BETWEEN_HOSTS``), and
    a warm-up still waiting for a process that died held up the survivors' in-place re-form
    past its deadline (a CI run of test_launch's in-place test); the first save compiles them
    on the caller's thread, as before."""
    if jax.process_count() > 1:
        return []
    try:
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.serialization import replica_slices as rs

        h = ocp.type_handlers.get_type_handler(jax.Array)
        args = (h._replica_id, h._use_replica_parallel, h._min_slice_bytes_for_replica_parallel,
                h._max_replicas_for_replica_parallel)
        out, seen = [], set()
        for x in jax.tree.leaves(tree):
            if not isinstance(x, jax.Array) or x.is_deleted():
                continue
            for r in rs.get_replica_slices(x, *args).replica_slices:
                if r.slice_args is None or r.is_on_host:
                    continue
                a, dev = r.unsliced_data, next(iter(r.unsliced_data.devices()))
                s = r.slice_args
                key = (tuple(a.shape), str(a.dtype), s.start_index, s.limit_index, s.axis, dev)
                if key not in seen:
                    seen.add(key)
                    out.append((r.index, s, tuple(a.shape), a.dtype, dev))
        return out
    except Exception:  # Orbax's private API moved: the first save compiles them
        return []


def run(planned) -> None:
    """Cuts each planned slice once (compiling it into JAX's cache), from zeros on its device."""
    if not planned:
        return
    from orbax.checkpoint._src.serialization import replica_slices as rs

    for index, sargs, shape, dtype, dev in planned:
        z = jnp.zeros(shape, dtype, device=dev)
        jax.block_until_ready(rs.ReplicaSlice(index, z, sargs).data())
        del z
