"""Out-of-band connection set-up over TCP (what perftest does), the same for every provider.

Frames: `!4sBBHI` header (magic b"EPVB", version 1, kind 1 = JSON, reserved, body length) then a
UTF-8 JSON object of at most `MAX_BODY_BYTES`. Anything else is a `BootstrapError` naming the
problem; nothing waits without a deadline.
"""
from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Dict, Optional, Tuple

from .errors import BootstrapError

HEADER = struct.Struct("!4sBBHI")
MAGIC = b"EPVB"
VERSION = 1
KIND_JSON = 1
#: QP info and a handful of MR descriptors fit in a few KiB; 1 MiB leaves room without inviting abuse
MAX_BODY_BYTES = 1 << 20


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BootstrapError(f"timed out waiting for {what} ({pos} of {n} bytes)")
        sock.settimeout(left)
        try:
            got = sock.recv_into(view[pos:], n - pos)
        except socket.timeout:
            continue
        except OSError as exc:
            raise BootstrapError(f"connection lost while reading {what}: {exc}", exc.errno) from exc
        if got == 0:
            raise BootstrapError(f"peer closed the bootstrap connection while sending {what} ({pos} of {n} bytes)")
        pos += got
    return bytes(buf)


class BootstrapConn:
    """A connected bootstrap socket exchanging JSON objects."""

    def __init__(self, sock: socket.socket, peer: Optional[Tuple[str, int]] = None) -> None:
        """`peer`: the peer's address where known (a socket wrapped after connecting, e.g. in TLS,
        whose peer may already have closed it)."""
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer: Tuple[str, int] = peer or sock.getpeername()[:2]
        self.local: Tuple[str, int] = sock.getsockname()[:2]

    def send(self, obj: Dict[str, Any], timeout_s: float = 10.0) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        if len(body) > MAX_BODY_BYTES:
            raise BootstrapError(f"bootstrap message of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(HEADER.pack(MAGIC, VERSION, KIND_JSON, 0, len(body)) + body)
        except OSError as exc:
            raise BootstrapError(f"cannot send to bootstrap peer {self.peer}: {exc}", exc.errno) from exc

    def recv(self, timeout_s: float = 10.0) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        magic, version, kind, _, length = HEADER.unpack(_recv_exact(self.sock, HEADER.size, deadline, "bootstrap header"))
        if magic != MAGIC and magic[:1] == b"\x16":  # a TLS handshake record
            raise BootstrapError(f"bootstrap peer {self.peer} speaks TLS (it sent a TLS ClientHello); this side "
                                 f"does not: TLS is on there and off here")
        if magic != MAGIC:
            raise BootstrapError(f"bootstrap peer {self.peer} sent garbage (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION or kind != KIND_JSON:
            raise BootstrapError(f"bootstrap peer {self.peer} speaks version {version}/kind {kind}; this side speaks {VERSION}/{KIND_JSON}")
        if length > MAX_BODY_BYTES:
            raise BootstrapError(f"bootstrap peer {self.peer} announced {length} bytes, more than {MAX_BODY_BYTES}")
        body = _recv_exact(self.sock, length, deadline, "bootstrap body")
        try:
            obj = json.loads(body)
        except ValueError as exc:
            raise BootstrapError(f"bootstrap peer {self.peer} sent malformed JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise BootstrapError(f"bootstrap peer {self.peer} sent {type(obj).__name__}, expected an object")
        return obj

    def exchange(self, obj: Dict[str, Any], timeout_s: float = 10.0) -> Dict[str, Any]:
        """Send ours, receive theirs (both sides may call it at once)."""
        self.send(obj, timeout_s)
        return self.recv(timeout_s)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "BootstrapConn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Listener:
    """Accepts bootstrap connections from many peers."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backlog: int = 64) -> None:
        try:
            self.sock = socket.create_server((host, port), backlog=backlog, reuse_port=False)
        except OSError as exc:
            raise BootstrapError(f"cannot listen on {host}:{port}: {exc}", exc.errno) from exc
        self.address: Tuple[str, int] = self.sock.getsockname()[:2]

    def accept(self, timeout_s: Optional[float] = 10.0) -> BootstrapConn:
        self.sock.settimeout(timeout_s)
        try:
            sock, _ = self.sock.accept()
        except socket.timeout as exc:
            raise BootstrapError(f"no peer connected to {self.address} within {timeout_s} s") from exc
        except OSError as exc:
            raise BootstrapError(f"accept on {self.address} failed: {exc}", exc.errno) from exc
        return BootstrapConn(sock)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(host: str, port: int, timeout_s: float = 10.0) -> BootstrapConn:
    """Connect to a bootstrap listener, retrying refused connections until `timeout_s` (the peer may start later)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.02
    while True:
        left = deadline - time.monotonic()
        try:
            return BootstrapConn(socket.create_connection((host, port), timeout=max(left, 0.01)))
        except OSError as exc:
            if time.monotonic() + pause >= deadline:
                raise BootstrapError(f"cannot reach bootstrap peer {host}:{port} within {timeout_s} s: {exc}", exc.errno) from exc
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
