"""A connection's engine: the one loop that runs both modes (fedrdma.py, fedrdma_e.py) over the connection's
wire (wire.py), and the port it offers them (port.py).

The loop: take user requests (send, cancel, release, stop), start the next queued transfer when none is active
(the protocol's policy picks its mode and window), let the active transfer's mode post what its machine allows,
then handle completions and the peer's control frames (inbound.py), and check deadlines every 100 ms. When the
connection ends for a reason of its path, its transfers go to the endpoint's resumer (resume.py), not to failure.

All protocol state is touched with `_turn_lock` held: by the engine's thread; by a user's thread whose send,
release or cancel finds no turn running and takes it at once (`_request`); where the CQ takes an arrival hook
(easypyverbs.capabilities.ArrivalHook: an emulated NIC), by the NIC's thread that queued completions
(`on_arrival`). Each borrowed turn saves a wake-up of the engine's thread; it takes the lock without blocking
(else the engine takes the work on its next turn), so no lock order arises, and what it raises is left in
`_failed` for the engine's thread to end the connection with. So a future's callbacks may run in any of these
threads.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Callable, Deque, Dict, List, Optional, Tuple, Union

import easypyverbs as ev
from easypyverbs.bootstrap import loads_object
from easypyverbs.capabilities import ArrivalHook
from easypyverbs.stalls import clock

from .. import metrics, protocol as P
from ..config import ChannelConfig
from ..errors import (ConfigError, PayloadTooLarge, PeerUnreachable, TransferCancelled,
                      TransferError)
from ..protocol.frames import CtrlKind, ErrorCode, ResumeState
from ..protocol.hello import Hello
from ..protocol.packing import SuffixClaim, encode_resume
from ..protocol.policy import Mode, choose_mode, first_chunk_bytes
from ..protocol.refusal import error_frame
from .buffers import RecvBuffers
from .ending import Ending
from .inbound import Inbound, Modes, cause_first
from .outgoing import Outgoing, Request, Where
from .path import Path
from .port import Plan
from .transfer import Message, TransferFuture
from .wire import Wire

if TYPE_CHECKING:
    from .resume import Resumer

log = logging.getLogger("fate_rdma.channel")

#: what a request carries: SEND its transfer, CANCEL the transfer's future, RELEASE a slot, STOP nothing;
#: ASK (transfer id, bytes, the future of the answer), ANSWER (transfer id, ResumeState, bytes held), BREAK why
_Arg = Union[Outgoing, TransferFuture, int, None, Tuple[P.Ctrl, "concurrent.futures.Future[Tuple[ResumeState, int]]"],
             Tuple[int, ResumeState, int], BaseException]


class Engine(Inbound, Ending):
    """Runs a connection's transfers in both directions (port.SendPort and port.RecvPort to its modes)."""

    def __init__(self, wire: Wire, path: Path, cfg: ChannelConfig, peer: Hello, recv_buffers: RecvBuffers,
                 deliver: Callable[[Message], None], closed: Callable[[], bool], on_dead: Callable[[], None],
                 where: Where, label: str) -> None:
        """`peer`: the peer's hello; `recv_buffers`: what a delivered message copies into (Message.detach);
        `deliver`: to the endpoint; `closed`: the peer closed its end of the bootstrap connection; `on_dead`: the
        connection's teardown; `where`, `label`: the connection's path and provider (for the trace, the log)."""
        self.wire, self.path, self.cfg = wire, path, cfg
        self.peer_hello, self.peer = peer, peer.name
        self.recv_buffers = recv_buffers
        self._deliver, self._closed, self._on_dead = deliver, closed, on_dead
        self.where, self.label = where, label
        self.modes = Modes()
        self._requests: Deque[Tuple[Request, _Arg]] = collections.deque()
        self._outq: Deque[Outgoing] = collections.deque()
        self._active: Optional[Outgoing] = None
        self._draining: List[Outgoing] = []  # failed, waiting for their WRITEs in flight to complete
        self._stop = False
        self.dead: Optional[BaseException] = None
        self._turn_lock = threading.Lock()
        self._failed: Optional[BaseException] = None  # what a borrowed turn raised, for the engine to die of
        self._dead_err: Optional[BaseException] = None  # what requests that come after _die are failed with
        self._hooked = False
        #: resume.py: where transfers go when the connection breaks under them, and what the peer is told it
        #: holds of its own (None: resume_window_s is 0); `address`: what to dial to resume
        self.resume: Optional["Resumer"] = None
        self.address = self.peer
        self._resumable = False  # the connection ended for a reason of its path: its transfers wait for the next
        #: RESUMEs sent, per transfer, in order (an ask that timed out is answered before the next: frames keep order)
        self._asked: Dict[int, Deque[Tuple[int, "concurrent.futures.Future[Tuple[ResumeState, int]]"]]] = {}
        self.thread = threading.Thread(target=self._run, name=f"fate-rdma-conn-{self.peer}", daemon=True)

    def start(self, modes: Modes) -> None:
        """Run `modes` (made with this engine as their port) from now on."""
        self.modes = modes
        cq = self.wire.cq
        # an emulated NIC's threads may handle their completions themselves
        self._hooked = isinstance(cq, ArrivalHook)
        if isinstance(cq, ArrivalHook):
            cq.on_arrival = self.on_arrival
        self.thread.start()

    # -- requests (any thread) ------------------------------------------------------------------
    def submit(self, o: Outgoing) -> None:
        self._request(Request.SEND, o)

    def cancel(self, fut: TransferFuture) -> None:
        self._request(Request.CANCEL, fut)

    def release_slot(self, slot: int) -> None:
        """A delivered FedRDMA-E message was released (RecvPort)."""
        self._request(Request.RELEASE, slot)

    def close(self) -> None:
        if self.thread.is_alive():
            self._request(Request.STOP, None)
            self.thread.join(timeout=10)

    def ask_resume(self, tid: int, total: int, claim: Optional[SuffixClaim] = None
                   ) -> "concurrent.futures.Future[Tuple[ResumeState, int]]":
        """What the peer holds of transfer `tid` of `total` bytes (RESUME, with FedRDMA-E's `claim`; the future
        of its RESUMED)."""
        fut: "concurrent.futures.Future[Tuple[ResumeState, int]]" = concurrent.futures.Future()
        self._request(Request.ASK, (encode_resume(tid, total, claim), fut))
        return fut

    def answer_resume(self, tid: int, state: ResumeState, held: int) -> None:
        self._request(Request.ANSWER, (tid, state, held))

    def break_off(self, why: PeerUnreachable) -> None:
        """End the connection as if its path had broken: its transfers wait for the next (resume.py)."""
        self._request(Request.BREAK, why)

    def _request(self, kind: Request, arg: _Arg) -> None:
        self._requests.append((kind, arg))
        # a send or a release is taken in the caller's thread when no turn is running (no hand-off to the
        # engine's thread); else the engine takes it on its next turn
        if kind is Request.STOP or not self._turn_lock.acquire(blocking=False):
            self.wire.cq.wake()
            self._if_dead()
            return
        try:
            if self.dead is None and self._failed is None:
                self._turn()
        except BaseException as exc:  # the engine's thread fails the connection with it (as its own turn would)
            self._failed = exc
            self.wire.cq.wake()
            if not isinstance(exc, Exception):
                raise  # (KeyboardInterrupt: the caller's too)
        finally:
            self._turn_lock.release()
        self._if_dead()

    def _if_dead(self) -> None:
        if self._dead_err is not None:  # (died before the request was taken: fail it as _die failed the rest)
            self._fail_requests(self._dead_err)

    def on_arrival(self) -> bool:
        """ArrivalHook.on_arrival: the NIC's thread that queued completions handles them, unless a turn is running
        (whose thread takes them next); False wakes the engine."""
        if not self._turn_lock.acquire(blocking=False):
            return False
        try:
            if self.dead is not None or self._failed is not None:
                return False
            wcs = self.wire.cq.poll(64)
            while wcs:
                for wc in cause_first(wcs):
                    self._on_wc(wc)
                wcs = self.wire.cq.poll(64)
            self._turn()
            return True
        except BaseException as exc:  # (the engine's thread dies of it: woken, the queue may be empty now)
            self._failed = exc
            self.wire.cq.wake()
            return False
        finally:
            self._turn_lock.release()

    # -- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        last_tick = clock()
        try:
            with self._turn_lock:
                self.path.probe.start(clock())
            while not self._stop:
                with self._turn_lock:
                    if self._failed is not None:  # (a borrowed turn failed: nothing more on what it left)
                        raise self._failed
                    self._turn()
                try:  # (hooked: completions are taken with the lock held only, so that they are handled in order)
                    wcs = self.wire.cq.wait(0.05, max_entries=0 if self._hooked else 64)
                except ev.PollTimeout:
                    wcs = []
                with self._turn_lock:
                    if self._failed is not None:
                        raise self._failed
                    if self._hooked:
                        wcs = self.wire.cq.poll(64)
                    for wc in cause_first(wcs):
                        self._on_wc(wc)
                    now = clock()
                    if now - last_tick > 0.1:
                        last_tick = now
                        self._tick(now)
            with self._turn_lock:
                self._die(PeerUnreachable(f"connection to {self.peer} closed"), quiet=True)
        except BaseException as exc:  # the engine must never die silently
            with self._turn_lock:
                self._die(exc)

    def _turn(self) -> None:
        """Take the requests and post what the active transfer allows (with `_turn_lock` held)."""
        with self.wire.control.held():  # this turn's control frames leave with its WRITEs
            self._handle_requests()
            self._pump()

    def _handle_requests(self) -> None:
        while self._requests:
            kind, arg = self._requests.popleft()
            if kind is Request.SEND and isinstance(arg, Outgoing):
                self._outq.append(arg)
            elif kind is Request.CANCEL and isinstance(arg, TransferFuture):
                self._cancel_out(arg)
            elif kind is Request.RELEASE and isinstance(arg, int) and self.modes.slot_receiver is not None:
                self.modes.slot_receiver.release(arg)
            elif kind is Request.STOP:
                self._stop = True
            elif kind is Request.ASK and isinstance(arg, tuple):
                ask, fut = arg[0], arg[-1]
                assert isinstance(ask, P.Ctrl) and isinstance(fut, concurrent.futures.Future)
                self._asked.setdefault(ask.transfer_id, collections.deque()).append((ask.value, fut))
                self.send_ctrl(ask)
            elif kind is Request.ANSWER and isinstance(arg, tuple):
                tid, state, held = arg[0], arg[1], arg[-1]
                assert isinstance(tid, int) and isinstance(state, ResumeState) and isinstance(held, int)
                self.send_ctrl(P.Ctrl(CtrlKind.RESUMED, int(tid), int(state), held))
            elif kind is Request.BREAK and isinstance(arg, BaseException):
                raise arg

    def _cancel_out(self, fut: TransferFuture) -> None:
        a = self._active
        if a is not None and a.fut is fut:
            self.fail(a, TransferCancelled(f"transfer {fut.transfer_id} cancelled by sender", fut.transfer_id), tell_peer=True)
            return
        for o in list(self._outq):
            if o.fut is fut:
                self._outq.remove(o)
                o.payload.close()
                fut.set_exception(TransferCancelled(f"transfer {fut.transfer_id} cancelled before it started", fut.transfer_id))

    def _start(self, o: Outgoing) -> bool:
        """Make `o` the active transfer; False if it must wait (no free slot yet)."""
        cfg, now, path = self.cfg, clock(), self.path
        peer = self.peer_hello
        try:
            mode = choose_mode(cfg.mode, o.payload.total, peer.pool.slot_payload_bytes if peer.pool else None,
                               peer.staging is not None, cfg.too_large, o.fut.transfer_id, peer=self.peer)
            if not o.payload.startable(back_to_front=mode is Mode.FEDRDMA_E):
                return False  # (staged chunks go front to back: once the payload's copy is done)
        except (PayloadTooLarge, ConfigError, TransferCancelled) as exc:  # too large, modes disagree, copy failed
            o.payload.close()
            o.fut.set_exception(exc)
            return True
        window, chunk = path.window(mode is Mode.FEDRDMA_E)
        plan = Plan(now=now, window=window, chunk_bytes=chunk, qps=path.active_qps,
                    first_chunk_bytes=first_chunk_bytes(cfg.link_enable, path.rate_bps(), not path.kind.has_link),
                    no_progress_s=cfg.no_progress_timeout_s, total_s=cfg.transfer_timeout_s)
        sender = self.modes.slot_sender if mode is Mode.FEDRDMA_E else self.modes.staged_sender
        assert sender is not None, "choose_mode picks a mode whose receive memory the peer offered"
        machine = sender.machine(o, plan)
        if machine is None:
            return False
        o.begin(machine, mode, self.where)
        # (a resumed transfer: the largest window and chunk of its tries, which bound what it sent twice)
        o.fut.mode, o.fut.window, o.fut.chunks = mode.value, max(o.fut.window, machine.window), len(machine.chunks)
        o.fut.chunk_bytes = max([o.fut.chunk_bytes, *(c.length for c in machine.chunks)])
        self._active = o
        return True

    def _pump(self) -> None:
        if self.path.probe.rtt_s is None:
            return
        while self._active is None and self._outq:
            if not self._start(self._outq[0]):
                return
            self._outq.popleft()
        o = self._active
        if o is None or o.error is not None:
            return
        fill = o.payload.fill
        if fill is not None and fill.error is not None:
            self.fail(o, TransferCancelled(f"transfer {o.fut.transfer_id}: the payload's copy failed: {fill.error}",
                                           o.fut.transfer_id), tell_peer=True)
            return
        if o.mode is not Mode.FEDRDMA_E:  # (FedRDMA-E posts the held control frames in its batch of WRITEs)
            self.wire.control.flush()  # a staged chunk's digest is taken between its WRITE and its header: no batch
        sender = self.modes.slot_sender if o.mode is Mode.FEDRDMA_E else self.modes.staged_sender
        assert sender is not None, "a transfer started in a mode has that mode's sender"
        sender.pump(o)

    # -- the port (port.SendPort, port.RecvPort) ------------------------------------------------
    def next_qp(self) -> ev.QP:
        return self.wire.next_qp(self.path.active_qps)

    def control_qp(self) -> ev.QP:
        return self.wire.control_qp()

    def batched(self) -> contextlib.AbstractContextManager[None]:
        return self.wire.batched()

    def post_data(self, qp: ev.QP, o: Outgoing, c: P.Chunk, remote: ev.RemoteMR, roff: int, signal_last: bool,
                  seq: int, in_place: bool = False) -> None:
        self.wire.post_data(qp, o, c, remote, roff, signal_last, seq, in_place)

    def post_header(self, qp: ev.QP, o: Outgoing, hdr: P.Header, seq: int, remote: ev.RemoteMR, roff: int,
                    imm: int) -> None:
        self.wire.post_header(qp, o, hdr, seq, remote, roff, imm)

    def send_ctrl(self, c: P.Ctrl) -> None:
        self.wire.control.send(c)

    def wake(self) -> None:
        self.wire.cq.wake()

    def step_aside(self, o: Outgoing) -> None:
        if self._active is o:
            self._active = None

    def finish(self, o: Outgoing) -> None:
        o.payload.close()
        self.step_aside(o)
        secs = o.finished()
        p = o.source
        o.fut.set_result({"transfer_id": o.fut.transfer_id, "bytes": p.total if p else o.payload.total, "seconds": secs,
                          "mode": o.mode.value if o.mode else "", "window": o.fut.window, "chunks": o.fut.chunks,
                          "chunk_bytes": o.fut.chunk_bytes, "qps": self.path.active_qps, "resumes": p.resumes if p else 0,
                          "resent_bytes": p.resent_bytes if p else 0, "resume_wait_s": p.waited_s if p else 0.0})

    def fail(self, o: Outgoing, exc: BaseException, tell_peer: bool) -> None:
        if o.error is not None:
            return
        o.error = exc
        if o.machine is not None:
            o.machine.cancel(str(exc)) if isinstance(exc, TransferCancelled) else o.machine.fail(exc)
        if self.modes.slot_sender is not None:
            self.modes.slot_sender.forget(o)
        if tell_peer:
            self.send_ctrl(P.Ctrl(CtrlKind.CANCEL, o.fut.transfer_id, 0, 0, str(exc)[:200]))
        if self._active is o:
            self._active = None
            self._draining.append(o)
        self._maybe_finish_failed(o)

    def _maybe_finish_failed(self, o: Outgoing) -> None:
        """A failed transfer's resources are freed only when none of its WRITEs is still in flight."""
        if o.pending_wrs > 0:
            return
        if o in self._draining:
            self._draining.remove(o)
        if o.mode is Mode.FEDRDMA_E and self.modes.slot_sender is not None:
            self.modes.slot_sender.give_back_unused(o)
        o.payload.close()
        if not o.fut.done():
            o.fut.set_exception(o.error)

    def refuse(self, tid: int, code: ErrorCode, reason: str) -> None:
        log.warning("transfer %d from %s refused: %s", tid, self.peer, reason)
        metrics.refused(code.name.lower())
        self.send_ctrl(error_frame(tid, code, reason))

    def deliver(self, tid: int, meta: bytes, view: memoryview, mode: str, releaser: Optional[Callable[[], None]],
                lend: Optional[Callable[[], bool]] = None) -> None:
        try:  # (the peer's bytes: malformed, nested too deep or not an object are handed on raw)
            md = loads_object(meta or b"{}")
        except ValueError:
            md = {"_raw_metadata": meta.hex()}
        self._deliver(Message(self.peer, tid, md, view, mode, releaser, self.recv_buffers.get, lend))

    # -- time -----------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        cfg = self.cfg
        wait = max(cfg.connect_timeout_s, cfg.no_progress_timeout_s)  # (a connected peer may be held)
        if self.path.probe.overdue(now, wait):
            raise PeerUnreachable(f"{self.peer} did not answer the RTT probe within {wait:g} s")
        if self._closed():
            raise PeerUnreachable(f"{self.peer} closed its end of the connection (its process or endpoint ended)")
        a = self._active
        if a is not None and a.error is None and a.machine is not None:
            try:
                a.machine.tick(now)
            except TransferError as exc:
                a.error = None  # the machine failed itself; fail() records it and tells the peer
                self.fail(a, exc, tell_peer=True)
        modes = self.modes
        for part in (modes.slot_sender, modes.slot_receiver, modes.staged_receiver):
            if part is not None:
                part.tick(now)
        # reassembly and copy buffers unused for pool_idle_s are let go of, as idle slots shrink
        self.recv_buffers.trim(cfg.pool_idle_s)
