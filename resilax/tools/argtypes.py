"""argparse types for the command line's counts and sizes: a value out of range is a usage
error naming its bound, before any work starts (not a ZeroDivisionError or a traceback later)."""

from __future__ import annotations

import argparse


def int_at_least(lo: int):
    """An integer >= ``lo``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


def positive_float(text: str) -> float:
    """A finite float > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def output_path(text: str) -> str:
    """A file to write at the end (a benchmark's JSON, a plot): its directory must exist and be
    writable now, so a long run does not end in a traceback instead of its results."""
    import os

    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {parent!r} is not writable")
    return text
