"""Small file helpers shared by the CLI, benchmarks and tools."""

from __future__ import annotations

import json
import os
import threading


def write_json(path: str | os.PathLike, obj, **dump_kwargs) -> None:
    """Writes ``obj`` as JSON atomically: a temporary file, then ``os.replace``, so a reader
    (or a crash) never sees half a file and an older result is replaced only by a whole one.
    The temporary file is this writer's own (process and thread in its name): writers of one
    file in a directory several hosts share (the verdict every agent writes under
    ``launch --nodes --in-place``) each replace it whole, none renames another's half-written
    temporary file (a shared name made an agent fail: "No such file ... membership.json.tmp")."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, **{"indent": 2, **dump_kwargs})
    os.replace(tmp, path)
