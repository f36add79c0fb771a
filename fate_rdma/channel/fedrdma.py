"""FedRDMA over a connection: chunks through the peer's staging buffers, one ACK each, reassembly.

Sending: chunk i goes to a staging buffer of the peer that we hold credit for: its data, then
[HEADER|meta] as WRITE_WITH_IMM(imm = STAGING_BIT | buffer index). The peer copies the chunk to the
transfer's destination and ACKs it, naming the buffer, which gives the credit back.
Receiving: the mirror image, with protocol.FedRdmaReceiver deciding what each chunk is.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Optional

import crc32c

from easypyverbs.stalls import clock

from .. import protocol as P
from .. import trace
from ..errors import IntegrityError, PayloadTooLarge, RemoteProtocolError
from ..protocol.frames import CtrlKind, ErrorCode
from ..protocol.policy import StagingCredits
from .buffers import RecvBuffers, copy_into
from .checksum import payload_digest
from .handshake import StagingOffer

if TYPE_CHECKING:
    from .connection import Connection, Outgoing

log = logging.getLogger("fate_rdma.channel")

#: the immediate of a staged chunk's WRITE_WITH_IMM; FedRDMA-E immediates (slot << 16 | seq) stay below it
STAGING_BIT = 1 << 31


class StagedSender:
    """Posts FedRDMA chunks into the peer's staging buffers and turns its ACKs into progress."""

    def __init__(self, conn: "Connection", offer: StagingOffer) -> None:
        self.conn, self.offer = conn, offer
        self.credits = StagingCredits(offer.count)

    def machine(self, o: "Outgoing", window: int, common: Dict[str, float]) -> P.FedRdmaSender:
        return P.FedRdmaSender(o.fut.transfer_id, o.payload.total, self.conn.cfg.chunk_bytes,
                               min(window, self.offer.count), **common)

    def pump(self, o: "Outgoing") -> None:
        for c in o.machine.next_chunks(self.credits.available):
            self._post(o, c)

    def _post(self, o: "Outgoing", c: P.Chunk) -> None:
        conn = self.conn
        qp = conn.next_qp()
        st = self.credits.take()
        staging = conn.remote["staging"]
        base = self.offer.base(st)
        conn.post_data(qp, o, c, staging, self.offer.data_offset(st), False, c.seq)
        meta = o.meta if c.seq == 0 else b""
        digest: Any = None
        if o.integrity.kind == "crc32c":
            digest = 0
            for s in o.payload.sges(c.offset, c.length):
                digest = crc32c.crc32c(s.view(), digest)
        elif o.integrity.kind in ("blake2b", "xxh3"):
            digest = payload_digest(o.integrity, [s.view() for s in o.payload.sges(c.offset, c.length)])
        hdr = o.integrity.seal(o.machine.header(c, len(meta), None), meta, digest)
        conn.post_header(qp, o, hdr, c.seq, staging, base, STAGING_BIT | st)

    def on_ack(self, c: P.Ctrl, active: Optional["Outgoing"]) -> None:
        """An ACK: the staging buffer it names is ours again; progress if it is the active transfer's."""
        self.credits.give_back(int(c.aux))
        if active is not None and active.machine is not None and active.fut.transfer_id == c.transfer_id \
                and active.error is None and isinstance(active.machine, P.FedRdmaSender):
            active.machine.on_ack(int(c.value), clock())
            active.fut._progress(active.machine.done_bytes)
            if active.machine.finished:
                self.conn.finish_out(active)


class _Reassembly:
    """An incoming FedRDMA transfer being put together."""

    def __init__(self, total: int, buffers: RecvBuffers) -> None:
        self.dest = buffers.get(total)
        self.view = memoryview(self.dest).cast("B")
        self.meta: Optional[bytes] = None


class StagedReceiver:
    """Takes chunks out of this side's staging buffers, copies them into place, and ACKs them."""

    def __init__(self, conn: "Connection") -> None:
        self.conn = conn
        cfg = conn.cfg
        self.machine = P.FedRdmaReceiver(cfg.max_payload_bytes, cfg.no_progress_timeout_s, integrity=conn.recv_integrity)
        self._incoming: Dict[int, _Reassembly] = {}

    @property
    def busy(self) -> bool:
        return bool(self._incoming)

    def on_chunk(self, st: int) -> None:
        conn = self.conn
        if not 0 <= st < conn.mem.staging.count:  # type: ignore[union-attr]
            raise RemoteProtocolError(f"WRITE_WITH_IMM names staging buffer {st}; this side has "
                                      f"{conn.mem.staging.count}")  # type: ignore[union-attr]
        view = conn.mem.staging_view(st)
        hdr = P.decode_header(bytes(view[:P.HEADER.size]))
        ack = P.Ctrl(CtrlKind.ACK, hdr.transfer_id, hdr.seq, st)
        data_at = P.HEADER.size + conn.mem.staging.meta_cap  # type: ignore[union-attr]
        if hdr.length > conn.mem.staging.chunk_capacity:  # type: ignore[union-attr]
            raise RemoteProtocolError(f"transfer {hdr.transfer_id} chunk {hdr.seq}: {hdr.length} bytes do not fit a "
                                      f"staging buffer of {conn.mem.staging.chunk_capacity}")  # type: ignore[union-attr]
        data = view[data_at:data_at + hdr.length]
        meta = bytes(view[P.HEADER.size:P.HEADER.size + hdr.meta_len])  # the checksum covers it
        try:
            placed = self.machine.on_chunk(hdr, data, clock(), meta)
        except (IntegrityError, PayloadTooLarge, RemoteProtocolError) as exc:
            self._forget(hdr.transfer_id)
            code = (ErrorCode.INTEGRITY if isinstance(exc, IntegrityError) else
                    ErrorCode.TOO_LARGE if isinstance(exc, PayloadTooLarge) else ErrorCode.PROTOCOL)
            conn.refuse(hdr.transfer_id, code, str(exc))
            conn.send_ctrl(ack)
            return
        if placed is not None:
            inc = self._incoming.get(hdr.transfer_id)
            if inc is None:
                budget = conn.endpoint.budget
                if not budget.reserve(hdr.total):  # refused at its first chunk, before allocation
                    self.machine.cancel(hdr.transfer_id)
                    conn.refuse(hdr.transfer_id, ErrorCode.TOO_LARGE,
                                f"{hdr.total} bytes would exceed the receiver's memory budget ({budget.limit_bytes} "
                                f"bytes, {budget.held_bytes} held)")
                    conn.send_ctrl(ack)
                    return
                inc = self._incoming[hdr.transfer_id] = _Reassembly(hdr.total, conn.endpoint.recv_buffers)
            copy_into(inc.dest, hdr.offset, data)  # the reassembly copy FedRDMA pays for
            if hdr.seq == 0:
                inc.meta = meta
        complete = placed is not None and placed.complete
        if complete:  # (traced before the last ACK, which completes the send; every chunk was checked on arrival)
            trace.event("c_arrived", tid=hdr.transfer_id, peer=conn.peer)
            trace.event("c_verified", tid=hdr.transfer_id, peer=conn.peer)
        conn.send_ctrl(ack)
        if complete:
            inc = self._incoming.pop(hdr.transfer_id)
            conn.endpoint.budget.release(hdr.total)  # the application's memory from here on
            conn.deliver(hdr.transfer_id, inc.meta or b"{}", inc.view, "fedrdma", None)

    def _forget(self, transfer_id: int) -> None:
        inc = self._incoming.pop(transfer_id, None)
        if inc is not None:
            self.conn.endpoint.budget.release(inc.dest.nbytes)

    def on_cancel(self, transfer_id: int) -> bool:
        """The sender cancelled `transfer_id`; True if it was arriving here."""
        if self.machine.cancel(transfer_id):
            self._forget(transfer_id)
            return True
        return False

    def tick(self, now: float) -> None:
        for tid in self.machine.expired(now):
            self._forget(tid)
            self.conn.refuse(tid, ErrorCode.TIMEOUT, f"incoming transfer dropped: no chunk for "
                             f"{self.conn.cfg.no_progress_timeout_s:g} s")

    def clear(self) -> None:
        for tid in list(self._incoming):
            self._forget(tid)

