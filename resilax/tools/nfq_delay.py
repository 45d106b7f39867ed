"""A fixed delay on every packet a netfilter rule queues: netem's ``delay`` where the kernel has no netem.

``python -m resilax.tools.nfq_delay --queue N --delay-ms D`` binds netfilter queue ``N`` of
its network namespace (``NFQUEUE``: an iptables target, ``CONFIG_NETFILTER_XT_TARGET_NFQUEUE``)
and gives each queued packet its verdict (accept) ``D`` ms after the kernel queued it, in
order: every packet the rule sends there leaves ``D`` ms late, handshakes, acknowledgements
and retransmissions included. `netns.NetHosts.delay` runs it in a host's namespace with an
``OUTPUT`` rule on the host's link. It prints ``ready`` once bound, and runs until killed.

Only the packets' metadata crosses to this process (``NFQNL_COPY_META``); the queue holds up
to 65536 packets (beyond, the kernel accepts them undelayed: ``NFQA_CFG_F_FAIL_OPEN``), so a
delay of D ms holds at most 65536 packets in flight per D ms. Costs: one netlink message each
way per packet, in Python (tens of thousands of packets per second on one core).

Raw netlink (``NETLINK_NETFILTER``), no library: the structures are those of
``linux/netfilter/nfnetlink_queue.h``.
"""

from __future__ import annotations

import argparse
import collections
import errno
import socket
import struct
import sys
import threading
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
MAXLEN = 65536


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * ((4 - n % 4) % 4)


def _msg(kind: int, queue: int, attrs: bytes, seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body


def _check_ack(sock) -> None:
    data = sock.recv(65536)
    n, kind = struct.unpack_from("=IH", data)
    if kind == NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, 16)
        if err:
            raise OSError(-err, f"nfq_delay: netlink refused the queue's configuration (errno {-err})")


def bind(queue: int) -> socket.socket:
    """A netlink socket bound to netfilter queue ``queue``, copying metadata only."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((0, 0))
    for seq, attrs in enumerate((
            _attr(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)),
            _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),
            _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", MAXLEN)),
            _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))
            + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))), start=1):
        s.send(_msg(NFQNL_MSG_CONFIG, queue, attrs, seq, NLM_F_REQUEST | NLM_F_ACK))
        _check_ack(s)
    return s


def _packet_ids(data: bytes):
    """The packet ids of the NFQNL_MSG_PACKET messages in one netlink read."""
    off = 0
    while off + 16 <= len(data):
        n, kind = struct.unpack_from("=IH", data, off)
        if n < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a = off + 20  # nlmsghdr + nfgenmsg
            while a + 4 <= off + n:
                alen, akind = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if akind & 0x7FFF == NFQA_PACKET_HDR:
                    (pid,) = struct.unpack_from("!I", data, a + 4)
                    yield pid
                    break
                a += (alen + 3) & ~3
        off += (n + 3) & ~3


def run(queue: int, delay_s: float) -> None:
    s = bind(queue)
    held: collections.deque = collections.deque()  # (due, packet id), in arrival order
    cv = threading.Condition()

    def release():
        seq = 1000
        while True:
            with cv:
                while not held:
                    cv.wait()
                due, pid = held[0]
                now = time.monotonic()
                if due > now:
                    cv.wait(due - now)
                    continue
                held.popleft()
            seq += 1
            s.send(_msg(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid)), seq))

    threading.Thread(target=release, daemon=True).start()
    print("ready", flush=True)
    while True:
        try:
            data = s.recv(1 << 20)
        except OSError as e:  # ENOBUFS: notifications were lost (their packets go on when retransmitted)
            if e.errno != errno.ENOBUFS:
                raise
            continue
        t = time.monotonic() + delay_s
        with cv:
            for pid in _packet_ids(data):
                held.append((t, pid))
            cv.notify()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m resilax.tools.nfq_delay", description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, default=0)
    p.add_argument("--delay-ms", type=float, required=True)
    a = p.parse_args(argv)
    try:
        run(a.queue, a.delay_ms / 1000.0)
    except OSError as e:
        print(f"nfq_delay: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
