"""FedRDMA over a connection: chunks through the peer's staging buffers, one ACK each, reassembly.

Sending: chunk i goes to a staging buffer of the peer that we hold credit for: its data, then
[HEADER|meta] as WRITE_WITH_IMM, whose immediate names the buffer (protocol/packing.py). The peer copies the
chunk to the transfer's destination and ACKs it, naming the buffer, which gives the credit back.
Receiving: the mirror image, with protocol.FedRdmaReceiver deciding what each chunk is (its states and their
transitions are the protocol's).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

import crc32c
from numpy.typing import NDArray

import easypyverbs as ev
from easypyverbs.stalls import clock

from .. import protocol as P
from .. import trace
from ..errors import IntegrityError, PayloadTooLarge, RemoteProtocolError
from ..protocol.frames import CtrlKind, ErrorCode
from ..protocol.hello import StagingOffer
from ..protocol.integrity import Digest, Integrity
from ..protocol.packing import staged_imm
from ..protocol.policy import StagingCredits
from ..protocol.refusal import code_for
from .buffers import RecvBuffers, Share, copy_into
from .checksum import payload_digest
from .outgoing import Outgoing
from .port import Plan, RecvPort, SendPort

log = logging.getLogger("fate_rdma.channel")

#: resume.Resumer.keep: (peer, transfer id, bytes, metadata, reassembly buffer, first bytes arrived and verified)
Keep = Callable[[str, int, int, Optional[bytes], NDArray[Any], int], None]


def _machine(o: Outgoing) -> P.FedRdmaSender:
    m = o.machine
    assert isinstance(m, P.FedRdmaSender), "a staged transfer is FedRDMA's"
    return m


class StagedSender:
    """Posts FedRDMA chunks into the peer's staging buffers and turns its ACKs into progress."""

    def __init__(self, port: SendPort, offer: StagingOffer, staging: ev.RemoteMR) -> None:
        """`offer`: the peer's staging buffers, `staging`: the MR that holds them."""
        self.port, self.offer, self.staging = port, offer, staging
        self.credits = StagingCredits(offer.count)

    def machine(self, o: Outgoing, plan: Plan) -> P.FedRdmaSender:
        return P.FedRdmaSender(o.fut.transfer_id, o.payload.total, plan.chunk_bytes, min(plan.window, self.offer.count),
                               now=plan.now, first_chunk_bytes=plan.first_chunk_bytes,
                               no_progress_s=plan.no_progress_s, total_s=plan.total_s)

    def pump(self, o: Outgoing) -> None:
        m = _machine(o)
        for c in m.next_chunks(self.credits.available):
            self._post(o, m, c)

    def _post(self, o: Outgoing, m: P.FedRdmaSender, c: P.Chunk) -> None:
        port = self.port
        qp = port.next_qp()
        st = self.credits.take()
        base = self.offer.base(st)
        port.post_data(qp, o, c, self.staging, self.offer.data_offset(st), False, c.seq)
        meta = o.meta if c.seq == 0 else b""
        digest: Digest = None
        if o.integrity.kind == "crc32c":
            crc = 0
            for s in o.payload.sges(c.offset, c.length):
                crc = crc32c.crc32c(s.view(), crc)
            digest = crc
        elif o.integrity.kind in ("blake2b", "blake3", "xxh3"):
            digest = payload_digest(o.integrity, [s.view() for s in o.payload.sges(c.offset, c.length)])
        hdr = o.integrity.seal(m.header(c, len(meta), None), meta, digest)
        port.post_header(qp, o, hdr, c.seq, self.staging, base, staged_imm(st))

    def on_ack(self, c: P.Ctrl, active: Optional[Outgoing]) -> None:
        """An ACK: the staging buffer it names is ours again; progress if it is the active transfer's."""
        self.credits.give_back(int(c.aux))
        if active is not None and active.machine is not None and active.fut.transfer_id == c.transfer_id \
                and active.error is None and isinstance(active.machine, P.FedRdmaSender):
            active.machine.on_ack(int(c.value), clock())
            active.report_progress(active.machine.done_bytes)
            if active.machine.finished:
                self.port.finish(active)


class _Reassembly:
    """An incoming FedRDMA transfer being put together."""

    def __init__(self, total: int, buffers: RecvBuffers) -> None:
        self.dest = buffers.get(total)
        self.view = self.dest.data.cast("B")
        self.meta: Optional[bytes] = None


class StagedReceiver:
    """Takes chunks out of this side's staging buffers, copies them into place, and ACKs them."""

    def __init__(self, port: RecvPort, peer: str, offer: StagingOffer, staging_view: Callable[[int], memoryview],
                 share: Share, buffers: RecvBuffers, max_payload_bytes: int, no_progress_s: float,
                 integrity: Integrity) -> None:
        """`offer`: this side's staging buffers, `staging_view(i)`: buffer i's bytes (layout.LocalMemory);
        `share`: the connection's part of the memory budget, which reassembly buffers reserve from (within
        what this peer may hold), `buffers`: where they come from."""
        self.port, self.peer, self.offer, self.staging_view = port, peer, offer, staging_view
        self.share, self.buffers, self.no_progress_s = share, buffers, no_progress_s
        self.machine = P.FedRdmaReceiver(max_payload_bytes, no_progress_s, integrity=integrity)
        self._incoming: Dict[int, _Reassembly] = {}

    @property
    def busy(self) -> bool:
        return bool(self._incoming)

    def on_chunk(self, st: int) -> None:
        port, offer = self.port, self.offer
        offer.check_arrival(st)
        view = self.staging_view(st)
        hdr = P.decode_header(bytes(view[:P.HEADER.size]))
        ack = P.Ctrl(CtrlKind.ACK, hdr.transfer_id, hdr.seq, st)
        data_at = P.HEADER.size + offer.meta_cap
        offer.check_chunk(hdr)
        data = view[data_at:data_at + hdr.length]
        meta = bytes(view[P.HEADER.size:P.HEADER.size + hdr.meta_len])  # the checksum covers it
        try:
            placed = self.machine.on_chunk(hdr, data, clock(), meta)
        except (IntegrityError, PayloadTooLarge, RemoteProtocolError) as exc:
            self._forget(hdr.transfer_id)
            port.refuse(hdr.transfer_id, code_for(exc), str(exc))
            port.send_ctrl(ack)
            return
        if placed is not None:
            inc = self._incoming.get(hdr.transfer_id)
            if inc is None:
                if not self.share.reserve(hdr.total):  # refused at its first chunk, before allocation
                    self.machine.refuse(hdr.transfer_id)
                    # (what is left of the budget is not the peer's to know: Budget.reserve logs it here)
                    port.refuse(hdr.transfer_id, ErrorCode.TOO_LARGE,
                                f"payload of {hdr.total} bytes exceeds the receiver's limit for this peer")
                    port.send_ctrl(ack)
                    return
                inc = self._incoming[hdr.transfer_id] = _Reassembly(hdr.total, self.buffers)
            copy_into(inc.dest, hdr.offset, data)  # the reassembly copy FedRDMA pays for
            if hdr.seq == 0:
                inc.meta = meta
        complete = placed is not None and placed.complete
        if complete:  # (traced before the last ACK, which completes the send; every chunk was checked on arrival)
            trace.event("c_arrived", tid=hdr.transfer_id, peer=self.peer)
            trace.event("c_verified", tid=hdr.transfer_id, peer=self.peer)
        port.send_ctrl(ack)
        if complete:
            inc = self._incoming.pop(hdr.transfer_id)
            self.share.release(hdr.total)  # the application's memory from here on
            port.deliver(hdr.transfer_id, inc.meta or b"{}", inc.view, "fedrdma", None)

    def _forget(self, transfer_id: int) -> None:
        inc = self._incoming.pop(transfer_id, None)
        if inc is not None:
            self.share.release(inc.dest.nbytes)

    def on_cancel(self, transfer_id: int) -> bool:
        """The sender cancelled `transfer_id` (or a CANCEL named a transfer of neither side's: it is dropped
        should its chunks come); True if it was arriving here."""
        if self.machine.cancel(transfer_id):
            self._forget(transfer_id)
            return True
        return False

    def tick(self, now: float) -> None:
        for tid in self.machine.expired(now):
            self._forget(tid)
            self.port.refuse(tid, ErrorCode.TIMEOUT, f"incoming transfer dropped: no chunk for "
                             f"{self.no_progress_s:g} s")

    def clear(self, keep: Optional[Keep] = None) -> None:
        """The connection ended: let go of what was arriving, or hand it to `keep` (resume.Resumer.keep) as its
        reassembly buffer and how many of its first bytes arrived, verified."""
        for tid in list(self._incoming):
            inc = self._incoming[tid]
            self._forget(tid)
            if keep is not None:
                keep(self.peer, tid, inc.dest.nbytes, inc.meta, inc.dest, self.machine.held_prefix(tid))
