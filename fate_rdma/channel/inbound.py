"""What arrives on a connection, to the part it concerns: work completions (of our WRITEs and control SENDs,
receives of the peer's control frames and WRITE_WITH_IMM notices) and the peer's control frames, each
checked (an unknown or out-of-turn frame ends the connection naming it). Engine's (engine.py) half that
reads; it runs in the engine's turn, with `_turn_lock` held."""
from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Deque, Dict, List, Optional, Protocol, Tuple, cast

import easypyverbs as ev
from easypyverbs.stalls import clock

from .. import protocol as P
from ..config import ChannelConfig
from ..errors import PeerUnreachable, RemoteProtocolError, TransferCancelled
from ..protocol.frames import CtrlKind, ResumeState
from ..protocol.packing import StagedWrite, decode_imm, decode_resume, is_recv, split_recv_wr_id
from ..protocol.policy import Mode
from ..protocol.refusal import refusal
from .fedrdma import StagedReceiver, StagedSender
from .fedrdma_e import SlotReceiver, SlotSender
from .outgoing import Outgoing, Where, Wr
from .path import Path
from .wire import Wire

if TYPE_CHECKING:
    from .holding import PeerEngine
    from .resume import Resumer

log = logging.getLogger("fate_rdma.channel")


@dataclass
class Modes:
    """The parts of the two modes a connection runs: a sender where the peer offered receive memory of that
    mode (staging buffers, a pool of slots), a receiver where this side did."""

    staged_sender: Optional[StagedSender] = None
    staged_receiver: Optional[StagedReceiver] = None
    slot_sender: Optional[SlotSender] = None
    slot_receiver: Optional[SlotReceiver] = None


def cause_first(wcs: List[ev.WC]) -> List[ev.WC]:
    """`wcs` with the first error completion that is not a flush first: when a QP goes to ERR its other work
    requests complete WR_FLUSH_ERR, and one of those may be polled before the completion that says why."""
    if all(wc.ok for wc in wcs):
        return wcs
    cause = next((wc for wc in wcs if not wc.ok and wc.status is not ev.WCStatus.WR_FLUSH_ERR), None)
    return wcs if cause is None else [cause] + [wc for wc in wcs if wc is not cause]


class _Fail(Protocol):
    """Engine.fail: fail transfer `o` with `exc`, telling the peer (CANCEL) or not."""

    def __call__(self, o: Outgoing, exc: BaseException, tell_peer: bool) -> None: ...


class Inbound:
    """Engine's handling of completions and control frames (a part of Engine: its state is the engine's)."""

    wire: Wire
    path: Path
    cfg: ChannelConfig
    peer: str
    label: str
    where: Where
    modes: Modes
    resume: Optional["Resumer"]
    _active: Optional[Outgoing]
    _asked: Dict[int, Deque[Tuple[int, "concurrent.futures.Future[Tuple[ResumeState, int]]"]]]
    # the engine's own (engine.Engine defines them): fail a transfer, send a control frame, free a failed one
    fail: "_Fail"
    send_ctrl: Callable[[P.Ctrl], None]
    _maybe_finish_failed: Callable[[Outgoing], None]

    # -- completions ----------------------------------------------------------------------------
    def _on_wc(self, wc: ev.WC) -> None:
        """A work completion: of a WRITE or control SEND of ours, or a receive of the peer's control frame or
        of its WRITE_WITH_IMM notice."""
        if is_recv(wc.wr_id):
            self._on_recv(wc)
            return
        entry = self.wire.take(wc.wr_id)
        if not wc.ok:
            raise PeerUnreachable(f"connection to {self.peer} failed: work completion {wc.status.name}{_why(wc)}")
        if entry is None:
            return
        kind, o, seq, extra = entry
        if kind is Wr.CTRL:
            self.wire.control.on_complete(extra)
            return
        if kind is Wr.HEADER:
            self.wire.header_done(extra)
        if o is None:  # (every WRITE's entry names its transfer)
            return
        o.pending_wrs -= 1
        if o.error is not None:
            self._maybe_finish_failed(o)
        elif o.mode is Mode.FEDRDMA_E and self.modes.slot_sender is not None:
            self.modes.slot_sender.on_write_complete(o, seq)

    def _on_recv(self, wc: ev.WC) -> None:
        qp_idx, k = split_recv_wr_id(wc.wr_id)
        if not wc.ok:
            raise PeerUnreachable(f"connection to {self.peer} failed: receive completed with {wc.status.name}{_why(wc)}")
        if wc.opcode == ev.WCOpcode.RECV_RDMA_WITH_IMM:
            imm = wc.imm_data or 0
            self.wire.post_recv(qp_idx, k)
            arrival = decode_imm(imm)
            if isinstance(arrival, StagedWrite):
                if self.modes.staged_receiver is None:
                    raise RemoteProtocolError(f"{self.peer} wrote a FedRDMA chunk; this side offered no staging buffers")
                self.modes.staged_receiver.on_chunk(arrival.index)
            else:
                if self.modes.slot_receiver is None:
                    raise RemoteProtocolError(f"{self.peer} wrote a FedRDMA-E slot; this side offered no receive pool")
                self.modes.slot_receiver.on_write_imm(imm)
            return
        c = self.wire.received(qp_idx, k, wc.byte_len)
        self.wire.post_recv(qp_idx, k)
        self._on_ctrl(c)

    def _on_ctrl(self, c: P.Ctrl) -> None:
        """A control frame from the peer, to the part it concerns."""
        a, modes, peer = self._active, self.modes, self.peer
        if c.kind is CtrlKind.ACK:
            if modes.staged_sender is None:
                raise RemoteProtocolError(f"{peer} sent an ACK; this side never wrote to its staging buffers")
            modes.staged_sender.on_ack(c, a)
        elif c.kind in (CtrlKind.CREDIT, CtrlKind.RECLAIM):
            if modes.slot_sender is None:
                raise RemoteProtocolError(f"{peer} sent a {c.kind.name}; it offered no receive pool")
            if c.kind is CtrlKind.CREDIT:
                modes.slot_sender.on_credit(c, a)
            else:
                modes.slot_sender.on_reclaim(c)
        elif c.kind in (CtrlKind.GROW, CtrlKind.RETURN, CtrlKind.PLACED):
            if modes.slot_receiver is None:
                raise RemoteProtocolError(f"{peer} sent a {c.kind.name}; this side offered no receive pool")
            if c.kind is CtrlKind.GROW:
                modes.slot_receiver.on_grow(c)
            elif c.kind is CtrlKind.RETURN:
                modes.slot_receiver.on_return(c)
            else:
                modes.slot_receiver.on_placed(c)
        elif c.kind is CtrlKind.CANCEL:
            if a is not None and a.fut.transfer_id == c.transfer_id:
                self.fail(a, TransferCancelled(f"transfer {c.transfer_id} cancelled by {peer}: {c.reason}",
                                               c.transfer_id), tell_peer=False)
            elif modes.staged_receiver is not None and modes.staged_receiver.on_cancel(c.transfer_id):
                log.info("transfer %d from %s cancelled by the sender", c.transfer_id, peer)
        elif c.kind is CtrlKind.DONE:
            if modes.slot_sender is not None:
                modes.slot_sender.on_done(c.transfer_id, a)
        elif c.kind is CtrlKind.ERROR:
            self._on_error(c, a)
        elif c.kind is CtrlKind.RESUME:
            total, claim = decode_resume(c)  # (every field checked)
            if self.resume is None:  # (resume_window_s 0: nothing is held here)
                self.send_ctrl(P.Ctrl(CtrlKind.RESUMED, c.transfer_id, int(ResumeState.UNKNOWN), 0))
            else:
                self.resume.holdings.answer(cast("PeerEngine", self), peer, c.transfer_id, total, claim)
        elif c.kind is CtrlKind.RESUMED:
            self._on_resumed(c)
        elif c.kind is CtrlKind.PROBE:
            self.send_ctrl(P.Ctrl(CtrlKind.PROBE_REPLY, 0, c.value))
        elif c.kind is CtrlKind.PROBE_REPLY:
            probe = self.path.probe
            if probe.on_reply(int(c.value), clock()):
                log.info("connection to %s: RTT %.3f ms, window %d of %d-byte chunks, %s, data path %s", peer,
                         (probe.rtt_s or 0.0) * 1e3, *self.path.window(self.cfg.mode == "fedrdma-e"),
                         self.label, self.where["path"])

    def _on_resumed(self, c: P.Ctrl) -> None:
        """The peer's answer to a RESUME of ours, checked: a state it may be in, bytes it may hold."""
        asks = self._asked.get(c.transfer_id)
        asked = asks.popleft() if asks else None
        if asks is not None and not asks:
            del self._asked[c.transfer_id]
        if asked is None:
            raise RemoteProtocolError(f"{self.peer} sent RESUMED for transfer {c.transfer_id}, which this side "
                                      f"did not ask about")
        total, fut = asked
        if c.value not in ResumeState.__members__.values():
            raise RemoteProtocolError(f"{self.peer} sent RESUMED for transfer {c.transfer_id} in unknown state "
                                      f"{c.value}")
        state = ResumeState(c.value)
        offset = state in (ResumeState.PARTIAL, ResumeState.SUFFIX)  # (the offset held to, or from)
        if (offset and not 0 < c.aux < total) or (not offset and c.aux):
            raise RemoteProtocolError(f"{self.peer} sent RESUMED for transfer {c.transfer_id} of {total} bytes "
                                      f"holding {c.aux} bytes in state {state.name}")
        fut.set_result((state, int(c.aux)))

    def _on_error(self, c: P.Ctrl, a: Optional[Outgoing]) -> None:
        """The peer refused transfer `c.transfer_id` (ERROR): it fails with the error its code names."""
        sender = self.modes.slot_sender
        if sender is not None:
            sender.on_refused(c.transfer_id)  # a refused GROW: the slot's old grant stands
        target = sender.placed.get(c.transfer_id) if sender is not None else None
        target = target or (a if a is not None and a.fut.transfer_id == c.transfer_id else None)
        if target is not None:
            self.fail(target, refusal(c, self.peer), tell_peer=False)

    def _first_error_completion(self, exc: BaseException) -> BaseException:
        """Why a QP went to the error state, where `exc` only says that it is there (a post found it so, or a
        flushed work request completed, before the engine took the completion that says why): that completion's
        error, else `exc`."""
        try:
            if not any(rc.qp.state == ev.QPState.ERR for rc in self.wire.rcs):
                return exc  # (a QP in ERR is what a flush or a refused post says; anything else is its own cause)
            failed = [wc for wc in cause_first(self.wire.cq.poll(64)) if not wc.ok]
        except ev.EasyVerbsError:
            failed = []
        if not failed or failed[0].status is ev.WCStatus.WR_FLUSH_ERR:
            return exc
        return PeerUnreachable(f"connection to {self.peer} failed: work completion {failed[0].status.name}"
                               f"{_why(failed[0])}")


def _why(wc: ev.WC) -> str:
    return f" ({wc.reason})" if getattr(wc, "reason", "") else ""
