"""One job per directory: an ``flock`` on a lock file in it, held while the job runs.

Two jobs writing one directory delete each other's checkpoints (Orbax keeps the newest
``keep`` steps of whatever it finds there), quarantine each other's record-log entries,
and a resume may then read the other job's state. `resilax launch`'s supervisor locks its
run directory (the agents of a job across hosts share that lock) and a single-process run
locks its checkpoint directory (`Checkpoints`); processes of one multi-process job share
their directories and lock nothing themselves (their supervisor, if any, does).

The kernel drops an ``flock`` when its process ends, SIGKILL included: a relaunch after any
death takes the lock at once. A file system without locks is said in a warning and not
locked. The holder writes its pid, host and start time into the file for the message of
the next one refused (a record whose pid is gone, or is not a resilax process any more,
is not named).
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import threading
import time
import warnings


class DirectoryInUse(Exception):
    """Another process holds the lock; ``pid`` is its pid when it can tell (a resilax process
    on this host), ``holder`` says so in words."""

    def __init__(self, path: pathlib.Path, pid: int | None, started: float | None = None):
        self.path, self.pid = path, pid
        self.holder = ("another process" if pid is None else
                       f"pid {pid}, started {time.strftime('%H:%M:%S', time.localtime(started))}")
        super().__init__(f"{path} is held by {self.holder}")


def acquire(lock_path, *, shared: bool = False, what: str = "resilax") -> int | None:
    """Opens ``lock_path`` (created if missing) and takes its lock without waiting; returns
    the file descriptor (keep it open: closing it releases the lock), or None where the file
    system has no locks (a warning names it).

    Raises:
      DirectoryInUse: another process holds it (exclusively, or at all for an exclusive one).
      OSError: the file cannot be opened (a directory that is missing or not writable).
    """
    import fcntl

    lock_path = pathlib.Path(lock_path)
    # Held open read-only: a file open for writing keeps its file system from being remounted
    # read-only (`mount -o remount,ro`: "busy"). NFS turns an flock into a POSIX lock, and an
    # exclusive one there needs a writable descriptor (EBADF): then it is opened for writing.
    for flags in (os.O_RDONLY, os.O_RDWR):
        fd = os.open(lock_path, flags | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUse(lock_path, *_holder(lock_path)) from None
        except OSError as e:
            os.close(fd)
            if e.errno == errno.EBADF and flags == os.O_RDONLY:
                continue
            # ENOLCK, EOPNOTSUPP: a file system without locks
            warnings.warn(f"{what}: the file system of {lock_path.parent} takes no locks ({e.strerror or e}): "
                          f"nothing keeps a second job out of it", RuntimeWarning, stacklevel=3)
            return None
    if not shared:  # who holds it, for the message of the next one refused
        try:
            lock_path.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "t": time.time()}))
        except OSError:
            pass
    return fd


def _holder(lock_path: pathlib.Path) -> tuple[int | None, float | None]:
    """The holder's (pid, start time) from its record, or (None, None)."""
    try:
        rec = json.loads(lock_path.read_bytes()[:4096] or b"{}")
        pid, host, started = int(rec["pid"]), str(rec["host"]), float(rec["t"])
        if host == os.uname().nodename and b"resilax" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid, started
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None, None


_held: dict[str, list] = {}  # this process's locks: lock file -> [fd, holders]
_held_lock = threading.Lock()


def hold(directory, name: str = "resilax.lock", what: str = "resilax") -> str | None:
    """Takes ``directory/name`` exclusively for this process; a second hold from this process
    counts (one process may open a directory twice: a resume in the same script). Returns
    the key for `release`, or None when nothing was locked (no locks on that file system).

    Raises:
      DirectoryInUse: another process holds it.
    """
    key = str(pathlib.Path(directory).absolute() / name)
    with _held_lock:
        if key in _held:
            _held[key][1] += 1
            return key
        fd = acquire(key, what=what)
        if fd is None:
            return None
        _held[key] = [fd, 1]
        return key


def release(key: str | None) -> None:
    """Gives one `hold` back; the last one closes the lock file (the lock goes with it)."""
    if key is None:
        return
    with _held_lock:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _held[key]
            os.close(entry[0])
