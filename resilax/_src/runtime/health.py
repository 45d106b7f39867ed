"""Liveness: which devices (and so which failure domains) are dead.

In single-controller CPU emulation a dead device is one whose buffers resilax deleted
(`fail_slice` fault); `Liveness.mark_dead` records it and `Liveness.probe` is the
detector the recovery path asks. On real multi-controller runs the same question is
answered by the runtime (``jax.live_devices``) or a probe with a timeout; that probe is
left out here.
"""

from __future__ import annotations

import time


class Liveness:
    """Dead-device registry and failure-domain probe. Host-side, cheap."""

    def __init__(self):
        self.dead: set = set()
        self.failed_at: dict[int, float] = {}  # domain index -> time.perf_counter() of death

    def mark_dead(self, domain: int, devices) -> None:
        self.dead |= set(devices)
        self.failed_at.setdefault(domain, time.perf_counter())

    def probe(self, domains) -> list[int]:
        """Indices (into ``domains``) of domains with at least one dead device."""
        return [i for i, devs in enumerate(domains) if any(d in self.dead for d in devs)]
