"""Run by tests/test_wrap.py in a process with XLA:CPU's default code generation (the suite's
own processes use the older loop emitters, a test-speed setting in conftest): the wrapped step
against `jax.jit` of the user's step on the same mesh, replicated and FSDP state, 5 steps.
Prints one JSON line per layout. Bitwise equality to a differently split program is a
property of the compiler's code generation, so it is checked under the one users get.

Usage: python tests/wrap_probe.py
"""

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resilax  # noqa: E402
from resilax._src.step.sharding import resolve as resolve_shardings  # noqa: E402
from resilax.tools import example as ex  # noqa: E402
from helpers import SMALL, state_equal  # noqa: E402


def main():
    topo = resilax.Topology.emulated(2, 4)
    for specs in ("replicated", "fsdp"):
        template = ex.make_state(SMALL)
        spec_tree = P() if specs == "replicated" else ex.fsdp_specs(template, "fsdp", 4)
        data = ex.make_iterator(SMALL)
        batches = [next(data) for _ in range(5)]
        step = resilax.wrap(ex.train_step, topology=topo, state_sharding=spec_tree)
        w = step.init(template)
        sh = resolve_shardings(spec_tree, template, step.mesh, "s")
        bsh = resolve_shardings(P("data"), batches[0], step.mesh, "b")
        rep = NamedSharding(step.mesh, P())
        plain = jax.jit(ex.train_step, in_shardings=(sh, bsh), out_shardings=(sh, {"loss": rep, "accuracy": rep}))
        p = jax.device_put(template, sh)
        losses_equal = True
        for b in batches:
            w, wm = step(w, b)
            p, pm = plain(p, jax.device_put(b, bsh))
            losses_equal &= float(wm["loss"]) == float(pm["loss"])
        print(json.dumps({"specs": specs, "steps": step.step, "losses_equal": losses_equal,
                          "state_equal": state_equal(w, p),
                          # init copied the template: donation did not eat it
                          "template_usable": bool(np.isfinite(np.asarray(template.params["Dense_0"]["kernel"])).all())}),
              flush=True)
        step.close()


if __name__ == "__main__":
    main()
