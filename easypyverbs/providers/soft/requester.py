"""Soft provider: the requester half of the RC queue pair (SoftQP).

Posting (`post`: a lone small WR leaves from the posting thread, as if the doorbell rang the wire;
`QP.batch`: a list of WRs leaves together), the send thread (`send_loop`: WRs in PSN order, the ones
posted meanwhile in one vectored write, paced by the link model) and the ACK reader (`ack_loop`:
completes WRs in order, a cumulative ACK's at once). Uses the QP's lock, state and error handling through
a port (port.py, QPPort), as the responder half (responder.py) does.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Set, Tuple, Union, cast

from ...api import OPCODE_OF, SGE
from ...buffers import address_of
from ...enums import QPState, WCStatus
from ...errors import EasyVerbsError, UsageError
from ...types import WC
from . import samehost, shm, wire
from .leave import Leaving, send_out
from .link import DelayLine
from .port import QPPort
from .responder import PSN_MASK, _OPS

log = logging.getLogger("easypyverbs.soft")

#: most WRs the sender puts in one vectored write (each is a header and its payload's iovecs; sendmsg
#: takes 512 iovecs at a time): enough to empty a window of small WRITEs in one system call
SEND_BATCH_WRS = 64
#: and at most this many payload bytes (a larger WR still goes, alone): batching saves system calls,
#: which only small WRs feel. Uncapped, a window of 32 x 4 MiB WRITEs left in one sendmsg and reached
#: 0.58-0.85 x raw TCP in `bench verbs --quick --soft-path tcp` where one WR per call reached 0.79-1.10
#: (2-core test machine, same runs)
SEND_BATCH_BYTES = 1 << 20
#: largest WR the posting thread writes to the wire itself when the requester is not streaming, and the
#: fewest WRs in flight that count as a stream (`post`): with at most 2 in flight, a window of 32
#: small WRITEs kept its batched rate in `bench verbs --quick --soft-path tcp` (4 KiB: 44k msgs/s
#: against 46k; every WR from the posting thread: 24k), and a 0-byte transfer's round trip fell from
#: 0.74 to 0.66 ms (medians over 8 A/B pairs of scratch runs, README; 2-core test machine)
INLINE_SEND_BYTES = 64 << 10
DOORBELL_INFLIGHT = 3
#: most WRs of one batch (QP.batch) the posting thread writes itself, each at most INLINE_SEND_BYTES: a
#: small message's chunks and header in one write instead of one each
DOORBELL_BATCH_WRS = 4
#: smallest WRITE the requester offers to copy into the responder's shared memory itself (push, wire.py): a
#: push costs a round trip before its copy, which a smaller payload's copy would not repay
PUSH_MIN_BYTES = 1 << 20
#: a push is copied and announced (PLACED) this much at a time: the responder digests each piece while the
#: next is copied
PUSH_PIECE_BYTES = 2 << 20
#: rkeys remembered as "no push here" (forgotten all at once past this: they are offered once more)
NO_PUSH_RKEYS = 4096


class _WR:
    __slots__ = ("wr_id", "op", "sges", "raddr", "rkey", "imm", "signaled", "psn", "length", "no_ack", "on_leave")

    def __init__(self, wr_id: int, op: str, sges: List[SGE], raddr: int, rkey: int, imm: Optional[int], signaled: bool,
                 on_leave: Optional[Callable[[int, memoryview], None]] = None) -> None:
        self.wr_id, self.op, self.sges, self.raddr, self.rkey = wr_id, op, sges, raddr, rkey
        self.imm, self.signaled, self.psn, self.no_ack, self.on_leave = imm, signaled, 0, False, on_leave
        self.length = sum(s.length for s in sges)


class Requester:
    """The requester half of a SoftQP: its send queue, and its connection to the peer's NIC with the threads that
    write to it and read its answers (uses the QP's lock, state and error handling through `qp`)."""

    def __init__(self, qp: QPPort, psn: int) -> None:
        """`psn`: the first request's."""
        self.qp = qp
        self.sock: Optional[Any] = None  # the connection to the peer's NIC: a socket, or a TLSStream with TLS on
        self.pull = False  # the responder reads our payloads itself (same-host path)
        self.ack_line: Optional[DelayLine] = None  # completions the link model delays
        self.outstanding = 0  # WRs posted and not completed yet
        self._next_psn = psn
        self._send_q: Deque[_WR] = collections.deque()
        self._inflight: Deque[_WR] = collections.deque()
        self._tx_busy = False  # a thread is writing requests to the wire (only one does, in PSN order)
        self._tail: Optional[List[memoryview]] = None  # a doorbell write's part that did not fit the socket
        self._batch: Optional[List[_WR]] = None  # WRs posted inside QP.batch(), held until it ends
        self._batch_owner = 0  # the thread that opened it
        self._push = False  # a large WRITE into the responder's shared memory may be copied by us
        self._push_regions: Optional[shm.PeerRegions] = None  # the responder's regions we write into
        self._push_psn: Optional[int] = None  # the WRITE whose PUSH_AT the send thread waits for
        self._push_at: Optional[Tuple[int, ...]] = None  # that PUSH_AT's body, once it came
        self._push_later = False  # that PUSH_AT declined this WRITE only ("not this one")
        self._defer_ack = False  # requests no completion waits for may be answered later (wire.py)
        self._no_push_rkeys: Set[int] = set()  # rkeys the responder answered "no push here" for

    def connected(self, sock: Any, pull: bool, push: bool, defer_ack: bool) -> None:
        """The QP is connected (SoftQP._connect, under `qp.cv`): requests go on `sock`; `pull`: the responder
        reads their payloads (same-host path); `push`: we may copy large WRITEs into its shared memory;
        `defer_ack`: it may answer requests later."""
        self.pull, self._push, self._defer_ack = pull, push, defer_ack
        self.sock = sock

    def awaits_answers(self) -> bool:
        """(under `qp.cv`) Are requests in flight, awaiting the peer's answer?"""
        return bool(self._inflight)

    def flush(self) -> List[_WR]:
        """(under `qp.cv`, the QP failing) The WRs not completed, oldest first, taken off the queues: they complete
        with errors (SoftQP.enter_error)."""
        self.drop_tail()
        victims = list(self._inflight) + list(self._send_q)
        self._inflight.clear()
        self._send_q.clear()
        self.outstanding -= len(victims)
        return victims

    def drop_tail(self) -> None:
        """(under `qp.cv`) Forget a doorbell write's rest: its views would keep the MR's buffer exported."""
        self._tail = None

    # -- posting --------------------------------------------------------------------------------
    def post(self, op: str, sges: List[SGE], raddr: Optional[int], rkey: int, imm: Optional[int], wr_id: int,
              signaled: bool, on_leave: Optional[Callable[[int, memoryview], None]] = None) -> None:
        wr = _WR(wr_id, op, sges, raddr or 0, rkey, imm, signaled, on_leave)
        with self.qp.cv:
            if self.outstanding >= self.qp.cap.max_send_wr:
                raise EasyVerbsError(f"send queue full ({self.qp.cap.max_send_wr} WRs outstanding)", 12)  # ENOMEM
            self.outstanding += 1
            if self._batch is not None and self._batch_owner == threading.get_ident():
                self._batch.append(wr)  # leaves with its batch (end_batch)
                return
            if not self._may_ring([wr]):
                self._send_q.append(wr)
                self.qp.tx_cv.notify()
                return
            self._tx_busy = True
            self._number([wr])
        self._ring([wr])

    def _may_ring(self, wrs: List[_WR]) -> bool:
        """May the posting thread write `wrs` itself (under `_cv`)? Small WRs posted to a requester that is
        not streaming (nothing queued or being written, at most DOORBELL_INFLIGHT - 1 WRs awaiting their
        answer) leave from the posting thread, as if the doorbell rang the wire: one thread hand-off less
        for a lone message (a control frame, a small payload), about a tenth of a 0-byte transfer's round
        trip on this 2-core machine. A stream of WRs still goes through the send thread, which batches them
        into few writes. Never under a link model (each WR is paced) or TLS (a TLSStream takes no partial
        write)."""
        return (len(wrs) <= DOORBELL_BATCH_WRS
                and all(w.length <= INLINE_SEND_BYTES and w.on_leave is None for w in wrs)
                and len(self._inflight) < DOORBELL_INFLIGHT and not self._send_q and not self._tx_busy
                and self.qp.st == QPState.RTS and not self.qp.closing and isinstance(self.sock, socket.socket)
                and not self.qp.nic.link)

    def begin_batch(self) -> None:
        with self.qp.cv:
            if self._batch is not None:
                raise UsageError(f"QP {self.qp.qpn} already has a batch of posts open (batches do not nest)")
            self._batch, self._batch_owner = [], threading.get_ident()

    def end_batch(self) -> None:
        """Hand the batch's WRs on together: written by this thread (one write) if `_may_ring`, else queued
        for the send thread at once; on a QP that left RTS meanwhile, flushed as its queue was."""
        with self.qp.cv:
            batch, self._batch = self._batch or [], None
            if not batch:
                return
            live = self.qp.st == QPState.RTS and not self.qp.closing
            if not live:
                self.outstanding -= len(batch)
            elif not self._may_ring(batch):
                self._send_q.extend(batch)
                self.qp.tx_cv.notify()
                return
            else:
                self._tx_busy = True
                self._number(batch)
        if live:
            self._ring(batch)
            return
        why = "the QP left RTS before its batch was handed on"
        for wr in batch:
            wc = WC(wr.wr_id, WCStatus.WR_FLUSH_ERR, OPCODE_OF[wr.op], 0, None, self.qp.qpn, reason=why)
            self.qp.send_cq.push(wc)

    def _ring(self, wrs: List[_WR]) -> None:
        """Write `wrs` (numbered; this thread holds `_tx_busy`) to the wire from this thread; what the
        socket cannot take now goes to the send thread, before any other WR."""
        sock = cast(socket.socket, self.sock)  # (_may_ring: a plain socket)
        frames, broken, _ = self._frame(wrs)
        bufs = cast(List[memoryview], frames)  # (_may_ring: no WR with an on_leave hook, so no Leaving)
        status = WCStatus.LOC_PROT_ERR  # if `broken`: its MR went away after posting
        try:
            rest = wire.send_without_waiting(sock, bufs) if bufs else []
        except OSError as exc:
            rest, broken, status = [], f"send to peer failed: {exc}", WCStatus.RETRY_EXC_ERR
        if broken is not None:  # nothing more goes on this QP (`_tx_busy` stays taken): it errors
            self.qp.fail(status, broken)
            return
        with self.qp.cv:
            if rest:  # the socket's buffer was full: the send thread writes the rest before any other WR
                self._tail = rest
            else:
                self._tx_busy = False
            if self._can_write():
                self.qp.tx_cv.notify()

    # -- requester ------------------------------------------------------------------------------
    def _can_write(self) -> bool:
        """May the send thread write now (under `_cv`): a doorbell write's rest, or queued WRs while no
        other thread writes."""
        return self._tail is not None or (bool(self._send_q) and not self._tx_busy)

    def _number(self, batch: List[_WR]) -> None:
        """Give `batch` its PSNs and put it in flight (under `_cv`, by whoever holds `_tx_busy`)."""
        for wr in batch:
            wr.psn = self._next_psn
            self._next_psn = (self._next_psn + 1) & PSN_MASK
            # its answer may wait (wire.py, deferred answers) if no completion does, and few others await theirs
            # (so the posting thread still writes a lone message itself: _may_ring)
            wr.no_ack = (self._defer_ack and not wr.signaled and wr.op != "read" and not self._pushes(wr)
                         and len(self._inflight) < DOORBELL_INFLIGHT - 1)
            self._inflight.append(wr)

    def _frame(self, batch: List[_WR]) -> Tuple[List[Union[memoryview, Leaving]], Optional[str], float]:
        """The requests of `batch` as iovecs (a WRITE with an `on_leave` hook as one Leaving: send_out), the
        reason a WR cannot go (the ones before it still go), and when the link model frees the wire."""
        link = self.qp.nic.link
        bufs: List[Union[memoryview, Leaving]] = []
        free_at = now = time.monotonic()
        for wr in batch:
            try:
                views = [] if wr.op == "read" else [s.view() for s in wr.sges]
            except UsageError as exc:  # MR deregistered after posting
                return bufs, f"wr {wr.wr_id}: {exc}", free_at
            opcode = _OPS[wr.op] | (wire.OP_HAS_IMM if wr.imm is not None else 0) | (wire.OP_NO_ACK if wr.no_ack else 0)
            if self.pull and wr.op != "read":  # same-host path: name our bytes, the responder reads them
                opcode |= wire.OP_PULL | (wire.OP_PUSH if self._pushes(wr) else 0)
                spans = [(s.mr.addr + s.offset, s.length) for s in wr.sges if s.length]
                region = shm.region_of(spans)
                views = [memoryview(wire.PULL_COUNT.pack(len(spans) | (wire.PULL_HAS_REGION if region else 0))
                                    + b"".join(wire.PULL_SPAN.pack(*sp) for sp in spans)
                                    + (wire.PULL_REGION.pack(*region) if region else b""))]
            free_at = link.reserve(wire.REQ.size + sum(v.nbytes for v in views), now) if link else now
            bufs.append(memoryview(wire.REQ.pack(wire.REQ_MAGIC, wire.VERSION, opcode, wr.psn, wr.length, wr.raddr,
                                                 wr.rkey, wr.imm or 0, int((free_at - now) * 1e6))))
            if wr.on_leave is not None:  # (QP.post_write passes none on the same-host path)
                bufs.append(Leaving(views, wr.on_leave, wr.wr_id))
            else:
                bufs.extend(views)
        return bufs, None, free_at

    def send_loop(self) -> None:
        try:
            self._send_batches()
        finally:  # the push mappings' only user: unmapped as it ends
            if self._push_regions is not None:
                self._push_regions.close()
                self._push_regions = None

    def _send_batches(self) -> None:
        link = self.qp.nic.link
        sock = self.sock
        assert sock is not None
        while True:
            batch: List[_WR] = []
            pushing: Optional[_WR] = None  # the batch's last WR where it is one to push
            with self.qp.cv:
                while not self._can_write() and self.qp.st == QPState.RTS and not self.qp.closing:
                    self.qp.tx_cv.wait()
                if self.qp.st != QPState.RTS or not self._can_write():
                    return  # (closing: a doorbell write may still be under way, and it is the only writer)
                tail, self._tail = self._tail, None
                if tail is None:
                    # what was posted meanwhile leaves in one vectored write; under a link model one WR at
                    # a time, since each is paced
                    nbytes = 0
                    while self._send_q and (not batch or (not link and len(batch) < SEND_BATCH_WRS
                                                          and nbytes + self._send_q[0].length <= SEND_BATCH_BYTES)):
                        batch.append(self._send_q.popleft())
                        nbytes += batch[-1].length
                        if self._pushes(batch[-1]):
                            pushing = batch[-1]
                            break  # it ends its batch: nothing follows it before its PUSH_AT is answered
                    self._number(batch)
                    self._tx_busy = True
                    if pushing is not None:  # (before it leaves: its PUSH_AT may come back at once)
                        self._push_psn, self._push_at = pushing.psn, None
            bufs, broken, free_at = self._frame(batch) if tail is None else (tail, None, time.monotonic())
            try:
                send_out(sock, bufs)
            except OSError as exc:
                self.qp.fail(WCStatus.RETRY_EXC_ERR, f"send to peer failed: {exc}")
                return
            if broken is not None:  # nothing after it goes (`_tx_busy` stays taken): the QP errors
                self.qp.fail(WCStatus.LOC_PROT_ERR, broken)
                return
            if pushing is not None:
                try:
                    self._await_push(sock, pushing)
                except OSError as exc:
                    self.qp.fail(WCStatus.RETRY_EXC_ERR, f"send to peer failed: {exc}")
                    return
            with self.qp.cv:
                self._tx_busy = False
                self.qp.cv.notify_all()  # for whoever waits on `qp.cv` for the writer to let go (tests)
            if link:  # the link stays busy until the last bit has left
                pause = free_at - time.monotonic()
                if pause > 0:
                    time.sleep(pause)

    def ack_loop(self) -> None:
        sock = self.sock
        assert sock is not None
        hdr = memoryview(bytearray(wire.RESP.size))
        rd = wire.Reader(sock)  # the only reader of `sock`
        delay = self.qp.nic.link_model.delay_s
        while True:
            try:
                rd.read_into(hdr)
            except (socket.timeout, BlockingIOError):  # SO_RCVTIMEO expired: fine unless WRs wait
                with self.qp.cv:
                    stalled = bool(self._inflight) and not self.qp.closing
                if stalled:
                    self.qp.fail(WCStatus.RETRY_EXC_ERR, "no response from peer within the retry timeout")
                    return
                continue
            except (OSError, wire.PeerClosed) as exc:
                if not self.qp.closing:
                    with self.qp.cv:
                        busy = bool(self._inflight or self._send_q)
                    self.qp.fail(WCStatus.RETRY_EXC_ERR,
                                 f"connection to peer lost: {exc}" if busy else f"peer disconnected: {exc}")
                return
            magic, version, kind, psn, status, length = wire.RESP.unpack(hdr)
            if kind == wire.PUSH_AT and magic == wire.RESP_MAGIC and version == wire.VERSION:
                try:
                    if not self._push_asked(rd, psn, length, delay, status == wire.PUSH_LATER):
                        self.qp.fail(WCStatus.BAD_RESP_ERR, "unexpected PUSH_AT from peer")
                        return
                except (OSError, wire.PeerClosed) as exc:
                    self.qp.fail(WCStatus.RETRY_EXC_ERR, f"connection to peer lost: {exc}")
                    return
                continue
            # ACKs are cumulative (as on a real RC link): an answer for psn also acknowledges
            # every earlier request still in flight
            earlier: List[_WR] = []
            wr = None
            with self.qp.cv:
                idx = next((i for i, w in enumerate(self._inflight) if w.psn == psn), None)
                if idx is not None:
                    earlier = [self._inflight.popleft() for _ in range(idx)]
                    wr = self._inflight.popleft()
            if earlier:
                self._complete_later(earlier, WCStatus.SUCCESS, delay)
            if magic != wire.RESP_MAGIC or version != wire.VERSION or wr is None or wr.psn != psn \
                    or kind not in (wire.ACK, wire.NAK, wire.READ_RESP) or status not in WCStatus.__members__.values():
                if wr is not None:
                    self._finish([wr], WCStatus.BAD_RESP_ERR)
                self.qp.fail(WCStatus.BAD_RESP_ERR, "malformed or unexpected response from peer")
                return
            if kind == wire.READ_RESP:
                try:
                    if length != wr.length:
                        raise wire.PeerClosed(f"READ response of {length} bytes for a {wr.length}-byte read")
                    for s in wr.sges:
                        rd.read_into(s.view())
                except (OSError, UsageError, wire.PeerClosed) as exc:
                    self._finish([wr], WCStatus.LOC_PROT_ERR if isinstance(exc, UsageError) else WCStatus.BAD_RESP_ERR)
                    self.qp.fail(WCStatus.WR_FLUSH_ERR, f"READ response failed: {exc}")
                    return
            self._complete_later([wr], WCStatus(status), delay)

    # -- push (wire.py): a large same-host WRITE copied by us into the responder's shared memory ----------
    def _pushes(self, wr: _WR) -> bool:
        return self._push and wr.op == "write" and wr.length >= PUSH_MIN_BYTES and wr.rkey not in self._no_push_rkeys

    def _no_push(self, rkey: int) -> None:
        """Offer no push for WRITEs under `rkey` again (a bounded memory: forgotten all at once when full)."""
        if len(self._no_push_rkeys) >= NO_PUSH_RKEYS:
            self._no_push_rkeys.clear()
        self._no_push_rkeys.add(rkey)

    def _push_asked(self, rd: wire.Reader, psn: int, length: int, delay: float, later: bool = False) -> bool:
        """The ack reader got PUSH_AT for `psn`: hand its body (empty: no push here, or with `later` not this
        one) to the send thread, which waits for it (the answer also acknowledges every request before that
        WRITE). False if nobody waits for it."""
        if length not in (0, wire.PUSH_AT_BODY.size):
            return False
        body = wire.PUSH_AT_BODY.unpack(rd.read(length)) if length else ()
        earlier: List[_WR] = []
        with self.qp.cv:
            idx = next((i for i, w in enumerate(self._inflight) if w.psn == psn), None)
            if self._push_psn != psn or idx is None:
                return False
            earlier = [self._inflight.popleft() for _ in range(idx)]
            self._push_at, self._push_later = body, later and not body
            self.qp.tx_cv.notify_all()
        if earlier:
            self._complete_later(earlier, WCStatus.SUCCESS, delay)
        return True

    def _await_push(self, sock: Any, wr: _WR) -> None:
        """`wr` (a push-marked WRITE) has left: wait for the responder's PUSH_AT or its answer to `wr`, and
        after a PUSH_AT copy the payload in (or decline) and send PLACED. Bounded: the ack reader fails the
        QP when the peer answers nothing within the retry timeout, which ends the wait."""
        with self.qp.cv:  # (`_push_psn` was set when `wr` was numbered)
            while (self._push_at is None and self.qp.st == QPState.RTS and not self.qp.closing
                   and any(w is wr for w in self._inflight)):
                self.qp.tx_cv.wait(1.0)  # (woken by the ack reader; the timeout only re-checks)
            body, later = self._push_at, self._push_later
            self._push_psn, self._push_at, self._push_later = None, None, False
        if not body:  # answered without a push (or the QP is failing), or "no push here": not for this rkey again
            if body is not None and not later:  # ("not this one": the next is offered again)
                self._no_push(wr.rkey)
            return

        def note(placed: int) -> None:
            wire.send_buffers(sock, [memoryview(wire.REQ.pack(wire.REQ_MAGIC, wire.VERSION, wire.OP_PLACED, wr.psn,
                                                              placed, 0, 0, 0, 0))])

        target = self._push_target(wr, body)
        if target is None:
            self._no_push(wr.rkey)
            note(0)  # declined: the responder reads it itself
            return
        mapped, pieces, views = target
        done = 0
        for remote, local in pieces:  # piece by piece, each announced: the responder digests it meanwhile
            if self.qp.st != QPState.RTS or self.qp.closing:
                return  # this QP failed or closes: no piece more (a responder that failed first may still
                # see one piece land after it let go of the MR: a connection that fails drops its slots)
            mapped.copy(remote, local)
            done += sum(n for _, n in local)
            note(done)
        del views

    def _push_target(self, wr: _WR, body: Tuple[int, ...]) -> Optional[Tuple[Any, List[Any], List[memoryview]]]:
        """Where to copy `wr`'s payload in the responder's region named in PUSH_AT `body`: (the writable
        mapping, the copy's pieces of PUSH_PIECE_BYTES as (remote spans, local spans), the payload's views,
        held while it is copied); None (decline: the responder reads it itself) unless the pid is the peer's
        (it holds the other end of this QP's connection, samehost.peer_owns; not this process; this network
        namespace) and the region maps as the provider's own memfd (shm.PeerRegions' checks), is none of ours
        and holds the WRITE's target."""
        fd, ino, base, size, pid = body
        try:
            views = [s.view() for s in wr.sges]  # (held: the buffers stay alive while we copy from them)
            if pid == os.getpid() or shm.own_inode(ino):
                return None
            regions = self._push_regions
            if regions is None or regions.pid != pid:
                if not samehost.same_network_namespace(pid) or not samehost.peer_owns(pid, self.sock):
                    log.warning("soft QP %d: the peer named pid %d for a push, which does not hold its end of the "
                                "connection; this QP pushes no more", self.qp.qpn, pid)
                    self._push = False
                    return None
                if regions is not None:
                    regions.close()
                regions = self._push_regions = shm.PeerRegions(pid, writable=True)
            m = regions.get((fd, ino, base, size))
            if m is None or not m.holds([(wr.raddr, wr.length)]):
                return None
            local = [(address_of(v), v.nbytes) for v in views if v.nbytes]
            sizes = [min(PUSH_PIECE_BYTES, wr.length - o) for o in range(0, wr.length, PUSH_PIECE_BYTES)]
            return m, list(zip(samehost._split([(wr.raddr, wr.length)], sizes), samehost._split(local, sizes))), views
        except (OSError, ValueError, UsageError) as exc:
            log.info("soft QP %d: push of wr %d declined: %s", self.qp.qpn, wr.wr_id, exc)
            return None

    def _complete_later(self, wrs: List[_WR], st: WCStatus, delay: float) -> None:
        """Complete `wrs` (in order, all with `st`) now, or after the link model's return delay."""
        if self.ack_line is not None:
            self.ack_line.submit(time.monotonic() + delay, lambda: self._finish(wrs, st))
        else:
            self._finish(wrs, st)

    def _finish(self, wrs: List[_WR], status: WCStatus) -> None:
        with self.qp.cv:  # once for a cumulative ACK's WRs, not once each
            self.outstanding -= len(wrs)
            self.qp.cv.notify_all()
            if self._push_psn is not None:  # the send thread waits for a push-marked WRITE's fate
                self.qp.tx_cv.notify_all()
        if status != WCStatus.SUCCESS:
            self.qp.err_seen = True
        why = "" if status == WCStatus.SUCCESS else f"the peer answered {status.name}"
        cq, qpn, ok = self.qp.send_cq, self.qp.qpn, status == WCStatus.SUCCESS
        pushed = False
        for wr in wrs:
            if not ok or wr.signaled:
                cq.push(WC(wr.wr_id, status, OPCODE_OF[wr.op], wr.length, None, qpn, reason=why), defer=ok)
                pushed = True
        if ok and pushed:
            cq.arrived()
        if status != WCStatus.SUCCESS:
            self.qp.enter_error(WCStatus.WR_FLUSH_ERR, f"wr {wrs[-1].wr_id} failed with {status.name}")
