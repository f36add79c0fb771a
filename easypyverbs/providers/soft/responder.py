"""Soft provider: the responder side of an RC queue pair (the emulated NIC's work for a peer's requests).

One thread per QP reads the requester's frames, checks each request against the MR table (rkey, bounds,
access) and the posted receives, places the bytes (from the socket, or with the same-host path straight
from the requester's memory, samehost.py), and answers ACK/NAK, delayed by the link model if any.
`SoftQP` (qp.py) has one `Responder` and one `Requester` (requester.py), and keeps the QP's state, posted
receives and lifetime; each half sees it through a port (port.py, QPPort).
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Any, List, Optional, Tuple, Union, cast

from ...buffers import address_of
from ...enums import Access, QPState, WCOpcode, WCStatus
from ...errors import UsageError
from ...stalls import clock
from ...types import WC
from . import samehost, shm, wire
from .landing import Landing
from .link import DelayLine
from .port import QPPort, TargetMR

#: answers to back-to-back WRITEs are coalesced (one cumulative ACK), but at least once per this many
#: bytes: a sender whose window is counted in completed WRITEs must see them complete while it streams,
#: or a window of W chunks fills the link only once per W chunks (measured: fedrdma-e needed 2.5x the
#: window of fedrdma on a 100 Mbit/s x 20 ms testbed link before this bound)
ACK_EVERY_BYTES = 1 << 20
#: and at least once per this many requests (a stream of small SENDs: signaled completions in step)
ACK_EVERY_REQUESTS = 16
#: a request whose answer may wait (OP_NO_ACK, wire.py) is answered this long after it was placed at the latest
#: (or with the next request's answer, before): a connection's lone control frames cost no answer each
DEFERRED_ACK_S = 0.005
PSN_MASK = 0xFFFFFF
log = logging.getLogger("easypyverbs.soft")
_OPS = {"send": wire.OP_SEND, "write": wire.OP_WRITE, "read": wire.OP_READ}


def _readable(sock: Any, timeout_s: float) -> bool:
    """Does `sock` have bytes to read (or its end) within `timeout_s`?"""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(timeout_s * 1000))
#: a same-host request's payload: its spans in the requester's memory, and the mapping to copy them from (or None)
#: (or the region named, not yet mapped: a WRITE the requester offered to push, mapped only if it does not)
Pulled = Tuple[List[Any], Any]


class ProtocolViolation(Exception):
    """The requester sent what the protocol does not allow at this point."""


class Responder:
    """The responder half of a SoftQP: its connection from the peer's requester, and the thread serving it (uses
    the QP's posted receives, CQs and error handling through `qp`)."""

    def __init__(self, qp: QPPort) -> None:
        self.qp = qp
        self.sock: Optional[Any] = None  # the peer's requester's connection: a socket, or a TLSStream with TLS on
        self.resp_line: Optional[DelayLine] = None  # answers the link model delays
        self._resp_lock = threading.Lock()
        self._scratch: Optional[memoryview] = None
        self._unacked_bytes = self._unacked_reqs = 0  # bytes and requests placed since the last answer
        self._pull_pid = 0  # the requester's pid when we read its payloads (same-host path)
        self._regions: Optional[shm.PeerRegions] = None  # the requester's shared regions mapped here
        self._push_ok = False  # the requester may copy large WRITEs into our shared memory
        self._defer_ok = False  # the requester's requests may carry OP_NO_ACK, and we may answer them later
        self._owed_psn: Optional[int] = None  # the last request deferred (OP_NO_ACK), not answered yet
        self._deferred = 0  # of `_unacked_reqs`, those that carried OP_NO_ACK

    def attached(self, sock: Any, pull_pid: int = 0, push: bool = False, defer_ack: bool = False) -> None:
        """The peer's requester dialed the QP (SoftQP.attach_responder, under `qp.cv`): `sock` is its connection."""
        self._pull_pid = pull_pid
        self._push_ok = bool(pull_pid and push)
        self._defer_ok = defer_ack
        self.sock = sock

    # -- responder ------------------------------------------------------------------------------
    def _take_recv(self) -> Optional[Any]:
        # on the clock without this process's holds: the receive it waits for is posted by a thread of this
        # process, which a hold (code keeping the GIL) stops as it stops this one
        qp = self.qp
        deadline = clock() + qp.nic.rnr_timeout_s
        with qp.cv:
            while not qp.recv_q and qp.st != QPState.ERR and not qp.closing:
                left = deadline - clock()
                if left <= 0:
                    return None
                qp.recv_cv.wait(left)
            return qp.recv_q.popleft() if qp.recv_q else None

    def _find_mr(self, rkey: int, raddr: int, length: int, need: Access) -> Optional[TargetMR]:
        mr = self.qp.nic.mr_by_rkey(rkey)
        # int.__and__: IntFlag's own & builds a flag member, a few microseconds per request
        if mr is None or mr.pd is not self.qp.pd or not int.__and__(mr.access, need):
            return None
        if raddr < mr.addr or raddr + length > mr.addr + mr.length:
            return None
        return mr

    def _lookup(self, rkey: int, raddr: int, length: int, need: Access) -> Optional[memoryview]:
        mr = self._find_mr(rkey, raddr, length, need)
        try:
            return None if mr is None else mr.remote_view(rkey, raddr - mr.addr, length)
        except UsageError:  # deregistered meanwhile
            return None

    def respond_loop(self, sock: socket.socket, psn: int, fwd_delay_s: float) -> None:
        """The responder thread: serve the requests arriving on `sock` (the QP's `attached` connection)."""
        try:
            self._respond(sock, psn, fwd_delay_s)
        finally:  # this thread is the connection's only reader: once it ends, nothing of the peer stays mapped
            if self._regions is not None:
                self._regions.close()

    def _respond(self, sock: socket.socket, psn: int, fwd_delay_s: float) -> None:
        hdr = memoryview(bytearray(wire.REQ.size))
        rd = wire.Reader(sock)  # the only reader of `sock`: headers and small payloads in few system calls
        expected = psn
        while True:
            try:
                if self._owed_psn is not None:
                    self._answer_owed(rd)
                if self._regions is not None:
                    self._await_request(rd, self._regions)
                rd.read_into(hdr)
                magic, version, opcode, psn, length, raddr, rkey, imm, due_us = wire.REQ.unpack(hdr)
                due = time.monotonic() + due_us / 1e6 + fwd_delay_s
                op, has_imm, pull = opcode & wire.OP_MASK, bool(opcode & wire.OP_HAS_IMM), bool(opcode & wire.OP_PULL)
                push, no_ack = bool(opcode & wire.OP_PUSH), bool(opcode & wire.OP_NO_ACK)
                if magic != wire.REQ_MAGIC or version != wire.VERSION or op not in _OPS.values() or psn != expected \
                        or (pull and (not self._pull_pid or op == wire.OP_READ)) \
                        or (push and (not pull or op != wire.OP_WRITE)) \
                        or (no_ack and (not self._defer_ok or op == wire.OP_READ or push)):
                    self.qp.enter_error(WCStatus.WR_FLUSH_ERR, f"protocol violation from peer (magic {magic:#x}, "
                                                               f"psn {psn}, expected {expected})")
                    return
                expected = (expected + 1) & PSN_MASK
                pulled = self._read_spans(rd, length, push and self._push_ok) if pull else None
                if pull and pulled is None:
                    self.qp.enter_error(WCStatus.WR_FLUSH_ERR, "protocol violation from peer (bad same-host spans)")
                    return
                self._serve(rd, op, has_imm, psn, length, raddr, rkey, imm, due, pulled,
                            push and self._push_ok, no_ack)
            except (OSError, wire.PeerClosed) as exc:
                acks_pending = self.qp.awaits_answers()
                # with sends in flight, the ack reader sees the peer's last answer (a NAK, say) and
                # then the closed connection itself, and errors the QP with the right statuses
                if not self.qp.closing and not acks_pending:
                    self.qp.enter_error(WCStatus.WR_FLUSH_ERR, f"peer disconnected: {exc}")
                return
            except ProtocolViolation as exc:
                self.qp.enter_error(WCStatus.WR_FLUSH_ERR, str(exc))
                return
            except UsageError as exc:  # a posted receive's MR was deregistered
                self.qp.enter_error(WCStatus.LOC_PROT_ERR, f"receive buffer unusable: {exc}")
                return
            except Exception as exc:  # a fault of this NIC: the QP fails, naming it, rather than going deaf
                log.exception("soft QP %d responder failed", self.qp.qpn)
                self.qp.enter_error(WCStatus.WR_FLUSH_ERR, f"responder failed: {type(exc).__name__}: {exc}")
                return

    def _answer_owed(self, rd: wire.Reader) -> None:
        """Deferred answers (wire.py; a plain socket, never TLS): unless a next request arrives within
        DEFERRED_ACK_S (whose answer, or a later one, acknowledges the requests before it), answer the last
        request deferred now."""
        if rd.buffered() or _readable(rd.sock, DEFERRED_ACK_S):
            return
        self._unacked_bytes = self._unacked_reqs = self._deferred = 0
        self.send_owed()

    def send_owed(self) -> None:
        """Send a deferred answer still owed (at QP.close too, before the sockets go: the requester's WR was
        placed and must complete as such, not fail with the closed connection). Once: under `_resp_lock`."""
        sock = self.sock
        with self._resp_lock:
            psn, self._owed_psn = self._owed_psn, None
            if psn is None or sock is None:
                return
            try:
                wire.send_buffers(sock, [wire.resp(wire.ACK, psn, WCStatus.SUCCESS)])
            except OSError:
                pass

    @staticmethod
    def _await_request(rd: wire.Reader, regions: shm.PeerRegions) -> None:
        """Before reading the next request: unmap the peer's freed regions now and then, and while none has
        come (so that a mapping does not keep memory alive that the peer let go of while this QP idles)."""
        regions.maybe_prune()
        if not regions.mapped or rd.buffered() or not isinstance(rd.sock, socket.socket):
            return  # (a TLS stream may hold decrypted bytes its socket does not show: read it as before)
        while regions.mapped and not _readable(rd.sock, shm.PRUNE_EVERY_S):
            regions.maybe_prune()

    def _read_spans(self, rd: wire.Reader, length: int, defer: bool = False) -> Optional[Pulled]:
        """The (address, length) spans of a same-host request, and the mapping of the shared region they
        lie in if the requester names one that can be mapped (`defer`: the region named, mapped when
        needed); None if the spans do not add up to `length` or lie outside the region named."""
        (count,) = wire.PULL_COUNT.unpack(rd.read(wire.PULL_COUNT.size))
        named, count = bool(count & wire.PULL_HAS_REGION), count & ~wire.PULL_HAS_REGION
        if count > wire.MAX_PULL_SPANS:
            return None
        raw = rd.read(count * wire.PULL_SPAN.size)
        spans = [wire.PULL_SPAN.unpack_from(raw, i * wire.PULL_SPAN.size) for i in range(count)]
        src: Union[None, Tuple[int, ...], shm.Mapped] = None  # (a region named, not mapped yet: `defer`)
        if named:
            region = wire.PULL_REGION.unpack(rd.read(wire.PULL_REGION.size))
            if self._regions is None:
                self._regions = shm.PeerRegions(self._pull_pid)
            if defer:
                src = region
            else:
                inside, src = self._regions.source(region, spans)
                if not inside:
                    return None
        return (spans, src) if sum(n for _, n in spans) == length else None

    def _place(self, rd: wire.Reader, pulled: Optional[Pulled], targets: List[memoryview], due: float, psn: int,
               landing: Optional[Landing] = None, push: bool = False) -> bool:
        """Fill `targets` with the request's payload: from the socket, or (same-host path) straight from
        the requester's memory, or (`push`: a WRITE whose requester offered to copy it) by the requester
        where the target lies in a shared region of ours. False (the request answered with an error, the
        QP failing) if the requester's memory cannot be read. `landing` (one target, a tracked MR's
        WRITE): place it piece by piece, each digested as soon as it is placed."""
        if pulled is None:
            if landing is not None:
                for at, n, _first in landing.pieces(over_tcp=True):
                    rd.read_into(targets[0][at:at + n])
                    landing.landed(at, n)
                return True
            for t in targets:
                rd.read_into(t)
            return True
        pieces = landing.pieces() if landing is not None else None
        with shm.placing() as others:
            if push and len(targets) == 1 and self._pushed(rd, targets[0], psn, landing, pieces, shm.take_push(others)):
                return True
            return self._read_pulled(rd, pulled, targets, due, psn, landing, pieces)

    def _read_pulled(self, rd: wire.Reader, pulled: Pulled, targets: List[memoryview], due: float, psn: int,
                     landing: Optional[Landing], pieces: Optional[List[Tuple[int, int, bool]]]) -> bool:
        """Copy a same-host request's payload from the requester's memory into `targets` (`_place`)."""
        try:
            src = pulled[1]
            if isinstance(src, tuple):  # a push declined: the region named, mapped now
                regions = cast(shm.PeerRegions, self._regions)  # (made when the region was named: _read_spans)
                inside, src = regions.source(src, pulled[0])
                if not inside:
                    raise OSError(22, "the spans lie outside the region named")
            samehost.read_from(self._pull_pid, pulled[0], [(address_of(t), t.nbytes) for t in targets],
                               pieces=pieces, on_piece=landing.landed if landing is not None else None, src=src)
        except Exception as exc:  # OSError from the kernel; anything else must fail this request, not the thread
            self._answer(rd.sock, due, wire.NAK, psn, WCStatus.LOC_PROT_ERR, then_error=True,
                         why=f"cannot read the requester's memory: {exc}")
            return False
        return True

    def _pushed(self, rd: wire.Reader, target: memoryview, psn: int, landing: Optional[Landing] = None,
                pieces: Optional[List[Tuple[int, int, bool]]] = None, take: bool = True) -> bool:
        """Ask the requester to copy a WRITE's payload into `target` itself (already checked: rkey, bounds,
        access) where it lies in a shared region of ours and we `take` pushes now (shm.take_push; else an
        empty PUSH_AT, "no push here" or, for a shared target, "not this one": we read it ourselves):
        PUSH_AT, then its PLACED notes, each the length of the prefix placed so far, growing to the whole
        (`landing`: each of its `pieces` digested as soon as a note covers it, while the requester copies on).
        True if it placed the payload; False if it declined (a first note of 0 bytes: read it as before) or no
        region holds `target`. Raises ProtocolViolation on anything but the notes owed (the QP fails)."""
        assert self.resp_line is None  # (no delayed answer that a PUSH_AT, sent at once, could overtake)
        region = shm.region_of([(address_of(target), target.nbytes)])
        later = region is not None and not take
        # (empty: no push here, or with PUSH_LATER not this one, and the requester offers the next WRITE again)
        body = wire.PUSH_AT_BODY.pack(*region, os.getpid()) if region is not None and take else b""
        with self._resp_lock:
            wire.send_buffers(rd.sock, [wire.resp(wire.PUSH_AT, psn, wire.PUSH_LATER if later else WCStatus.SUCCESS,
                                                  len(body))] + ([memoryview(body)] if body else []))
        if not body:
            return False
        placed, i = 0, 0
        while placed < target.nbytes:
            magic, version, opcode, got_psn, length, _a, _k, _i, _d = wire.REQ.unpack(rd.read(wire.REQ.size))
            if magic != wire.REQ_MAGIC or version != wire.VERSION or opcode != wire.OP_PLACED or got_psn != psn \
                    or not (placed < length <= target.nbytes or (length == 0 and placed == 0)):
                raise ProtocolViolation(f"protocol violation from peer (expected PLACED for psn {psn} beyond "
                                        f"{placed} of {target.nbytes} bytes)")
            if length == 0:
                return False
            placed = length
            while landing is not None and pieces is not None and i < len(pieces) and sum(pieces[i][:2]) <= placed:
                landing.landed(pieces[i][0], pieces[i][1])
                i += 1
        return True

    def _serve(self, rd: wire.Reader, op: int, has_imm: bool, psn: int, length: int, raddr: int, rkey: int,
               imm: int, due: float, pulled: Optional[Pulled] = None, push: bool = False, no_ack: bool = False) -> None:
        sock = rd.sock  # answers go out on it; every byte in comes through `rd`
        if op == wire.OP_READ:
            view = self._lookup(rkey, raddr, length, Access.REMOTE_READ)
            if view is None:
                self._answer(sock, due, wire.NAK, psn, WCStatus.REM_ACCESS_ERR)
            else:
                self._answer(sock, due, wire.READ_RESP, psn, WCStatus.SUCCESS, payload=view)
            return
        if op == wire.OP_WRITE:
            # the MR stays registered until this WRITE is placed: a deregistration meanwhile waits for it
            # (SoftMR.begin_remote), so no byte lands in memory whose registration has been revoked
            mr = self._find_mr(rkey, raddr, length, Access.REMOTE_WRITE)
            view = mr.begin_remote(rkey, raddr - mr.addr, length) if mr is not None else None
            if mr is None or view is None:
                self._drain(rd, length, pulled)
                self._answer(sock, due, wire.NAK, psn, WCStatus.REM_ACCESS_ERR)
                return
            try:
                recv = self._take_recv() if has_imm else None
                if has_imm and recv is None:
                    self._drain(rd, length, pulled)
                    self._answer(sock, due, wire.NAK, psn, WCStatus.RNR_RETRY_EXC_ERR)
                    return
                landing = mr.landing.begin(raddr - mr.addr, length) if mr.landing is not None else None
                placed = False
                try:
                    placed = self._place(rd, pulled, [view], due, psn, landing, push)
                finally:
                    if landing is not None:
                        landing.end(placed)
                if not placed:
                    return
            finally:
                mr.end_remote()
            if recv is None and self._may_coalesce(rd, due, length, psn, no_ack):
                return  # the next request is already arriving (or its answer may wait): a later one acknowledges it
            wc = WC(recv[0], WCStatus.SUCCESS, WCOpcode.RECV_RDMA_WITH_IMM, length, imm, self.qp.qpn) if recv else None
            self._answer(sock, due, wire.ACK, psn, WCStatus.SUCCESS, wc=wc)
            return
        recv = self._take_recv()  # SEND
        if recv is None:
            self._drain(rd, length, pulled)
            self._answer(sock, due, wire.NAK, psn, WCStatus.RNR_RETRY_EXC_ERR)
            return
        wr_id, sges = recv
        if length > sum(s.length for s in sges):
            self._drain(rd, length, pulled)
            wc = WC(wr_id, WCStatus.LOC_LEN_ERR, WCOpcode.RECV, length, None, self.qp.qpn)
            self._answer(sock, due, wire.NAK, psn, WCStatus.REM_INV_REQ_ERR, wc=wc, then_error=True)
            return
        left, targets = length, []
        for s in sges:
            k = min(left, s.length)
            if k:
                targets.append(s.view()[:k])
            left -= k
        if not self._place(rd, pulled, targets, due, psn):
            return
        wc = WC(wr_id, WCStatus.SUCCESS, WCOpcode.RECV, length, imm if has_imm else None, self.qp.qpn)
        # (a control frame: a batch's, or one whose answer may wait)
        if self._may_coalesce(rd, due, length, psn, no_ack):
            self.qp.recv_cq.push(wc, defer=True)
            self.qp.recv_cq.arrived()
            return
        self._answer(sock, due, wire.ACK, psn, WCStatus.SUCCESS, wc=wc)

    def _may_coalesce(self, rd: wire.Reader, due: float, length: int, psn: int, no_ack: bool = False) -> bool:
        """May the answer to a request just placed in full wait for the next one's (one cumulative ACK, as on
        an RC link)? Yes if that request is already arriving or this one's answer may wait (`no_ack`, wire.py:
        answered within DEFERRED_ACK_S then, _answer_owed), no delay line holds answers back, and fewer
        than ACK_EVERY_BYTES and ACK_EVERY_REQUESTS have gone unanswered. A WRITE_WITH_IMM is always
        answered at once: its completion is the requester's news that a message is placed, which must not
        wait for the next message's first chunk."""
        if not (self.resp_line is None and due <= time.monotonic() and self._unacked_bytes + length < ACK_EVERY_BYTES
                and self._unacked_reqs + 1 < ACK_EVERY_REQUESTS):
            return False
        # an answer held for the next request only (no OP_NO_ACK: a completion may wait for it) is never
        # deferred further by that request: answered at once instead, not DEFERRED_ACK_S later
        if no_ack and self._unacked_reqs == self._deferred:
            with self._resp_lock:
                self._owed_psn = psn
            self._deferred += 1
        elif not rd.more_pending():
            return False
        self._unacked_bytes += length
        self._unacked_reqs += 1
        return True

    def _drain(self, rd: wire.Reader, length: int, pulled: Optional[Pulled] = None) -> None:
        if pulled is not None:
            return  # same-host path: the payload never came over the socket
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 20))
        wire.drain(rd, length, self._scratch)

    def _answer(self, sock: socket.socket, due: float, kind: int, psn: int, status: WCStatus,
                wc: Optional[WC] = None, payload: Optional[memoryview] = None, then_error: bool = False,
                why: str = "") -> None:
        self._unacked_bytes = self._unacked_reqs = self._deferred = 0  # every answer acknowledges those before it
        def deliver() -> None:
            if then_error:
                self.qp.err_seen = True
            if wc is not None:
                self.qp.recv_cq.push(wc, defer=not then_error)
            try:
                with self._resp_lock:  # (`_owed_psn` only under it: QP.close may send the owed answer itself)
                    self._owed_psn = None
                    n = payload.nbytes if payload is not None else 0
                    wire.send_buffers(sock, [wire.resp(kind, psn, status, n)]
                                      + ([payload] if payload is not None else []))
            except OSError:
                pass  # the requester notices the lost connection itself
            if wc is not None and not then_error:
                self.qp.recv_cq.arrived()  # (its consumer's work after the answer has left)
            if then_error:
                self.qp.enter_error(WCStatus.WR_FLUSH_ERR,
                                    why or f"receive failed with {wc.status.name if wc else status.name}")

        if self.resp_line is None and due > time.monotonic():
            self.resp_line = DelayLine(f"soft-qp{self.qp.qpn}-respdelay")
        if self.resp_line is not None:
            self.resp_line.submit(due, deliver)
        else:
            deliver()
