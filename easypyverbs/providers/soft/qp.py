"""Soft provider: the RC queue pair.

Each direction of a connected pair is one TCP connection from the requester to the responder's
emulated NIC. This module: the QP's state, connection and teardown; requester.py and responder.py its
two halves. Requester threads: `sender` (transmits WRs in order, the WRs posted meanwhile in one
vectored write, paced by the link model; a lone small WR leaves from the posting thread instead,
`_post`) and `acks` (reads ACK/NAK/READ responses, completes WRs in order, a cumulative ACK's WRs at
once). Responder thread: `responder` (validates each request against
the MR table, places bytes with `recv_into` straight in the target MR, small ones through a read-ahead
buffer, wire.Reader; consumes posted receives, answers: responder.py). Completions that the link model delays go through a FIFO
`DelayLine`, so order is kept.
"""
from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Deque, List, Optional, Set, Tuple

from ... import stalls
from ...api import CQ, OPCODE_OF, PD, QP, SGE
from ...bootstrap import Patience
from ...enums import QPState, WCOpcode, WCStatus
from ...errors import EasyVerbsError, UsageError
from ...tls import TLSStream, handshake
from ...types import WC, QPCap, QPInfo
from . import samehost, shm, wire
from .link import DelayLine
from .requester import DOORBELL_BATCH_WRS, DOORBELL_INFLIGHT, Requester, _WR  # noqa: F401 (the tests read them here)
from .responder import PSN_MASK, Responder

log = logging.getLogger("easypyverbs.soft")


def _reply(sock: Any, gid: str, timeout_s: float, patient_until: float) -> bytes:
    """The peer NIC's HELLO_REPLY within `timeout_s`, or on until `patient_until` while the peer's host
    acknowledges everything sent to it (bootstrap.Patience): its NIC is a thread of a process that may be
    held (native code keeping its GIL)."""
    wait = Patience(timeout_s, patient_until)
    buf = bytearray(wire.HELLO_REPLY.size)
    view, pos = memoryview(buf), 0
    try:
        while pos < len(buf):
            left = wait.left(getattr(sock, "sock", sock), f"soft NIC {gid} (a new QP)")  # (a TLSStream's socket)
            if left <= 0:
                raise socket.timeout(f"no answer within {stalls.clock() - wait.start:.1f} s" + (
                    " (its host acknowledged all this side sent: its process is held or stuck)" if wait.waited else ""))
            sock.settimeout(left)
            try:
                got = sock.recv_into(view[pos:], len(buf) - pos)
            except socket.timeout:
                continue
            if got == 0:
                raise wire.PeerClosed(f"peer closed the connection after {pos} of {len(buf)} bytes")
            pos += got
    finally:
        sock.settimeout(timeout_s)
    return bytes(buf)


class SoftQP(Requester, Responder, QP):
    def __init__(self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> None:
        super().__init__(pd, send_cq, recv_cq, cap)
        self.qpn = self.ctx.add_qp(self)  # type: ignore[attr-defined]
        self.psn = secrets.randbelow(PSN_MASK + 1)
        self.token = secrets.token_bytes(wire.TOKEN_BYTES)  # handed out in QPInfo only
        self._next_psn = self.psn
        self._st = QPState.INIT
        self._err_seen = False  # set before an error completion is pushed; the flush follows
        # one lock, three conditions, so that each event wakes only the threads it concerns: `_tx_cv` the
        # send thread (a WR queued, a doorbell write's rest), `_recv_cv` a responder waiting for a posted
        # receive, `_cv` the rest (close's drain, state changes). One condition for all woke the send
        # thread for every ACK and every posted receive: 18 needless thread switches per 64 KiB round trip
        lock = threading.RLock()
        self._cv = threading.Condition(lock)
        self._tx_cv = threading.Condition(lock)
        self._recv_cv = threading.Condition(lock)
        self._send_q: Deque[_WR] = collections.deque()
        self._inflight: Deque[_WR] = collections.deque()
        self._outstanding = 0
        self._tx_busy = False  # a thread is writing requests to the wire (only one does, in PSN order)
        self._tail: Optional[List[memoryview]] = None  # a doorbell write's part that did not fit the socket
        self._batch: Optional[List[_WR]] = None  # WRs posted inside QP.batch(), held until it ends
        self._batch_owner = 0  # the thread that opened it
        self._recv_q: Deque[Any] = collections.deque()
        self._req_sock: Optional[Any] = None  # a socket, or a TLSStream with TLS on
        self._resp_sock: Optional[Any] = None
        self._resp_lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._ack_line: Optional[DelayLine] = None
        self._resp_line: Optional[DelayLine] = None
        self._closing = False
        self._scratch: Optional[memoryview] = None
        self._unacked_bytes = self._unacked_reqs = 0  # responder: bytes and requests placed since the last answer
        self._pull = False  # requester: the responder reads our payloads itself (same-host path)
        self._pull_pid = 0  # responder: the requester's pid when we read its payloads (same-host path)
        self._regions: Optional[shm.PeerRegions] = None  # responder: the requester's shared regions mapped here
        self._probe: Optional[samehost.Probe] = None
        self._push = False  # requester: a large WRITE into the responder's shared memory may be copied by us
        self._push_regions: Optional[shm.PeerRegions] = None  # requester: the responder's regions we write into
        self._push_psn: Optional[int] = None  # requester: the WRITE whose PUSH_AT the send thread waits for
        self._push_at: Optional[Tuple[int, ...]] = None  # requester: that PUSH_AT's body, once it came
        self._push_later = False  # requester: that PUSH_AT declined this WRITE only ("not this one")
        self._push_ok = False  # responder: the requester may copy large WRITEs into our shared memory
        self._defer_ack = False  # requester: requests no completion waits for may be answered later (wire.py)
        self._defer_ok = False  # responder: ... and we may answer them later
        self._owed_psn: Optional[int] = None  # responder: the last request deferred (OP_NO_ACK), not answered yet
        self._deferred = 0  # responder: of `_unacked_reqs`, those that carried OP_NO_ACK
        self._no_push_rkeys: Set[int] = set()  # requester: rkeys the responder answered "no push here" for

    # -- connection -----------------------------------------------------------------------------
    def _info(self) -> QPInfo:
        ctx = self.ctx
        return QPInfo("soft", self.qpn, self.psn, ctx.nic_address, 0, ctx.link_model.mtu, ctx.max_msg_bytes,  # type: ignore[attr-defined]
                      token=self.token.hex())

    def _state(self) -> QPState:
        # an error completion is visible only once the QP reads ERR, as on a real device (rxe, NICs)
        return QPState.ERR if self._err_seen else self._st

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=f"soft-qp{self.qpn}-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _connect(self, remote: QPInfo, timeout_s: float, patient_until: float) -> None:
        host, _, port = remote.gid.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"soft QPInfo gid must be host:port, got {remote.gid!r}")
        link = self.ctx.link_model  # type: ignore[attr-defined]
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        except OSError as exc:
            raise EasyVerbsError(f"soft QP {self.qpn}: cannot reach peer NIC {remote.gid}: {exc}", exc.errno) from exc
        tls = self.ctx.tls  # type: ignore[attr-defined]
        if tls is not None:
            try:
                sock = TLSStream(handshake(sock, tls.client, False, timeout_s, patient_until), timeout_s)
            except OSError as exc:  # ssl.SSLError, TimeoutError, a reset
                sock.close()
                raise EasyVerbsError(f"soft QP {self.qpn}: TLS handshake with peer NIC {remote.gid} failed: {exc} "
                                     f"(this side has TLS on: does the peer NIC, and does its certificate come from "
                                     f"this side's CA?)") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            token = bytes.fromhex(remote.token).ljust(wire.TOKEN_BYTES, b"\0")[:wire.TOKEN_BYTES]
            offer = self.ctx.same_host and self.ctx.link is None  # type: ignore[attr-defined]
            self._probe = samehost.Probe() if offer else None
            flags = (wire.FLAG_SAME_HOST | (wire.FLAG_PUSH if shm.push_enabled() else 0)) if offer else 0
            if tls is None and self.ctx.link is None and wire.defer_ack_enabled():  # type: ignore[attr-defined]
                flags |= wire.FLAG_DEFER_ACK
            sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, flags,
                                         self.qpn, remote.qpn, self.psn, int(link.delay_s * 1e6), token,
                                         os.getpid(), self._probe.addr if self._probe else 0,
                                         self._probe.value if self._probe else bytes(16)))
            magic, version, kind, status, flags = wire.HELLO_REPLY.unpack(_reply(sock, remote.gid, timeout_s, patient_until))
        except (OSError, wire.PeerClosed) as exc:
            sock.close()
            raise EasyVerbsError(f"soft QP {self.qpn}: handshake with {remote.gid} failed: {exc}") from exc
        if magic != wire.HELLO_MAGIC or version != wire.VERSION or kind != 2 or status != wire.HELLO_OK:
            sock.close()
            why = {wire.HELLO_NO_QP: "no such QP", wire.HELLO_BUSY: "QP already connected",
                   wire.HELLO_BAD_TOKEN: "wrong attach token",
                   wire.HELLO_TLS_REQUIRED: "that NIC takes TLS connections only (TLS on there, off here)",
                   }.get(status, "bad reply")
            raise EasyVerbsError(f"soft QP {self.qpn}: peer {remote.gid} refused QP {remote.qpn}: {why}")
        wire.set_kernel_timeouts(sock, self.ctx.retry_timeout_s)  # type: ignore[attr-defined]
        self._pull = bool(flags & wire.FLAG_SAME_HOST)
        self._defer_ack = bool(flags & wire.FLAG_DEFER_ACK)
        self._push = self._pull and bool(flags & wire.FLAG_PUSH) and self._probe is not None
        self._probe = None
        with self._cv:
            self._req_sock = sock
            self._st = QPState.RTS
        if link.delay_s > 0:
            self._ack_line = DelayLine(f"soft-qp{self.qpn}-ackdelay")
        self._spawn(self._send_loop, "send")
        self._spawn(self._ack_loop, "acks")

    @property
    def data_path(self) -> str:
        """How this QP's outgoing payloads reach the peer: "same-host (memfd map / process_vm_readv)" (the peer's
        NIC copies them: through a mapping where they lie in shared memory, shm.py, else with
        process_vm_readv), "tcp" or "tcp+tls" (the context's `tls`)."""
        tls = isinstance(self._req_sock, TLSStream)
        if self._pull:  # under TLS too: the payload is a copy between two processes of this host
            return "same-host (memfd map / process_vm_readv)" + (", headers over tls" if tls else "")
        return "tcp+tls" if tls else "tcp"

    @property
    def calls_on_leave(self) -> bool:
        """A WRITE's bytes leave through this QP's own send thread (over TCP, with TLS or not), which hands each
        piece to the WRITE's `on_leave` first; on the same-host path the peer's NIC reads them: never called."""
        return not self._pull

    def attach_responder(self, sock: Any, src_qpn: int, psn: int, fwd_delay_s: float,
                         pull_pid: int = 0, push: bool = False, defer_ack: bool = False) -> bool:
        """Called by the NIC when the peer's requester dials this QP (`pull_pid`: same-host path; `push`: it
        may copy large WRITEs into our shared memory itself; `defer_ack`: its requests may carry OP_NO_ACK)."""
        with self._cv:
            if self._closing or self._resp_sock is not None or self._st == QPState.ERR:
                return False
            self._pull_pid = pull_pid
            self._push_ok = bool(pull_pid and push)
            self._defer_ok = defer_ack
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._resp_sock = sock
        self._spawn(lambda: self._respond_loop(sock, psn, fwd_delay_s), "resp")
        return True

    # -- posting: requester.py; receives ---------------------------------------------------------
    def _post_recv(self, sges: List[SGE], wr_id: int) -> None:
        with self._cv:
            if len(self._recv_q) >= self.cap.max_recv_wr:
                raise EasyVerbsError(f"receive queue full ({self.cap.max_recv_wr} WRs posted)", 12)
            self._recv_q.append((wr_id, sges))
            self._recv_cv.notify()

    def _fail(self, status: WCStatus, why: str) -> None:
        """Error the QP after the completions already due (keeps completion order)."""
        if self._ack_line is not None:
            self._ack_line.submit(time.monotonic(), lambda: self._enter_error(status, why))
        else:
            self._enter_error(status, why)

    def _enter_error(self, first_status: WCStatus, why: str) -> None:
        with self._cv:
            if self._st == QPState.ERR:
                return
            self._st = QPState.ERR
            self._tail = None  # (its views would keep the MR's buffer exported)
            victims = list(self._inflight) + list(self._send_q)
            self._inflight.clear()
            self._send_q.clear()
            self._outstanding -= len(victims)
            recvs = list(self._recv_q)
            self._recv_q.clear()
            self._wake_all()
        if not self._closing:
            # a peer that closed its QP is routine; anything else deserves a warning
            (log.info if why.startswith("peer disconnected") else log.warning)("soft QP %d -> ERR: %s", self.qpn, why)
        for i, wr in enumerate(victims):
            st = first_status if i == 0 else WCStatus.WR_FLUSH_ERR
            self.send_cq.push(WC(wr.wr_id, st, OPCODE_OF[wr.op], 0, None, self.qpn, reason=why))  # type: ignore[attr-defined]
        for wr_id, _ in recvs:
            self.recv_cq.push(WC(wr_id, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, None, self.qpn, reason=why))  # type: ignore[attr-defined]
        self._shutdown_sockets()

    def _wake_all(self) -> None:
        """Wake every waiter on this QP (under `_cv`): its state changed."""
        for cv in (self._cv, self._tx_cv, self._recv_cv):
            cv.notify_all()

    def _shutdown_sockets(self) -> None:
        for s in (self._req_sock, self._resp_sock):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    # -- lifetime -------------------------------------------------------------------------------
    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Wait (bounded) for posted sends to complete, then tear down."""
        if not self.closed and self._st == QPState.RTS:
            with self._cv:
                self._cv.wait_for(lambda: self._outstanding == 0 or self._st != QPState.RTS, timeout=drain_timeout_s)
        super().close()

    def abort(self) -> None:
        super().close()

    def _close_impl(self) -> None:
        with self._cv:
            self._closing = True
            self._wake_all()
        self._send_owed()
        self._shutdown_sockets()
        for line in (self._ack_line, self._resp_line):
            if line is not None:
                line.close(drain=False)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        for s in (self._req_sock, self._resp_sock):
            if s is not None:
                s.close()
        with self._cv:
            self._st = QPState.ERR
            self._tail = None
        self.ctx.remove_qp(self.qpn)  # type: ignore[attr-defined]
