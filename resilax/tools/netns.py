"""Hosts that are really apart, on one Linux machine: network namespaces on a bridge.

`NetHosts(n)` makes ``n`` "hosts" for a test or `resilax bench multihost --netns`: each a
network namespace with its own address in a private subnet (``10.213.<k>.<i + 1>/24``),
joined by a veth pair to a bridge of its own in the root namespace, with nothing else on
that bridge (no route out, no address in the root namespace). A process started with
`NetHosts.wrap` runs in its host's network namespace and in a mount and UTS namespace of its
own: its own ``/dev/shm`` and ``/tmp`` (empty tmpfs), its own host name (``<prefix>h<i>``)
which its own ``/etc/hosts`` resolves to its address (so gloo, which advertises the address
the host name resolves to, is reached over the veths, not on loopback). Everything else of
the file system is shared: the run directory, the code, the compilation cache.

Faults, from outside the host (its processes keep running):

- `partition` / `heal`: the host's bridge port down / up (its link has no carrier; TCP
  sends time out, connects fail);
- `lossy` / `clear`: packet loss (and delay) on the host's link: ``tc netem`` where the
  kernel has it; where it has not (``CONFIG_NET_SCH_NETEM`` unset, as on the test machine)
  loss is an nftables rule in the host's namespace (``numgen random``, both directions) and
  the delay is a token-bucket rate limit (``tc tbf``; queueing delay under load, not a fixed
  one): `lossy` returns what it applied;
- `delay` / `clear`: a fixed delay on every packet the host sends: ``tc netem`` where the
  kernel has it; else an iptables ``NFQUEUE`` rule and `nfq_delay` in each other host's
  namespace, which holds each packet from it that long where it arrives (needs ``iptables``);
- `cut_run_dir` / `restore_run_dir`: the host's view of a directory (the run directory)
  replaced by an empty tmpfs in its mount namespace, and given back: a host cut off its
  shared storage whose writes land nowhere the others see;
- `read_only_run_dir` / `writable_run_dir`: the host's view of a directory turned read-only
  (a bind mount of it onto itself, read-only when attached, in its mount namespace: new
  writes there fail with EROFS, open files keep working), and writable again.

Requires root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux); `unavailable`
says why not. `close` removes the namespaces, veths and bridge (a namespace's processes
are SIGKILLed first); `sweep` removes what a killed run left (names with the prefix).
Costs: ~0.1 s per host to set up, nothing per packet but the kernel's bridging.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile

PREFIX = "rxn"  # every name this module makes starts with it (`sweep`)


def _run(*argv, check=True, input=None) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=30)
    if check and r.returncode != 0:
        raise NetnsError(f"resilax netns: {' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class NetnsError(RuntimeError):
    """A namespace, link or rule could not be made or changed (the message names the command)."""


def unavailable() -> str | None:
    """Why hosts in namespaces cannot be made here (None: they can). Tries one namespace."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process runs as uid %d)" % os.geteuid()
    for tool in ("ip", "unshare", "nsenter", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2 / util-linux)"
    name = f"{PREFIX}probe{os.getpid() % 100000}"
    r = _run("ip", "netns", "add", name, check=False)
    if r.returncode != 0:
        return f"'ip netns add' failed: {r.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


def netem_available() -> bool:
    """Whether the kernel has ``tc netem`` (fixed delay and loss on a link)."""
    probe = f"{PREFIX}nq{os.getpid() % 100000}"
    if _run("ip", "link", "add", probe, "type", "dummy", check=False).returncode != 0:
        return False
    try:
        return _run("tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _run("ip", "link", "del", probe, check=False)


def sweep(prefix: str = PREFIX) -> list[str]:
    """Removes namespaces and links whose name starts with ``prefix`` (left by a killed run)."""
    gone = []
    for ns in _run("ip", "netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(prefix):
            _kill_ns(name)
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    for ln in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = ln.split(":")[1].strip().split("@")[0] if ":" in ln else ""
        if name.startswith(prefix):
            _run("ip", "link", "del", name, check=False)
            gone.append(name)
    return gone


def _kill_ns(ns: str) -> None:
    r = _run("ip", "netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


class NetHosts:
    """``n`` hosts as network namespaces on a bridge (module docstring). A context manager:
    `close` on exit, also when the body raised.

    Args:
      n: how many hosts.
      tag: a short distinct name for this set (default: from the pid); names are
        ``<PREFIX><tag>h<i>`` (namespace), ``...v<i>`` (the host's end of its veth),
        ``...p<i>`` (the bridge's end), ``...br`` (the bridge), each at most 15 characters.
      subnet: the first three octets of the hosts' /24 (default ``10.213.<pid % 250>``).
    """

    def __init__(self, n: int, *, tag: str | None = None, subnet: str | None = None):
        if n < 1:
            raise ValueError(f"resilax netns: n must be >= 1, got {n}")
        why = unavailable()
        if why:
            raise NetnsError(f"resilax netns: cannot make hosts in namespaces here: {why}")
        self.n = n
        self.tag = tag or f"{os.getpid() % 10000:04d}"
        self.base = f"{PREFIX}{self.tag}"
        if len(self.base) + 3 > 15:
            raise ValueError(f"resilax netns: tag {tag!r} is too long (interface names are at most 15 characters)")
        self.subnet = subnet or f"10.213.{os.getpid() % 250 + 1}"
        self.bridge = f"{self.base}br"
        self.etc = pathlib.Path(tempfile.mkdtemp(prefix=f"{self.base}-etc-", dir="/run"))
        self._made: list[tuple[str, str]] = []
        self._lossy: dict[int, str] = {}
        self._ro: dict[tuple[int, str], int] = {}  # `read_only_run_dir`'s binds: (host, path) -> pid
        self._delays: dict[int, list[subprocess.Popen]] = {}  # `delay`'s nfq_delay processes, per delayed host
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def ns(self, i: int) -> str:
        return f"{self.base}h{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def hostname(self, i: int) -> str:
        return self.ns(i)

    def _port(self, i: int) -> str:
        return f"{self.base}p{i}"

    def _dev(self, i: int) -> str:
        return f"{self.base}v{i}"

    def _setup(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "link", "set", self.bridge, "up")
        hosts_lines = ["127.0.0.1 localhost"] + [f"{self.address(i)} {self.hostname(i)}" for i in range(self.n)]
        for i in range(self.n):
            ns, dev, port = self.ns(i), self._dev(i), self._port(i)
            _run("ip", "netns", "add", ns)
            self._made.append(("netns", ns))
            _run("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            self._made.append(("link", port))
            _run("ip", "link", "set", port, "master", self.bridge)
            _run("ip", "link", "set", port, "up")
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            (self.etc / f"hosts{i}").write_text("\n".join(hosts_lines) + "\n")

    # ------------------------------------------------------------------ processes
    def wrap(self, i: int, argv: list[str], shared=()) -> list[str]:
        """``argv`` run as a process of host ``i``: its network namespace, a mount and UTS
        namespace of its own with empty ``/dev/shm`` and ``/tmp`` and its host name resolving
        to its address. The command's children stay in them (they inherit namespaces).
        ``shared``: directories under ``/tmp`` or ``/dev/shm`` that stay the shared ones (the
        run directory), bound back over the private tmpfs."""
        keep = _kept(shared)
        stash = "".join(f"mkdir -p /run/{self.base}-{i}-{k} && mount --rbind {d} /run/{self.base}-{i}-{k} && "
                        for k, d in enumerate(keep))
        back = "".join(f"mkdir -p {d} && mount --rbind /run/{self.base}-{i}-{k} {d} && " for k, d in enumerate(keep))
        script = (f"mount --make-rprivate / && {stash}mount -t tmpfs -o size=2g tmpfs /dev/shm && "
                  f"mount -t tmpfs tmpfs /tmp && {back}"
                  f"mount --bind {self.etc / f'hosts{i}'} /etc/hosts && hostname {self.hostname(i)} && "
                  f'exec "$@"')
        return ["ip", "netns", "exec", self.ns(i), "unshare", "--mount", "--uts", "--propagation", "private", "--",
                "sh", "-c", script, "resilax-host", *argv]

    def pids(self, i: int) -> list[int]:
        """The processes in host ``i``'s network namespace."""
        return [int(p) for p in _run("ip", "netns", "pids", self.ns(i), check=False).stdout.split()]

    def kill(self, i: int) -> None:
        """SIGKILL to every process of host ``i`` (its memory, /dev/shm and /tmp, goes with them:
        a tmpfs of a mount namespace lives as long as a process in it)."""
        _kill_ns(self.ns(i))

    # ------------------------------------------------------------------ faults
    def partition(self, i: int) -> None:
        """Host ``i``'s link down (its bridge port): it reaches no other host, they reach it not."""
        _run("ip", "link", "set", self._port(i), "down")

    def heal(self, i: int) -> None:
        _run("ip", "link", "set", self._port(i), "up")

    def lossy(self, i: int, *, loss: float = 0.05, delay_ms: float = 50.0, rate_mbit: float = 20.0) -> str:
        """Loss (a fraction) and delay on host ``i``'s link; returns what was applied. Without
        netem the delay is a rate limit's (``rate_mbit``) queue of up to ``delay_ms``."""
        dev, ns = self._dev(i), self.ns(i)
        if netem_available():
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
                 "loss", f"{loss * 100:g}%", "delay", f"{delay_ms:g}ms")
            how = f"tc netem: loss {loss * 100:g}%, delay {delay_ms:g} ms"
        else:
            if shutil.which("nft") is None:
                raise NetnsError("resilax netns: no tc netem in this kernel and no 'nft' (nftables) for packet loss")
            pct = max(1, round(loss * 100))
            rules = (f"table inet {PREFIX}loss {{\n"
                     f" chain out {{ type filter hook output priority 0; numgen random mod 100 < {pct} drop; }}\n"
                     f" chain in {{ type filter hook input priority 0; numgen random mod 100 < {pct} drop; }}\n}}\n")
            _run("ip", "netns", "exec", ns, "nft", "-f", "-", input=rules)
            # no fixed delay without netem: a rate limit, whose queue delays packets under load
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                 "burst", "32kb", "latency", f"{max(delay_ms, 1):g}ms")
            how = (f"nftables: {pct}% of packets dropped each way; tc tbf: {rate_mbit:g} mbit/s, queue up to {delay_ms:g} ms "
                   f"(no netem in this kernel: no fixed delay)")
        self._lossy[i] = how
        return how

    def delay(self, i: int, delay_ms: float = 50.0) -> str:
        """Every packet host ``i`` sends arrives ``delay_ms`` late (as netem's delay on its
        link's sending side); returns what was applied. ``tc netem`` where the kernel has it;
        else, in every other host's namespace, an iptables ``NFQUEUE`` rule on the packets
        from host ``i`` and `nfq_delay`, which holds each one's verdict ``delay_ms`` (all of
        them: handshakes, acknowledgements, retransmissions). The packets are held where they
        arrive, not where they leave: a sender's packet held in its own output path still
        counts against TCP's small-queue limit, which then let 2 packets through per delay
        (60 kB/s). Raises `NetnsError` when neither is available."""
        dev, ns = self._dev(i), self.ns(i)
        if netem_available():
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                 f"{delay_ms:g}ms")
            return f"tc netem: delay {delay_ms:g} ms"
        if shutil.which("iptables") is None:
            raise NetnsError("resilax netns: no tc netem in this kernel and no 'iptables' for an NFQUEUE delay "
                             "(apt-get install iptables)")
        import sys

        for j in range(self.n):
            if j == i:
                continue
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns(j), sys.executable, "-m", "resilax.tools.nfq_delay",
                                     "--queue", str(i), "--delay-ms", f"{delay_ms:g}"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            ready = proc.stdout.readline().strip()  # (it prints "ready" once bound, or exits saying why)
            if ready != "ready":
                proc.kill()
                raise NetnsError(f"resilax netns: the NFQUEUE delay did not start: {proc.stderr.read().strip()}")
            self._delays.setdefault(i, []).append(proc)
            # --queue-bypass: were the program gone, packets pass undelayed rather than dropped
            _run("ip", "netns", "exec", self.ns(j), "iptables", "-A", "INPUT", "-s", self.address(i), "-j", "NFQUEUE",
                 "--queue-num", str(i), "--queue-bypass")
        return f"iptables NFQUEUE + nfq_delay at the receivers: every packet host {i} sends arrives {delay_ms:g} ms late"

    def clear(self, i: int) -> None:
        """Removes `lossy`'s and `delay`'s rules from host ``i``'s link."""
        ns = self.ns(i)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", self._dev(i), "root", check=False)
        _run("ip", "netns", "exec", ns, "nft", "delete", "table", "inet", f"{PREFIX}loss", check=False)
        self._lossy.pop(i, None)
        procs = self._delays.pop(i, [])
        for j in range(self.n) if procs else ():
            if j != i:
                _run("ip", "netns", "exec", self.ns(j), "iptables", "-D", "INPUT", "-s", self.address(i), "-j",
                     "NFQUEUE", "--queue-num", str(i), "--queue-bypass", check=False)
        for proc in procs:
            proc.kill()
            proc.wait()

    def cut_run_dir(self, i: int, path, pid: int) -> None:
        """Replaces ``path`` by an empty tmpfs in the mount namespace of process ``pid`` (of host
        ``i``): that host's writes there land where no other host sees them."""
        _run("nsenter", f"--mount=/proc/{pid}/ns/mnt", "mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path))

    def restore_run_dir(self, i: int, path, pid: int) -> None:
        _run("nsenter", f"--mount=/proc/{pid}/ns/mnt", "umount", "-l", str(path))

    def read_only_run_dir(self, i: int, path, pid: int) -> None:
        """``path`` turns read-only for host ``i``, in the mount namespace of its process ``pid``:
        a bind mount of ``path`` onto itself, read-only from the moment it is attached (the
        mount API's ``open_tree`` clone, made read-only by ``mount_setattr`` while detached, then
        ``move_mount``: `_READ_ONLY_BIND`). Files already open keep working; a new open for
        writing, a create, rename or unlink there fails with EROFS, as on an NFS export turned
        read-only. (``mount -o remount,ro`` of the file system is refused, EBUSY, while files on
        it are open for writing; so is ``mount --bind`` then ``remount,bind,ro`` once a write
        was opened through the new bind in between.) Checked: a file created there from that
        namespace must fail with "Read-only file system" (else `NetnsError`, the bind removed).
        The bind lives in that mount namespace only: `writable_run_dir` removes it, and it goes
        with the host's processes."""
        import sys

        ns, path = f"--mount=/proc/{pid}/ns/mnt", str(path)
        self._ro[(i, path)] = pid
        try:
            _run("nsenter", ns, sys.executable, "-c", _READ_ONLY_BIND, path)
            r = _run("nsenter", ns, "touch", f"{path}/.resilax-read-only-probe", check=False)
            if r.returncode == 0 or "Read-only file system" not in r.stderr:
                raise NetnsError(f"resilax netns: {path} bound read-only in host {i}'s mount namespace, yet creating a "
                                 f"file there gave {r.returncode} ({r.stderr.strip()!r}), not EROFS")
        except BaseException:
            self.writable_run_dir(i, path, pid)
            raise

    def writable_run_dir(self, i: int, path, pid: int) -> None:
        """Undoes `read_only_run_dir` (its bind mount detached; a no-op when there is none)."""
        if self._ro.pop((i, str(path)), None) is not None:
            _run("nsenter", f"--mount=/proc/{pid}/ns/mnt", "umount", "-l", str(path), check=False)

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Kills every process in the hosts' namespaces, removes the namespaces, links and bridge."""
        for (i, path), pid in list(self._ro.items()):  # (they go with the host's processes too)
            self.writable_run_dir(i, path, pid)
        for proc in (p for ps in self._delays.values() for p in ps):  # (in a namespace: killed below too)
            proc.kill()
            proc.wait()
        self._delays = {}
        for kind, name in reversed(self._made):
            if kind == "netns":
                _kill_ns(name)
                _run("ip", "netns", "del", name, check=False)
            else:
                _run("ip", "link", "del", name, check=False)
        self._made = []
        shutil.rmtree(self.etc, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# a read-only bind of argv[1] onto itself, read-only before it is attached (Linux >= 5.12;
# the syscall numbers are the same on every architecture): open_tree(OPEN_TREE_CLONE),
# mount_setattr(MOUNT_ATTR_RDONLY), move_mount(MOVE_MOUNT_F_EMPTY_PATH)
_READ_ONLY_BIND = """
import ctypes, os, sys
libc, path = ctypes.CDLL(None, use_errno=True), sys.argv[1].encode()
def call(*a):
    r = libc.syscall(*a)
    if r < 0:
        e = ctypes.get_errno()
        sys.exit(f"syscall {a[0]} on {sys.argv[1]}: {os.strerror(e)}")
    return r
fd = call(428, -100, path, 1 | os.O_CLOEXEC)
attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)
call(442, fd, b"", 0x1000, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
call(429, fd, b"", -100, path, 4)
"""


def _kept(shared) -> list[str]:
    """The directories under ``/tmp`` or ``/dev/shm`` a host's private tmpfs must not hide:
    ``shared`` (the run directory), and what its processes run from when that lies there
    (a CI checkout or virtual environment under ``/tmp``: the interpreter's prefix, the
    directory resilax is imported from, ``PYTHONPATH``, the working directory)."""
    import sys

    import resilax

    want = [pathlib.Path(d).absolute() for d in shared]
    runs_from = [sys.prefix, sys.base_prefix, pathlib.Path(resilax.__file__).parents[1], os.getcwd(),
                 *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    for d in runs_from:
        d = pathlib.Path(d).absolute()
        if (d.parts[1:2] == ("tmp",) and len(d.parts) > 2 or d.parts[1:3] == ("dev", "shm") and len(d.parts) > 3) \
                and d.is_dir():
            want.append(d)
    out: list[str] = []
    for d in sorted(set(want), key=lambda x: len(x.parts)):
        if not any(d == pathlib.Path(k) or pathlib.Path(k) in d.parents for k in out):
            out.append(str(d))
    return out

