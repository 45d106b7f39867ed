"""A data iterator's state in a checkpoint's JSON metadata (and the record log's entries)."""

from __future__ import annotations

import base64

from resilax._src.errors import CheckpointError


def encode_data_state(s):
    """Iterator states are JSON dicts (grain datasets) or bytes (grain DataLoader)."""
    if s is None or isinstance(s, (dict, list, int, float, str)):
        return {"kind": "json", "value": s}
    if isinstance(s, (bytes, bytearray)):
        return {"kind": "bytes", "value": base64.b64encode(bytes(s)).decode()}
    raise CheckpointError(
        f"resilax: the data iterator's get_state() must return a JSON-able value or bytes, but got {type(s).__name__}"
    )


def decode_data_state(d):
    if d["kind"] == "bytes":
        return base64.b64decode(d["value"])
    return d["value"]
