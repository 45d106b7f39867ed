"""Small file helpers shared by the CLI, benchmarks and tools."""

from __future__ import annotations

import json
import os


def write_json(path: str | os.PathLike, obj, **dump_kwargs) -> None:
    """Writes ``obj`` as JSON atomically: a temporary file, then ``os.replace``, so a reader
    (or a crash) never sees half a file and an older result is replaced only by a whole one."""
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, **{"indent": 2, **dump_kwargs})
    os.replace(tmp, path)
