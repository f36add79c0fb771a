"""Mutual TLS for TCP connections that easypyverbs makes (the soft provider's data connections) and that
its users make (a bootstrap connection): contexts from PEM files, a handshake with a total deadline,
and a stream that two threads may use at once (one reading, one writing).

Policy (both directions): TLS 1.3 only, a certificate required from both sides and verified against
one CA file, no hostname check (peers are named by their certificate, checked by the caller), no
session tickets (nothing is resumed; and no record of them is left on a connection after its
handshake, where a bootstrap socket looks for its peer's end of file).
"""
from __future__ import annotations

import dataclasses
import select
import socket
import ssl
import threading
import time
from typing import Any, List, Optional, Sequence

from . import stalls
from .bootstrap import Patience

#: first byte of a TLS connection (a handshake record carrying the ClientHello)
TLS_RECORD_HANDSHAKE = b"\x16"
#: one SSL_write at most this large: bounds how long the stream's lock is held while a reader waits
WRITE_BYTES = 256 << 10
#: buffers smaller than this are joined before they are sent, so a frame header is not a record of its own
COALESCE_BYTES = 16 << 10
#: a waiting reader or writer wakes at least this often and retries (cheap; bounds any missed wake-up)
MAX_WAIT_S = 1.0


@dataclasses.dataclass(frozen=True)
class MutualTLS:
    """The two contexts one side of a mutually authenticated connection needs."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str) -> "MutualTLS":
        """Contexts that present `cert` (with `key`) and accept only peers whose certificate `ca` signed.
        Raises ssl.SSLError / OSError naming what failed to load (never the key's content)."""
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        for ctx in (server, client):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.load_cert_chain(cert, key)
            ctx.load_verify_locations(cafile=ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        client.check_hostname = False  # the peer's name is checked against its certificate by the caller
        server.num_tickets = 0
        return cls(server, client)


def peer_names(sock: Any) -> List[str]:
    """The names a verified peer certificate carries: its subject commonName(s), then its URI SANs."""
    return names_in(sock.getpeercert() or {})


def names_in(cert: Any) -> List[str]:
    """The names in a certificate as `SSLSocket.getpeercert()` decodes it: commonName(s), URI SANs."""
    names = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    return names + [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]


def first_byte(sock: socket.socket, timeout_s: float) -> bytes:
    """Peek at the first byte the peer sent (b"" if it closed): tells a TLS ClientHello from plaintext."""
    sock.settimeout(max(timeout_s, 0.001))
    try:
        return sock.recv(1, socket.MSG_PEEK)
    except socket.timeout as exc:
        raise TimeoutError(f"peer sent nothing within {timeout_s:.1f} s") from exc


def handshake(sock: socket.socket, context: ssl.SSLContext, server_side: bool, timeout_s: float,
              patient_until: float = 0.0) -> ssl.SSLSocket:
    """Wrap `sock` (which the returned socket then owns) and run the TLS handshake within `timeout_s` in
    all: a peer that trickles bytes cannot stretch it. `patient_until` (a dialer's; stalls' clock): past
    `timeout_s`, wait on until then while the peer's host acknowledges everything sent to it (a held peer
    process, as bootstrap.BootstrapConn.wait_patiently). Closes the socket and raises on failure
    (ssl.SSLError, ssl.SSLCertVerificationError, TimeoutError, OSError). The socket is left non-blocking."""
    wait = Patience(timeout_s, patient_until)
    sock.setblocking(False)
    ssock = context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
    try:
        while True:
            try:
                ssock.do_handshake()
                return ssock
            except ssl.SSLWantReadError:
                events = select.POLLIN
            except ssl.SSLWantWriteError:
                events = select.POLLOUT
            left = wait.left(ssock, f"TLS peer {_peer_of(ssock)}")
            if left <= 0:
                raise TimeoutError(f"TLS handshake not done within {timeout_s:.1f} s" + (
                    f" (nor {stalls.clock() - wait.start:.0f} s while the peer's host acknowledged everything: its "
                    f"process is held or stuck)" if wait.waited else ""))
            p = select.poll()
            p.register(ssock.fileno(), events)
            p.poll(left * 1000)
    except BaseException:
        ssock.close()
        raise


def _peer_of(sock: socket.socket) -> str:
    try:
        return "%s:%s" % tuple(sock.getpeername()[:2])
    except OSError:
        return "(gone)"


def _poller(fd: int, events: int) -> Any:
    p = select.poll()
    p.register(fd, events)
    return p


class TLSStream:
    """A TLS connection that one thread reads while another writes, as a soft QP's connection carries
    requests one way and answers the other. OpenSSL's SSL object must not be used by two threads at
    once, so every SSL call runs under one lock and never blocks: the socket is non-blocking and the
    waits happen in poll, outside the lock. Offers the socket calls the soft provider makes
    (recv_into, sendall, send_buffers, more_pending, settimeout, setsockopt, shutdown, close);
    `timeout_s` bounds each call's wait for progress, like SO_RCVTIMEO/SO_SNDTIMEO (None: no bound)."""

    def __init__(self, ssock: ssl.SSLSocket, timeout_s: Optional[float] = None) -> None:
        ssock.setblocking(False)
        self.sock = ssock
        self.timeout_s = timeout_s
        self.version = ssock.version() or "TLS"
        self._lock = threading.Lock()
        fd = ssock.fileno()
        self._readable = _poller(fd, select.POLLIN)  # used by the reading thread only
        self._writable = _poller(fd, select.POLLOUT)  # by the writing thread only

    def settimeout(self, timeout_s: Optional[float]) -> None:
        self.timeout_s = timeout_s

    def setsockopt(self, *args: Any) -> None:
        self.sock.setsockopt(*args)

    def fileno(self) -> int:
        return self.sock.fileno()

    def _deadline(self) -> Optional[float]:
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def _wait(self, write: bool, deadline: Optional[float]) -> None:
        left = MAX_WAIT_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"TLS connection: no progress within {self.timeout_s} s")
        (self._writable if write else self._readable).poll(min(left, MAX_WAIT_S) * 1000)

    def recv_into(self, view: Any, nbytes: int = 0) -> int:
        n = nbytes or memoryview(view).nbytes
        deadline = self._deadline()
        while True:
            with self._lock:
                try:
                    return self.sock.recv_into(view, n)  # 0 at the peer's end of file
                except ssl.SSLWantReadError:
                    write = False
                except ssl.SSLWantWriteError:
                    write = True
            self._wait(write, deadline)

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        pos, deadline = 0, self._deadline()
        while pos < view.nbytes:
            # after a WANT_* the same bytes must be offered again: the piece only moves with pos
            piece = view[pos:pos + WRITE_BYTES]
            with self._lock:
                try:
                    pos += self.sock.send(piece)
                    deadline = self._deadline()
                    continue
                except ssl.SSLWantWriteError:
                    write = True
                except ssl.SSLWantReadError:
                    write = False
            self._wait(write, deadline)

    def send_buffers(self, bufs: Sequence[memoryview]) -> None:
        """Send every buffer in order; small ones are joined (TLS has no vectored write)."""
        small = bytearray()
        for b in bufs:
            if b.nbytes < COALESCE_BYTES:
                small += b
                continue
            if small:
                self.sendall(small)
                small = bytearray()
            self.sendall(b)
        if small:
            self.sendall(small)

    def more_pending(self) -> bool:
        """Bytes of a next frame are already here (decrypted, or still on the socket)."""
        with self._lock:
            if self.sock.pending():
                return True
        return bool(_poller(self.sock.fileno(), select.POLLIN).poll(0))

    def shutdown(self, how: int) -> None:
        # the TCP socket's shutdown: SSLSocket.shutdown would also drop its SSL object under a reader
        socket.socket.shutdown(self.sock, how)

    def close(self) -> None:
        with self._lock:
            self.sock.close()
