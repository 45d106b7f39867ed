"""Host stores across hosts: the agent's store server and the workers' client (no JAX).

Under `resilax launch --nodes` each host's store is that host's memory, which another host
reaches only through the network. The agent of each host serves its store
(`StoreServer`, a thread of the agent, so it lives as long as the host's store does): a
worker *puts* a copy of each step's shards into the store of the next live host (its
mirror, so the shards outlive their host), agents *list* what a store holds when they
agree on what a new generation can resume from, and a worker of a re-formed mesh *gets*
the copies it needs from another host's store.

The protocol, one request per connection: the server opens with a fresh nonce; then each
message is 16 bytes (the header's and the body's length, big-endian), a JSON header, the
body (a step's ``.npz`` bytes, or nothing). Where the job has a key (``RESILAX_STORE_KEY``,
hex: `resilax launch --nodes` gives every agent and worker one, `job_key`), each header
carries ``mac``, an HMAC-SHA256 under the key of the nonce, the header without ``mac`` and
the body's SHA-256: the server serves no request without a valid one, the client trusts no
reply without one (a reply's MAC covers the request's too, so it answers that request).
Without a key (a store used alone, as the unit tests do) nothing is authenticated. Every body
travels with its commit record, whose SHA-256 the receiver checks before it commits or
uses anything (a put of damaged bytes is refused, a get of damaged bytes returns None).
Nothing is unpickled. A store directory named in a request must be ``host<j>/own`` or
``host<j>/mirror`` under the store's root. The server binds the agent's ``--address``
(loopback unless told otherwise).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pathlib
import secrets
import socket
import socketserver
import struct
import sys
import threading

from resilax._src.protect import hoststore_files as _files

MAX_HEADER = 64 << 20  # a record with every (leaf, shard) key of a large state fits
MAX_BODY = 1 << 40
TIMEOUT_S = 10.0  # a peer that does not answer within this is treated as gone


KEY_ENV = "RESILAX_STORE_KEY"
KEY_FILE = "store.key"


class StoreNetError(OSError):
    """A store server refused a request, or answered something malformed."""


def job_key(run_dir) -> str:
    """The job's store key (hex), made once per run directory: ``RESILAX_STORE_KEY`` where the
    caller set it (a cluster's secret), else ``run_dir/store.key``, created by the first
    agent (readable by its owner only; whoever can read the run directory is trusted as the
    rendezvous there already is). Sets ``RESILAX_STORE_KEY`` in this process, so the workers
    an agent starts inherit it."""
    key = os.environ.get(KEY_ENV)
    if not key:
        path = pathlib.Path(run_dir) / KEY_FILE
        tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic, never over another agent's key
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
        key = path.read_text().strip()
    try:
        if len(bytes.fromhex(key)) < 16:
            raise ValueError("shorter than 16 bytes")
    except ValueError as e:
        raise StoreNetError(f"the host stores' key ({KEY_ENV} or {pathlib.Path(run_dir) / KEY_FILE}) is not "
                            f"usable: {e}") from None
    os.environ[KEY_ENV] = key
    return key


def _key() -> bytes | None:
    k = os.environ.get(KEY_ENV)
    return bytes.fromhex(k) if k else None


def _mac(key: bytes, nonce: bytes, header: dict, body: bytes, request_mac: str = "") -> str:
    h = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True).encode()
    msg = b"\0".join((nonce, request_mac.encode(), h, hashlib.sha256(body).digest()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _check_mac(key: bytes | None, nonce: bytes, header: dict, body: bytes, who: str, request_mac: str = "") -> None:
    if key is None:
        return
    got = header.get("mac")
    if not isinstance(got, str) or not hmac.compare_digest(got, _mac(key, nonce, header, body, request_mac)):
        raise StoreNetError(f"{who} is not authenticated with the job's store key ({KEY_ENV})")


def _exact(sock, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = sock.recv(min(n - got, 1 << 22))
        if not b:
            raise StoreNetError(f"connection closed after {got} of {n} bytes")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _send(sock, header: dict, body: bytes = b"") -> None:
    h = json.dumps(header).encode()
    sock.sendall(struct.pack(">QQ", len(h), len(body)) + h)
    if body:
        sock.sendall(body)


def _recv(sock) -> tuple[dict, bytes]:
    nh, nb = struct.unpack(">QQ", _exact(sock, 16))
    if nh > MAX_HEADER or nb > MAX_BODY:
        raise StoreNetError(f"a message of {nh} + {nb} bytes is over the limits ({MAX_HEADER} + {MAX_BODY})")
    try:
        header = json.loads(_exact(sock, nh))
    except ValueError as e:
        raise StoreNetError(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise StoreNetError("the header is not a JSON object")
    return header, _exact(sock, nb)


def _step(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise StoreNetError(f"a step must be an integer >= 0, got {v!r}")
    return v


class StoreServer:
    """Serves the store under ``root`` on ``host`` (port 0: a free one; `address` says
    which) until `close`: put into ``host<j>/mirror``, list, get (module docstring)."""

    def __init__(self, root, host: str = "127.0.0.1", port: int = 0):
        self.root = pathlib.Path(root)
        self.puts = 0
        self.generation: tuple[int, str] | None = None  # this host's generation (`fence`): none older is taken
        self.key = _key()  # the job's key as the server starts (the agent set it: `job_key`)
        store = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(TIMEOUT_S)
                key, nonce, header = store.key, secrets.token_bytes(16), {}
                try:
                    _send(self.request, {"nonce": nonce.hex()})
                    header, body = _recv(self.request)
                    _check_mac(key, nonce, header, body, "the request")
                    reply, out = store._serve(header, body)
                except (OSError, ValueError) as e:
                    reply, out = {"ok": False, "error": str(e)}, b""
                if key is not None:
                    reply["mac"] = _mac(key, nonce, reply, out, str(header.get("mac", "")))
                try:
                    _send(self.request, reply, out)
                except OSError:
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request, client_address):
                # one line in the log, not socketserver's traceback on stderr: the client's
                # request fails and it says so; the traceback goes to the debug log
                e = sys.exc_info()[1]
                log = logging.getLogger("resilax")
                log.debug("resilax host store server: a request from %s failed", client_address, exc_info=True)
                log.warning("resilax host store server: a request from %s failed: %s: %s", client_address,
                            type(e).__name__, str(e)[:200])

        self._server = Server((host, port), Handler)
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="resilax-store-server", daemon=True)
        self._thread.start()

    def _dir(self, name) -> pathlib.Path:
        if not isinstance(name, str) or not _files.STORE_DIR.fullmatch(name):
            raise StoreNetError(f"{name!r} is not a store directory (host<j>/own or host<j>/mirror)")
        return self.root / name

    def _serve(self, header: dict, body: bytes) -> tuple[dict, bytes]:
        op = header.get("op")
        if op == "put":
            meta = header.get("meta")
            if not isinstance(meta, dict):
                raise StoreNetError("a put needs the step's commit record ('meta')")
            step, slot = _step(meta.get("step")), _step(meta.get("process"))
            stale = self._stale(meta)
            if stale:
                raise StoreNetError(f"the mirror of step {step} of process {slot} is refused: {stale}")
            if hashlib.sha256(body).hexdigest() != meta.get("sha256"):
                raise StoreNetError(f"the bytes of step {step} of process {slot} do not match their SHA-256: "
                                    f"not stored")
            _files.write_raw(self._dir(f"host{slot}/mirror"), step, body, meta)
            self.puts += 1
            return {"ok": True}, b""
        if op == "list":
            step = header.get("step")
            got = _files.records(self.root, None if step is None else _step(step))
            return {"ok": True, "records": {d: {str(s): r for s, r in recs.items()} for d, recs in got.items()}}, b""
        if op == "get":
            got = _files.read_raw(self._dir(header.get("dir")), _step(header.get("step")))
            if got is None:
                return {"ok": False, "error": f"no verified copy of step {header.get('step')} in {header.get('dir')}"}, b""
            return {"ok": True, "meta": got[1]}, got[0]
        raise StoreNetError(f"unknown request {op!r} (put, list or get)")

    def fence(self, generation: int, generation_id: str) -> None:
        """This host runs ``generation`` now: mirrors of an older generation, or of another one
        with the same number (formed by a side cut off the run directory), are refused from now
        on (a newer one is taken: its writers may start before this host's agent does)."""
        self.generation = (int(generation), str(generation_id))

    def _stale(self, meta: dict) -> str | None:
        if self.generation is None or not meta.get("generation_id"):
            return None
        g, gid = int(meta.get("generation", -1)), str(meta["generation_id"])
        mine, mine_id = self.generation
        if g < mine or (g == mine and gid != mine_id):
            return (f"it was written by generation {g} ({gid[:12]}), and this host runs generation {mine} "
                    f"({mine_id[:12]}): the writer was fenced")
        return None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _request(address: str, header: dict, body: bytes = b"", timeout_s: float = TIMEOUT_S) -> tuple[dict, bytes]:
    host, port = address.rsplit(":", 1)
    key = _key()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        hello, _ = _recv(sock)
        try:
            nonce = bytes.fromhex(hello["nonce"])
        except (KeyError, TypeError, ValueError):
            raise StoreNetError(f"the store at {address} did not open with a nonce") from None
        if key is not None:
            header = dict(header, mac=_mac(key, nonce, header, body))
        _send(sock, header, body)
        reply, out = _recv(sock)
    _check_mac(key, nonce, reply, out, f"the reply of the store at {address} ({reply.get('error', 'no error')})",
               str(header.get("mac", "")))
    if not reply.get("ok"):
        raise StoreNetError(f"the store at {address}: {reply.get('error', 'refused')}")
    return reply, out


def put(address: str, meta: dict, raw: bytes, timeout_s: float = TIMEOUT_S) -> None:
    """Stores ``raw`` (a step's ``.npz``, committed by ``meta``) as process ``meta["process"]``'s
    mirror in the store at ``address``. Raises `OSError` (`StoreNetError`) when it is not stored."""
    _request(address, {"op": "put", "meta": meta}, raw, timeout_s)


def listing(address: str, step: int | None = None, timeout_s: float = TIMEOUT_S) -> dict[str, dict[int, dict]]:
    """What the store at ``address`` holds, as `hoststore_files.records`. Raises `OSError`."""
    reply, _ = _request(address, {"op": "list", "step": step}, timeout_s=timeout_s)
    return {d: {int(s): r for s, r in recs.items()} for d, recs in reply.get("records", {}).items()}


def get(address: str, directory: str, step: int, timeout_s: float = TIMEOUT_S) -> tuple[bytes, dict] | None:
    """``(npz bytes, meta)`` of ``step`` in ``directory`` of the store at ``address``, checked
    against its SHA-256; None when it has no verified copy, cannot be reached, or the bytes
    arrived damaged."""
    try:
        reply, raw = _request(address, {"op": "get", "dir": directory, "step": step}, timeout_s=timeout_s)
    except OSError:
        return None
    meta = reply.get("meta")
    if not isinstance(meta, dict) or meta.get("step") != step or hashlib.sha256(raw).hexdigest() != meta.get("sha256"):
        return None
    return raw, meta
