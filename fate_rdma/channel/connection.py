"""One peer connection: set-up, and the engine thread that runs both modes over a small shared loop.

Data moves as RDMA WRITEs in both modes (fedrdma.py, fedrdma_e.py); control frames (ACK, CREDIT,
CANCEL, ERROR, PROBE, DONE) travel as SENDs on QP 0. Receive queues hold small buffers only (control
frames and the notices of WRITE_WITH_IMM), so they never stall on a large SEND.

The loop: take user requests (send, cancel, release, stop), start the next queued transfer when none
is active (the protocol's policy picks its mode and window), let the active transfer's mode post what
its machine allows, then dispatch completions and control frames, and check deadlines every 100 ms.
All protocol state is touched under one lock: by the engine thread; by a user's thread whose send, release
or cancel finds no turn running and takes it at once; and, on the soft provider, by the emulated NIC's thread
that queued completions, which handles them there (SoftCQ.on_arrival): one thread hand-off less each. So a
future's callbacks may run in any of these threads.
"""
from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
from typing import Any, Deque, Dict, List, Optional, Tuple

import easypyverbs as ev
from easypyverbs.stalls import clock

from .. import protocol as P
from ..config import ChannelConfig
from ..errors import (ConfigError, FateRdmaError, PayloadTooLarge, PeerUnreachable, RemoteProtocolError,
                      TransferCancelled, TransferError)
from ..protocol.frames import MAX_META, CtrlKind, ErrorCode
from ..protocol.policy import (Mode, choose_mode, first_chunk_bytes, path_rate_bps, qps_in_use, short_tcp_path,
                               slot_chunk_bytes, window_for)
from .completions import RECV_TAG, on_wc
from .checksum import block_hasher, integrities, payload_checksum_async
from .leaving import LeavingDigest
from .control import ControlSender, RttProbe
from .fedrdma import StagedReceiver, StagedSender
from .fedrdma_e import SlotReceiver, SlotSender
from .auth import Identity
from .handshake import bootstrap_closed, confirm_posted, negotiate
from .layout import RECV_DEPTH, LocalMemory
from .outgoing import Outgoing, Request, Wr
from .posting import data_qp_cap, post_chunk, same_host_path, soft_tcp_path
from .transfer import Fill, Message, Payload, TransferFuture
from .turns import Turns

log = logging.getLogger("fate_rdma.channel")

class Connection(Turns):
    def __init__(self, endpoint: Any, boot: ev.BootstrapConn, dialer: bool, identity: Identity) -> None:
        """`identity`: who the peer proved to be on `boot` (auth.authenticate ran first)."""
        self.endpoint = endpoint
        self.cfg: ChannelConfig = endpoint.config
        self.boot = boot
        self.identity = identity
        self.send_integrity, self.recv_integrity = integrities(self.cfg.checksum, identity, dialer)
        self.rcs: List[ev.RCConnection] = []
        self.mem: Optional[LocalMemory] = None
        self._reserved = 0  # bytes of the endpoint's memory budget this connection holds
        self.cq = endpoint.ctx.create_cq(8192)
        try:
            self._setup(endpoint.ctx, endpoint.pd, boot)
        except BaseException:
            self._release_resources()
            raise
        self._requests: Deque[Tuple[Request, Any]] = collections.deque()
        self._outq: Deque[Outgoing] = collections.deque()
        self._active: Optional[Outgoing] = None
        self._draining: List[Outgoing] = []  # failed, waiting for their WRITEs in flight to complete
        self._wrs: Dict[int, Tuple[Wr, Any, int, int]] = {}
        self._wr_seq = 0
        self._rr = 0
        self._tids = itertools.count(2)  # (next() on it is atomic: user threads take ids without a lock)
        self._stop = False
        self.dead: Optional[BaseException] = None
        # protocol state is touched only with this held: by the engine's thread, a user's thread that takes its
        # own request at once (_request), a soft NIC's thread (_on_arrival); `_failed`: what a borrowed turn
        # raised, for the engine to die of
        self._turn_lock = threading.Lock()
        self._failed: Optional[BaseException] = None
        self._dead_err: Optional[BaseException] = None  # what requests that come after _die are failed with
        self.control = ControlSender(self.mem, lambda: self.rcs[0].qp, lambda idx: self._wr_id(Wr.CTRL, None, 0, idx))  # type: ignore[arg-type]
        self.probe = RttProbe(self.control.send)
        # the soft provider's NIC threads may handle their completions themselves (SoftCQ.on_arrival)
        self._hooked = hasattr(self.cq, "on_arrival")
        if self._hooked:
            self.cq.on_arrival = self._on_arrival  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._run, name=f"fate-rdma-conn-{self.peer}", daemon=True)
        self._thread.start()

    # -- set-up ---------------------------------------------------------------------------------
    def _setup(self, ctx: ev.Context, pd: ev.PD, boot: ev.BootstrapConn) -> None:
        cfg = self.cfg
        t = cfg.connect_timeout_s
        track = block_hasher(self.recv_integrity) if ctx.tracks_writes else None
        agreed = negotiate(boot, cfg, self.endpoint.name, self.endpoint.terms, self.identity.name)
        peer, pool, staging, nqps = agreed.peer, agreed.pool, agreed.staging, agreed.qps
        self.peer = peer.name
        self.peer_hello = peer
        self.near = agreed.near  # (handshake.Agreed)
        # FedRDMA-E slots start small and reserve more as they grow (fedrdma_e.SlotReceiver.on_grow)
        first = pool.slots * pool.offset_in_slot(min(cfg.slot_initial_bytes, cfg.slot_bytes)) if pool else 0
        offered = first + (staging.count * staging.buf_bytes if staging else 0)
        if not self.endpoint.budget.reserve(offered):
            raise PayloadTooLarge(f"connection from {peer.name}: its receive memory ({offered} bytes) would exceed this "
                                  f"endpoint's memory budget ({self.endpoint.budget.limit_bytes} bytes, "
                                  f"{self.endpoint.budget.held_bytes} held)")
        self._reserved = offered
        self.mem = mem = LocalMemory(pd, nqps, cfg.max_window, pool, staging, cfg.slot_initial_bytes, track, agreed.near)
        cap = data_qp_cap(self.endpoint.send_sge_limit(self.cq))  # (posting.py: a WRITE gathers up to 30 arrays)
        for i in range(nqps):
            rc = ev.establish(ctx, boot, mrs=mem.remote_mrs if i == 0 else None, pd=pd, cap=cap, timeout_s=t,
                              owns_bootstrap=False, cq=self.cq)
            self.rcs.append(rc)
            if i == 0:
                self.remote = rc.remote_mrs
            for k in range(RECV_DEPTH):
                self._post_recv(i, k)
        confirm_posted(boot, t)
        #: the data QPs copy payloads by the soft provider's same-host path (fixed once they are connected)
        self.same_host_copy = same_host_path(self.rcs)
        #: ... or over the soft provider's TCP streams with no link model (FedRDMA-E's larger chunk there)
        self.soft_tcp = soft_tcp_path(ctx, self.rcs)
        if peer.staging is not None:
            st = self.remote.get("staging")
            if st is None or st.length < peer.staging.count * peer.staging.buf_bytes:
                raise RemoteProtocolError(f"{self.peer} offers {peer.staging.count} staging buffers of "
                                          f"{peer.staging.buf_bytes} bytes but no MR that holds them")
        self.slot_sender = SlotSender(self, peer.pool) if peer.pool else None
        self.staged_sender = StagedSender(self, peer.staging) if peer.staging else None
        self.slot_receiver = SlotReceiver(self, pool) if pool else None
        self.staged_receiver = StagedReceiver(self) if staging else None
        self.label = ctx.label
        self.emulated = ctx.emulated
        #: what the trace says a transfer of this connection went over (`bench timeline` names it on every row)
        self.where = {"provider": ctx.provider, "emulated": ctx.emulated,
                      "path": str(getattr(self.rcs[0].qp, "data_path", "verbs")) if self.rcs else "verbs"}

    @property
    def pool_bytes(self) -> int:
        """Bytes of this side's FedRDMA-E receive slots registered now (they follow the traffic)."""
        return self.mem.pool_bytes if self.mem is not None else 0

    def _post_recv(self, qp_idx: int, k: int) -> None:
        self.rcs[qp_idx].qp.post_recv(self.mem.recv_sge(qp_idx, k), wr_id=RECV_TAG | (qp_idx << 20) | k)  # type: ignore[union-attr]

    # -- user side (any thread) -----------------------------------------------------------------
    def send(self, buffers: Any, metadata: Optional[Dict[str, Any]] = None, fill: Optional[Fill] = None) -> TransferFuture:
        if self.dead is not None:
            raise PeerUnreachable(f"connection to {self.peer} is down: {self.dead}")
        meta = json.dumps(metadata or {}, separators=(",", ":")).encode()
        if len(meta) > MAX_META:
            raise FateRdmaError(f"metadata of {len(meta)} bytes exceeds {MAX_META}")
        payload = Payload(self.endpoint.pd, buffers, fill)
        tid = (id(self) & 0xFFFF) << 40 | next(self._tids)
        fut = TransferFuture(tid, payload.total, lambda f: self._request(Request.CANCEL, f))
        fut.set_running_or_notify_cancel()
        out = Outgoing(fut, payload, meta, self.send_integrity)
        if out.checksums and self.cfg.mode == "fedrdma-e":
            # digested as its chunks leave (leaving.py: made with its chunks, fedrdma_e.SlotSender.pump), else now
            out.leave_ok = LeavingDigest.wanted(payload.total, self.send_integrity, fill, [rc.qp for rc in self.rcs],
                                                self.slot_chunk())
            if not out.leave_ok:
                out.crc_future = payload_checksum_async(payload.views(), self.send_integrity, fill)
        if out.crc_future is not None and not out.crc_future.done():  # (a small payload's is taken at once: the SEND
            out.crc_future.add_done_callback(lambda _f: self.cq.wake())                # request wakes the engine)
        if fill is not None:
            fill.on_change(self.cq.wake)
        self._request(Request.SEND, out)
        return fut

    def release_slot(self, slot: int) -> None:
        """A delivered FedRDMA-E message was released (any thread)."""
        self._request(Request.RELEASE, slot)

    def close(self) -> None:
        if self._thread.is_alive():
            self._request(Request.STOP, None)
            self._thread.join(timeout=10)

    # -- engine loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        last_tick = clock()
        try:
            with self._turn_lock:
                self.probe.start(clock())
            while not self._stop:
                with self._turn_lock:
                    if self._failed is not None:  # (a borrowed turn failed: nothing more on what it left)
                        raise self._failed
                    self._turn()
                try:  # (hooked: completions are taken with the lock held only, so that they are handled in order)
                    wcs = self.cq.wait(0.05, max_entries=0 if self._hooked else 64)
                except ev.PollTimeout:
                    wcs = []
                with self._turn_lock:
                    if self._failed is not None:
                        raise self._failed
                    if self._hooked:
                        wcs = self.cq.poll(64)
                    for wc in wcs:
                        on_wc(self, wc)
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
        with self.control.held():  # this turn's control frames leave with its WRITEs
            self._handle_requests()
            self._pump()

    def _handle_requests(self) -> None:
        while self._requests:
            kind, arg = self._requests.popleft()
            if kind is Request.SEND:
                self._outq.append(arg)
            elif kind is Request.CANCEL:
                self._cancel_out(arg)
            elif kind is Request.RELEASE:
                self.slot_receiver.release(arg)  # type: ignore[union-attr]
            elif kind is Request.STOP:
                self._stop = True

    def _cancel_out(self, fut: TransferFuture) -> None:
        a = self._active
        if a is not None and a.fut is fut:
            self.fail_out(a, TransferCancelled(f"transfer {fut.transfer_id} cancelled by sender", fut.transfer_id), tell_peer=True)
            return
        for o in list(self._outq):
            if o.fut is fut:
                self._outq.remove(o)
                o.payload.close()
                fut.set_exception(TransferCancelled(f"transfer {fut.transfer_id} cancelled before it started", fut.transfer_id))

    def _rate_bps(self) -> float:
        return path_rate_bps(self.cfg.link_rate_bps, getattr(self.endpoint.ctx, "link_model", None))

    def slot_chunk(self) -> int:
        """FedRDMA-E's chunk on this connection's path (policy.slot_chunk_bytes)."""
        cfg = self.cfg
        return slot_chunk_bytes(cfg.chunk_bytes, cfg.same_host_chunk_bytes, self.same_host_copy,
                                cfg.tcp_chunk_bytes, short_tcp_path(self.soft_tcp, self.probe.rtt_s))

    def window(self, fedrdma_e: bool) -> Tuple[int, int]:
        """(chunks in flight, chunk bytes) for a transfer in FedRDMA-E (`fedrdma_e`) or FedRDMA: the automatic
        window holds the same bytes whatever the chunk."""
        cfg = self.cfg
        chunk = self.slot_chunk() if fedrdma_e else cfg.chunk_bytes
        return window_for(cfg.window, self._rate_bps(), self.probe.rtt_s or 0.0, chunk, cfg.min_auto_window,
                          cfg.max_window, self.endpoint.ctx.provider), chunk

    def _start(self, o: Outgoing) -> bool:
        """Make `o` the active transfer; False if it must wait (no free slot yet)."""
        cfg, now = self.cfg, clock()
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
        w, _chunk = self.window(mode is Mode.FEDRDMA_E)
        le = first_chunk_bytes(cfg.link_enable, self._rate_bps(), self.same_host_copy or self.soft_tcp)
        common = dict(now=now, first_chunk_bytes=le,
                      no_progress_s=cfg.no_progress_timeout_s, total_s=cfg.transfer_timeout_s)
        engine = self.slot_sender if mode is Mode.FEDRDMA_E else self.staged_sender
        machine = engine.machine(o, w, common)  # type: ignore[union-attr]
        if machine is None:
            return False
        o.begin(machine, mode, self.where)
        o.fut.mode, o.fut.window, o.fut.chunks = mode.value, machine.window, len(machine.chunks)
        self._active = o
        return True

    def _pump(self) -> None:
        if self.probe.rtt_s is None:
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
            self.fail_out(o, TransferCancelled(f"transfer {o.fut.transfer_id}: the payload's copy failed: {fill.error}",
                                               o.fut.transfer_id), tell_peer=True)
            return
        if o.mode is not Mode.FEDRDMA_E:  # (FedRDMA-E posts the held control frames in its batch of WRITEs)
            self.control.flush()  # a staged chunk's digest is taken between its WRITE and its header: no batch
        (self.slot_sender if o.mode is Mode.FEDRDMA_E else self.staged_sender).pump(o)  # type: ignore[union-attr]

    # -- posting (called by the modes) ----------------------------------------------------------
    def _wr_id(self, kind: Wr, out: Any, seq: int, extra: int) -> int:
        self._wr_seq += 1
        self._wrs[self._wr_seq] = (kind, out, seq, extra)
        return self._wr_seq

    @property
    def active_qps(self) -> int:
        """The QPs chunks are striped over now (policy.qps_in_use)."""
        return qps_in_use(self.cfg.qps_per_peer, self.probe.rtt_s, len(self.rcs))

    def next_qp(self) -> ev.QP:
        self._rr = (self._rr + 1) % self.active_qps
        return self.rcs[self._rr].qp

    def post_data(self, qp: ev.QP, o: Outgoing, c: P.Chunk, remote: ev.RemoteMR, roff: int, signal_last: bool,
                  seq: int, in_place: bool = False) -> None:
        """WRITE chunk `c` of `o` to `remote` at `roff` (posting.post_chunk; `in_place`: into a FedRDMA-E slot)."""
        def signal() -> int:
            o.pending_wrs += 1
            return self._wr_id(Wr.DATA, o, seq, 0)

        o.note_posted()
        post_chunk(qp, o.payload.sges(c.offset, c.length), c.offset, in_place, remote, roff,
                   signal if signal_last else None, o.leaving.hook_for(c) if o.leaving is not None else None)

    def post_header(self, qp: ev.QP, o: Outgoing, hdr: P.Header, seq: int, remote: ev.RemoteMR, roff: int,
                    imm: int) -> None:
        """WRITE_WITH_IMM a header (and chunk 0's metadata) to `remote` at `roff`."""
        idx, sge = self.mem.put_header(P.encode_header(hdr), o.meta if hdr.meta_len else b"")  # type: ignore[union-attr]
        o.pending_wrs += 1
        qp.post_write_with_imm(sge, remote, imm, remote_offset=roff, wr_id=self._wr_id(Wr.HEADER, o, seq, idx))

    # -- completions ----------------------------------------------------------------------------
    def unset_active(self, o: Outgoing) -> None:
        if self._active is o:
            self._active = None

    def finish_out(self, o: Outgoing) -> None:
        o.payload.close()
        self.unset_active(o)
        secs = o.finished()
        o.fut.set_result({"transfer_id": o.fut.transfer_id, "bytes": o.payload.total, "seconds": secs,
                          "mode": o.mode.value if o.mode else "", "window": o.fut.window, "chunks": o.fut.chunks,
                          "qps": self.active_qps})

    def fail_out(self, o: Outgoing, exc: BaseException, tell_peer: bool) -> None:
        if o.error is not None:
            return
        o.error = exc
        if o.machine is not None:
            o.machine.cancel(str(exc)) if isinstance(exc, TransferCancelled) else o.machine.fail(exc)
        if self.slot_sender is not None:
            self.slot_sender.forget(o)
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
        if o.mode is Mode.FEDRDMA_E:
            self.slot_sender.give_back_unused(o)  # type: ignore[union-attr]
        o.payload.close()
        if not o.fut.done():
            o.fut.set_exception(o.error)

    # -- receive side helpers (called by the modes) ---------------------------------------------
    def refuse(self, tid: int, code: ErrorCode, reason: str) -> None:
        log.warning("transfer %d from %s refused: %s", tid, self.peer, reason)
        self.send_ctrl(P.Ctrl(CtrlKind.ERROR, tid, int(code), 0, reason[:500]))

    def deliver(self, tid: int, meta: bytes, view: memoryview, mode: str, releaser: Any, lend: Any = None) -> None:
        try:
            md = json.loads(meta or b"{}")
        except ValueError:
            md = {"_raw_metadata": meta.hex()}
        self.endpoint._inbox_put(Message(self.peer, tid, md, view, mode, releaser, self.endpoint.recv_buffers.get, lend))

    # -- control sends --------------------------------------------------------------------------
    def send_ctrl(self, c: P.Ctrl) -> None:
        self.control.send(c)

    # -- time -----------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        wait = max(self.cfg.connect_timeout_s, self.cfg.no_progress_timeout_s)  # (a connected peer may be held)
        if self.probe.overdue(now, wait):
            raise PeerUnreachable(f"{self.peer} did not answer the RTT probe within {wait:g} s")
        if bootstrap_closed(self.boot):
            raise PeerUnreachable(f"{self.peer} closed its end of the connection (its process or endpoint ended)")
        a = self._active
        if a is not None and a.error is None:
            try:
                a.machine.tick(now)
            except TransferError as exc:
                a.error = None  # the machine failed itself; fail_out records it and tells the peer
                self.fail_out(a, exc, tell_peer=True)
        for part in (self.slot_sender, self.slot_receiver, self.staged_receiver):
            if part is not None:
                part.tick(now)
        # reassembly and copy buffers unused for pool_idle_s are let go of, as idle slots shrink
        self.endpoint.recv_buffers.trim(self.cfg.pool_idle_s)

    # -- teardown -------------------------------------------------------------------------------
    def _die(self, exc: BaseException, quiet: bool = False) -> None:
        if self.dead is None:
            self.dead = exc
        busy = self._active is not None or bool(self._outq) or bool(self.staged_receiver and self.staged_receiver.busy)
        if not quiet:
            # a peer that closes while idle is a normal end; losing it mid-transfer is not
            (log.warning if busy else log.info)("connection to %s lost: %s", self.peer, exc)
        err = exc if isinstance(exc, PeerUnreachable) else PeerUnreachable(f"connection to {self.peer} lost: {exc}")
        self._dead_err = err
        placed = list(self.slot_sender.placed.values()) if self.slot_sender is not None else []
        for o in ([self._active] if self._active else []) + list(self._outq) + self._draining + placed:
            o.payload.close()
            if not o.fut.done():
                o.fut.set_exception(err)
        self._active, self._outq, self._draining = None, collections.deque(), []
        if self.slot_sender is not None:
            self.slot_sender.placed.clear()
        self._fail_requests(err)
        if self.staged_receiver is not None:
            self.staged_receiver.clear()
        self._release_resources()
        self.endpoint._forget(self)

    def _release_resources(self) -> None:
        for rc in self.rcs:
            rc.qp.abort()
        if self.mem is not None:
            self.mem.close()
        self.endpoint.budget.release(self._reserved)
        self._reserved = 0
        self.cq.close()
        self.boot.close()
