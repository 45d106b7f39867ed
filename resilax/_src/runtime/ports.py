"""Ports for coordination services: picked free, and held until the service listens.

JAX's coordination service is a gRPC server, and gRPC binds with ``SO_REUSEPORT``: a second
service started on a port where another one listens starts without an error, and the
kernel then spreads new connections over both (measured on jaxlib 0.10.2). Workers of one
job could attach to another job's service. A port picked free (bind to port 0, then
closed) is free only at that instant: until the service binds it, anything on the host may
take it (an outgoing connection, another program's bind, another service).

So resilax starts a service only on a port it holds or has checked:

- `reserve_port` picks a free port and *holds* it with a socket of its own, bound with
  ``SO_REUSEPORT`` but not listening: nothing else takes the port meanwhile (no bind to
  port 0 picks it, no outgoing connection uses it, a plain bind is refused), and the
  service it is meant for can still bind beside the hold;
- `jaxdist.start_service` starts the service inside `binding`, which takes the hold and
  closes it once the service listens.
  On a port not held here it first checks that nothing is bound there (`check_free`) and
  raises `PortInUseError` naming the port, instead of sharing it.

A hold this process never used (a proposed generation that another agent's proposal beat)
is closed at the next `reserve_port` once older than `HOLD_S`.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time

from resilax._src.errors import ResilaxError

HOLD_S = 600.0  # a hold unused for this long is closed at the next reserve_port
_REUSEPORT = getattr(socket, "SO_REUSEPORT", None)  # (None: no hold is possible; check_free still is)
_held: dict[tuple[str, int], tuple[socket.socket, float]] = {}
_lock = threading.Lock()


class PortInUseError(ResilaxError, OSError):
    """A coordination service's port is already bound by another socket on this host."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (not held: prefer `reserve_port` for a service)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1", tries: int = 20) -> int:
    """A port free on ``host``, held by this process until `take` (`jaxdist.start_service`
    takes it when it starts the service there)."""
    now = time.time()
    with _lock:
        for key, (s, t) in list(_held.items()):
            if now - t > HOLD_S:
                s.close()
                del _held[key]
    if _REUSEPORT is None:
        return free_port(host)
    for _ in range(tries):
        port = free_port(host)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, _REUSEPORT, 1)
        try:
            s.bind((host, port))
        except OSError as e:  # taken in the instant since it was free: pick another
            s.close()
            if e.errno == errno.EADDRINUSE:
                continue
            raise
        with _lock:
            _held[(host, port)] = (s, now)
        return port
    raise PortInUseError(f"resilax: no free port on {host} could be held in {tries} tries")


def take(host: str, port: int) -> socket.socket | None:
    """The hold of ``host:port`` made by `reserve_port` in this process (the caller closes it
    once its service listens), or None."""
    with _lock:
        held = _held.pop((host, int(port)), None)
    return None if held is None else held[0]


@contextlib.contextmanager
def binding(host: str, port: int):
    """Around a service's start on ``host:port``: the port's hold (`reserve_port`), if this
    process has one, is closed once the block ends (the service listens by then); a port not
    held here is checked first (`check_free`: `PortInUseError`)."""
    held = take(host, port)
    try:
        if held is None:  # (gRPC would bind beside another socket's SO_REUSEPORT without a word)
            check_free(host, port)
        yield
    finally:
        if held is not None:
            held.close()


def check_free(host: str, port: int) -> None:
    """Raises `PortInUseError` when a socket on this host is bound to ``host:port`` (a plain
    bind there is refused: whatever the other socket is, a gRPC server included)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # (SO_REUSEADDR: connections of an earlier user in TIME_WAIT do not count; a socket
        # bound or listening there does)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise PortInUseError(
                f"resilax: port {port} on {host} is already in use; a coordination service is not started "
                f"beside another program's socket (its workers could attach to the other one). Pick another "
                f"port, or let resilax pick one") from None
