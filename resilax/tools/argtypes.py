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
