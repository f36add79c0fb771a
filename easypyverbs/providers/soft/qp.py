"""Soft provider: the RC queue pair.

Each direction of a connected pair is one TCP connection from the requester to the responder's
emulated NIC. This module: the QP's state, posted receives, connection, error handling and teardown;
requester.py and responder.py its two halves, each an object of its own that sees the QP through a port
(port.py, QPPort). Requester threads: `sender` (transmits WRs in order, the WRs posted meanwhile in one
vectored write, paced by the link model; a lone small WR leaves from the posting thread instead,
`Requester.post`) and `acks` (reads ACK/NAK/READ responses, completes WRs in order, a cumulative ACK's WRs at
once). Responder thread: `responder` (validates each request against
the MR table, places bytes with `recv_into` straight in the target MR, small ones through a read-ahead
buffer, wire.Reader; consumes posted receives, answers: responder.py). Completions that the link model
delays go through a FIFO `DelayLine`, so order is kept.
"""
from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Union

from ... import stalls
from ...api import CQ, OPCODE_OF, PD, QP, SGE, SGEs
from ...bootstrap import Patience
from ...enums import QPState, WCOpcode, WCStatus
from ...errors import EasyVerbsError, UsageError
from ...tls import TLSStream, handshake
from ...types import WC, DataPath, QPCap, QPInfo, RemoteMR
from . import samehost, shm, wire
from .cq import SoftCQ
from .link import DelayLine
from .port import NIC
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


class SoftQP(QP):
    send_cq: SoftCQ  # (the soft context makes SoftCQs only)
    recv_cq: SoftCQ

    def __init__(self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap, nic: NIC) -> None:
        """`nic`: the emulated NIC of `pd`'s context (SoftContext)."""
        super().__init__(pd, send_cq, recv_cq, cap)
        self.nic = nic
        self.qpn = nic.add_qp(self)
        self.psn = secrets.randbelow(PSN_MASK + 1)
        self.token = secrets.token_bytes(wire.TOKEN_BYTES)  # handed out in QPInfo only, unless bound
        #: capabilities.AttachToken: tokens derived from the session (none in QPInfo), once bind_attach ran
        self._derive: Optional[Callable[[int, bool], bytes]] = None
        self._awaits: Optional[str] = None  # the peer NIC's host, from connect() (NIC admission: awaits_host)
        self.st = QPState.INIT
        self.err_seen = False  # set before an error completion is pushed; the flush follows
        # one lock, three conditions, so that each event wakes only the threads it concerns: `tx_cv` the
        # send thread (a WR queued, a doorbell write's rest), `recv_cv` a responder waiting for a posted
        # receive, `cv` the rest (close's drain, state changes). One condition for all woke the send
        # thread for every ACK and every posted receive: 18 needless thread switches per 64 KiB round trip
        lock = threading.RLock()
        self.cv = threading.Condition(lock)
        self.tx_cv = threading.Condition(lock)
        self.recv_cv = threading.Condition(lock)
        self.recv_q: Deque[Any] = collections.deque()
        self.closing = False
        self._threads: List[threading.Thread] = []
        self._probe: Optional[samehost.Probe] = None
        self.requester = Requester(self, self.psn)
        self.responder = Responder(self)

    # -- connection -----------------------------------------------------------------------------
    def bind_attach(self, derive: Callable[[int, bool], bytes]) -> None:
        """capabilities.AttachToken: this QP's attach token, and the one it presents to its peer's QP, come from
        `derive` (a sealed bootstrap's attach_token); its QPInfo carries none."""
        if self.st is not QPState.INIT:
            raise UsageError(f"soft QP {self.qpn}: bind_attach before connect, not in state {self.st.name}")
        mine = derive(self.qpn, True)
        if len(mine) != wire.TOKEN_BYTES:
            raise UsageError(f"an attach token is {wire.TOKEN_BYTES} bytes, got {len(mine)}")
        self.token, self._derive = mine, derive

    def _info(self) -> QPInfo:
        nic = self.nic
        return QPInfo("soft", self.qpn, self.psn, nic.nic_address, 0, nic.link_model.mtu, nic.max_msg_bytes,
                      token="" if self._derive is not None else self.token.hex())

    def _remote_token(self, remote: QPInfo) -> bytes:
        """What this QP presents to attach to `remote`: the derived token where bound, else its QPInfo's."""
        if self._derive is None:
            return bytes.fromhex(remote.token).ljust(wire.TOKEN_BYTES, b"\0")[:wire.TOKEN_BYTES]
        if remote.token:
            raise EasyVerbsError(f"soft QP {self.qpn}: peer QP {remote.qpn} hands out its attach token in its QPInfo "
                                 f"over a sealed bootstrap: it does not bind its data connection to the session "
                                 f"(an older easypyverbs?), so this side cannot attach to it")
        return self._derive(remote.qpn, False)

    def _state(self) -> QPState:
        # an error completion is visible only once the QP reads ERR, as on a real device (rxe, NICs)
        return QPState.ERR if self.err_seen else self.st

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=f"soft-qp{self.qpn}-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    @property
    def awaits_host(self) -> Optional[str]:
        return self._awaits if self.responder.sock is None else None

    def _connect(self, remote: QPInfo, timeout_s: float, patient_until: float) -> None:
        host, _, port = remote.gid.rpartition(":")
        self._awaits = host.strip("[]")
        if not host or not port.isdigit():
            raise UsageError(f"soft QPInfo gid must be host:port, got {remote.gid!r}")
        link = self.nic.link_model
        token = self._remote_token(remote)
        try:
            plain = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s,
                                             source_address=self.nic.source)
        except OSError as exc:
            raise EasyVerbsError(f"soft QP {self.qpn}: cannot reach peer NIC {remote.gid}: {exc} (the peer's soft "
                                 f"data port, one of its soft_data_ports: open to this host in its firewall?)",
                                 exc.errno) from exc
        sock: Union[socket.socket, TLSStream] = plain
        tls = self.nic.tls
        if tls is not None:
            try:
                sock = TLSStream(handshake(plain, tls.client, False, timeout_s, patient_until), timeout_s)
            except OSError as exc:  # ssl.SSLError, TimeoutError, a reset
                plain.close()
                raise EasyVerbsError(f"soft QP {self.qpn}: TLS handshake with peer NIC {remote.gid} failed: {exc} "
                                     f"(this side has TLS on: does the peer NIC, and does its certificate come from "
                                     f"this side's CA?)") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            offer = self.nic.same_host and self.nic.link is None
            self._probe = samehost.Probe() if offer else None
            flags = (wire.FLAG_SAME_HOST | (wire.FLAG_PUSH if shm.push_enabled() else 0)) if offer else 0
            if tls is None and self.nic.link is None and wire.defer_ack_enabled():
                flags |= wire.FLAG_DEFER_ACK
            sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, flags,
                                         self.qpn, remote.qpn, self.psn, int(link.delay_s * 1e6), token,
                                         os.getpid(), self._probe.addr if self._probe else 0,
                                         self._probe.value if self._probe else bytes(16)))
            reply = _reply(sock, remote.gid, timeout_s, patient_until)
            magic, version, kind, status, flags = wire.HELLO_REPLY.unpack(reply)
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
        wire.set_kernel_timeouts(sock, self.nic.retry_timeout_s)
        pull = bool(flags & wire.FLAG_SAME_HOST)
        push = pull and bool(flags & wire.FLAG_PUSH) and self._probe is not None
        self._probe = None
        req = self.requester
        with self.cv:
            req.connected(sock, pull, push, bool(flags & wire.FLAG_DEFER_ACK))
            self.st = QPState.RTS
        if link.delay_s > 0:
            req.ack_line = DelayLine(f"soft-qp{self.qpn}-ackdelay")
        self._spawn(req.send_loop, "send")
        self._spawn(req.ack_loop, "acks")

    @property
    def data_path(self) -> str:
        """How this QP's outgoing payloads reach the peer: "same-host (memfd map / process_vm_readv)" (the peer's
        NIC copies them: through a mapping where they lie in shared memory, shm.py, else with
        process_vm_readv), "tcp" or "tcp+tls" (the context's `tls`)."""
        tls = isinstance(self.requester.sock, TLSStream)
        if self.requester.pull:  # under TLS too: the payload is a copy between two processes of this host
            return "same-host (memfd map / process_vm_readv)" + (", headers over tls" if tls else "")
        return "tcp+tls" if tls else "tcp"

    @property
    def path_kind(self) -> DataPath:
        """Emulated: a copy between two processes of this host (the same-host path), else TCP, through the link
        model where it is active."""
        if self.requester.pull:
            return DataPath.SAME_HOST_EMULATED
        return DataPath.LINK_EMULATED if self.nic.link is not None else DataPath.TCP_EMULATED

    # -- capabilities.LeavingWrites -------------------------------------------------------------
    @property
    def calls_on_leave(self) -> bool:
        """A WRITE's bytes leave through this QP's own send thread (over TCP, with TLS or not), which hands each
        piece to the WRITE's `on_leave` first; on the same-host path the peer's NIC reads them: never called."""
        return not self.requester.pull

    def post_write(self, sges: SGEs, remote: RemoteMR, remote_offset: int = 0, wr_id: int = 0, signaled: bool = True,
                   on_leave: Optional[Callable[[int, memoryview], None]] = None) -> None:
        """QP.post_write, with `on_leave` as capabilities.LeavingWrites has it (called where `calls_on_leave`)."""
        if on_leave is None or not self.calls_on_leave:
            super().post_write(sges, remote, remote_offset, wr_id, signaled)
            return
        lst = self._rdma_sges(sges, remote, remote_offset, None)
        self.requester.post("write", lst, remote.addr + remote_offset, remote.rkey, None, wr_id, signaled, on_leave)

    def attach_responder(self, sock: Any, src_qpn: int, psn: int, fwd_delay_s: float,
                         pull_pid: int = 0, push: bool = False, defer_ack: bool = False) -> bool:
        """Called by the NIC when the peer's requester dials this QP (`pull_pid`: same-host path; `push`: it
        may copy large WRITEs into our shared memory itself; `defer_ack`: its requests may carry OP_NO_ACK)."""
        with self.cv:
            if self.closing or self.responder.sock is not None or self.st == QPState.ERR:
                return False
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.responder.attached(sock, pull_pid, push, defer_ack)
        self._spawn(lambda: self.responder.respond_loop(sock, psn, fwd_delay_s), "resp")
        return True

    # -- posting: sends (requester.py), receives -------------------------------------------------
    def _post(self, op: str, sges: List[SGE], raddr: Optional[int], rkey: int, imm: Optional[int], wr_id: int,
              signaled: bool) -> None:
        self.requester.post(op, sges, raddr, rkey, imm, wr_id, signaled)

    def _begin_batch(self) -> None:
        self.requester.begin_batch()

    def _end_batch(self) -> None:
        self.requester.end_batch()

    def _post_recv(self, sges: List[SGE], wr_id: int) -> None:
        with self.cv:
            if len(self.recv_q) >= self.cap.max_recv_wr:
                raise EasyVerbsError(f"receive queue full ({self.cap.max_recv_wr} WRs posted)", 12)
            self.recv_q.append((wr_id, sges))
            self.recv_cv.notify()

    # -- errors (port.QPPort) -------------------------------------------------------------------
    def awaits_answers(self) -> bool:
        with self.cv:
            return self.requester.awaits_answers()

    def fail(self, status: WCStatus, why: str) -> None:
        """Error the QP after the completions already due (keeps completion order)."""
        line = self.requester.ack_line
        if line is not None:
            line.submit(time.monotonic(), lambda: self.enter_error(status, why))
        else:
            self.enter_error(status, why)

    def _to_error(self, why: str) -> None:
        self.enter_error(WCStatus.WR_FLUSH_ERR, why)

    def enter_error(self, first_status: WCStatus, why: str) -> None:
        with self.cv:
            if self.st == QPState.ERR:
                return
            self.st = QPState.ERR
            victims = self.requester.flush()
            recvs = list(self.recv_q)
            self.recv_q.clear()
            self._wake_all()
        if not self.closing:
            # a peer that closed its QP is routine; anything else deserves a warning
            (log.info if why.startswith("peer disconnected") else log.warning)("soft QP %d -> ERR: %s", self.qpn, why)
        for i, wr in enumerate(victims):
            st = first_status if i == 0 else WCStatus.WR_FLUSH_ERR
            self.send_cq.push(WC(wr.wr_id, st, OPCODE_OF[wr.op], 0, None, self.qpn, reason=why))
        for wr_id, _ in recvs:
            self.recv_cq.push(WC(wr_id, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, None, self.qpn, reason=why))
        self._shutdown_sockets()

    def _wake_all(self) -> None:
        """Wake every waiter on this QP (under `cv`): its state changed."""
        for cv in (self.cv, self.tx_cv, self.recv_cv):
            cv.notify_all()

    def _shutdown_sockets(self) -> None:
        for s in (self.requester.sock, self.responder.sock):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    # -- lifetime -------------------------------------------------------------------------------
    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Wait (bounded) for posted sends to complete, then tear down."""
        if not self.closed and self.st == QPState.RTS:
            with self.cv:
                self.cv.wait_for(lambda: self.requester.outstanding == 0 or self.st != QPState.RTS,
                                 timeout=drain_timeout_s)
        super().close()

    def abort(self) -> None:
        super().close()

    def _close_impl(self) -> None:
        with self.cv:
            self.closing = True
            self._wake_all()
        self.responder.send_owed()
        self._shutdown_sockets()
        for line in (self.requester.ack_line, self.responder.resp_line):
            if line is not None:
                line.close(drain=False)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        for s in (self.requester.sock, self.responder.sock):
            if s is not None:
                s.close()
        with self.cv:
            self.st = QPState.ERR
            self.requester.drop_tail()
        self.nic.remove_qp(self.qpn)
