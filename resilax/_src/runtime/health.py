"""Liveness, hangs and stragglers of failure domains (`HealthConfig`), in one process.

`Liveness` runs a watchdog thread, off the critical path:

- **Probe**: every ``HealthConfig.probe_every_s`` it dispatches a tiny computation to every
  live failure domain (``x + 1`` replicated over the domain's devices, compiled once per
  domain) and waits for the answers up to ``hang_detect_s``. A domain that does not answer
  in time is declared **hung**. When no domain answers at all, nothing is declared (a
  stalled host cannot tell which domain is at fault): an event says so.
- **Step deadline**: the driver tells it when each call of the step starts and ends. Once a
  few calls were measured, a call running longer than ``max(step_deadline_min_s,
  step_deadline_factor x median call time)`` starts a probe round at once, so a hang that
  stops the step is found within deadline + ``hang_detect_s``.
- **Stragglers**: the answer times of the last ``straggler_rounds`` rounds, per domain, once
  the step is in its steady state (a few calls measured after the first). A
  domain slow in *every* one of those rounds (its fastest answer more than
  ``straggler_factor`` times the median of the other domains' medians, and at least 1 ms
  more) is reported (event ``straggler``), and failed like a dead one when
  ``remove_stragglers``. A real straggler is slow each time; a healthy domain on a busy host
  is late now and then (the probe thread descheduled), which a median of 5 let through.
  The domains of a round are dispatched one after another and timed from the end of that
  dispatch, so none pays for another's.

The driver (`ResilientStep`) asks `gate` at every step boundary (and before a save): it
returns the domains declared hung, which the driver fails (their memory is then deleted,
as for a lost slice: the hung domain is killed) and recovers from, before anything else is
dispatched. Under `resilax launch` (several processes) this watchdog is not used: the
supervisors' heartbeats and step deadline are the monitor there (``launch``).

**Emulation (named so):** CPU devices have no queue that can stall: XLA runs a CPU
computation on host threads as soon as its inputs are ready, so a real hung accelerator
cannot happen here. The faults ``hang_slice@N/k`` and ``slow_slice@N/k`` therefore act at
resilax's own dispatch: from the fault on, nothing resilax dispatches to a hung domain
starts (the step waits in `gate`, the domain's probes are never run, so they time out for
real); its memory is untouched until the domain is declared hung and failed. A slow domain's
work starts `SLOW_SLICE_S` late (each step waits for it, as an SPMD step waits for its
slowest participant; so do its probes). Detection itself (timeouts, deadlines, medians) is
the real code that runs on real hardware.
"""

from __future__ import annotations

import atexit
import collections
import statistics
import threading
import time
import weakref

import jax
import numpy as np

SLOW_SLICE_S = 0.05  # how late an emulated straggler (fault slow_slice) starts its work
_MIN_CALLS = 3  # calls measured (after the first, which compiles) before a deadline applies
_FLOOR_S = 1e-3  # a straggler is slower than the rest by at least this much


class Liveness:
    """The watchdog of one `ResilientStep` (see the module docstring)."""

    def __init__(self, cfg, domains: list[list], alive: list[int]):
        self.cfg = cfg
        self.domains = domains
        self.alive = list(alive)
        self._cond = threading.Condition()
        self._stalled: dict[int, float] = {}  # emulated hang: domain -> when it stopped answering
        self._slow: dict[int, float] = {}  # emulated straggler: domain -> seconds its work starts late
        self.hung: dict[int, dict] = {}  # declared hung, not yet failed by the driver
        self._stragglers: dict[int, dict] = {}  # reported, not yet taken by the driver
        self._told_slow: set = set()
        self.down: dict[int, float] = {}  # failed domains, watched for coming back: domain -> since
        self._repaired: set = set()  # emulation: the failed domain's hardware is back (fault repair_slice)
        self.back: dict[int, dict] = {}  # answering again, not yet taken by the driver
        self._probes: dict[int, tuple] = {}
        self.latency = {d: collections.deque(maxlen=cfg.straggler_rounds) for d in range(len(domains))}
        self._calls = collections.deque(maxlen=20)
        self._call_t0: float | None = None
        self._call_id = 0
        self._probed_call = -1
        self._last_round = 0.0
        self.rounds = 0
        self._events: list[tuple[str, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_loop, args=(weakref.ref(self), self._stop), daemon=True,
                                        name="resilax-liveness")
        for d in self.alive:  # compiled here, on the caller's thread, not in the watchdog's first round
            self._probe(d)
        self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------ driver side
    def call_begin(self) -> None:
        with self._cond:
            self._call_t0 = time.perf_counter()
            self._call_id += 1

    def call_end(self, record: bool = True) -> None:
        with self._cond:
            if self._call_t0 is not None and record and self._call_id > 1:
                self._calls.append(time.perf_counter() - self._call_t0)
            self._call_t0 = None

    def deadline(self) -> float | None:
        """The current step deadline in seconds (None: too few calls measured yet)."""
        if len(self._calls) < _MIN_CALLS:
            return None
        return max(self.cfg.step_deadline_min_s, self.cfg.step_deadline_factor * statistics.median(self._calls))

    def gate(self, domains) -> list[int]:
        """Called before resilax dispatches to ``domains``: blocks while one of them does not
        answer and is not yet declared hung; returns those declared hung (the caller fails
        them). An emulated straggler makes the caller wait for it here."""
        with self._cond:
            while True:
                hung = [d for d in domains if d in self.hung]
                if hung or not any(d in self._stalled for d in domains):
                    break
                self._cond.wait(0.05)
            slow = max((self._slow.get(d, 0.0) for d in domains), default=0.0)
        if slow and not hung:
            time.sleep(slow)
        return hung

    def failed(self, domain: int) -> dict:
        """The driver failed ``domain``: forget it until it rejoins. Returns what was known."""
        with self._cond:
            info = self.hung.pop(domain, None) or {}
            self._stalled.pop(domain, None)
            self._slow.pop(domain, None)
            self._stragglers.pop(domain, None)
            self._told_slow.discard(domain)
            self.latency[domain].clear()
            return info

    def lost(self, domain: int) -> None:
        """The driver failed ``domain``: its memory is gone (the probe's input too), nothing
        is dispatched to it; the watchdog watches for it to come back."""
        with self._cond:
            p = self._probes.pop(domain, None)
            if p is not None:
                p[1].delete()
            self.down.setdefault(domain, time.perf_counter())
            self.back.pop(domain, None)

    def rejoined(self, domain: int) -> None:
        with self._cond:
            self.down.pop(domain, None)
            self._repaired.discard(domain)
            self.back.pop(domain, None)

    def take_back(self) -> dict[int, dict]:
        """Failed domains whose probe answered again (each once)."""
        with self._cond:
            out, self.back = self.back, {}
            return out

    def set_alive(self, alive) -> None:
        with self._cond:
            self.alive = list(alive)
            for d in alive:
                self._probe(d)

    def take_events(self) -> list[tuple[str, dict]]:
        with self._cond:
            out, self._events = self._events, []
            return out

    def take_stragglers(self) -> dict[int, dict]:
        with self._cond:
            out, self._stragglers = self._stragglers, {}
            return out

    # ------------------------------------------------------------ emulated faults
    def stall(self, domain: int) -> None:
        """Fault ``hang_slice``: the domain stops answering (memory kept)."""
        with self._cond:
            self._stalled.setdefault(domain, time.perf_counter())

    def repair(self, domain: int) -> None:
        """Fault ``repair_slice``: the failed domain's hardware is back (repaired or replaced,
        fresh memory). Nothing rejoins here: the watchdog's next probe of it must answer."""
        with self._cond:
            if domain in self.down:
                self._repaired.add(domain)

    def slow(self, domain: int, seconds: float = SLOW_SLICE_S) -> None:
        """Fault ``slow_slice``: the domain's work starts ``seconds`` late from now on."""
        with self._cond:
            self._slow[domain] = seconds

    # ------------------------------------------------------------ watchdog side
    def _probe(self, d: int):
        """Domain ``d``'s probe ``(executable, input)``, built once."""
        p = self._probes.get(d)
        if p is None:
            devs = self.domains[d]
            sh = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devs), ("d",)), jax.sharding.PartitionSpec())
            x = jax.device_put(np.zeros((), np.float32), sh)
            # compiled, not run: building a probe never waits on the domain (only a probe
            # round does, with its timeout)
            f = jax.jit(lambda v: v + 1, out_shardings=sh).lower(x).compile()
            p = self._probes[d] = (f, x)
        return p

    def tick(self) -> None:
        """One look (the watchdog calls it every ``min(probe_every_s, step_deadline_min_s) / 4``,
        between 5 and 100 ms)."""
        now = time.perf_counter()
        with self._cond:
            t0, cid, alive = self._call_t0, self._call_id, list(self.alive)
        dl = self.deadline()
        if t0 is not None and dl is not None and now - t0 > dl and self._probed_call != cid:
            self._probed_call = cid
            self.probe_round(alive, why={"reason": "step_deadline", "deadline_s": dl, "waited_s": now - t0})
        elif now - self._last_round >= self.cfg.probe_every_s:
            self.probe_round(alive)
            self._probe_down()

    def _probe_down(self) -> None:
        """Probes the failed domains that may answer again; one that answers within
        ``hang_detect_s`` is back (`take_back`). **Emulated:** a failed domain's devices are
        CPU devices that never really died, so only a domain whose repair was emulated
        (fault ``repair_slice``) is probed; the others get nothing dispatched (they are dead).
        The probe, its timeout and what the driver does with an answer are the real code."""
        with self._cond:
            todo = [d for d in self.down if d in self._repaired]
        for d in todo:
            t0 = time.perf_counter()
            f, x = self._probe(d)  # a fresh input on the domain's devices: its old memory is gone
            y = f(x)
            while not y.is_ready() and time.perf_counter() - t0 < self.cfg.hang_detect_s:
                time.sleep(5e-4)
            if y.is_ready():
                now = time.perf_counter()
                with self._cond:
                    if d in self.down:
                        self._repaired.discard(d)  # known to be back: reported once, not probed again
                        self.back[d] = {"found_by": "probe", "answer_s": now - t0,
                                        "down_s": now - self.down[d]}
                        self._cond.notify_all()

    def probe_round(self, alive, why=None) -> dict[int, float | None]:
        """Probes ``alive``; returns each domain's answer time (None: no answer within
        ``hang_detect_s``), declares the silent ones hung, updates the straggler stats."""
        timeout = self.cfg.hang_detect_s
        t0 = time.perf_counter()
        with self._cond:
            stalled, slow = dict(self._stalled), dict(self._slow)
        outs, ready, sent = {}, {}, {}
        while time.perf_counter() - t0 < timeout:  # every domain gets the full timeout
            now = time.perf_counter() - t0
            new = []
            for d in alive:
                # emulated hang: the probe never starts on the domain; emulated straggler: it starts late
                if d not in outs and d not in stalled and now >= slow.get(d, 0.0):
                    with self._cond:  # the driver may fail it meanwhile: then nothing goes to it
                        if d in self.down:
                            continue
                        f, x = self._probe(d)
                        outs[d] = f(x)
                        new.append(d)
            # The domains dispatched together are timed from the end of their dispatch, when
            # this thread can first look at them: timed from its own dispatch, the first one
            # paid for the others' (on a busy host, ms each, the GIL shared with the step
            # loop), the same domain in every round, and was once judged a straggler (a
            # healthy domain removed in the fresh-clone suite). An emulated straggler counts
            # from the round's start: its late start stands for a late device.
            dispatched = time.perf_counter() - t0
            for d in new:
                sent[d] = 0.0 if d in slow else dispatched
            for d, y in outs.items():
                if d not in ready and y.is_ready():
                    ready[d] = time.perf_counter() - t0 - sent[d]
            if all(d in ready or d in self.down for d in alive):
                break
            time.sleep(5e-4)
        self._last_round = time.perf_counter()
        self.rounds += 1
        with self._cond:
            watched = [d for d in alive if d not in self.down]  # one failed by the driver meanwhile is not hung
            silent = [d for d in watched if d not in ready]
            if silent and len(silent) == len(watched):
                self._events.append(("probe_timeout", {"domains": silent, "timeout_s": timeout,
                                                       "reason": "no domain answered: nothing declared"}))
            elif silent:
                for d in silent:
                    since = stalled.get(d, t0)
                    self.hung[d] = {"domain": d, "since": since, "detected_s": self._last_round - since,
                                    "timeout_s": timeout,
                                    **(why or {"reason": "probe"})}
                self._cond.notify_all()
            elif why is not None:
                self._events.append(("step_deadline_missed", {**why, "reason": "every domain answers: a slow step"}))
            if len(self._calls) >= _MIN_CALLS:
                # stragglers are judged in the steady state only: while the first calls
                # compile (and the meshes of the next failure compile in the background) a
                # probe's answer time says how busy the host is, not how slow a domain is
                # (a healthy domain was removed so, under load, in the fresh-clone suite)
                for d, s in ready.items():
                    self.latency[d].append(s)
                self._find_stragglers([d for d in alive if d in ready])
        return {d: ready.get(d) for d in alive}

    def _find_stragglers(self, alive) -> None:
        f = self.cfg.straggler_factor
        if f is None or len(alive) < 2:
            return
        n = self.cfg.straggler_rounds
        if any(len(self.latency[d]) < n for d in alive):
            return
        med = {d: statistics.median(self.latency[d]) for d in alive}
        for d in alive:
            others = statistics.median([med[o] for o in alive if o != d])
            fastest = min(self.latency[d])
            if fastest > f * others and fastest - others > _FLOOR_S:
                if d not in self._told_slow:
                    self._told_slow.add(d)
                    self._stragglers[d] = {"domain": d, "median_s": med[d], "fastest_s": fastest, "others_median_s": others,
                                           "factor": med[d] / others if others else float("inf"), "rounds": n}
            else:
                self._told_slow.discard(d)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._stalled.clear()
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.cfg.hang_detect_s + 1.0)
        try:
            atexit.unregister(self.close)
        except Exception:  # interpreter shutting down
            pass


def _loop(ref, stop: threading.Event) -> None:
    lv = ref()
    # fine enough for the cadence and the shortest deadline, coarse enough not to take the
    # GIL from the step loop often (each wake-up is a hand-over)
    tick = min(0.1, max(0.005, min(lv.cfg.probe_every_s, lv.cfg.step_deadline_min_s) / 4))
    del lv
    while not stop.wait(tick):
        lv = ref()
        if lv is None:
            return
        try:
            lv.tick()
        except Exception as e:  # never take the run down from here: say so at the next boundary
            with lv._cond:
                lv._events.append(("liveness_error", {"error": repr(e)}))
            stop.wait(1.0)
        del lv
