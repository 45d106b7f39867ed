"""The rendezvous of a job across hosts: agent leases and agreement on each generation, in a shared directory.

One agent per host (``resilax launch --nodes N --node-rank R``) registers here; the agents
agree on each *generation* of the job: its number, its hosts (members), the host that runs
the coordination service (``service_node``), the service's address and each host's process
ids. Nothing but files in a directory every host sees (a Slurm cluster's shared file
system, a Kubernetes PVC): no server of its own that could be a single point of failure.
It relies on what POSIX file systems (NFS included) give: ``os.replace`` of a whole file is
atomic, and ``os.link`` to an existing name fails (create-once); `check_run_dir` refuses a
directory where that does not hold. What a cut-off side wrote is fenced by generation
identity (`runtime.fence`).

Files, under ``<run_dir>/rendezvous/`` (every record JSON with a ``sha256`` of its other
fields; a record that does not parse or whose checksum does not match raises
`CorruptRecordError` naming the file; no pickle):

- ``leases/node<R>.json``: agent R's lease ``{rank, incarnation, pid, host, address, store,
  workers, t, expires}`` (``store``: its host store's server), rewritten every ``lease_s / 3``
  by a thread, a failed write retried every ``lease_s / 40`` (a gap of up to about 2/3 of a
  lease is survived). A lease whose ``expires`` has passed is dead (wall clocks of the hosts
  must agree to well within ``lease_s``: NTP; checked against the file system's clock at
  every lease write and before another's lease is taken for expired: `ClockSkewError` past
  a quarter of the lease). ``incarnation`` is new for every agent process: a replacement
  with a dead agent's rank takes the rank over once the old lease expired (never while it
  is live: `RankTakenError`), and the old agent, should it wake up (SIGSTOP, SIGCONT), finds
  its incarnation claimed (below) or another incarnation in its lease, stops renewing and
  is *fenced* (`LeaseLostError`). A renewal that was under way when the agent stopped (its
  lease read, not yet written) may still land on its successor's lease once; the claim
  decides: the woken agent finds it after its write and stops, and the successor, finding a
  claimed incarnation in its lease, writes its own back at its next renewal.
- ``generations/g<k>.proposal.json``: the proposal for generation k, created once (a
  temporary file, then ``os.link``: of concurrent proposers exactly one wins and the
  others read its record). Only the lowest rank with a live lease proposes, and it names
  itself the service node: a proposer is alive when it proposes, so the service never
  lands on a dead host, and it publishes the coordinator address (``address:port``, a port
  free on its host) in the record. Members are the ranks with live leases, in rank order;
  each node's process ids are consecutive, ``workers`` of them per node (from its lease).
- ``generations/g<k>.ack.node<R>.json``: member R read proposal k (the proposal's sha256
  and R's incarnation in it).
- ``generations/g<k>.outcome.json``: ``committed`` (every member acked) or ``abandoned``
  (a member that had not acked lost its lease or was replaced, or the acks did not all come
  within ``ack_timeout_s``), created once by whichever agent sees it first: every agent
  reads the same outcome, so none can take a generation as committed that another takes
  as abandoned.
- ``requests/g<k>.node<R>.json``: agent R asks for a generation after k (its workers died:
  every host must restart its workers); the proposer reads it through `Rendezvous.changed`.
- ``claims/node<R>.<incarnation>.json``: rank R was taken over from the dead incarnation
  named, by a spare agent (`standby`: created once, so of several spares exactly one stands
  in) or by a replacement's `Rendezvous.register`, before it writes its lease. The fence
  of that incarnation, for good.

A generation is only proposed after the previous one has an outcome, so generation
numbers are dense and each has at most one proposal. The agent layer (`resilax launch
--nodes`) calls `Rendezvous.agree` to get a committed generation, `Rendezvous.changed`
while it runs to learn that it must end (a member lost, replaced or asking, an agent
joined, a newer proposal), then `agree(after=k)` again.

Cost: one small file write per agent per ``lease_s / 3``; reading ``N`` leases per `changed`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import socket
import threading
import time
import uuid

from resilax._src.errors import ResilaxError
from resilax._src.runtime import ports

RENDEZVOUS = "rendezvous"  # <run_dir>/rendezvous
COMMITTED, ABANDONED = "committed", "abandoned"
_LEASE_RE = re.compile(r"node(\d+)\.json")
_PROPOSAL_RE = re.compile(r"g(\d+)\.proposal\.json")


class RendezvousError(ResilaxError):
    """The agents could not agree on a generation (timeout, fewer live agents than needed)."""


class CorruptRecordError(RendezvousError):
    """A rendezvous record does not parse or fails its checksum."""


class RankTakenError(RendezvousError):
    """Another live agent holds this node rank."""


class LeaseLostError(RendezvousError):
    """This agent's lease expired and another agent took its rank over: it must stop."""


class ClockSkewError(LeaseLostError):
    """This host's wall clock is off from the shared file system's by more than the leases
    allow (`Rendezvous.max_skew_s`): its leases would be misjudged, so it takes no rank."""


class RunDirError(RendezvousError):
    """The run directory cannot hold a rendezvous: create-once (``os.link``) does not work there."""


# ------------------------------------------------------------------ records
def _digest(rec: dict) -> str:
    body = {k: v for k, v in rec.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _sealed(rec: dict) -> bytes:
    return json.dumps({**rec, "sha256": _digest(rec)}, sort_keys=True, indent=1).encode()


def _tmp(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _write_tmp(path: pathlib.Path, rec: dict, sync: bool = True) -> pathlib.Path:
    tmp = _tmp(path)
    try:
        with open(tmp, "wb") as f:
            f.write(_sealed(rec))
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except BaseException:  # (a full disk: no temporary file left at each retry)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def write_record(path, rec: dict, sync: bool = True) -> None:
    """Writes ``rec`` with its checksum, atomically (a reader sees the old record or the new).
    ``sync=False``: no fsync (a lease: it must outlive no crash of its host, and its renewal
    must not wait on a busy disk's flush for longer than the lease)."""
    path = pathlib.Path(path)
    os.replace(_write_tmp(path, rec, sync), path)


def create_record(path, rec: dict) -> bool:
    """Creates ``path`` holding ``rec`` unless it exists; True if this call created it.
    Whole or absent to any reader; of concurrent callers exactly one gets True."""
    path = pathlib.Path(path)
    tmp = _write_tmp(path, rec)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def read_record(path) -> dict | None:
    """The record at ``path`` (checksum verified), or None when there is none.

    Raises:
      CorruptRecordError: it does not parse, or it has no or a wrong ``sha256``.
    """
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(raw)
    except ValueError as e:
        raise CorruptRecordError(f"resilax rendezvous: {path} is not valid JSON ({e}); expected a record written by "
                                 f"resilax.rendezvous (a torn write on the shared file system, or another writer)") \
            from None
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str):
        raise CorruptRecordError(f"resilax rendezvous: {path} has no sha256 field; expected a checksummed record, "
                                 f"got {type(rec).__name__} with keys {sorted(rec) if isinstance(rec, dict) else []}")
    if rec["sha256"] != _digest(rec):
        raise CorruptRecordError(f"resilax rendezvous: {path} fails its checksum (recorded {rec['sha256'][:12]}..., "
                                 f"computed {_digest(rec)[:12]}...): the record was changed after it was written")
    return rec


# ------------------------------------------------------------------ a generation
@dataclasses.dataclass(frozen=True)
class Generation:
    """A proposed (or committed) generation. ``process_ids[r]``: node r's global process ids."""

    generation: int
    members: tuple[int, ...]
    incarnations: dict[int, str]
    service_node: int
    coordinator: str
    process_ids: dict[int, tuple[int, ...]]
    num_processes: int
    proposed_t: float
    sha256: str

    @classmethod
    def from_record(cls, rec: dict) -> "Generation":
        return cls(generation=int(rec["generation"]), members=tuple(int(r) for r in rec["members"]),
                   incarnations={int(r): i for r, i in rec["incarnations"].items()},
                   service_node=int(rec["service_node"]), coordinator=rec["coordinator"],
                   process_ids={int(r): tuple(p) for r, p in rec["process_ids"].items()},
                   num_processes=int(rec["num_processes"]), proposed_t=float(rec["t"]), sha256=rec["sha256"])


# ------------------------------------------------------------------ the rendezvous
class Rendezvous:
    """Agent ``rank``'s view of the rendezvous in ``<run_dir>/rendezvous``.

    Args:
      run_dir: the job's directory, shared by every host.
      rank: this node's rank (0 <= rank); ``workers``: how many worker processes it runs.
      lease_s: a lease not renewed for this long is dead (renewed every ``lease_s / 3``).
      address: how other hosts reach this one (the coordinator address when it is the
        service node); loopback by default.
      ack_timeout_s: a proposal not acked by every member within this is abandoned.
      store: the address of this host's store server (`hoststore_net`), in the lease ("": none).
      port_fn: picks the coordination service's port on this host (default: a free one).
      clock: wall clock (tests inject one); the renewal thread is off when ``renew=False``
        is passed to `register`.
      clock_check: compare ``clock`` with the shared file system's at every lease write and
        refuse a clock off by more than `max_skew_s` (`ClockSkewError`); off for a virtual
        clock (tests that move time by hand).
    """

    def __init__(self, run_dir, rank: int, *, workers: int, lease_s: float = 5.0, address: str = "127.0.0.1",
                 ack_timeout_s: float = 60.0, port_fn=None, clock=time.time, poll_s: float = 0.05, store: str = "",
                 clock_check: bool = True):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"resilax rendezvous: rank must be an integer >= 0, got {rank!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"resilax rendezvous: workers must be an integer >= 1, got {workers!r}")
        if not lease_s > 0:
            raise ValueError(f"resilax rendezvous: lease_s must be > 0, got {lease_s!r}")
        self.root = pathlib.Path(run_dir).absolute() / RENDEZVOUS
        self.rank, self.workers, self.lease_s, self.address = rank, workers, float(lease_s), address
        self.store = store
        self.ack_timeout_s, self.poll_s, self.clock = float(ack_timeout_s), poll_s, clock
        self.clock_check = clock_check
        # the service's port, held from the proposal until this agent starts the service there
        self.port_fn = port_fn or (lambda: ports.reserve_port(self.address))
        self.incarnation = uuid.uuid4().hex
        self.lost = False  # fenced: another incarnation holds this rank (or this host's clock is off)
        self.skew = ""  # why this host's clock was found off (`ClockSkewError`)
        self._acked: set[str] = set()  # the proposals (sha256) this agent acknowledged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for d in ("leases", "generations", "requests", "claims"):
            (self.root / d).mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------- leases
    def _lease_path(self, rank: int) -> pathlib.Path:
        return self.root / "leases" / f"node{rank}.json"

    @property
    def max_skew_s(self) -> float:
        """The most this host's clock may be off from the shared file system's: a quarter of the
        lease (every host judges the others' leases by its own clock; past this a host could
        be taken for dead while it renews, or hold a rank past its lease)."""
        return self.lease_s / 4

    def _write_lease(self):
        now = self.clock()
        path = self._lease_path(self.rank)
        write_record(path, {
            "rank": self.rank, "incarnation": self.incarnation, "pid": os.getpid(), "host": socket.gethostname(),
            "address": self.address, "store": self.store, "workers": self.workers, "t": now,
            "expires": now + self.lease_s}, sync=False)
        self._judge_clock(now, self.clock(), path)

    def check_clock(self) -> None:
        """Compares this host's clock with the shared file system's now (touches a file of this
        agent's and reads its modification time back): before this agent takes another's
        lease for expired, so that a clock that jumped does not make it end generations.

        Raises:
          ClockSkewError: off by more than `max_skew_s` (this agent withdraws its lease).
        """
        if not self.clock_check:
            return
        probe = self.root / "leases" / f".clock.node{self.rank}.{self.incarnation[:12]}"
        before = self.clock()
        probe.touch()
        self._judge_clock(before, self.clock(), probe)

    def _judge_clock(self, before: float, after: float, path: pathlib.Path) -> None:
        # a file's modification time is the file system's clock (the file server's on NFS, one
        # clock every host's writes share): this host's clock must agree with it. The write
        # happened between ``before`` and ``after`` (this host's clock): a slow write (a busy
        # disk, a loaded host) is not taken for a clock that is off
        stamped = os.stat(path).st_mtime
        if not self.clock_check or before - self.max_skew_s <= stamped <= after + self.max_skew_s:
            return
        skew, now = (before - stamped, before) if stamped < before else (after - stamped, after)
        self.lost = True
        self.skew = (f"resilax rendezvous: node {self.rank}'s clock is {skew:+.2f} s off the run directory's "
                     f"file system ({path} was stamped {stamped:.2f}, this host's clock said {now:.2f}); leases "
                     f"compare wall clocks across hosts and allow at most {self.max_skew_s:g} s (a quarter of "
                     f"--lease {self.lease_s:g} s): synchronise the clocks (NTP, chrony) or raise --lease. This "
                     f"agent takes no rank")
        lease = self._lease_path(self.rank)
        with contextlib.suppress(OSError, CorruptRecordError):  # withdraw: no other host may count it live
            cur = read_record(lease)
            if cur is not None and cur["incarnation"] == self.incarnation:
                lease.unlink()
        raise ClockSkewError(self.skew)

    def register(self, *, renew: bool = True, wait_s: float = 0.0) -> None:
        """Takes this rank's lease and (``renew``) starts the thread that keeps it. A live lease
        of another agent on this rank (one just killed, whose lease has not expired yet) is
        waited for, up to ``wait_s``.

        Raises:
          RankTakenError: another agent still holds a live lease on this rank after ``wait_s``.
        """
        check_run_dir(self.root)
        deadline = time.monotonic() + wait_s
        while True:
            cur = read_record(self._lease_path(self.rank))
            if cur is None or cur["incarnation"] == self.incarnation or cur["expires"] <= self.clock():
                break
            if time.monotonic() >= deadline:
                raise RankTakenError(
                    f"resilax rendezvous: node rank {self.rank} is held by a live agent (pid {cur['pid']} on "
                    f"{cur['host']}, lease expires in {cur['expires'] - self.clock():.1f} s); expected a free rank or "
                    f"an expired lease (waited {wait_s:g} s for it to expire)")
            time.sleep(self.poll_s)
        if cur is not None and cur["incarnation"] != self.incarnation:  # fence the expired one first
            self.claim(self.rank, cur["incarnation"], by=self.incarnation)  # (a spare's claim may be there already)
        self._write_lease()
        if renew:
            self._thread = threading.Thread(target=self._renew_loop, name=f"resilax-lease-{self.rank}", daemon=True)
            self._thread.start()

    def renew(self) -> None:
        """Extends this agent's lease.

        Raises:
          LeaseLostError: another incarnation took the rank over (this agent is fenced).
        """
        self.check_fence()
        cur = read_record(self._lease_path(self.rank))
        if self._held_by_other(self.rank, cur, self.incarnation):
            self.lost = True
            raise LeaseLostError(f"resilax rendezvous: node {self.rank}'s lease is now held by pid {cur['pid']} on "
                                 f"{cur['host']} (this agent's lease expired and a replacement took the rank)")
        self._write_lease()
        self.check_fence()  # stopped between the read and the write: the write may have hit a successor's lease

    def claim_path(self, rank: int, incarnation: str) -> pathlib.Path:
        return self.root / "claims" / f"node{rank}.{incarnation}.json"

    def claim(self, rank: int, dead: str, **who) -> bool:
        """Claims rank ``rank`` from its dead incarnation ``dead`` (create-once: True for exactly
        one claimant); the fence of that incarnation for good."""
        return create_record(self.claim_path(rank, dead), {"rank": rank, "dead": dead, **who, "pid": os.getpid(),
                                                           "host": socket.gethostname(), "t": self.clock()})

    def _held_by_other(self, rank: int, lease: dict | None, incarnation: str) -> bool:
        """Whether ``lease`` of ``rank`` names another incarnation than ``incarnation``, not a
        claimed one (a fenced agent's last write, undone at its successor's next renewal)."""
        return (lease is not None and lease["incarnation"] != incarnation
                and not self.claim_path(rank, lease["incarnation"]).exists())

    def check_fence(self) -> None:
        """Raises `LeaseLostError` when this agent is fenced: a replacement or a spare claimed
        its incarnation (one file check: no read of the leases)."""
        if not self.lost and self.claim_path(self.rank, self.incarnation).exists():
            self.lost = True
            raise LeaseLostError(f"resilax rendezvous: node {self.rank} lost its lease to another agent: its "
                                 f"incarnation {self.incarnation[:8]} was claimed (this agent's lease expired and a "
                                 f"replacement or a spare took the rank)")
        if self.lost:
            if self.skew:
                raise ClockSkewError(self.skew)
            raise LeaseLostError(f"resilax rendezvous: node {self.rank} lost its lease to another agent")

    def _renew_loop(self):
        wait = self.lease_s / 3
        while not self._stop.wait(wait):
            try:
                self.renew()
                wait = self.lease_s / 3
            except LeaseLostError:
                return
            except (OSError, CorruptRecordError):  # a transient shared-file-system error: the lease ages
                wait = min(self.lease_s / 3, max(self.poll_s, self.lease_s / 40))

    def close(self, *, release: bool = True) -> None:
        """Stops renewing; ``release``: removes the lease now (the others see this agent gone at
        once instead of after ``lease_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_s)
        with contextlib.suppress(OSError):
            (self.root / "leases" / f".clock.node{self.rank}.{self.incarnation[:12]}").unlink(missing_ok=True)
        if release and not self.lost:
            try:
                cur = read_record(self._lease_path(self.rank))
            except CorruptRecordError:
                cur = None
            if cur is not None and cur["incarnation"] == self.incarnation:
                self._lease_path(self.rank).unlink(missing_ok=True)

    def leases(self) -> dict[int, dict]:
        """Every lease record, live or dead, by rank."""
        out = {}
        for p in (self.root / "leases").iterdir():
            m = _LEASE_RE.fullmatch(p.name)
            if m:
                rec = read_record(p)
                if rec is not None:
                    out[int(m.group(1))] = rec
        return out

    def live(self, leases: dict | None = None) -> dict[int, dict]:
        """The leases that have not expired, by rank."""
        now = self.clock()
        return {r: l for r, l in (self.leases() if leases is None else leases).items() if l["expires"] > now}

    # -------------------------------------------------------------- generations
    def _gen_path(self, g: int, what: str) -> pathlib.Path:
        return self.root / "generations" / f"g{g}.{what}.json"

    def latest(self) -> int | None:
        """The newest generation with a proposal, or None."""
        gs = [int(m.group(1)) for p in (self.root / "generations").iterdir()
              if (m := _PROPOSAL_RE.fullmatch(p.name))]
        return max(gs) if gs else None

    def proposal(self, g: int) -> Generation | None:
        rec = read_record(self._gen_path(g, "proposal"))
        return None if rec is None else Generation.from_record(rec)

    def outcome(self, g: int) -> dict | None:
        """``{"outcome": "committed" | "abandoned", "why"}`` of generation ``g``, or None (pending)."""
        return read_record(self._gen_path(g, "outcome"))

    def propose(self, g: int, live: dict[int, dict]) -> Generation:
        """Proposes generation ``g`` with the agents ``live`` (rank -> lease) as members and this
        node as the service node; returns the proposal of ``g`` that won (this one or a
        concurrent proposer's)."""
        members = sorted(live)
        ids, nxt = {}, 0
        for r in members:
            ids[str(r)] = list(range(nxt, nxt + int(live[r]["workers"])))
            nxt += int(live[r]["workers"])
        create_record(self._gen_path(g, "proposal"), {
            "generation": g, "members": members, "incarnations": {str(r): live[r]["incarnation"] for r in members},
            "service_node": self.rank, "coordinator": f"{self.address}:{self.port_fn()}", "process_ids": ids,
            "num_processes": nxt, "proposer_pid": os.getpid(), "t": self.clock()})
        return self.proposal(g)

    def _member(self, gen: Generation) -> bool:
        return gen.incarnations.get(self.rank) == self.incarnation

    def ack(self, gen: Generation) -> None:
        """Acknowledges proposal ``gen`` (no-op unless this agent, this incarnation, is a member)."""
        if self._member(gen) and gen.sha256 not in self._acked:
            self._acked.add(gen.sha256)
            create_record(self._gen_path(gen.generation, f"ack.node{self.rank}"), {
                "generation": gen.generation, "rank": self.rank, "incarnation": self.incarnation,
                "proposal_sha256": gen.sha256, "t": self.clock()})

    def decide(self, gen: Generation) -> str | None:
        """The outcome of ``gen``: records it when this agent can tell (every member acked:
        committed; a member that did not ack lost its lease, was replaced, or the acks are
        overdue: abandoned), then returns the recorded outcome (None: still pending)."""
        out = self.outcome(gen.generation)
        if out is not None:
            return out["outcome"]
        leases = self.leases()
        now = self.clock()
        missing, why = [], None
        for r in gen.members:
            ack = read_record(self._gen_path(gen.generation, f"ack.node{r}"))
            if ack is not None and ack["proposal_sha256"] == gen.sha256 and ack["incarnation"] == gen.incarnations[r]:
                continue
            missing.append(r)
            lease = leases.get(r)
            if lease is not None and lease["expires"] <= now:
                self.check_clock()  # (this host's clock may be the one that is off)
            if lease is None or lease["expires"] <= now:
                why = why or f"node {r} lost its lease before it acknowledged"
            elif lease["incarnation"] != gen.incarnations[r]:
                why = why or f"node {r} was replaced by another agent before it acknowledged"
        if not missing:
            rec = {"generation": gen.generation, "outcome": COMMITTED, "why": "every member acknowledged"}
        elif why is None and now > gen.proposed_t + self.ack_timeout_s:
            rec = {"generation": gen.generation, "outcome": ABANDONED,
                   "why": f"nodes {missing} did not acknowledge within {self.ack_timeout_s:g} s"}
        elif why is not None:
            rec = {"generation": gen.generation, "outcome": ABANDONED, "why": why}
        else:
            return None
        create_record(self._gen_path(gen.generation, "outcome"), {**rec, "decided_by": self.rank, "t": now})
        return self.outcome(gen.generation)["outcome"]

    def request(self, after: int, why: str) -> None:
        """Asks for a generation after ``after`` (e.g. this node's workers died)."""
        write_record(self.root / "requests" / f"g{after}.node{self.rank}.json",
                     {"after": after, "rank": self.rank, "incarnation": self.incarnation, "why": why,
                      "t": self.clock()})

    def _requests(self, after: int) -> list[dict]:
        out = []
        for p in (self.root / "requests").glob(f"g{after}.node*.json"):
            rec = read_record(p)
            if rec is not None:
                out.append(rec)
        return out

    def changed(self, gen: Generation) -> str | None:
        """Why generation ``gen`` must end (a newer proposal; a member's lease expired or another
        agent took its rank; a live agent is not a member; a member asked), or None."""
        g = self.latest()
        if g is not None and g > gen.generation:
            return f"generation {g} was proposed"
        leases = self.leases()
        live = self.live(leases)
        for r in gen.members:
            lease = leases.get(r)
            if self._held_by_other(r, lease, gen.incarnations[r]):
                return f"node {r} was replaced (another agent holds its rank)"
            if r not in live:
                if lease is not None:
                    self.check_clock()  # (this host's clock may be the one that is off)
                return f"node {r}'s lease expired" if lease is not None else f"node {r} left"
        joined = sorted(set(live) - set(gen.members))
        if joined:
            return f"node(s) {joined} joined"
        for req in self._requests(gen.generation):
            return f"node {req['rank']} asked for a new generation: {req['why']}"
        now = self.proposal(gen.generation)
        if now is None or now.sha256 != gen.sha256:
            return (f"generation {gen.generation} in the rendezvous is not the one this agent runs (it was cut off "
                    f"from the run directory while its generation was formed: fenced)")
        return None

    def agree(self, after: int = -1, *, min_nodes: int = 1, timeout_s: float = 300.0) -> Generation:
        """Waits for a committed generation newer than ``after`` that has this agent as a
        member, taking part as it goes: acks proposals that name it, decides outcomes it can
        see, and, as the lowest live rank, proposes the next generation once the newest has
        an outcome (or none exists) and at least ``min_nodes`` agents are live. Asks for a new
        generation (`request`) when the newest committed one is not newer than ``after``.

        Raises:
          RendezvousError: no such generation within ``timeout_s`` (the message says what
            it waited for).
          LeaseLostError: this agent was fenced.
          CorruptRecordError: a record it read is corrupt.
        """
        deadline = time.monotonic() + timeout_s
        asked = False
        while True:
            try:
                got = self._agree_once(after, min_nodes, asked)
            except OSError as e:  # the run directory is unreachable (a host cut off it): wait for it
                got, state = None, f"the rendezvous in {self.root} cannot be read ({e})"
            else:
                got, asked, state = got
            if isinstance(got, Generation):
                return got
            if time.monotonic() > deadline:
                raise RendezvousError(f"resilax rendezvous: node {self.rank} got no committed generation after "
                                      f"{after} within {timeout_s:g} s: {state}")
            time.sleep(self.poll_s)

    def _agree_once(self, after: int, min_nodes: int, asked: bool):
        """One look of `agree`: ``(the generation to run or None, asked, what it waits for)``."""
        while True:
            self.check_fence()  # a hung agent that wakes here proposes, acks and asks for nothing
            g = self.latest()
            state = "no generation proposed yet"
            need_new = g is None
            if g is not None:
                gen = self.proposal(g)
                self.ack(gen)
                out = self.decide(gen)
                state = f"generation {g} {out or 'pending'} (members {list(gen.members)})"
                if out == COMMITTED and g > after and self._member(gen):
                    return gen, asked, state
                need_new = out is not None
                if out == COMMITTED and self._member(gen) and not asked:
                    self.request(g, f"node {self.rank} needs a generation after {after}")
                    asked = True
            if need_new:
                live = self.live()
                if len(live) >= min_nodes and min(live) == self.rank:
                    self.check_clock()  # a proposer with a clock that is off would judge every lease wrong
                    self.propose(0 if g is None else g + 1, live)
                    continue
                state += f"; live nodes {sorted(live)} (need {min_nodes}, the lowest proposes)"
            return None, asked, state


def standby(run_dir, nodes: int, *, ended, idle_timeout_s: float = 300.0, poll_s: float = 0.2,
            clock=time.time) -> tuple[int, str] | None:
    """A spare agent's wait (``resilax launch --spare``): ``(rank, the dead incarnation)`` of
    a host of the running job whose agent's lease expired (the host died or hangs), claimed
    by this call; None once ``ended()`` (the job completed or was preempted). The caller
    then runs as that rank's agent (`Rendezvous.register` takes the expired lease over; a
    hung agent that wakes up is fenced), and the job grows back to full size without the
    lost host's own replacement.

    Only while the job runs: the newest committed generation has a member whose live lease
    is the incarnation it committed with. A relaunch's agents have new incarnations, so a
    spare never takes a rank whose agent of the relaunch has not registered yet (every rank
    registers before a launch's first generation). A claim is a create-once record per rank
    and dead incarnation: of several spares exactly one stands in for a lost host.

    Raises:
      RendezvousError: no job ran in ``run_dir`` for ``idle_timeout_s`` (not started, or
        its agents gave up) and it did not end.
    """
    rdv = Rendezvous(run_dir, 0, workers=1, clock=clock)  # (reads only: registers nothing)
    idle_since = time.monotonic()
    while True:
        if ended():
            return None
        if time.monotonic() - idle_since > idle_timeout_s:
            raise RendezvousError(f"resilax rendezvous: a spare saw no job running in {rdv.root.parent} for "
                                  f"{idle_timeout_s:g} s (none started, or its agents gave up)")
        try:
            leases, running = rdv.leases(), None
            g = rdv.latest()
            while g is not None and g >= 0 and running is None:
                out = rdv.outcome(g)
                running = rdv.proposal(g) if out is not None and out["outcome"] == COMMITTED else None
                g -= 1
            now = clock()
            if running is not None and any(
                    (lease := leases.get(m)) is not None and lease["expires"] > now
                    and lease["incarnation"] == running.incarnations[m] for m in running.members):
                idle_since = time.monotonic()
                for r in range(nodes):
                    lease = leases.get(r)
                    if lease is not None and lease["expires"] <= now and rdv.claim(r, lease["incarnation"]):
                        return r, lease["incarnation"]
        except (OSError, CorruptRecordError):
            pass  # a transient shared-file-system error or a torn record: look again
        time.sleep(poll_s)


# file systems whose rename or link is not atomic (object stores behind FUSE): no create-once
_NO_FENCE_FS = ("fuse.gcsfuse", "fuse.s3fs", "fuse.goofys", "fuse.mountpoint-s3", "fuse.blobfuse", "fuse.rclone")


def _fs_type(path: pathlib.Path) -> str:
    best, kind = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for parts in (ln.split() for ln in f):
            if len(parts) > 2 and f"{path}/".startswith(parts[1].rstrip("/") + "/") and len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


def check_run_dir(root) -> None:
    """That ``root`` can hold the rendezvous: create-once by ``os.link`` works there (what
    proposals, outcomes and claims rely on to have one winner) and it is not an object store
    behind FUSE (rename is copy + delete there, not atomic).

    Raises:
      RunDirError: naming the directory, its file system and what failed.
    """
    root = pathlib.Path(root)
    kind = _fs_type(root.absolute())
    if kind in _NO_FENCE_FS:
        raise RunDirError(f"resilax rendezvous: the run directory {root.parent} is on {kind}, whose rename and link "
                          f"are not atomic: agents could not fence a cut-off host there; put the run directory on a "
                          f"POSIX shared file system (NFS, Lustre, GPFS, CephFS; a ReadWriteMany volume of one)")
    probe = root / f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        try:
            os.link(probe, probe.with_suffix(".link"))
            os.link(probe, probe.with_suffix(".link"))
        except FileExistsError:
            pass  # create-once holds: the second link failed
        else:
            raise RunDirError(f"resilax rendezvous: in {root} a hard link to an existing name succeeded: create-once "
                              f"does not hold on this file system ({kind or 'unknown'})")
    except RunDirError:
        raise
    except OSError as e:
        raise RunDirError(f"resilax rendezvous: the run directory {root.parent} ({kind or 'unknown'} file system) "
                          f"cannot hold the rendezvous: create-once by hard link failed ({e}); it needs a POSIX "
                          f"shared file system with hard links (NFS, Lustre, GPFS, CephFS)") from None
    finally:
        probe.unlink(missing_ok=True)
        probe.with_suffix(".link").unlink(missing_ok=True)
