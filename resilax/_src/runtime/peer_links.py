"""Cutting this process's TCP connections to the other workers once the job goes on without a dead one.

A collective that a dead process broke fails at once in the processes that were connected
to it ("Connection reset by peer"), but the others wait in gloo until XLA's CPU collective
timeout (``--collective-timeout``): for a peer survivor that already left the collective, or
for another device of their own process whose part of the step was aborted (an all-reduce
or all-to-all between the process's two devices). That was 5 of the 8.5 s of a re-form on 2
cores (`resilax bench multiprocess`). Nothing in JAX or XLA ends the wait sooner: the
communicator is cached for the life of the backend, and dropping the backend waits for the
collective (measured, docs/multiprocess.md). A closed connection does: gloo fails the wait
with "Connection closed by peer" (seen in the re-form runs right after the cut, for the
all-gather across processes and the all-to-all within one).

So when the supervisor's verdict names a dead process (``--in-place``), each survivor shuts
down (``shutdown(SHUT_RDWR)``) its TCP connections from its heartbeat thread, which runs
while the main thread is blocked in the collective. When the job re-forms, every connection
goes but those to the ports in ``keep`` (the coordination service: the survivor detaches
through it): the backend is dropped anyway. When the survivors go on on their backend
(``--shrink backend``) only the connections to other processes go: their next collectives
run over device lists without the dead one's devices (new communicators), while the pairs
within a process serve the same devices again (a wait on one of those still ends at the
timeout, and the communicator it broke then fails the next step: the known fallback to a
restart). Linux only (``/proc``); elsewhere nothing happens and the survivors wait for the
timeout as before.
"""

from __future__ import annotations

import os
import socket

_ESTABLISHED = "01"


def _own_sockets() -> dict[int, int]:
    """``{socket inode: fd}`` of this process's open sockets."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


def _tcp_table() -> dict[int, tuple[str, tuple[str, int], tuple[str, int]]]:
    """``{inode: (state, (local address, port), (remote address, port))}`` from /proc/self/net."""
    out = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            p = line.split()
            if len(p) < 10:
                continue
            (la, lp), (ra, rp) = (x.rsplit(":", 1) for x in (p[1], p[2]))
            out[int(p[9])] = (p[3], (la, int(lp, 16)), (ra, int(rp, 16)))
    return out


def peer_connections(keep=(), within: bool = False) -> list[int]:
    """The fds of this process's established TCP connections to other processes, less those
    to the ports in ``keep``. A connection to one of this process's own sockets (both ends
    here: a gloo pair between two of its devices) is one only with ``within``."""
    mine = _own_sockets()
    table = _tcp_table()
    own = set() if within else {table[i][1][1] for i in mine if i in table}  # this process's ports
    keep = {int(k) for k in keep}
    return sorted(fd for i, fd in mine.items() if i in table and table[i][0] == _ESTABLISHED
                  and table[i][2][1] not in own | keep)


def cut(keep=(), within: bool = False) -> int:
    """Shuts down this process's TCP connections (`peer_connections`); returns how many. The
    fds stay open (their owners close them); a wait on one fails."""
    n = 0
    for fd in peer_connections(keep, within):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()  # (the duplicate only)
    return n
