"""One peer connection: QPs, receive pools, and the engine thread that runs the protocol machines.

Data moves as RDMA WRITEs in both modes; control frames (ACK, CREDIT, CANCEL, ERROR, PROBE) travel
as SENDs on QP 0. Receive queues hold small buffers only (control frames and the zero-length
receives that WRITE_WITH_IMM consumes), so they never stall on a large SEND.

- FedRDMA: chunk i -> a free staging buffer of the peer: data, then [HEADER|meta] as
  WRITE_WITH_IMM(imm = 1<<31 | staging index); the peer copies it to the destination and ACKs.
- FedRDMA-E: chunks n-1..1 -> their final offsets in the peer's slot, then chunk 0 and
  [HEADER|meta] with WRITE_WITH_IMM(imm = slot<<16 | seq); the peer hands out a view of the slot.

All protocol state is touched by the engine thread only; user threads post requests to it.
"""
from __future__ import annotations

import collections
import logging
import mmap
from concurrent.futures import Future as concurrent_futures_Future  # noqa: F401  (tests wrap checksum futures)
import sys
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import crc32c
import numpy as np

import easypyverbs as ev

from .. import protocol as P
from ..config import ChannelConfig
from ..errors import (FateRdmaError, IntegrityError, PayloadTooLarge, PeerUnreachable, RemoteProtocolError,
                      TransferCancelled, TransferError)
from ..protocol.fedrdma_e import slot_payload_offset, split_imm
from ..protocol.frames import MAX_META, CtrlKind, ErrorCode
from .checksum import payload_checksum, payload_checksum_async
from .transfer import Message, Payload, TransferFuture, group_sges

log = logging.getLogger("fate_rdma.channel")

CTRL_BUF = P.CTRL.size + 1024 + 64
RECV_DEPTH = 256  # per QP: control frames + WRITE_WITH_IMM notifications in flight
CTRL_SENDS = 256
STAGING_BIT = 1 << 31
HDR_SLOT = P.HEADER.size + MAX_META
_ERR = {ErrorCode.INTEGRITY: IntegrityError, ErrorCode.TOO_LARGE: PayloadTooLarge, ErrorCode.PROTOCOL: RemoteProtocolError,
        ErrorCode.TIMEOUT: TransferError, ErrorCode.INTERNAL: TransferError}


class _Out:
    """An outgoing transfer as the engine sees it."""

    def __init__(self, fut: TransferFuture, payload: Payload, meta: bytes, checksums: bool) -> None:
        self.fut, self.payload, self.meta = fut, payload, meta
        self.checksums = checksums
        self.meta_crc = crc32c.crc32c(meta) if checksums else 0
        #: FedRDMA-E whole-payload checksum, computed while the first chunks are on the wire
        self.crc_future: Any = None
        self.mode = ""
        self.machine: Any = None
        self.slot: Optional[int] = None
        self.pending_wrs = 0
        self.error: Optional[BaseException] = None
        self.tell_peer = False
        self.started = 0.0
        self.placed_at = 0.0
        self.confirmed = False


def _fresh(n: int) -> np.ndarray:
    """n bytes of new memory; large ones mapped with MAP_POPULATE, which faults all pages in at once
    (about 2-3 x faster than taking one fault per 4 KiB page while the data is being copied in)."""
    if n >= 64 << 20 and hasattr(mmap, "MAP_POPULATE"):
        try:
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            return np.frombuffer(m, dtype=np.uint8)
        except OSError:
            pass
    return np.empty(max(n, 1), dtype=np.uint8)


class RecvBuffers:
    """FedRDMA reassembly buffers, recycled: a buffer is handed out again once no message view and no
    array made from one refers to it any more (CPython reference count), so round after round of
    same-sized payloads lands in memory that is already faulted in. At most `max_bytes` are kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._bufs: List[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0

    def get(self, n: int) -> np.ndarray:
        with self._lock:
            for i in range(len(self._bufs)):
                b = self._bufs[i]
                # references: the list, `b`, getrefcount's argument; anything more is a live view
                if n <= b.nbytes <= 2 * n + (1 << 20) and sys.getrefcount(b) == 3:
                    self.reused += 1
                    return b[:n]
            if n > self.max_bytes:
                return _fresh(n)
            while self._bufs and sum(x.nbytes for x in self._bufs) + n > self.max_bytes:
                idle = [j for j in range(len(self._bufs)) if sys.getrefcount(self._bufs[j]) == 2]
                if not idle:
                    return _fresh(n)
                del self._bufs[idle[0]]
            b = _fresh(n)
            self._bufs.append(b)
            return b[:n]

    def clear(self) -> None:
        with self._lock:
            self._bufs = []


class _In:
    """An incoming FedRDMA transfer being reassembled."""

    def __init__(self, total: int, buffers: Optional[RecvBuffers] = None) -> None:
        self.dest = buffers.get(total) if buffers is not None else np.empty(total, dtype=np.uint8)
        self.view = memoryview(self.dest).cast("B")
        self.meta: Optional[bytes] = None


class Connection:
    def __init__(self, endpoint: Any, boot: ev.BootstrapConn, dialer: bool) -> None:
        self.endpoint = endpoint
        cfg: ChannelConfig = endpoint.config
        self.cfg = cfg
        self.boot = boot
        ctx, pd = endpoint.ctx, endpoint.pd
        self._mrs: List[ev.MR] = []
        self.rcs: List[ev.RCConnection] = []
        self.cq = ctx.create_cq(8192)
        try:
            self._setup(ctx, pd, boot, dialer)
        except BaseException:
            self._release_resources()
            raise
        self._requests: Deque[Tuple[str, Any]] = collections.deque()
        self._outq: Deque[_Out] = collections.deque()
        self._active: Optional[_Out] = None
        self._draining: List[_Out] = []
        self._verdict: Dict[int, _Out] = {}  # FedRDMA-E transfers placed, awaiting the receiver's DONE
        self._incoming: Dict[int, _In] = {}
        self._wrs: Dict[int, Tuple[str, Any, int, int]] = {}
        self._wr_seq = 0
        self._rr = 0
        self._next_tid = 1
        self._stop = False
        self.dead: Optional[BaseException] = None
        self.rtt_s: Optional[float] = None
        self._probe: Dict[int, float] = {}
        self._rtts: List[float] = []
        self._ctrl_backlog: Deque[bytes] = collections.deque()
        self._thread = threading.Thread(target=self._run, name=f"fate-rdma-conn-{self.peer}", daemon=True)
        self._thread.start()

    # -- set-up ---------------------------------------------------------------------------------
    def _register(self, pd: ev.PD, nbytes: int, access: ev.Access) -> Tuple[np.ndarray, ev.MR]:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)  # untouched pages cost no memory until written
        mr = pd.reg_mr(buf, access)
        self._mrs.append(mr)
        return buf, mr

    def _setup(self, ctx: ev.Context, pd: ev.PD, boot: ev.BootstrapConn, dialer: bool) -> None:
        cfg = self.cfg
        t = cfg.connect_timeout_s
        want_pool = cfg.mode == "fedrdma-e"
        want_staging = cfg.mode == "fedrdma" or cfg.too_large == "fedrdma"
        self.staging_buf_bytes = HDR_SLOT + cfg.chunk_bytes
        self.pool = P.FedRdmaEReceiver(cfg.pool_slots, cfg.slot_bytes, MAX_META, cfg.checksum == "crc32c") if want_pool else None
        hello = {
            "fate_rdma": 1, "name": self.endpoint.name, "qps": cfg.qps_per_peer,
            "pool": {"slots": cfg.pool_slots, "slot_payload_bytes": cfg.slot_bytes, "meta_cap": MAX_META} if want_pool else None,
            "staging": {"count": cfg.max_window, "buf_bytes": self.staging_buf_bytes, "meta_cap": MAX_META} if want_staging else None,
        }
        peer = boot.exchange(hello, t)
        if peer.get("fate_rdma") != 1 or not isinstance(peer.get("name"), str):
            raise RemoteProtocolError(f"peer at {boot.peer} is not a fate-rdma endpoint of this version")
        self.peer = peer["name"]
        self.peer_pool = peer.get("pool")
        self.peer_staging = peer.get("staging")
        nqps = max(1, min(cfg.qps_per_peer, int(peer.get("qps", 1))))
        rw = ev.Access.all_rdma()
        mrs: Dict[str, ev.MR] = {}
        self.pool_bytes = 0
        if self.pool is not None:
            self.pool_bytes = cfg.pool_slots * self.pool.slot_bytes
            self._pool_buf, mrs["pool"] = self._register(pd, self.pool_bytes, rw)
            self._pool_buf.fill(0)  # fault the pool in now, as pinning by ibv_reg_mr would, not during a transfer
        if want_staging:
            self._staging_buf, mrs["staging"] = self._register(pd, cfg.max_window * self.staging_buf_bytes, rw)
            self.staging = P.FedRdmaReceiver(cfg.max_payload_bytes, cfg.no_progress_timeout_s, cfg.checksum == "crc32c")
        self._recv_buf, self._recv_mr = self._register(pd, nqps * RECV_DEPTH * CTRL_BUF, ev.Access.LOCAL_WRITE)
        self._ctrl_buf, self._ctrl_mr = self._register(pd, CTRL_SENDS * CTRL_BUF, ev.Access.LOCAL_WRITE)
        nhdr = cfg.max_window * 2 + 4
        self._hdr_buf, self._hdr_mr = self._register(pd, nhdr * HDR_SLOT, ev.Access.LOCAL_WRITE)
        self._hdr_free = list(range(nhdr - 1, -1, -1))
        self._ctrl_free = list(range(CTRL_SENDS - 1, -1, -1))
        cap = ev.QPCap(max_send_wr=1024, max_recv_wr=RECV_DEPTH, max_send_sge=8, max_recv_sge=1)
        for i in range(nqps):
            rc = ev.establish(ctx, boot, mrs=mrs if i == 0 else None, pd=pd, cap=cap, timeout_s=t,
                              owns_bootstrap=False, cq=self.cq)
            self.rcs.append(rc)
            if i == 0:
                self.remote = rc.remote_mrs
            for k in range(RECV_DEPTH):
                self._post_recv(i, k)
        if boot.exchange({"posted": True}, t).get("posted") is not True:  # receives posted on both sides
            raise RemoteProtocolError("peer did not finish connection set-up")
        self.ring = P.SlotRing(int(self.peer_pool["slots"])) if self.peer_pool else None
        self._staging_free = list(range(int(self.peer_staging["count"]) - 1, -1, -1)) if self.peer_staging else []
        self.label = ctx.label
        self.emulated = ctx.emulated

    def _post_recv(self, qp_idx: int, k: int) -> None:
        off = (qp_idx * RECV_DEPTH + k) * CTRL_BUF
        self.rcs[qp_idx].qp.post_recv(self._recv_mr.sge(off, CTRL_BUF), wr_id=(1 << 62) | (qp_idx << 20) | k)

    # -- user side (any thread) -----------------------------------------------------------------
    def send(self, buffers: Any, metadata: Optional[Dict[str, Any]] = None) -> TransferFuture:
        if self.dead is not None:
            raise PeerUnreachable(f"connection to {self.peer} is down: {self.dead}")
        import json

        meta = json.dumps(metadata or {}, separators=(",", ":")).encode()
        if len(meta) > MAX_META:
            raise FateRdmaError(f"metadata of {len(meta)} bytes exceeds {MAX_META}")
        payload = Payload(self.endpoint.pd, buffers)
        tid = (id(self) & 0xFFFF) << 40 | self._take_tid()
        fut = TransferFuture(tid, payload.total, lambda f: self._request("cancel", f))
        fut.set_running_or_notify_cancel()
        out = _Out(fut, payload, meta, self.cfg.checksum == "crc32c")
        if out.checksums and self.cfg.mode == "fedrdma-e":
            out.crc_future = payload_checksum_async(payload.views())
            out.crc_future.add_done_callback(lambda _f: self.cq.wake())
        self._request("send", out)
        return fut

    _tid_lock = threading.Lock()

    def _take_tid(self) -> int:
        with self._tid_lock:
            self._next_tid += 1
            return self._next_tid

    def _request(self, kind: str, arg: Any) -> None:
        self._requests.append((kind, arg))
        self.cq.wake()

    def close(self) -> None:
        if self._thread.is_alive():
            self._request("stop", None)
            self._thread.join(timeout=10)

    # -- engine ---------------------------------------------------------------------------------
    def _run(self) -> None:
        last_tick = time.monotonic()
        try:
            self._send_probe()
            while not self._stop:
                self._handle_requests()
                self._pump()
                try:
                    wcs = self.cq.wait(0.05, max_entries=64)
                except ev.PollTimeout:
                    wcs = []
                for wc in wcs:
                    self._on_wc(wc)
                now = time.monotonic()
                if now - last_tick > 0.1:
                    last_tick = now
                    self._tick(now)
            self._die(PeerUnreachable(f"connection to {self.peer} closed"), quiet=True)
        except BaseException as exc:  # the engine must never die silently
            self._die(exc)

    def _handle_requests(self) -> None:
        while self._requests:
            kind, arg = self._requests.popleft()
            if kind == "send":
                self._outq.append(arg)
            elif kind == "cancel":
                self._cancel_out(arg)
            elif kind == "release":
                self.pool.release(arg)  # type: ignore[union-attr]
                self._send_ctrl(P.Ctrl(CtrlKind.CREDIT, 0, arg))
            elif kind == "stop":
                self._stop = True

    def _cancel_out(self, fut: TransferFuture) -> None:
        a = self._active
        if a is not None and a.fut is fut:
            self._fail_out(a, TransferCancelled(f"transfer {fut.transfer_id} cancelled by sender", fut.transfer_id), tell_peer=True)
            return
        for o in list(self._outq):
            if o.fut is fut:
                self._outq.remove(o)
                o.payload.close()
                fut.set_exception(TransferCancelled(f"transfer {fut.transfer_id} cancelled before it started", fut.transfer_id))

    def _window(self) -> int:
        cfg = self.cfg
        if isinstance(cfg.window, int):
            w = cfg.window
        else:
            bdp_bytes = self._rate_bps() / 8 * (self.rtt_s or 0.0)
            w = max(cfg.min_auto_window, min(cfg.max_window, int(-(-bdp_bytes // cfg.chunk_bytes)) + 1))
        return w

    def _rate_bps(self) -> float:
        if self.cfg.link_rate_bps:
            return self.cfg.link_rate_bps
        model = getattr(self.endpoint.ctx, "link_model", None)
        return model.rate_bps if model is not None and model.rate_bps else 10e9  # nominal 10 Gbit/s WAN

    def _first_chunk_bytes(self) -> int:
        on = self.cfg.link_enable
        if on == "auto":
            on = self._rate_bps() >= 4e9
        return 4096 if on else 0

    def _start(self, o: _Out) -> bool:
        """Make `o` the active transfer; False if it must wait (no free slot yet)."""
        cfg, now = self.cfg, time.monotonic()
        mode = cfg.mode
        total = o.payload.total
        if mode == "fedrdma-e":
            if self.peer_pool is None or total > int(self.peer_pool["slot_payload_bytes"]):
                if cfg.too_large == "fedrdma" and self.peer_staging is not None:
                    mode = "fedrdma"
                else:
                    limit = self.peer_pool["slot_payload_bytes"] if self.peer_pool else 0
                    o.payload.close()
                    o.fut.set_exception(PayloadTooLarge(
                        f"payload of {total} bytes exceeds {self.peer}'s FedRDMA-E receive slot of {limit} bytes "
                        f"(raise slot_bytes, or set too_large: fedrdma)", o.fut.transfer_id))
                    return True
        if mode == "fedrdma" and self.peer_staging is None:
            o.payload.close()
            o.fut.set_exception(FateRdmaError(f"{self.peer} offers no FedRDMA staging buffers (its mode is fedrdma-e)"))
            return True
        w = self._window()
        common = dict(now=now, first_chunk_bytes=self._first_chunk_bytes(), no_progress_s=cfg.no_progress_timeout_s,
                      total_s=cfg.transfer_timeout_s)
        if mode == "fedrdma-e":
            slot = self.ring.acquire()  # type: ignore[union-attr]
            if slot is None:
                return False
            o.slot = slot
            o.machine = P.FedRdmaESender(o.fut.transfer_id, o.fut.transfer_id & 0xFFFF, slot, total, cfg.chunk_bytes, w,
                                         slot_payload_bytes=int(self.peer_pool["slot_payload_bytes"]),  # type: ignore[index]
                                         header_after_all=len(self.rcs) > 1, **common)
        else:
            w = min(w, int(self.peer_staging["count"]))  # type: ignore[index]
            o.machine = P.FedRdmaSender(o.fut.transfer_id, total, cfg.chunk_bytes, w, **common)
        o.mode, o.started = mode, now
        o.fut.mode, o.fut.window, o.fut.chunks = mode, w, len(o.machine.chunks)
        self._active = o
        return True

    def _pump(self) -> None:
        if self.rtt_s is None:
            return
        while self._active is None and self._outq:
            if not self._start(self._outq[0]):
                return
            self._outq.popleft()
        o = self._active
        if o is None or o.error is not None:
            return
        if o.mode == "fedrdma-e":
            o.machine.hold_header = o.checksums and not (o.crc_future is not None and o.crc_future.done())
            if o.checksums and o.crc_future is None:
                o.crc_future = payload_checksum_async(o.payload.views())  # fell back from fedrdma
                o.crc_future.add_done_callback(lambda _f: self.cq.wake())
        for c in o.machine.next_chunks():
            if o.mode == "fedrdma-e":
                self._post_e_chunk(o, c)
            else:
                self._post_staged_chunk(o, c)

    def _wr_id(self, kind: str, out: Any, seq: int, extra: int) -> int:
        self._wr_seq += 1
        self._wrs[self._wr_seq] = (kind, out, seq, extra)
        return self._wr_seq

    def _write_header(self, o: _Out, hdr: P.Header) -> Tuple[int, ev.SGE]:
        idx = self._hdr_free.pop()
        base = idx * HDR_SLOT
        raw = P.encode_header(hdr)
        self._hdr_buf[base:base + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        if hdr.meta_len:
            self._hdr_buf[base + len(raw):base + len(raw) + hdr.meta_len] = np.frombuffer(o.meta, dtype=np.uint8)
        return idx, self._hdr_mr.sge(base, len(raw) + hdr.meta_len)

    def _post_data(self, qp: ev.QP, o: _Out, c: P.Chunk, remote: ev.RemoteMR, roff: int, signal_last: bool, seq: int) -> None:
        groups = group_sges(o.payload.sges(c.offset, c.length), qp.cap.max_send_sge)
        for i, g in enumerate(groups):
            if not g:
                continue
            last = signal_last and i == len(groups) - 1
            wr_id = self._wr_id("data", o, seq, 0) if last else 0
            o.pending_wrs += 1 if last else 0
            qp.post_write(g, remote, remote_offset=roff, wr_id=wr_id, signaled=last)
            roff += sum(s.length for s in g)

    def _next_qp(self) -> ev.QP:
        self._rr = (self._rr + 1) % len(self.rcs)
        return self.rcs[self._rr].qp

    def _post_e_chunk(self, o: _Out, c: P.Chunk) -> None:
        qp = self._next_qp() if c.seq else self.rcs[0].qp
        pool = self.remote["pool"]
        slot_total = P.HEADER.size + int(self.peer_pool["meta_cap"]) + int(self.peer_pool["slot_payload_bytes"])  # type: ignore[index]
        base = o.slot * slot_total  # type: ignore[operator]
        data_off = base + slot_payload_offset(int(self.peer_pool["meta_cap"])) + c.offset  # type: ignore[index]
        if c.seq != 0:
            self._post_data(qp, o, c, pool, data_off, True, c.seq)
            return
        self._post_data(qp, o, c, pool, data_off, False, 0)
        crc = o.crc_future.result() if o.checksums else None
        idx, sge = self._write_header(o, o.machine.header(len(o.meta), crc, o.meta_crc))
        o.pending_wrs += 1
        qp.post_write_with_imm(sge, pool, o.machine.imm, remote_offset=base, wr_id=self._wr_id("data", o, 0, idx + 1))

    def _post_staged_chunk(self, o: _Out, c: P.Chunk) -> None:
        qp = self._next_qp()
        st = self._staging_free.pop()
        staging = self.remote["staging"]
        base = st * int(self.peer_staging["buf_bytes"])  # type: ignore[index]
        data_off = base + P.HEADER.size + int(self.peer_staging["meta_cap"])  # type: ignore[index]
        self._post_data(qp, o, c, staging, data_off, False, c.seq)
        crc = None
        if o.checksums:
            crc = 0
            for s in o.payload.sges(c.offset, c.length):
                crc = crc32c.crc32c(s.view(), crc)
        meta_len = len(o.meta) if c.seq == 0 else 0
        idx, sge = self._write_header(o, o.machine.header(c, meta_len, crc, o.meta_crc))
        o.pending_wrs += 1
        qp.post_write_with_imm(sge, staging, STAGING_BIT | st, remote_offset=base, wr_id=self._wr_id("hdr", o, c.seq, idx + 1))

    # -- completions ----------------------------------------------------------------------------
    def _on_wc(self, wc: ev.WC) -> None:
        if wc.wr_id >> 62 == 1:
            self._on_recv(wc)
            return
        entry = self._wrs.pop(wc.wr_id, None)
        if not wc.ok:
            raise PeerUnreachable(f"connection to {self.peer} failed: work completion {wc.status.name}")
        if entry is None:
            return
        kind, o, seq, extra = entry
        if kind == "ctrl":
            self._ctrl_free.append(extra)
            self._flush_ctrl_backlog()
            return
        if extra:
            self._hdr_free.append(extra - 1)
        o.pending_wrs -= 1
        if o.error is not None:
            self._maybe_finish_failed(o)
            return
        if o.mode == "fedrdma-e":
            o.machine.on_write_complete(seq, time.monotonic())
            o.fut._progress(o.machine.done_bytes)
            if o.machine.finished:  # placed; the receiver's DONE (after its checksum) completes it
                if self._active is o:
                    self._active = None
                if o.confirmed:  # the DONE overtook the write's own completion (another socket)
                    self._finish_out(o)
                else:
                    o.placed_at = time.monotonic()
                    self._verdict[o.fut.transfer_id] = o

    def _finish_out(self, o: _Out) -> None:
        o.payload.close()
        if self._active is o:
            self._active = None
        secs = time.monotonic() - o.started
        o.fut.set_result({"transfer_id": o.fut.transfer_id, "bytes": o.payload.total, "seconds": secs, "mode": o.mode,
                          "window": o.fut.window, "chunks": o.fut.chunks})

    def _fail_out(self, o: _Out, exc: BaseException, tell_peer: bool) -> None:
        if o.error is not None:
            return
        o.error = exc
        self._verdict.pop(o.fut.transfer_id, None)
        o.machine.fail(exc) if not isinstance(exc, TransferCancelled) else o.machine.cancel(str(exc))
        if tell_peer:
            self._send_ctrl(P.Ctrl(CtrlKind.CANCEL, o.fut.transfer_id, 0, 0, str(exc)[:200]))
        if self._active is o:
            self._active = None
            self._draining.append(o)
        self._maybe_finish_failed(o)

    def _maybe_finish_failed(self, o: _Out) -> None:
        """A failed transfer's resources are freed only when none of its WRITEs is still in flight."""
        if o.pending_wrs > 0:
            return
        if o in self._draining:
            self._draining.remove(o)
        if o.slot is not None and o.mode == "fedrdma-e" and not o.machine.header_posted:
            self.ring.give_back(o.slot)  # type: ignore[union-attr]
        o.payload.close()
        if not o.fut.done():
            o.fut.set_exception(o.error)

    def _on_recv(self, wc: ev.WC) -> None:
        qp_idx, k = (wc.wr_id >> 20) & 0xFF, wc.wr_id & 0xFFFFF
        if not wc.ok:
            raise PeerUnreachable(f"connection to {self.peer} failed: receive completed with {wc.status.name}")
        if wc.opcode == ev.WCOpcode.RECV_RDMA_WITH_IMM:
            imm = wc.imm_data or 0
            self._post_recv(qp_idx, k)
            if imm & STAGING_BIT:
                self._on_staged_chunk(imm & ~STAGING_BIT)
            else:
                self._on_slot(imm)
            return
        off = (qp_idx * RECV_DEPTH + k) * CTRL_BUF
        raw = bytes(self._recv_buf[off:off + wc.byte_len])
        self._post_recv(qp_idx, k)
        self._on_ctrl(P.decode_ctrl(raw))

    def _on_ctrl(self, c: P.Ctrl) -> None:
        now = time.monotonic()
        a = self._active
        if c.kind is CtrlKind.ACK:
            self._staging_free.append(int(c.aux))
            if a is not None and a.mode == "fedrdma" and a.fut.transfer_id == c.transfer_id and a.error is None:
                a.machine.on_ack(int(c.value), now)
                a.fut._progress(a.machine.done_bytes)
                if a.machine.finished:
                    self._finish_out(a)
        elif c.kind is CtrlKind.CREDIT:
            self.ring.credit(int(c.value))  # type: ignore[union-attr]
        elif c.kind is CtrlKind.CANCEL:
            if a is not None and a.fut.transfer_id == c.transfer_id:
                self._fail_out(a, TransferCancelled(f"transfer {c.transfer_id} cancelled by {self.peer}: {c.reason}",
                                                    c.transfer_id), tell_peer=False)
            elif getattr(self, "staging", None) is not None and self.staging.cancel(c.transfer_id):
                self._incoming.pop(c.transfer_id, None)
                log.info("transfer %d from %s cancelled by the sender", c.transfer_id, self.peer)
        elif c.kind is CtrlKind.DONE:
            o = self._verdict.pop(c.transfer_id, None)
            if o is not None:
                self._finish_out(o)
            elif a is not None and a.fut.transfer_id == c.transfer_id:
                a.confirmed = True
        elif c.kind is CtrlKind.ERROR:
            a = self._verdict.get(c.transfer_id, a)
            if a is not None and a.fut.transfer_id == c.transfer_id:
                cls = _ERR.get(ErrorCode(c.value) if c.value in ErrorCode.__members__.values() else ErrorCode.INTERNAL, TransferError)
                self._fail_out(a, cls(f"transfer {c.transfer_id} refused by {self.peer}: {c.reason}", c.transfer_id), tell_peer=False)
        elif c.kind is CtrlKind.PROBE:
            self._send_ctrl(P.Ctrl(CtrlKind.PROBE_REPLY, 0, c.value))
        elif c.kind is CtrlKind.PROBE_REPLY:
            sent = self._probe.pop(int(c.value), None)
            if sent is not None:
                self._rtts.append(now - sent)
                if len(self._rtts) < 3:
                    self._send_probe()
                else:
                    self.rtt_s = min(self._rtts)
                    log.info("connection to %s: RTT %.3f ms, window %d", self.peer, self.rtt_s * 1e3, self._window())

    def _send_probe(self) -> None:
        nonce = len(self._rtts) + 1
        self._probe[nonce] = time.monotonic()
        self._send_ctrl(P.Ctrl(CtrlKind.PROBE, 0, nonce))

    def _refuse(self, tid: int, code: ErrorCode, reason: str) -> None:
        log.warning("transfer %d from %s refused: %s", tid, self.peer, reason)
        self._send_ctrl(P.Ctrl(CtrlKind.ERROR, tid, int(code), 0, reason[:500]))

    def _on_staged_chunk(self, st: int) -> None:
        base = st * self.staging_buf_bytes
        view = memoryview(self._staging_buf)[base:base + self.staging_buf_bytes]
        hdr = P.decode_header(bytes(view[:P.HEADER.size]))
        ack = P.Ctrl(CtrlKind.ACK, hdr.transfer_id, hdr.seq, st)
        data = view[HDR_SLOT:HDR_SLOT + hdr.length]
        try:
            placed = self.staging.on_chunk(hdr, data, time.monotonic())
        except (IntegrityError, RemoteProtocolError) as exc:
            self._incoming.pop(hdr.transfer_id, None)
            self._refuse(hdr.transfer_id, ErrorCode.INTEGRITY if isinstance(exc, IntegrityError) else ErrorCode.PROTOCOL, str(exc))
            self._send_ctrl(ack)
            return
        if placed is not None:
            inc = self._incoming.get(hdr.transfer_id)
            if inc is None:
                inc = self._incoming[hdr.transfer_id] = _In(hdr.total, self.endpoint.recv_buffers)
            inc.view[hdr.offset:hdr.offset + hdr.length] = data  # the reassembly copy FedRDMA pays for
            if hdr.seq == 0:
                meta = bytes(view[P.HEADER.size:P.HEADER.size + hdr.meta_len])
                if hdr.has_crc and crc32c.crc32c(meta) != hdr.meta_crc:
                    self.staging.cancel(hdr.transfer_id)
                    self._incoming.pop(hdr.transfer_id, None)
                    self._refuse(hdr.transfer_id, ErrorCode.INTEGRITY, "metadata crc32c mismatch")
                    self._send_ctrl(ack)
                    return
                inc.meta = meta
        self._send_ctrl(ack)
        if placed is not None and placed.complete:
            inc = self._incoming.pop(hdr.transfer_id)
            self._deliver(hdr.transfer_id, inc.meta or b"{}", inc.view, "fedrdma", None)

    def _on_slot(self, imm: int) -> None:
        assert self.pool is not None
        slot, _ = split_imm(imm)
        slot_total = self.pool.slot_bytes
        base = slot * slot_total
        view = memoryview(self._pool_buf)[base:base + slot_total]
        msg = self.pool.on_write_imm(imm, view)
        h = msg.header
        meta = view[msg.meta_offset:msg.meta_offset + h.meta_len]
        payload = view[msg.payload_offset:msg.payload_offset + h.total]
        try:
            if h.has_crc:
                self.pool.verify(msg, crc32c.crc32c(meta), payload_checksum([payload]))
        except IntegrityError as exc:
            self._refuse(h.transfer_id, ErrorCode.INTEGRITY, str(exc))
            self._send_ctrl(P.Ctrl(CtrlKind.CREDIT, 0, slot))
            return
        self._send_ctrl(P.Ctrl(CtrlKind.DONE, h.transfer_id))
        self._deliver(h.transfer_id, bytes(meta), payload, "fedrdma-e", lambda: self._request("release", slot))

    def _deliver(self, tid: int, meta: bytes, view: memoryview, mode: str, releaser: Any) -> None:
        import json

        try:
            md = json.loads(meta or b"{}")
        except ValueError:
            md = {"_raw_metadata": meta.hex()}
        self.endpoint._inbox_put(Message(self.peer, tid, md, view, mode, releaser, self.endpoint.recv_buffers.get))

    # -- control sends --------------------------------------------------------------------------
    def _send_ctrl(self, c: P.Ctrl) -> None:
        raw = P.encode_ctrl(c)
        if not self._ctrl_free:
            self._ctrl_backlog.append(raw)
            return
        self._post_ctrl(raw)

    def _post_ctrl(self, raw: bytes) -> None:
        idx = self._ctrl_free.pop()
        off = idx * CTRL_BUF
        self._ctrl_buf[off:off + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.rcs[0].qp.post_send(self._ctrl_mr.sge(off, len(raw)), wr_id=self._wr_id("ctrl", None, 0, idx))

    def _flush_ctrl_backlog(self) -> None:
        while self._ctrl_backlog and self._ctrl_free:
            self._post_ctrl(self._ctrl_backlog.popleft())

    # -- time -----------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        if self.rtt_s is None and self._probe and now - min(self._probe.values()) > self.cfg.connect_timeout_s:
            raise PeerUnreachable(f"{self.peer} did not answer the RTT probe within {self.cfg.connect_timeout_s} s")
        a = self._active
        if a is not None and a.error is None:
            try:
                a.machine.tick(now)
            except TransferError as exc:
                a.error = None  # let _fail_out record it
                self._fail_out(a, exc, tell_peer=True)
        for tid, o in list(self._verdict.items()):
            if now - o.placed_at > self.cfg.no_progress_timeout_s:
                self._fail_out(o, TransferError(f"transfer {tid}: placed, but {self.peer} did not confirm it within "
                                                f"{self.cfg.no_progress_timeout_s:g} s", tid), tell_peer=False)
        if getattr(self, "staging", None) is not None:
            for tid in self.staging.expired(now):
                self._incoming.pop(tid, None)
                log.warning("incoming transfer %d from %s dropped: no progress for %g s", tid, self.peer,
                            self.cfg.no_progress_timeout_s)

    # -- teardown -------------------------------------------------------------------------------
    def _die(self, exc: BaseException, quiet: bool = False) -> None:
        if self.dead is None:
            self.dead = exc
        busy = self._active is not None or bool(self._outq) or bool(self._incoming)
        if not quiet:
            # a peer that closes while idle is a normal end; losing it mid-transfer is not
            (log.warning if busy else log.info)("connection to %s lost: %s", self.peer, exc)
        err = exc if isinstance(exc, PeerUnreachable) else PeerUnreachable(f"connection to {self.peer} lost: {exc}")
        for o in ([self._active] if self._active else []) + list(self._outq) + self._draining + list(self._verdict.values()):
            o.payload.close()
            if not o.fut.done():
                o.fut.set_exception(err)
        self._active, self._outq, self._draining, self._verdict = None, collections.deque(), [], {}
        while self._requests:
            kind, arg = self._requests.popleft()
            if kind == "send":
                arg.payload.close()
                arg.fut.set_exception(err)
        self._incoming.clear()
        self._release_resources()
        self.endpoint._forget(self)

    def _release_resources(self) -> None:
        for rc in self.rcs:
            rc.qp.abort()
        for mr in self._mrs:
            mr.close()
        self.cq.close()
        self.boot.close()
