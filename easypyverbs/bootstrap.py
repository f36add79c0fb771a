"""Out-of-band connection set-up over TCP (what perftest does), the same for every provider.

Frames: `!4sBBHI` header (magic b"EPVB", version 1, kind, reserved, body length) then a UTF-8 JSON
object of at most `MAX_BODY_BYTES`, nested at most `MAX_JSON_DEPTH` deep. Anything else is a
`BootstrapError` naming the problem; nothing waits without a deadline.

Kind 1 (JSON): the body is the object. Kind 2 (sealed JSON), once both ends called `seal(send_key,
recv_key)` (after they authenticated each other: the keys come from their session): the object, then a
16-byte keyed BLAKE2b tag of (the message's number in its direction, u64 big-endian, counted from 0 at
the seal) || the object. The number is not sent: both ends count, so a message altered, forged, replayed,
reordered or dropped on the way fails the next check, and a sealed connection takes no unsealed message.
A sealed connection also derives the attach tokens of the QPs it sets up (`attach_token`): a QP whose peer
attaches over a connection of its own (capabilities.AttachToken: the soft provider's data connections)
takes the token both ends derive from the seal's keys, and none crosses in a message.

Deadlines run on easypyverbs.stalls' clock, so a hold of this process (native code keeping the GIL)
does not count against them. A hold of the *peer* would: its kernel completes our connect and takes
our bytes, but nothing answers until its Python runs again. A connection given `wait_patiently(s)`
(fate-rdma gives it to the peers it dialed, and to authenticated ones) therefore lets a read whose
deadline has passed wait on, until `s` seconds after that call (one window for the whole handshake,
not one per read), for as long as the peer's host has acknowledged every byte sent to it (Linux
TCP_INFO: established, nothing unacknowledged; first looked at no sooner than 0.5 s into the read,
so an ACK still on its way is not taken for a dead host), and says so in the log once. A peer that
closed, or whose host stopped acknowledging, still fails at the read's own deadline; a host that
vanishes after acknowledging everything is not noticed before the window ends (no keepalive runs here).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import struct
from typing import Any, Dict, Optional, Tuple

from . import stalls
from .errors import BootstrapError
from .retry import Retry

log = logging.getLogger("easypyverbs.bootstrap")

#: the BLAKE2b personalisation of attach tokens (BootstrapConn.attach_token), apart from the messages' tags
ATTACH_PERSON = b"epvb attach v1"

HEADER = struct.Struct("!4sBBHI")
MAGIC = b"EPVB"
VERSION = 1
KIND_JSON = 1
KIND_SEALED = 2
TAG_BYTES = 16
#: QP info and a handful of MR descriptors fit in a few KiB; 1 MiB leaves room without inviting abuse
MAX_BODY_BYTES = 1 << 20
#: bootstrap messages nest three levels (a message, its MR descriptors, one descriptor); deeper JSON is refused
#: before it is parsed, so a peer cannot make json.loads, or a repr of what it returns, recurse without bound
MAX_JSON_DEPTH = 32

#: a JSON string, or an unterminated one to the end of the text (so the scan stays linear on any text)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_JSON_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str, limit: int) -> int:
    """How deeply the arrays and objects of JSON `text` nest (strings skipped), counted no further than
    `limit` + 1; exact for any text json.loads accepts. Linear in the text's length."""
    depth = deepest = 0
    for c in _JSON_NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def loads_object(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Dict[str, Any]:
    """The JSON object `body` holds (UTF-8), or ValueError naming what is wrong: not UTF-8, nested deeper than
    `max_depth`, malformed, or a JSON value other than an object. For bytes from a peer."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"a body that is not UTF-8 ({exc})") from exc
    if json_depth(text, max_depth) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (RecursionError: only past the depth check, in a deep stack)
        raise ValueError(f"malformed JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"JSON {type(obj).__name__}, expected an object")
    return obj


#: struct tcp_info (linux/tcp.h): tcpi_state is its first byte, tcpi_unacked the u32 at offset 24
_TCP_ESTABLISHED, _TCPI_UNACKED = 1, 24


def peer_took_everything(sock: socket.socket) -> bool:
    """Whether the TCP connection is established and the peer's kernel acknowledged every byte sent on it:
    the peer's host is up and its socket open, whatever its process does (False where unknown)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError, ValueError):
        return False
    return len(info) >= _TCPI_UNACKED + 4 and info[0] == _TCP_ESTABLISHED and \
        struct.unpack_from("I", info, _TCPI_UNACKED)[0] == 0


class Patience:
    """The deadline of one wait on a peer: `timeout_s` from now, or, for a peer that may be held, on until
    `until` (stalls' clock) while its host acknowledges everything sent on the socket (peer_took_everything):
    that is first looked at 0.5 s in (an ACK may still be on its way), then each half second, never past
    `until`. The bootstrap reads, the dialer's TLS handshake and the soft NIC's answer to a new QP wait so."""

    def __init__(self, timeout_s: float, until: float = 0.0) -> None:
        self.start = stalls.clock()
        self.deadline = self.start + timeout_s
        self.last = max(self.deadline, until)
        if self.last > self.deadline:
            self.deadline = max(self.deadline, self.start + min(0.5, self.last - self.start))
        self.waited = False  # (waited past timeout_s for a peer whose host acknowledged everything)

    def left(self, sock: Any, who: str, quiet: bool = False) -> float:
        """Seconds to wait now; 0 once the wait is over (past its deadline, and past `until` or the peer's host
        not acknowledging). The first wait past timeout_s is logged, naming `who`, unless `quiet`."""
        now = stalls.clock()
        if now < self.deadline:
            return self.deadline - now
        if now >= self.last or not peer_took_everything(sock):
            return 0.0
        if not self.waited and not quiet:
            log.warning("%s has not answered for %.1f s, but its host acknowledged all this side sent: its process "
                        "may be held (native code keeping Python's GIL); waiting up to %.0f s more", who,
                        now - self.start, self.last - now)
        self.waited = True
        self.deadline = min(self.last, now + 0.5)
        return self.deadline - now


class BootstrapConn:
    """A connected bootstrap socket exchanging JSON objects."""

    def __init__(self, sock: socket.socket, peer: Optional[Tuple[str, int]] = None) -> None:
        """`peer`: the peer's address where known (a socket wrapped after connecting, e.g. in TLS,
        whose peer may already have closed it)."""
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer: Tuple[str, int] = peer or sock.getpeername()[:2]
        self.local: Tuple[str, int] = sock.getsockname()[:2]
        self.patience_s = 0.0  # the window wait_patiently gave, and when it ends (stalls' clock)
        self.patient_until = 0.0
        self.patience_why = ""
        self.told = False  # (the one log line about a silent peer was written)
        self._keys: Optional[Tuple[bytes, bytes]] = None  # (send, recv) once sealed
        self._sent = self._received = 0  # messages since the seal, each way

    def seal(self, send_key: bytes, recv_key: bytes) -> None:
        """From now on every message this side sends carries a MAC under `send_key` and its number, and every
        message it receives must carry one under `recv_key` (see the module's doc). Both ends seal at the same
        point of their exchange."""
        if not send_key or not recv_key:
            raise ValueError("seal needs two keys")
        self._keys, self._sent, self._received = (bytes(send_key), bytes(recv_key)), 0, 0

    @property
    def sealed(self) -> bool:
        return self._keys is not None

    def attach_token(self, qpn: int, mine: bool) -> bytes:
        """The attach token (16 bytes) of this side's QP `qpn` (`mine`: what the peer must present to attach to
        it) or of the peer's QP `qpn` (what this side presents): keyed BLAKE2b under the key of the direction the
        attacher's messages take, so both ends derive the same token and it never crosses in a message."""
        if self._keys is None:
            raise BootstrapError("attach tokens come from a sealed bootstrap connection; this one is not sealed")
        if not 0 <= qpn < 1 << 32:
            raise BootstrapError(f"QP number {qpn} is out of range")
        key = self._keys[1] if mine else self._keys[0]
        return hashlib.blake2b(qpn.to_bytes(4, "big"), key=key, digest_size=16, person=ATTACH_PERSON).digest()

    @staticmethod
    def _tag(key: bytes, number: int, body: bytes) -> bytes:
        return hashlib.blake2b(number.to_bytes(8, "big") + body, key=key, digest_size=TAG_BYTES).digest()

    def wait_patiently(self, seconds: float, why: str = "") -> None:
        """Let reads past their deadline wait until `seconds` from now while the peer's host keeps
        acknowledging what this side sent (a held peer process; see the module's doc). `why` names the
        setting, for the log and the error."""
        self.patience_s, self.patient_until, self.patience_why = float(seconds), stalls.clock() + seconds, why

    def keep_patience_of(self, other: "BootstrapConn") -> None:
        """Carry `other`'s window (and whether it already logged) to this connection that wraps its socket."""
        self.patience_s, self.patient_until = other.patience_s, other.patient_until
        self.patience_why = other.patience_why
        self.told = other.told

    def send(self, obj: Dict[str, Any], timeout_s: float = 10.0) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        kind = KIND_JSON
        if self._keys is not None:
            body, kind = body + self._tag(self._keys[0], self._sent, body), KIND_SEALED
            self._sent += 1
        if len(body) > MAX_BODY_BYTES:
            raise BootstrapError(f"bootstrap message of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(HEADER.pack(MAGIC, VERSION, kind, 0, len(body)) + body)
        except OSError as exc:
            raise BootstrapError(f"cannot send to bootstrap peer {self.peer}: {exc}", exc.errno) from exc

    def recv(self, timeout_s: float = 10.0) -> Dict[str, Any]:
        wait = Patience(timeout_s, self.patient_until)
        magic, version, kind, _, length = HEADER.unpack(self._recv_exact(HEADER.size, wait, "bootstrap header"))
        if magic != MAGIC and magic[:1] == b"\x16":  # a TLS handshake record
            raise BootstrapError(f"bootstrap peer {self.peer} speaks TLS (it sent a TLS ClientHello); this side "
                                 f"does not: TLS is on there and off here")
        if magic != MAGIC:
            raise BootstrapError(f"bootstrap peer {self.peer} sent garbage (magic {magic!r}, expected {MAGIC!r})")
        expect = KIND_JSON if self._keys is None else KIND_SEALED
        if version != VERSION or kind not in (KIND_JSON, KIND_SEALED):
            raise BootstrapError(f"bootstrap peer {self.peer} speaks version {version}/kind {kind}; this side speaks "
                                 f"{VERSION}/{expect}")
        if kind != expect:
            raise BootstrapError(f"bootstrap message #{self._received} from {self.peer[0]}:{self.peer[1]} is "
                                 + ("not sealed, though this connection is: forged or altered on the way"
                                    if expect == KIND_SEALED else "sealed, though this connection is not yet"))
        if length > MAX_BODY_BYTES or length < (TAG_BYTES if kind == KIND_SEALED else 0):
            raise BootstrapError(f"bootstrap peer {self.peer} announced {length} bytes, outside [0, {MAX_BODY_BYTES}]")
        body = self._recv_exact(length, wait, "bootstrap body")
        if self._keys is not None:
            body, tag = body[:-TAG_BYTES], body[-TAG_BYTES:]
            if not hmac.compare_digest(tag, self._tag(self._keys[1], self._received, body)):
                raise BootstrapError(f"bootstrap message #{self._received} from {self.peer[0]}:{self.peer[1]} fails "
                                     f"its MAC: altered, forged, replayed or reordered on the way, or one before it "
                                     f"was dropped")
            self._received += 1
        try:
            return loads_object(body)
        except ValueError as exc:
            raise BootstrapError(f"bootstrap peer {self.peer} sent {exc}") from exc

    def _recv_exact(self, n: int, wait: Patience, what: str) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        pos = 0
        while pos < n:
            left = wait.left(self.sock, f"bootstrap peer {self.peer[0]}:{self.peer[1]}", quiet=self.told)
            self.told = self.told or wait.waited
            if left <= 0:
                why = (f"; its host took all this side sent, but its process did not answer within "
                       f"{self.patience_s:g} s ({self.patience_why or 'patience'}): held that long, or stuck"
                       if wait.waited else "")
                raise BootstrapError(f"timed out waiting for {what} from {self.peer[0]}:{self.peer[1]} "
                                     f"({pos} of {n} bytes){why}")
            self.sock.settimeout(left)
            try:
                got = self.sock.recv_into(view[pos:], n - pos)
            except socket.timeout:
                continue
            except OSError as exc:
                raise BootstrapError(f"connection lost while reading {what}: {exc}", exc.errno) from exc
            if got == 0:
                raise BootstrapError(f"peer closed the bootstrap connection while sending {what} ({pos} of {n} bytes)")
            pos += got
        return bytes(buf)

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

    def stop(self) -> None:
        """Wake a thread blocked in accept() at once (it gets a BootstrapError); close() still follows."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # (not listening any more, or already shut down)
            pass

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(host: str, port: int, timeout_s: float = 10.0, source: Optional[str] = None) -> BootstrapConn:
    """Connect to a bootstrap listener, retrying refused connections until `timeout_s` (the peer may start later).
    `source`: the local address to connect from (see source_address)."""
    return connect_with(host, port, Retry(timeout_s), source)


def source_address(host: str) -> Optional[Tuple[str, int]]:
    """Where a process that listens on `host` connects from: that address, so that its peers see the address they
    know it by (their admission counts it as a party's: easypyverbs.admission); None (the kernel's choice) for a
    wildcard or loopback address, or a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return None if ip.is_unspecified or ip.is_loopback else (str(ip), 0)


def connect_with(host: str, port: int, retry: Retry, source: Optional[str] = None) -> BootstrapConn:
    """`connect` under a given retry policy (its clock and wait are the caller's)."""
    bind = source_address(source) if source else None
    for _ in retry:
        try:
            return BootstrapConn(socket.create_connection((host, port), timeout=max(retry.left_s(), 0.01),
                                                          source_address=bind))
        except OSError as exc:
            retry.failed(exc)
    last = retry.last_error
    raise BootstrapError(f"cannot reach bootstrap peer {host}:{port} within {retry.timeout_s:.3g} s "
                         f"({retry.attempts} attempts): {last}", getattr(last, "errno", None)) from last
