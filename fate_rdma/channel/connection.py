"""One peer connection: its set-up (the hello, its registered memory, its QPs, the modes' parts), the user's
side (send, release, close) and its teardown. Its transfers are run by its engine (engine.py) over its wire
(wire.py); the modes (fedrdma.py, fedrdma_e.py) see the engine through a port (port.py).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Dict, List, Mapping, Optional, Protocol, Tuple

import easypyverbs as ev

from .. import metrics, protocol as P
from ..config import ChannelConfig
from ..errors import FateRdmaError, PayloadTooLarge, PeerUnreachable, RemoteProtocolError
from ..protocol.frames import MAX_META, ResumeState
from ..protocol.packing import SuffixClaim
from .auth import Identity, direction_keys
from .buffers import Budget, RecvBuffers, Share
from .checksum import block_hasher, integrities, payload_checksum_async
from .control import RttProbe
from .engine import Engine
from .fedrdma import StagedReceiver, StagedSender
from .fedrdma_e import SlotReceiver, SlotSender
from .inbound import Modes
from .handshake import Agreed, bootstrap_closed, confirm_posted, negotiate, say_bye
from .layout import LocalMemory
from .leaving import LeavingDigest
from .outgoing import Outgoing, Where
from .path import Path
from .holding import RESUME_KEY
from .posting import connection_path, data_qp_cap
from .resume import RESUME_ROOM, Pending, Resumer
from .transfer import Buffers, Fill, Message, Payload, TransferFuture
from .wire import Wire

log = logging.getLogger("fate_rdma.channel")


class Host(Protocol):
    """What a connection needs of the endpoint that made it (endpoint.Endpoint)."""

    @property
    def config(self) -> ChannelConfig: ...

    @property
    def ctx(self) -> ev.Context: ...

    @property
    def name(self) -> str: ...

    @property
    def terms(self) -> Optional[Mapping[str, str]]: ...

    @property
    def budget(self) -> Budget: ...

    @property
    def recv_buffers(self) -> RecvBuffers: ...

    @property
    def resumer(self) -> Optional[Resumer]: ...

    def send_sge_limit(self, cq: ev.CQ) -> int: ...

    def next_transfer_id(self) -> int:
        """An id no other transfer of this endpoint has (it stays the transfer's when it is resumed)."""

    def deliver(self, msg: Message) -> None:
        """A complete message from a peer, for the application."""

    def forget(self, conn: "Connection") -> None:
        """`conn` has ended: no more sends on it."""


def checked_metadata(metadata: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A transfer's metadata, if the channel can carry it (else FateRdmaError, naming why)."""
    md = dict(metadata or {})
    if RESUME_KEY in md:
        raise FateRdmaError(f"metadata key {RESUME_KEY!r} is the channel's own")
    n = len(json.dumps(md, separators=(",", ":")).encode())
    if n > MAX_META - RESUME_ROOM:
        raise FateRdmaError(f"metadata of {n} bytes exceeds {MAX_META - RESUME_ROOM} (the frame's {MAX_META} less "
                            f"what a resumed transfer adds)")
    return md


def pending(buffers: Buffers, metadata: Optional[Dict[str, Any]], fill: Optional[Fill], tid: int,
            canceller: Any) -> Pending:
    """A new transfer of `buffers`, as its sender keeps it until the peer has it (resume.Pending)."""
    md = checked_metadata(metadata)
    total = Payload.measure(buffers)
    if fill is not None and fill.total != total:
        raise ValueError(f"a fill of {fill.total} bytes for a payload of {total}")
    fut = TransferFuture(tid, total, canceller)
    fut.set_running_or_notify_cancel()
    return Pending(fut, buffers, fill, md, total)


class Connection:
    def __init__(self, endpoint: Host, boot: ev.BootstrapConn, dialer: bool, identity: Identity,
                 address: Optional[str] = None) -> None:
        """`identity`: who the peer proved to be on `boot` (auth.authenticate ran first); `address`: what was
        dialed (the peer's name if it dialed)."""
        self.endpoint = endpoint
        self.cfg: ChannelConfig = endpoint.config
        self.boot = boot
        self.identity = identity
        self.send_integrity, self.recv_integrity = integrities(self.cfg.checksum, identity, dialer)
        #: every control frame is sealed where the connection has a session key (frames.py)
        self._ctrl_keys = direction_keys(identity.session_key, dialer, "ctrl") if identity.session_key else (b"", b"")
        #: the QPs, QP 0 first (set up here, aborted at the end; the engine posts on them through its wire)
        self.rcs: List[ev.RCConnection] = []
        self.mem: Optional[LocalMemory] = None
        #: the endpoint's memory budget this connection holds (its receive memory), within its peer's part
        self.share = Share(endpoint.budget, identity.name)
        self.cq = endpoint.ctx.create_cq(8192)
        #: a protection domain of this connection's own: its QPs, its receive memory and its payloads, so a key
        #: granted to this peer is refused on any other peer's QP (a real device and the soft provider check
        #: that an rkey's MR and the QP share the PD), whatever the other peer learnt of it
        self.pd = endpoint.ctx.alloc_pd()
        self._counted: object = None  # metrics.opened's token while this connection counts as live
        try:
            self.engine, modes = self._setup(endpoint.ctx, self.pd, boot)
        except BaseException:
            self._release_resources()
            raise
        self.engine.resume, self.engine.address = endpoint.resumer, address or self.peer
        self._counted = metrics.opened()  # (before the engine runs: its end says closed)
        try:
            self.engine.start(modes)
        except BaseException:
            metrics.closed(self._counted)
            self._counted = None
            raise

    # -- set-up ---------------------------------------------------------------------------------
    def _setup(self, ctx: ev.Context, pd: ev.PD, boot: ev.BootstrapConn) -> Tuple[Engine, Modes]:
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
        if not self.share.reserve(offered):  # (Budget.reserve logs the figures, once per peer)
            raise PayloadTooLarge(f"connection from {peer.name}: its receive memory ({offered} bytes) exceeds what "
                                  f"this endpoint holds for one peer (peer_budget_fraction of memory_budget_bytes)")
        self.mem = mem = LocalMemory(pd, nqps, cfg.max_window, pool, staging, cfg.slot_initial_bytes, track, agreed.near)
        cap = data_qp_cap(self.endpoint.send_sge_limit(self.cq))  # (posting.py: a WRITE gathers up to 30 arrays)
        wire = Wire(self.cq, mem, self.rcs, self._ctrl_keys)
        for i in range(nqps):
            rc = ev.establish(ctx, boot, mrs=mem.remote_mrs if i == 0 else None, pd=pd, cap=cap, timeout_s=t,
                              owns_bootstrap=False, cq=self.cq)
            wire.add(rc)
            if i == 0:
                self.remote = rc.remote_mrs
        confirm_posted(boot, t)
        #: how the data QPs move payloads, as the provider reports it (fixed once they are connected)
        self.path_kind = connection_path(self.rcs)
        #: ... by a copy between this process and the peer's, on this host
        self.same_host_copy = self.path_kind.same_host
        self.label = ctx.label
        self.emulated = ctx.emulated
        #: what the trace says a transfer of this connection went over (`bench timeline` names it on every row)
        self.where: Where = {"provider": ctx.provider, "emulated": ctx.emulated,
                             "path": self.rcs[0].qp.data_path if self.rcs else "verbs"}
        self.probe = RttProbe(wire.control.send)
        self.path = Path(cfg, self.probe, ctx, len(self.rcs), self.path_kind)
        engine = Engine(wire, self.path, cfg, peer, self.endpoint.recv_buffers, self.endpoint.deliver,
                        lambda: bootstrap_closed(boot), self._teardown, self.where, self.label)
        return engine, self._modes(engine, agreed, mem)

    def _modes(self, engine: Engine, agreed: Agreed, mem: LocalMemory) -> Modes:
        """Each mode's parts: a sender where the peer offered receive memory for it, a receiver where this side did."""
        cfg, peer = self.cfg, agreed.peer
        if peer.staging is not None:
            st = self.remote.get("staging")
            if st is None or st.length < peer.staging.count * peer.staging.buf_bytes:
                raise RemoteProtocolError(f"{self.peer} offers {peer.staging.count} staging buffers of "
                                          f"{peer.staging.buf_bytes} bytes but no MR that holds them")
        modes = Modes()
        if peer.pool is not None:
            modes.slot_sender = SlotSender(engine, self.peer, peer.pool, self.remote, bool(peer.placed_notes),
                                           self.same_host_copy)
        if peer.staging is not None:
            modes.staged_sender = StagedSender(engine, peer.staging, self.remote["staging"])
        if agreed.pool is not None and mem.slots is not None:
            modes.slot_receiver = SlotReceiver(engine, self.peer, agreed.pool, mem.slots, self.share,
                                               self.recv_integrity, cfg.pool_idle_s)
        if agreed.staging is not None:
            modes.staged_receiver = StagedReceiver(engine, self.peer, agreed.staging, mem.staging_view,
                                                   self.share, self.endpoint.recv_buffers,
                                                   cfg.max_payload_bytes, cfg.no_progress_timeout_s,
                                                   self.recv_integrity)
        return modes

    # -- what tests, reports and the endpoint look at -------------------------------------------
    @property
    def dead(self) -> Optional[BaseException]:
        """Why the connection ended (None while it is up)."""
        return self.engine.dead

    @property
    def slot_sender(self) -> Optional[SlotSender]:
        return self.engine.modes.slot_sender

    @property
    def slot_receiver(self) -> Optional[SlotReceiver]:
        return self.engine.modes.slot_receiver

    @property
    def staged_sender(self) -> Optional[StagedSender]:
        return self.engine.modes.staged_sender

    @property
    def staged_receiver(self) -> Optional[StagedReceiver]:
        return self.engine.modes.staged_receiver

    @property
    def active_qps(self) -> int:
        """The QPs chunks are striped over now (policy.qps_in_use)."""
        return self.path.active_qps

    @property
    def pool_bytes(self) -> int:
        """Bytes of this side's FedRDMA-E receive slots registered now (they follow the traffic)."""
        return self.mem.pool_bytes if self.mem is not None else 0

    def send_ctrl(self, c: P.Ctrl) -> None:
        """Send a control frame to the peer now (tests forge frames with it)."""
        self.engine.send_ctrl(c)

    # -- user side (any thread) -----------------------------------------------------------------
    def send(self, buffers: Buffers, metadata: Optional[Dict[str, Any]] = None,
             fill: Optional[Fill] = None) -> TransferFuture:
        if self.dead is not None:
            raise PeerUnreachable(f"connection to {self.peer} is down: {self.dead}")
        p = pending(buffers, metadata, fill, self.endpoint.next_transfer_id(), self.engine.cancel)
        return self._submit(p, 0)

    def resend(self, p: Pending, start: int, end: Optional[int] = None) -> None:
        """Send bytes [start, end) of transfer `p` again (what the peer did not hold of it: resume.py)."""
        end = p.total if end is None else end
        if p.fill is not None and not p.fill.done:  # (the copy runs on: only its final bytes go)
            p.fill.when_done(lambda: self._resend_filled(p, start, end))
            return
        self._resend_filled(p, start, end)

    def _resend_filled(self, p: Pending, start: int, end: int) -> None:
        if p.fill is not None and p.fill.error is not None:
            p.fut.set_exception(PeerUnreachable(f"transfer {p.fut.transfer_id}: the payload's copy failed: "
                                                f"{p.fill.error}"))
            return
        p.fut.rebind(self.engine.cancel)
        try:
            self._submit(p, start, end)
        except FateRdmaError as exc:
            if not p.fut.done():
                p.fut.set_exception(exc)

    def ask_resume(self, tid: int, total: int, claim: Optional[SuffixClaim]) -> Tuple[ResumeState, int]:
        """What the peer holds of transfer `tid` (resume.py): its state, and the offset it holds bytes to
        (PARTIAL) or from (SUFFIX), verified; `claim`: FedRDMA-E's bytes this side knows placed."""
        try:
            return self.engine.ask_resume(tid, total, claim).result(timeout=self.cfg.connect_timeout_s)
        except TimeoutError:
            raise PeerUnreachable(f"{self.peer} did not say within {self.cfg.connect_timeout_s:g} s what it holds "
                                  f"of transfer {tid}") from None

    def _submit(self, p: Pending, start: int, end: Optional[int] = None) -> TransferFuture:
        """Transfer `p`'s bytes [start, end) (all of it: 0, None), as the engine's next."""
        whole = start == 0 and end in (None, p.total)
        fill = p.fill if whole else None
        md = p.metadata if whole and not p.resumes else {**p.metadata, RESUME_KEY: [start, end or p.total, p.total]}
        meta = json.dumps(md, separators=(",", ":")).encode()
        if len(meta) > MAX_META:
            raise FateRdmaError(f"metadata of {len(meta)} bytes exceeds {MAX_META}")
        payload = Payload(self.pd, p.buffers if whole else p.views(start, end), fill)
        fut = p.fut
        out = Outgoing(fut, payload, meta, self.send_integrity, p, start)
        if out.checksums and self.cfg.mode == "fedrdma-e":
            # digested as its chunks leave (leaving.py: made with its chunks, fedrdma_e.SlotSender.pump), else now
            out.leave_ok = LeavingDigest.wanted(payload.total, self.send_integrity, fill, [rc.qp for rc in self.rcs],
                                                self.path.slot_chunk())
            if not out.leave_ok:
                out.crc_future = payload_checksum_async(payload.views(), self.send_integrity, fill)
        if out.crc_future is not None and not out.crc_future.done():  # (a small payload's is taken at once: the SEND
            out.crc_future.add_done_callback(lambda _f: self.cq.wake())                # request wakes the engine)
        if fill is not None:
            fill.on_change(self.cq.wake)
        self.engine.submit(out)
        return fut

    def release_slot(self, slot: int) -> None:
        """A delivered FedRDMA-E message was released (any thread)."""
        self.engine.release_slot(slot)

    def close(self, bye: bool = False) -> None:
        """End the connection; `bye`: this endpoint closes, say so first (handshake.say_bye)."""
        if bye and self.dead is None:
            say_bye(self.boot)
        self.engine.close()

    # -- teardown -------------------------------------------------------------------------------
    def _teardown(self) -> None:
        """The engine ended (with its lock held, its transfers failed): let go of everything, and of the endpoint."""
        self._release_resources()
        metrics.closed(self._counted)
        self._counted = None
        self.endpoint.forget(self)

    def _release_resources(self) -> None:
        for rc in self.rcs:
            rc.qp.abort()
        if self.mem is not None:
            self.mem.close()
        self.pd.close()  # (and what is left on it: a payload's MRs whose transfer the engine failed)
        self.share.release_all()
        self.cq.close()
        self.boot.close()
