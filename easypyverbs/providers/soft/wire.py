"""Frames of the soft provider's emulated RC transport (one TCP connection per QP and direction).

Every frame starts with a 2-byte magic and a version, so garbage is detected at once.

HELLO (requester -> responder NIC), `!4sBBHIIIQ16sIQ16s`, 72 bytes:
    magic b"SVRB", version u8, kind u8 (=1), flags u16 (bit 0: the requester offers the same-host
    path), src_qpn u32, dst_qpn u32, first psn u32,
    fwd_delay_us u64 (the requester's link model: one-way delay the responder adds),
    token 16 bytes (the responder QP's attach token, from its QPInfo: only a peer that received the
    QPInfo over the bootstrap can attach to the QP, not whoever scans QP numbers first; over a sealed
    bootstrap both ends derive it from their session instead, and no message carries it: AttachToken),
    pid u32, probe_addr u64, probe 16 bytes (same-host path: the responder must read `probe` at
    `probe_addr` in process `pid` with process_vm_readv before it uses the path; see samehost.py)
HELLO_REPLY (responder -> requester), `!4sBBHH`, 10 bytes: magic, version, kind (=2), status u16 (0 ok,
    1 no such QP, 2 QP already connected, 3 wrong token, 4 this NIC takes TLS connections only: sent
    in plaintext to a plaintext HELLO, then closed), flags u16 (bit 0: same-host path on)

With TLS on (`SoftContext(tls=...)`), a connection is a mutual TLS 1.3 connection from its first byte;
every frame above travels inside it (`easypyverbs.tls.TLSStream`: the calls below take either).

With the same-host path on, a SEND or WRITE request carries opcode bit 0x40 and, instead of its
payload, PULL `!I` (count) then count x `!QQ` (address, length) in the requester's memory. Where those
spans lie in one shared region of the requester (shm.py), the count's high bit is set and PULL_REGION
`!IQQQ` (fd, inode, base address, size) follows the spans: the responder may map it and copy from there.

Push (same-host path, HELLO flag bit 1 both ways): a large WRITE request may also carry opcode bit 0x20,
"I can copy this one myself". The responder checks it as any WRITE and answers PUSH_AT at once (a RESP,
then PUSH_AT_BODY `!IQQQI`: the region's fd, inode, base address and size, and its pid) where the target
lies in a shared region of its own and it takes a push now (shm.take_push: only while it copies another WRITE
already), else an empty PUSH_AT: "no push here" (status 0: it reads the payload itself as before, and the
requester offers no push for that rkey again) or "not this one" (status PUSH_LATER, a shared target while the
responder has nothing else to copy: it reads this payload itself, and the requester offers the next again).
The requester's send thread waits for that answer; after a PUSH_AT with a body it checks the pid (it must
hold the other end of this connection: samehost.peer_owns), copies the payload into its writable mapping of
the region piece by piece, and after each piece sends PLACED (a REQ with opcode OP_PLACED, the WRITE's psn,
and the length of the prefix placed so far, growing to the WRITE's length; a first PLACED of 0: declined, read
it yourself). The responder reads nothing else meanwhile, digests each piece as its note comes, and answers
the WRITE as usual.

Deferred answers (HELLO flag bit 2, offered by the requester, echoed by the responder that takes it; never under
TLS or a link model): a SEND or WRITE whose completion nobody waits for (unsignaled, with at most one other
request awaiting its answer) carries opcode bit 0x10. Its responder need not answer it at once: the answer of
a later request acknowledges it (ACKs are cumulative), and one that would not come within DEFERRED_ACK_S
(responder.py) is sent then, for the last request placed. So a lone control frame costs no answer on the wire
and no wake-up of the requester's ACK thread. Errors (NAKs) are answered at once as always.

REQ (requester -> responder), `!HBBIQQIIQ`, 40 bytes, then `length` payload bytes for SEND/WRITE:
    magic u16 0x5352 ("SR"), version u8, opcode u8, psn u32, length u64, remote_addr u64, rkey u32,
    imm u32, due_us u64 (link model: microseconds after this header that the message is complete)
    flags ride in the high bit of opcode: 0x80 = imm present.
RESP (responder -> requester), `!HBBIIQ`, 20 bytes, then `length` bytes for a READ response:
    magic u16 0x5341 ("SA"), version u8, kind u8 (ACK/NAK/READ_RESP), psn u32, status u32 (WCStatus
    the requester completes with), length u64
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Any, List, Sequence, Union

from ...tls import TLSStream

VERSION = 1
HELLO = struct.Struct("!4sBBHIIIQ16sIQ16s")
HELLO_REPLY = struct.Struct("!4sBBHH")
PULL_COUNT = struct.Struct("!I")
PULL_SPAN = struct.Struct("!QQ")
MAX_PULL_SPANS = 1024
PULL_REGION = struct.Struct("!IQQQ")
PULL_HAS_REGION = 0x80000000
FLAG_SAME_HOST = 1
FLAG_PUSH = 2
FLAG_DEFER_ACK = 4  # requests may carry OP_NO_ACK (offered by the requester, taken by the responder)
PUSH_AT_BODY = struct.Struct("!IQQQI")
HELLO_MAGIC = b"SVRB"
REQ = struct.Struct("!HBBIQQIIQ")
REQ_MAGIC = 0x5352
RESP = struct.Struct("!HBBIIQ")
RESP_MAGIC = 0x5341

OP_SEND, OP_WRITE, OP_READ = 1, 2, 3
OP_HAS_IMM = 0x80
OP_PULL = 0x40  # same-host path: the payload is read from the requester's memory
OP_PUSH = 0x20  # ... or, for a WRITE into a shared region of the responder, copied in by the requester
OP_NO_ACK = 0x10  # no completion waits for this request's answer: it may come later, cumulative (FLAG_DEFER_ACK)
OP_MASK = 0x0F
OP_PLACED = 5  # requester -> responder after PUSH_AT: the payload is in place (length), or not (0)
ACK, NAK, READ_RESP, PUSH_AT = 1, 2, 3, 4
PUSH_LATER = 1  # the status of an empty PUSH_AT that declines this WRITE only (the next may be pushed)
HELLO_OK, HELLO_NO_QP, HELLO_BUSY, HELLO_BAD_TOKEN, HELLO_TLS_REQUIRED = 0, 1, 2, 3, 4
TOKEN_BYTES = 16


def switched_on(env: str) -> bool:
    """A soft provider feature's switch in the environment: on unless `env` says off (off, 0, no, false)."""
    return os.environ.get(env, "on").strip().lower() not in ("off", "0", "no", "false")


def defer_ack_enabled() -> bool:
    """May requests whose answer no completion waits for be answered later (OP_NO_ACK)? Unless
    EASYPYVERBS_SOFT_DEFER_ACK is off (each side offers or takes it in the HELLO exchange)."""
    return switched_on("EASYPYVERBS_SOFT_DEFER_ACK")


def resp(kind: int, psn: int, status: int, length: int = 0) -> memoryview:
    """A RESP header (then `length` bytes: a READ response's, a PUSH_AT's body)."""
    return memoryview(RESP.pack(RESP_MAGIC, VERSION, kind, psn, int(status), length))


def set_kernel_timeouts(sock: Union[socket.socket, TLSStream], seconds: float) -> None:
    """Blocking socket with SO_SNDTIMEO/SO_RCVTIMEO: calls fail with EAGAIN after `seconds` of no progress.

    Unlike `settimeout`, which polls before every call (halving large-transfer throughput here),
    this keeps Python's direct blocking path and still bounds every wait.
    """
    if isinstance(sock, TLSStream):  # it waits in poll itself, with the same bound
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    sec = int(seconds)
    tv = struct.pack("ll", sec, int((seconds - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


class PeerClosed(ConnectionError):
    """The other end closed the connection."""


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock` (straight into the caller's memory, no intermediate copy)."""
    pos, n = 0, view.nbytes
    # a blocking socket fills the view in one call (MSG_WAITALL), the GIL released throughout
    waitall = isinstance(sock, socket.socket) and sock.gettimeout() is None
    while pos < n:
        got = (sock.recv_into(view[pos:], n - pos, socket.MSG_WAITALL) if waitall
               else sock.recv_into(view[pos:], n - pos))
        if got == 0:
            raise PeerClosed(f"peer closed the connection after {pos} of {n} bytes")
        pos += got


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exactly_into(sock, memoryview(buf))
    return bytes(buf)


def drain(sock: Any, n: int, scratch: memoryview) -> None:
    """Read and discard `n` bytes through a bounded scratch buffer (`sock`: a socket or a Reader)."""
    while n > 0:
        k = min(n, scratch.nbytes)
        if isinstance(sock, Reader):
            sock.read_into(scratch[:k])
        else:
            recv_exactly_into(sock, scratch[:k])
        n -= k


#: read-ahead of a Reader: enough frames of small messages (40-byte header + 4 KiB) per system call
#: to cut the calls per message about tenfold, small enough that the extra copy it costs a large
#: payload (its first bytes come through here) stays under 2 % of a 4 MiB chunk
READ_AHEAD_BYTES = 64 << 10


class Reader:
    """Reads the frames of one connection with few system calls: what is short (headers, spans, small
    payloads) comes out of a read-ahead buffer; a long payload goes straight from the socket into the
    caller's memory once the buffered bytes are used. The only reader of its socket.

    A short read (a quarter of the buffer at most) takes nothing until all of it is here, so a timeout
    (SO_RCVTIMEO) while waiting for a header leaves the stream where it was and the call can be repeated.
    """

    def __init__(self, sock: Any, size: int = READ_AHEAD_BYTES) -> None:
        self.sock = sock
        self._buf = memoryview(bytearray(size))
        self._small = size // 4  # longer reads go straight into the caller's memory
        self._start = self._end = 0

    def buffered(self) -> int:
        return self._end - self._start

    def more_pending(self) -> bool:
        """True if bytes of a next frame are already here (used to coalesce ACKs)."""
        return self._end > self._start or more_pending(self.sock)

    def _fill(self, need: int) -> None:
        """Read until at least `need` (<= the buffer's size) bytes are buffered."""
        if self._start + need > self._buf.nbytes:  # compact: move the buffered tail to the front
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        while self._end - self._start < need:
            got = self.sock.recv_into(self._buf[self._end:], self._buf.nbytes - self._end)
            if got == 0:
                raise PeerClosed(f"peer closed the connection after {self._end - self._start} of {need} bytes")
            self._end += got

    def read_into(self, view: memoryview) -> None:
        """Fill `view` with the next `view.nbytes` bytes of the stream."""
        n = view.nbytes
        if n <= self._small:
            if self._end - self._start < n:
                self._fill(n)
            view[:] = self._buf[self._start:self._start + n]
            self._start += n
            if self._start == self._end:
                self._start = self._end = 0
            return
        k = min(n, self._end - self._start)  # long: the buffered bytes, then the socket straight into `view`
        if k:
            view[:k] = self._buf[self._start:self._start + k]
            self._start += k
        if self._start == self._end:
            self._start = self._end = 0
        if k < n:
            recv_exactly_into(self.sock, view[k:])

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)


def more_pending(sock: Any) -> bool:
    """True if bytes of a next frame are already readable (used to coalesce ACKs)."""
    if isinstance(sock, TLSStream):
        return sock.more_pending()
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False


#: most bytes one `sendmsg` takes (send_buffers): a larger WRITE goes in calls of this size. Loopback TCP moved
#: 1 GiB of FedRDMA-E's 32 MiB WRITEs in 0.39-0.49 s as one call a WRITE and in 0.27-0.39 s in 4 MiB calls, raw TCP
#: (4 MiB sendalls) 0.27-0.39 s beside them (`bench transfer --scenarios loopback-tcp --checksum none`, three
#: alternations, 2-core test machine; 2 and 8 MiB calls read as 4); plain 32 MiB sendalls were slower than 4 MiB
#: ones too (median 0.35-0.37 against 0.28-0.32 s a GiB, scratch)
SEND_CALL_BYTES = 4 << 20


def send_buffers(sock: Any, bufs: Sequence[memoryview]) -> None:
    """Send every buffer in order with vectored writes of at most SEND_CALL_BYTES (and 512 iovecs) each,
    handling partial sends."""
    if isinstance(sock, TLSStream):
        sock.send_buffers(bufs)
        return
    pending: List[memoryview] = []
    for b in bufs:
        if b.itemsize != 1 or b.ndim != 1:  # slices and `_unsent` count items: make them bytes
            b = b.cast("B")
        n = b.nbytes
        if n > SEND_CALL_BYTES:
            pending.extend(b[i:i + SEND_CALL_BYTES] for i in range(0, n, SEND_CALL_BYTES))
        elif n:
            pending.append(b)
    while pending:
        k, size = 1, pending[0].nbytes  # a call's iovecs: at least one, then while they fit
        while k < len(pending) and k < 512 and size + pending[k].nbytes <= SEND_CALL_BYTES:
            size += pending[k].nbytes
            k += 1
        sent = sock.sendmsg(pending[:k])
        if not sent:  # (a blocking socket takes at least a byte or raises: never spin on nothing)
            raise OSError(f"sendmsg took none of {size} bytes")
        pending = _unsent(pending[:k], sent) + pending[k:]


def send_without_waiting(sock: socket.socket, bufs: Sequence[memoryview]) -> List[memoryview]:
    """One vectored write that never waits for room in the socket's buffer (a plain socket only);
    returns what it did not take, in order, for a blocking `send_buffers` to finish."""
    pending: List[memoryview] = [b for b in bufs if b.nbytes]
    if len(pending) > 512:
        return pending
    try:
        return _unsent(pending, sock.sendmsg(pending, [], socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return pending


def _unsent(pending: List[memoryview], sent: int) -> List[memoryview]:
    while sent:
        head = pending[0]
        if sent >= head.nbytes:
            sent -= head.nbytes
            pending.pop(0)
        else:
            pending[0] = head[sent:]
            sent = 0
    return pending
