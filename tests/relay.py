"""A TCP relay on the path between two parties, for the adversary tests: it listens where the dialer
expects its peer, connects on to the real peer, and passes bytes through, except that it reads the
bootstrap connection's frames (easypyverbs' `EPVB` framing) and lets a test's `tamper` rewrite, replay
or drop them. It holds no secret: what it can do is what an attacker between two sites can do.

    with Relay(("127.0.0.1", victim_port), tamper) as relay:   # relay.address: where to dial
        ...

`tamper(direction, index, frame)`: `direction` is "dialer" (frames the dialer sent) or "acceptor",
`index` counts that direction's frames from 0 (the auth exchange is 0 and 1 each way), `frame` the whole
frame (header and body); it returns the frames to pass on in its place (none: dropped). Each connection
through the relay is tampered with only while `relay.armed` (it disarms itself after the first
connection), so a later, honest connection shows that the legit path still works.
"""
from __future__ import annotations

import socket
import struct
import threading
from typing import Callable, List, Optional, Tuple

HEADER = struct.Struct("!4sBBHI")

Tamper = Callable[[str, int, bytes], List[bytes]]


def passthrough(direction: str, index: int, frame: bytes) -> List[bytes]:
    return [frame]


def _read_exactly(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return buf


class Relay:
    def __init__(self, target: Tuple[str, int], tamper: Tamper = passthrough) -> None:
        """`target`: where the real peer listens (may be set later, before anything connects)."""
        self.target, self.tamper = target, tamper
        self.armed = True
        self.seen: List[Tuple[str, int, int]] = []  # (direction, index, body bytes) of each frame read
        self.dialer_bytes = bytearray()  # what the dialer sent through, where it is not the bootstrap framing
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.address = "%s:%d" % self._lsock.getsockname()[:2]
        self._socks: List[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                down, _ = self._lsock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            self._socks += [down, up]
            tamper, self.armed = (self.tamper if self.armed else passthrough), False
            for src, dst, direction in ((down, up, "dialer"), (up, down, "acceptor")):
                threading.Thread(target=self._pump, args=(src, dst, direction, tamper), daemon=True,
                                 name=f"relay-{direction}").start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, tamper: Tamper) -> None:
        index = 0
        try:
            while True:
                head = src.recv(HEADER.size)
                while head and len(head) < 4 and b"EPVB".startswith(head):
                    more = src.recv(4 - len(head))
                    if not more:
                        break
                    head += more
                if not head:
                    break
                if head[:4] != b"EPVB":  # not the bootstrap framing (TLS, a soft data connection): bytes through
                    data = head
                    while data:
                        if direction == "dialer":
                            self.dialer_bytes += data
                        dst.sendall(data)
                        data = src.recv(1 << 16)
                    return
                rest = _read_exactly(src, HEADER.size - len(head))
                if rest is None:
                    break
                head += rest
                length = HEADER.unpack(head)[4]
                body = _read_exactly(src, length)
                if body is None:
                    break
                self.seen.append((direction, index, length))
                for frame in tamper(direction, index, head + body):
                    dst.sendall(frame)
                index += 1
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self._lsock.close()
        for s in self._socks:
            s.close()

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
