"""Control frames of a connection (SENDs on QP 0): sending them, dispatching the peer's, and the RTT
probe that sizes the auto window."""
from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional

import easypyverbs as ev
from easypyverbs.stalls import clock

from .. import protocol as P
from ..errors import (IntegrityError, PayloadTooLarge, RemoteProtocolError, TransferCancelled, TransferError,
                      TransferTimeout)
from ..protocol.frames import CtrlKind, ErrorCode
from .layout import LocalMemory

log = logging.getLogger("fate_rdma.channel")


class ControlSender:
    """Posts control frames from a fixed set of buffers; when all are in flight, frames wait in order
    in a backlog until a completion frees one.

    Only every SIGNAL_EVERY-th SEND (and each while buffers run short) asks for a completion: a
    completion on the QP means every earlier SEND on it completed too, so it frees the buffers of all
    frames posted before it, and the others cost the engine no completion to handle. Inside `held()`
    (an engine's turn) frames wait until `flush()` posts them in the turn's batch of WRITEs, or until
    the turn ends: a slot's CREDIT leaves with the next message's chunks in one write."""

    #: at most this many SENDs in a row without a completion (fewer than the buffers: one always comes)
    SIGNAL_EVERY = 16

    def __init__(self, mem: LocalMemory, qp: Callable[[], ev.QP], wr_id: Callable[[int], int]) -> None:
        self.mem, self._qp, self._wr_id = mem, qp, wr_id
        self._backlog: Deque[bytes] = collections.deque()
        self._posted: Deque[int] = collections.deque()  # buffers in flight, in posting order
        self._unsignaled = 0
        self._held: Optional[List[bytes]] = None

    def send(self, c: P.Ctrl) -> None:
        raw = P.encode_ctrl(c)
        if self._held is not None:
            self._held.append(raw)
        else:
            self._send_raw(raw)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Frames sent inside wait for `flush()` or the end (not posted if it ends in an error: the
        connection is going down)."""
        self._held = []
        try:
            yield
            self.flush()
        finally:
            self._held = None

    def flush(self) -> None:
        """Post the frames held so far, in order (inside a QP.batch: with its WRs)."""
        if self._held:
            held, self._held = self._held, []
            for raw in held:
                self._send_raw(raw)

    def _send_raw(self, raw: bytes) -> None:
        if not self.mem.ctrl_free or self._backlog:
            self._backlog.append(raw)
        else:
            self._post(raw)

    def _post(self, raw: bytes) -> None:
        free = self.mem.ctrl_free
        idx = free.pop()
        self._posted.append(idx)
        signal = self._unsignaled + 1 >= self.SIGNAL_EVERY or len(free) < self.SIGNAL_EVERY
        self._unsignaled = 0 if signal else self._unsignaled + 1
        self._qp().post_send(self.mem.put_ctrl(idx, raw), wr_id=self._wr_id(idx) if signal else 0, signaled=signal)

    def on_complete(self, idx: int) -> None:
        """The SEND from buffer `idx` completed, and with it every SEND posted before it: reuse their
        buffers, for the backlog first."""
        while self._posted:
            done = self._posted.popleft()
            self.mem.ctrl_free.append(done)
            if done == idx:
                break
        while self._backlog and self.mem.ctrl_free:
            self._post(self._backlog.popleft())


class RttProbe:
    """Three PROBE / PROBE_REPLY round trips when a connection starts; the RTT is their minimum."""

    ROUNDS = 3

    def __init__(self, send: Callable[[P.Ctrl], None]) -> None:
        self._send = send
        self._sent: Dict[int, float] = {}
        self._rtts: List[float] = []
        self.rtt_s: Optional[float] = None

    def start(self, now: float) -> None:
        nonce = len(self._rtts) + 1
        self._sent[nonce] = now
        self._send(P.Ctrl(CtrlKind.PROBE, 0, nonce))

    def on_reply(self, nonce: int, now: float) -> bool:
        """A PROBE_REPLY; True when it completed the measurement."""
        sent = self._sent.pop(nonce, None)
        if sent is None:
            return False  # unknown or repeated nonce: ignored
        self._rtts.append(now - sent)
        if len(self._rtts) < self.ROUNDS:
            self.start(now)
            return False
        self.rtt_s = min(self._rtts)
        return True

    def overdue(self, now: float, timeout_s: float) -> bool:
        """A probe has gone unanswered for `timeout_s`."""
        return self.rtt_s is None and bool(self._sent) and now - min(self._sent.values()) > timeout_s


#: what the peer's ERROR code means here
_ERR = {ErrorCode.INTEGRITY: IntegrityError, ErrorCode.TOO_LARGE: PayloadTooLarge, ErrorCode.PROTOCOL: RemoteProtocolError,
        ErrorCode.TIMEOUT: TransferTimeout}


def dispatch(conn: Any, c: P.Ctrl, a: Any) -> None:
    """A control frame from the peer, to the part of `conn` it concerns (`a`: the active outgoing transfer)."""
    if c.kind is CtrlKind.ACK:
        if conn.staged_sender is None:
            raise RemoteProtocolError(f"{conn.peer} sent an ACK; this side never wrote to its staging buffers")
        conn.staged_sender.on_ack(c, a)
    elif c.kind in (CtrlKind.CREDIT, CtrlKind.RECLAIM):
        if conn.slot_sender is None:
            raise RemoteProtocolError(f"{conn.peer} sent a {c.kind.name}; it offered no receive pool")
        if c.kind is CtrlKind.CREDIT:
            conn.slot_sender.on_credit(c, a)
        else:
            conn.slot_sender.on_reclaim(c)
    elif c.kind in (CtrlKind.GROW, CtrlKind.RETURN, CtrlKind.PLACED):
        if conn.slot_receiver is None:
            raise RemoteProtocolError(f"{conn.peer} sent a {c.kind.name}; this side offered no receive pool")
        if c.kind is CtrlKind.GROW:
            conn.slot_receiver.on_grow(c)
        elif c.kind is CtrlKind.RETURN:
            conn.slot_receiver.on_return(c)
        else:
            conn.slot_receiver.on_placed(c)
    elif c.kind is CtrlKind.CANCEL:
        if a is not None and a.fut.transfer_id == c.transfer_id:
            conn.fail_out(a, TransferCancelled(f"transfer {c.transfer_id} cancelled by {conn.peer}: {c.reason}",
                                               c.transfer_id), tell_peer=False)
        elif conn.staged_receiver is not None and conn.staged_receiver.on_cancel(c.transfer_id):
            log.info("transfer %d from %s cancelled by the sender", c.transfer_id, conn.peer)
    elif c.kind is CtrlKind.DONE:
        if conn.slot_sender is not None:
            conn.slot_sender.on_done(c.transfer_id, a)
    elif c.kind is CtrlKind.ERROR:
        if conn.slot_sender is not None:
            conn.slot_sender.on_refused(c.transfer_id)  # a refused GROW: the slot's old grant stands
        target = conn.slot_sender.placed.get(c.transfer_id) if conn.slot_sender is not None else None
        target = target or (a if a is not None and a.fut.transfer_id == c.transfer_id else None)
        if target is not None:
            cls = _ERR.get(ErrorCode(c.value), TransferError) if c.value in ErrorCode.__members__.values() else TransferError
            why = f"transfer {c.transfer_id} refused by {conn.peer}: {c.reason}"
            exc = cls(why, c.transfer_id) if issubclass(cls, TransferError) else cls(why)
            conn.fail_out(target, exc, tell_peer=False)
    elif c.kind is CtrlKind.PROBE:
        conn.send_ctrl(P.Ctrl(CtrlKind.PROBE_REPLY, 0, c.value))
    elif c.kind is CtrlKind.PROBE_REPLY:
        if conn.probe.on_reply(int(c.value), clock()):
            log.info("connection to %s: RTT %.3f ms, window %d of %d-byte chunks, %s, data path %s", conn.peer,
                     conn.probe.rtt_s * 1e3, *conn.window(conn.cfg.mode == "fedrdma-e"),  # type: ignore[operator]
                     conn.label, conn.where["path"])
