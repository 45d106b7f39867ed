"""Deterministic XLA on GPU: the flag resilax's bitwise promises need there.

XLA GPU's reductions, scatters and some cuDNN/cuBLAS algorithms are not deterministic by
default: two runs of the same step on the same GPU differ in the last bits (issue 26: two
uninterrupted runs of a GPT on an H100 were not bitwise equal; with the flag they were,
and SIGKILL + resume was too). ``--xla_gpu_deterministic_ops=true`` makes them deterministic,
at some cost in speed. CPU and TPU are deterministic without it.

`resilax train` and `resilax launch` start their workers with it (`with_deterministic`);
`resilax.wrap` on a GPU topology without it warns once (`determinism_warning`). Both are
pure functions of strings, so the decision is tested without a GPU. XLA reads XLA_FLAGS
once, when the backend starts: setting it later in a process changes nothing.
"""

from __future__ import annotations

import os
import warnings

FLAG = "--xla_gpu_deterministic_ops"

# what becomes "within tolerance" instead of bitwise without the flag
PROMISES = ("two runs of the same job", "resume after a crash (checkpoint + record log replay)",
            "rebuilding a lost slice from peer copies and replay", "the bit-exact elastic mode (DeterministicConfig)")


def flag_value(xla_flags: str, name: str = FLAG) -> str | None:
    """The value ``xla_flags`` gives ``name`` (the last occurrence wins, as in XLA's parser):
    ``"true"`` for a bare ``--name``, ``None`` when absent."""
    value = None
    for tok in (xla_flags or "").split():
        if tok == name:
            value = "true"
        elif tok.startswith(name + "="):
            value = tok[len(name) + 1:].strip().lower()
    return value


def with_deterministic(xla_flags: str | None) -> str:
    """``xla_flags`` with ``--xla_gpu_deterministic_ops=true`` added, unless it already names
    the flag (a user's explicit ``=false`` is kept: their choice, and `wrap` then warns)."""
    flags = (xla_flags or "").strip()
    if flag_value(flags) is not None:
        return flags
    return f"{flags} {FLAG}=true".strip()


def determinism_warning(platform: str, xla_flags: str | None) -> str | None:
    """The warning `resilax.wrap` gives, or None: only on ``gpu`` without the flag set true."""
    if platform != "gpu" or flag_value(xla_flags or "") in ("true", "1"):
        return None
    return (f"resilax.wrap: the topology's platform is gpu but XLA_FLAGS does not set {FLAG}=true, so XLA GPU's "
            f"reductions are not deterministic and these promises hold within tolerance (rounding, growing over "
            f"steps) instead of bitwise: {'; '.join(PROMISES)}. Set XLA_FLAGS='{FLAG}=true' before JAX starts "
            f"(`resilax train` and `resilax launch` do it for their workers)")


_gpu_warned = False


def warn_once_nondeterministic(platform: str) -> None:
    """Once per process: a GPU run without deterministic XLA is not bitwise (`determinism_warning`)."""
    global _gpu_warned
    msg = determinism_warning(platform, os.environ.get("XLA_FLAGS", ""))
    if msg is not None and not _gpu_warned:
        _gpu_warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
