"""What the update's skip gate costs in device memory and copies, on the devices present.

The update part applies the optimizer where the step's verdict is OK and keeps the old state
where it is not, with selects (no conditional). A select of every output made XLA:CPU copy
both Adam moments before a donated update (docs/performance.md); resilax now gates where each
value is made (`resilax/_src/step/gating.py`). For each model this compiles the optimizer
update three ways, state donated, and reads XLA's memory analysis and the optimised HLO:

- ``plain``: ``state.apply_gradients(grads)`` under ``jax.jit`` (what plain jit runs);
- ``select``: the same with every output selected (`gating.gate`, the old form);
- ``gated``: `gating.gated_update` (what resilax runs).

Columns: temporary memory (MB per device) and copy instructions. One device; runs in seconds
on CPU or a GPU (the next GPU session: does XLA:GPU copy the moments under the old form?).
Prints a table and writes JSON.

    python benchmarks/gate_memory.py --json benchmarks/results/gate_memory_cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _models():
    from resilax.tools import gpt
    from resilax.tools.models import CASES, many_leaves

    return {
        "many_leaves (1,802 leaves, Adam)": lambda: many_leaves(300)[0],
        "GPT d512 x4, 16k vocab (AdamW, bf16)": lambda: gpt.make_state(
            gpt.GPTSize(d=512, layers=4, heads=8, seq=32, batch=8, vocab=16_000)),
        "batchnorm_mlp": CASES["batchnorm_mlp"].make_state,
        "transformer_lm": CASES["transformer_lm"].make_state,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from resilax._src.io import write_json
    from resilax._src.step.gating import gate, gated_update
    from resilax._src.step.program import temp_bytes

    def update(s, g):
        return s.apply_gradients(grads=g)

    forms = {
        "plain": lambda s, g, ok: update(s, g),
        "select": lambda s, g, ok: gate(ok, update(s, g), s),
        "gated": lambda s, g, ok: gated_update(ok, update, s, g),
    }
    dev = jax.devices()[0]
    rows = []
    for name, make in _models().items():
        st = jax.device_put(make(), dev)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
        row = {"model": name, "leaves": len(jax.tree.leaves(st)),
               "state_mb": sum(x.nbytes for x in jax.tree.leaves(st)) / 1e6}
        for form, fn in forms.items():
            c = jax.jit(fn, donate_argnums=0).lower(abstract, abstract.params, jax.ShapeDtypeStruct((), jnp.int32)).compile()
            temp = temp_bytes(c)
            row[form] = {"temp_mb": None if temp is None else temp / 1e6, "copies": c.as_text().count(" copy(")}
        rows.append(row)
        print(f"  {name}: done", file=sys.stderr, flush=True)
    out = {"bench": "gate_memory", "platform": dev.platform, "device_kind": dev.device_kind, "rows": rows}
    f = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    print(f"\n{dev.platform} ({dev.device_kind}); temporary MB per device / copy instructions of the update, state donated")
    print(f"{'model':<40}{'leaves':>7}{'state MB':>10}{'plain':>14}{'select (old)':>16}{'gated (now)':>15}")
    for r in rows:
        cell = lambda k: f"{f(r[k]['temp_mb'])} / {r[k]['copies']}"  # noqa: E731
        print(f"{r['model']:<40}{r['leaves']:>7}{r['state_mb']:>10.1f}{cell('plain'):>14}{cell('select'):>16}"
              f"{cell('gated'):>15}")
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
