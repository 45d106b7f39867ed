"""Probe: does an all-reduce over one process's 4 local CPU devices give the same bits in a
one-process job (XLA's in-process collectives) and in a multi-process jax.distributed job
(gloo CPU collectives)?

    python benchmarks/collective_order_probe.py            # runs all three and compares

(Output of a run: benchmarks/results/collective_order_probe.txt. The cause of the bit-exact
mode's launched-vs-unlaunched difference with failure domains of more than 2 devices:
docs/multiprocess.md, "Which reduction order".)

Runs, with no resilax: (1) one process with 8 CPU devices, a psum (shard_map) and a
sharded jnp.sum over devices 0-3; (2) the same process attached to a one-process
jax.distributed job with gloo (what `resilax launch -n 1` is), over devices 4-7; (3) two
processes x 4 CPU devices under jax.distributed on localhost with gloo, each doing the
same over its own 4 devices.
Prints a digest of the bits and which fixed summation order of the 4 shards each matches.
"""
import hashlib
import json
import os
import socket
import subprocess
import sys

N = 4096


def orders(x):
    import numpy as np
    a = [x[i] for i in range(4)]
    cand = {
        "((0+1)+2)+3": ((a[0] + a[1]) + a[2]) + a[3],
        "(0+1)+(2+3)": (a[0] + a[1]) + (a[2] + a[3]),
        "((3+2)+1)+0": ((a[3] + a[2]) + a[1]) + a[0],
    }
    return {k: v.astype(np.float32) for k, v in cand.items()}


def work(devices):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.shard_map import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("d",))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, N)).astype(np.float32)  # shard i = row i, on device i
    sh = NamedSharding(mesh, P("d", None))
    xa = jax.make_array_from_single_device_arrays(
        x.shape, sh, [jax.device_put(x[i:i + 1], d) for i, d in enumerate(devices)])
    f_sum = jax.jit(lambda t: jnp.sum(t, axis=0), out_shardings=NamedSharding(mesh, P()))
    f_psum = jax.jit(shard_map(lambda t: jax.lax.psum(t, "d"), mesh=mesh, in_specs=P("d", None),
                               out_specs=P(None, None), check_rep=False))
    out = {}
    hlo = f_sum.lower(xa).compile().as_text()
    out["sum_has_all_reduce"] = "all-reduce" in hlo
    for name, f in (("jnp.sum", f_sum), ("psum", f_psum)):
        r = np.asarray(f(xa).addressable_shards[0].data).reshape(N)
        match = [k for k, v in orders(x.astype(np.float32)).items() if np.array_equal(v, r)]
        # per element: which order does it follow (a ring reduction orders each chunk differently)
        cands = orders(x)
        per = {k: int(np.sum(v == r)) for k, v in cands.items()}
        # the fixed left-to-right order of the 4 shards each run of elements follows
        import itertools
        perms = list(itertools.permutations(range(4)))
        sums = {pm: ((x[pm[0]] + x[pm[1]]) + x[pm[2]]) + x[pm[3]] for pm in perms}
        runs, i = [], 0
        while i < N:  # greedy: the longest run from i that one order explains
            best, bl = None, 0
            for pm, v in sums.items():
                j = i
                while j < N and v[j] == r[j]:
                    j += 1
                if j - i > bl:
                    best, bl = pm, j - i
            if bl == 0:
                runs.append((i, i + 1, "none"))
                i += 1
            else:
                runs.append((i, i + bl, "".join(map(str, best))))
                i += bl
        out_runs = [f"[{a}:{b}) {o}" for a, b, o in runs if b - a >= 64 or o == "none"][:12]
        out[name + ".runs"] = out_runs
        out[name] = {"digest": hashlib.sha256(r.tobytes()).hexdigest()[:16], "first": r[:3].tolist(),
                     "matches_order": match, "elements_matching_each_order": per}
    return out


def work2(devices):
    """A psum over 2 devices: a + b == b + a, so any order gives the same bits."""
    import jax
    import numpy as np
    from jax.experimental.shard_map import shard_map
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("d",))
    x = np.random.default_rng(1).standard_normal((2, N)).astype(np.float32)
    f = jax.jit(shard_map(lambda t: jax.lax.psum(t, "d"), mesh=mesh, in_specs=P("d", None),
                          out_specs=P(None, None), check_rep=False))
    r = np.asarray(f(x).addressable_shards[0].data).reshape(N)
    return hashlib.sha256(r.tobytes()).hexdigest()[:16]


def child(mode, pid, port):
    import jax
    if mode == "single":
        jax.config.update("jax_num_cpu_devices", 8)
        devs = jax.devices()[:4]
    elif mode == "single-gloo":  # what `resilax launch -n 1` is: one process, a client, gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", 8)
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=1, process_id=0)
        devs = jax.local_devices()[4:]  # the second domain's devices: the same bits as the first's
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", 4)
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
        devs = jax.local_devices()
    res = work(devs)
    res["two"] = work2(devs[:2])
    res["process"] = jax.process_index()
    res["devices"] = [d.id for d in devs]
    print("RESULT " + json.dumps(res), flush=True)
    if mode != "single":
        jax.distributed.shutdown()


def main():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    me = os.path.abspath(__file__)
    r = subprocess.run([sys.executable, me, "child", "single", "0", "0"], env=env, capture_output=True, text=True,
                       check=False, timeout=120)
    single = [json.loads(l[7:]) for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert single, r.stderr[-3000:]
    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    r = subprocess.run([sys.executable, me, "child", "single-gloo", "0", str(free_port())], env=env,
                       capture_output=True, text=True, check=False, timeout=120)
    single_gloo = [json.loads(l[7:]) for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert single_gloo, r.stderr[-3000:]
    port = free_port()
    ps = [subprocess.Popen([sys.executable, me, "child", "multi", str(i), str(port)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    multi = []
    for p in ps:
        o, e = p.communicate(timeout=180)
        got = [json.loads(l[7:]) for l in o.splitlines() if l.startswith("RESULT ")]
        assert got, e[-3000:]
        multi += got
    for label, res in [("1 process x 8 devices, devices 0-3 (in-process collectives)", single[0]),
                       ("1 process x 8 devices under jax.distributed (1 process, gloo), devices 4-7",
                        single_gloo[0])] + [
            (f"2 processes x 4 devices (gloo), process {m['process']} devices {m['devices']}", m) for m in multi]:
        print(label)
        print(f"  all-reduce in jnp.sum's HLO: {res['sum_has_all_reduce']}")
        for k in ("jnp.sum", "psum"):
            print(f"  {k:8s} digest {res[k]['digest']} first {res[k]['first']} fixed order matched: "
                  f"{res[k]['matches_order'] or 'none'}; elements (of {N}) equal to each order: "
                  f"{res[k]['elements_matching_each_order']}")
            print(f"    runs of >= 64 elements summed in one left-to-right shard order: {res[k + '.runs']}")
    print("psum over 2 devices, digests:", [single[0]["two"], single_gloo[0]["two"]] + [m["two"] for m in multi])
    eq = lambda a, b: all(a[k]["digest"] == b[k]["digest"] for k in ("jnp.sum", "psum"))
    print("2 processes (gloo) == 1 process, in-process collectives:", all(eq(m, single[0]) for m in multi))
    print("2 processes (gloo) == 1 process under jax.distributed (gloo):", all(eq(m, single_gloo[0]) for m in multi))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
