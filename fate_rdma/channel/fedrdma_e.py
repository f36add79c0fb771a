"""FedRDMA-E over a connection: chunks written straight into a receive slot of the peer, one header.

Sending: chunks n-1 .. 1 to their final offsets in the slot the SlotRing gives us, then chunk 0 and
[HEADER|meta] as WRITE_WITH_IMM(imm = slot << 16 | seq) on QP 0. The header carries the whole
payload's checksum, computed on a worker while the first chunks are on the wire. When every WRITE
has completed the transfer is PLACED; the receiver's DONE (sent after its own checksum) makes it
DONE, an ERROR fails it. To a receiver that asked for them (crc32c, xxh3), PLACED notes on the way say from
which offset the payload is placed; the receiver checksums those blocks before the header arrives.
Receiving: the WRITE_WITH_IMM says a slot is complete: verify, answer DONE, hand out a view of the
slot; releasing it sends the slot's CREDIT back.
Slots follow the traffic (protocol/pool.py, slots.py): a payload larger than its slot's grant first
sends GROW; the receiver reserves the room from its memory budget, registers the slot larger and
CREDITs it (or refuses the transfer). A receiver idle for pool_idle_s RECLAIMs its grown slots; the
sender RETURNs each once no transfer of its uses it, and the receiver shrinks it and CREDITs it again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import crc32c

import easypyverbs as ev
from easypyverbs.stalls import clock

from .. import protocol as P
from .. import trace
from ..errors import IntegrityError, RemoteProtocolError
from ..protocol.frames import PLACED_TOTAL_MASK, CtrlKind, ErrorCode
from ..protocol.integrity import BLOCK_BYTES, BLOCKWISE
from .buffers import clear
from .checksum import block_checksums_async, payload_checksum_async, payload_digest, payload_digest_with
from .leaving import LeavingDigest
from .handshake import PoolOffer

if TYPE_CHECKING:
    from .connection import Connection, Outgoing

log = logging.getLogger("fate_rdma.channel")

#: PLACED notes (crc32c, xxh3): for payloads of at least this many bytes, one note per this many bytes of newly
#: placed whole checksum blocks
PLACED_NOTE_MIN_BYTES = 2 * BLOCK_BYTES
PLACED_NOTE_EVERY_BYTES = 16 << 20
#: cores a machine needs for notes to a peer on the same host (the same-host copy keeps two busy)
SAME_HOST_NOTE_MIN_CPUS = 3

#: how long a transfer waits for a slot in use that has room, per GiB of payload, before it grows a
#: free slot instead (about what faulting that much fresh memory in costs on a small VM)
ROOM_WAIT_S_PER_GIB = 0.5


class SlotSender:
    """Posts FedRDMA-E transfers into the peer's receive slots and follows them to the peer's verdict."""

    def __init__(self, conn: "Connection", offer: PoolOffer) -> None:
        self.conn, self.offer = conn, offer
        #: each slot's MR at the peer, as last granted (its CREDIT carries the new rkey and room)
        self.slot_mrs: List[ev.RemoteMR] = []
        for i in range(offer.slots):
            mr = conn.remote.get(f"slot{i}")
            if mr is None or not offer.offset_in_slot(0) <= mr.length <= offer.slot_bytes:
                raise RemoteProtocolError(f"{conn.peer}: receive slot {i} of {offer.slots} has no MR of "
                                          f"{offer.offset_in_slot(0)} to {offer.slot_bytes} bytes "
                                          f"(got {mr.length if mr else 'none'})")
            self.slot_mrs.append(mr)
        self.ring = P.SlotRing(offer.slots, [mr.length - offer.offset_in_slot(0) for mr in self.slot_mrs],
                               offer.slot_payload_bytes, [mr.rkey for mr in self.slot_mrs])
        #: PLACED transfers, waiting for the receiver's DONE, by transfer id
        self.placed: Dict[int, "Outgoing"] = {}
        #: the peer takes PLACED notes (its hello says so), unless it copies our payloads on this host
        #: (same-host path) and this machine has no core beyond the copy's threads: there its early
        #: checksums only compete with the copy (1 GiB on 2 cores: 0.215 / 0.221 s with notes, 0.197 / 0.211
        #: s without, `bench transfer`, 2026-11-25)
        self.notes = bool(getattr(conn.peer_hello, "placed_notes", False)) and not (
            conn.same_host_copy and (os.cpu_count() or 1) < SAME_HOST_NOTE_MIN_CPUS)

    def machine(self, o: "Outgoing", window: int, common: Dict[str, float]) -> Optional[P.FedRdmaESender]:
        """A machine for `o` in the next free slot, or None while no slot is free (wait for CREDIT). A
        payload larger than the slot's grant asks the peer for room first (GROW): the machine waits."""
        now = common["now"]
        if o.first_try is None:
            o.first_try = now
        # a slot in use that has room comes back within a release and a CREDIT; growing another slot
        # instead faults that much fresh memory in (~0.3-1 s/GB): wait up to about what that would cost
        wait = now - o.first_try < ROOM_WAIT_S_PER_GIB * o.payload.total / (1 << 30)
        slot = self.ring.acquire(o.payload.total, wait_for_room=wait)
        if slot is None:
            return None
        o.slot = slot
        tid = o.fut.transfer_id
        m = P.FedRdmaESender(tid, tid & 0xFFFF, slot, o.payload.total, self.conn.slot_chunk(), window,
                             slot_payload_bytes=self.offer.slot_payload_bytes, room_bytes=self.ring.capacity[slot],
                             header_after_all=self.conn.active_qps > 1, **common)
        if m.state is P.fedrdma.SendState.GROWING:
            self.conn.send_ctrl(self.ring.grow(slot, tid, o.payload.total))
        return m

    def pump(self, o: "Outgoing") -> None:
        m = o.machine
        if o.checksums and o.crc_future is None:  # digested as it leaves, if its chunks allow; or fell back to this mode late
            o.leaving = LeavingDigest.make(o.payload.views(), o.integrity, m.chunks) if o.leave_ok else None
            o.crc_future = (o.leaving.future if o.leaving is not None
                            else payload_checksum_async(o.payload.views(), o.integrity, o.payload.fill))
            o.crc_future.add_done_callback(lambda _f: self.conn.cq.wake())
        if o.leaving is not None and not o.crc_future.done() and m.others_done():
            o.leaving.settle()  # (every byte that leaves before the header has: digest what it did not cover)
        m.hold_header = o.checksums and not o.crc_future.done()
        m.ready_from = o.payload.ready_from()
        chunks = m.next_chunks()
        if not chunks:
            return
        with contextlib.ExitStack() as batches:  # one list per QP: a small message's chunks and header in one write
            for rc in self.conn.rcs:
                batches.enter_context(rc.qp.batch())
            self.conn.control.flush()  # the turn's control frames (a slot's CREDIT) go first, in the same write
            for c in chunks:
                self._post(o, c)

    def _post(self, o: "Outgoing", c: P.Chunk) -> None:
        conn = self.conn
        qp = conn.next_qp() if c.seq else conn.rcs[0].qp
        slot_mr = self.slot_mrs[o.slot]  # type: ignore[index]
        data_off = self.offer.offset_in_slot(c.offset)
        if c.seq != 0:
            conn.post_data(qp, o, c, slot_mr, data_off, True, c.seq, in_place=True)
            return
        conn.post_data(qp, o, c, slot_mr, data_off, False, 0, in_place=True)
        digest = o.crc_future.result() if o.checksums else None
        hdr = o.integrity.seal(o.machine.header(len(o.meta), None), o.meta, digest)
        conn.post_header(qp, o, hdr, 0, slot_mr, 0, o.machine.imm)

    def on_write_complete(self, o: "Outgoing", seq: int) -> None:
        m: P.FedRdmaESender = o.machine
        m.on_write_complete(seq, clock())
        o.fut._progress(m.done_bytes)
        if self.notes and o.integrity.kind in BLOCKWISE and o.payload.total >= PLACED_NOTE_MIN_BYTES \
                and not m.header_posted:
            self._note_placed(o, m)
        if m.state is P.fedrdma.SendState.DONE:  # the receiver's DONE overtook this completion
            self.conn.finish_out(o)
        elif m.placed:
            self.conn.unset_active(o)
            self.placed[o.fut.transfer_id] = o

    def _note_placed(self, o: "Outgoing", m: P.FedRdmaESender) -> None:
        """Tell the receiver (PLACED) from which offset the payload is placed once that covers at least
        PLACED_NOTE_EVERY_BYTES of whole checksum blocks more than the last note did, or any more when only
        chunk 0 is left: it checksums those blocks while the rest arrives. On the control QP, so a note sent
        before the header arrives before it."""
        x = m.placed_from()
        if x is None:
            return
        first = -(-x // BLOCK_BYTES)  # the first block wholly placed (the last, short one included)
        before = o.noted if o.noted is not None else -(-o.payload.total // BLOCK_BYTES)
        if before - first < (1 if x == m.chunks[1].offset else PLACED_NOTE_EVERY_BYTES // BLOCK_BYTES):
            return
        o.noted = first
        self.conn.send_ctrl(P.Ctrl(CtrlKind.PLACED, o.fut.transfer_id, o.slot << 48 | o.payload.total, x))

    def on_done(self, tid: int, active: Optional["Outgoing"]) -> None:
        o = self.placed.pop(tid, None)
        if o is not None:
            if o.machine.on_confirm():
                self.conn.finish_out(o)
        elif active is not None and active.fut.transfer_id == tid and active.machine is not None \
                and isinstance(active.machine, P.FedRdmaESender) and active.error is None:
            active.machine.on_confirm()  # noted; completes when its last WRITE does

    def on_credit(self, c: P.Ctrl, active: Optional["Outgoing"]) -> None:
        """The peer granted a slot again (its new rkey and room); maybe the room `active` waits for."""
        grew = self.ring.on_credit(c)  # every field checked
        slot = int(c.value)
        self.slot_mrs[slot] = dataclasses.replace(self.slot_mrs[slot], rkey=self.ring.rkey[slot],
                                                  length=self.offer.offset_in_slot(self.ring.capacity[slot]))
        if grew is not None and active is not None and active.fut.transfer_id == grew and active.error is None:
            active.machine.on_room(self.ring.capacity[slot], clock())

    def on_reclaim(self, c: P.Ctrl) -> None:
        """The peer wants a grown slot back, to shrink it: returned now, or when our transfer in it ends."""
        self._send(self.ring.on_reclaim(c))

    def on_refused(self, tid: int) -> None:
        """An ERROR for `tid`: if it waited for room, the slot's old grant stands (before the transfer fails)."""
        self._send(self.ring.on_refused(tid))

    def _send(self, c: Optional[P.Ctrl]) -> None:
        if c is not None:
            self.conn.send_ctrl(c)

    def forget(self, o: "Outgoing") -> None:
        """`o` failed: stop waiting for its verdict, and take its slot back if the peer never saw it."""
        self.placed.pop(o.fut.transfer_id, None)

    def give_back_unused(self, o: "Outgoing") -> None:
        if o.slot is not None and not o.machine.header_posted:
            self._send(self.ring.give_back(o.slot))

    def tick(self, now: float) -> None:
        for tid, o in list(self.placed.items()):
            try:
                o.machine.tick(now)
            except Exception as exc:  # placed, but no verdict in time
                self.conn.fail_out(o, exc, tell_peer=False)


class SlotReceiver:
    """Validates and delivers transfers that arrive complete in this side's receive slots, and grows and
    shrinks the slots (the memory in conn.mem.slots, the grants in machine.pool)."""

    def __init__(self, conn: "Connection", offer: PoolOffer) -> None:
        self.conn, self.offer = conn, offer
        slots = conn.mem.slots
        self.machine = P.FedRdmaEReceiver(offer.slots, offer.slot_payload_bytes, offer.meta_cap,
                                          integrity=conn.recv_integrity, initial_payload_bytes=slots.initial_payload_bytes,
                                          idle_s=conn.cfg.pool_idle_s, now=clock(),
                                          rkeys=[mr.rkey for mr in slots.mrs])
        self.pool = self.machine.pool
        self._written: Dict[int, int] = {}  # slot -> bytes its last transfer announced (header to payload end)
        self._lent: Set[int] = set()  # slots whose payload the application holds in place (Message.detach)
        self._lent_lock = threading.Lock()
        #: slot -> (transfer id, payload bytes, {block: digest future}, [lowest block its notes covered]) started
        #: on the sender's PLACED notes
        self._early: Dict[int, Tuple[int, int, Dict[int, Any], List[int]]] = {}

    def on_placed(self, c: P.Ctrl) -> None:
        """The sender's PLACED note: payload bytes `c.aux` .. end of transfer `c.transfer_id` are in slot
        `c.value >> 48`; start their block digests (crc32c, xxh3). Every field is checked against the slot's
        grant first; a note for a transfer already seen (its header overtook it) is dropped, and so is one
        for another transfer than the first noted under the slot's grant: a peer gets no more checksum work
        out of notes than its transfers would cost (each block once per grant). The checksum proves what
        crossed the wire, not that the sender left those bytes alone afterwards."""
        slot, total, start, tid = c.value >> 48, c.value & PLACED_TOTAL_MASK, c.aux, c.transfer_id
        if slot >= self.machine.nslots or total > self.pool.capacity[slot] or start > total:
            raise RemoteProtocolError(f"{self.conn.peer}: PLACED note for slot {slot} ({start} of {total} bytes) does "
                                      f"not fit this side's pool")
        if not self.machine.verify_crc or self.machine.integrity.kind not in BLOCKWISE or self.machine.seen(tid) \
                or slot in self.machine.held:
            return
        early = self._early.setdefault(slot, (tid, total, {}, [-(-total // BLOCK_BYTES)]))
        if early[:2] != (tid, total):
            return
        first, covered = -(-start // BLOCK_BYTES), early[3]
        if first >= covered[0]:
            return  # nothing placed since the last note (notes go back to front, as the chunks)
        base = self.offer.offset_in_slot(0)
        # only the blocks placed since the last note; blocks digested where they landed need no second pass
        # (the soft provider's, MR.track_writes). Looking at every block on every note was about a quarter of
        # the receiving process's Python that xxh3 added to a 1 GiB transfer (py-spy, 2026-11-29)
        block_checksums_async(self.conn.mem.slot_view(slot)[base:base + total], first, early[2],
                              self.conn.mem.slots.landed[slot], self.machine.integrity.kind, upto=covered[0])
        covered[0] = first

    def on_write_imm(self, imm: int) -> None:
        conn = self.conn
        slot, _ = P.fedrdma_e.split_imm(imm)
        # a slot out of range is refused by the machine before it reads the (empty) view
        view = conn.mem.slot_view(slot) if slot < self.machine.nslots else memoryview(b"")
        try:
            msg = self.machine.on_write_imm(imm, view, clock())
        except RemoteProtocolError as exc:
            # a header we can read, refused (not the checksum required, sizes beyond the slot, a replay): refuse it and
            # give the slot back; anything worse (no such slot, a slot still held, garbage) ends the connection
            try:
                tid = P.decode_header(bytes(view[:P.HEADER.size])).transfer_id
            except RemoteProtocolError:
                raise exc from None
            if slot in self.machine.held:
                raise
            conn.refuse(tid, ErrorCode.PROTOCOL, str(exc))
            self.pool.refuse(slot)
            self._credit(slot)
            return
        trace.event("c_arrived", tid=msg.header.transfer_id, peer=conn.peer)
        landed = conn.mem.slots.landed[slot]  # (of the grant the transfer came under)
        conn.mem.revoke_slot(slot)  # before the checksum: nothing the peer writes from now on lands here
        h = msg.header
        self._written[slot] = msg.payload_offset + h.total
        meta = view[msg.meta_offset:msg.meta_offset + h.meta_len]
        payload = view[msg.payload_offset:msg.payload_offset + h.total]
        integrity = self.machine.integrity
        try:
            if integrity.kind in BLOCKWISE:
                early = self._early.pop(slot, None)
                known = early[2] if early is not None and early[:2] == (h.transfer_id, h.total) else {}
                digest = payload_digest_with(integrity, payload, known, landed)
                if integrity.kind == "crc32c":
                    self.machine.verify(msg, crc32c.crc32c(meta), digest)
                else:
                    self.machine.verify_tag(msg, bytes(meta), digest)
            elif integrity.kind == "blake2b":
                self.machine.verify_tag(msg, bytes(meta), payload_digest(integrity, [payload]))
        except IntegrityError as exc:
            conn.refuse(h.transfer_id, ErrorCode.INTEGRITY, str(exc))
            self._credit(slot)
            return
        trace.event("c_verified", tid=h.transfer_id, peer=conn.peer)  # (before the verdict leaves: the sender's c_done follows it)
        conn.send_ctrl(P.Ctrl(CtrlKind.DONE, h.transfer_id))
        conn.deliver(h.transfer_id, bytes(meta), payload, "fedrdma-e", lambda: conn.release_slot(slot),
                     lambda: self.lend(slot))

    def lend(self, slot: int) -> bool:
        """May the application keep `slot`'s payload in place (any thread)? Yes while another slot of
        this peer's pool stays in circulation (all but one may be lent, so transfers always progress) and
        the memory budget could grow that one as large (else a copy, and the slot goes back at once, as
        without lending: the sender's next payload of this size is not refused for want of room)."""
        budget = self.conn.endpoint.budget
        with self._lent_lock:
            if len(self._lent) + 1 >= self.machine.nslots \
                    or budget.limit_bytes - budget.held_bytes < self.conn.mem.slots.slot_bytes(slot):
                return False
            self._lent.add(slot)
            return True

    def lent_slots(self) -> Set[int]:
        with self._lent_lock:
            return set(self._lent)

    def release(self, slot: int) -> None:
        with self._lent_lock:
            lent = slot in self._lent
            self._lent.discard(slot)
        self.machine.release(slot, clock())
        written = self._written.pop(slot, 0)
        if lent and not self.machine.verify_crc:
            # without a checksum nothing proves the next transfer writes every byte it announces, and bytes it
            # does not write must not show what the application made of this payload in place (derived from
            # other parties' data, say): clear them. A slot that was not lent holds only what this peer
            # wrote (Message.view is read-only), so those bytes read as its own earlier payload, and the
            # clear (0.1 s per GiB here, before the CREDIT) stays off the path of back-to-back transfers
            clear(self.conn.mem.slot_view(slot)[:written])
        self._credit(slot)

    def _credit(self, slot: int) -> None:
        """Grant `slot` to the peer again, under a new rkey, and tell it."""
        self._early.pop(slot, None)
        rkey = self.conn.mem.grant_slot(slot)
        self.conn.send_ctrl(self.pool.granted(slot, rkey, self.pool.capacity[slot]))

    # -- the pool follows the traffic -------------------------------------------------------------
    def on_grow(self, c: P.Ctrl) -> None:
        """The peer's transfer `c.transfer_id` needs room in slot `c.value`: grant it within the memory
        budget, or refuse the transfer (the old grant stands)."""
        conn, slots, tid = self.conn, self.conn.mem.slots, c.transfer_id
        try:
            capacity = self.pool.room_for(c)  # every field checked before anything is allocated
        except RemoteProtocolError as exc:
            conn.refuse(tid, ErrorCode.PROTOCOL, str(exc))
            return
        slot = int(c.value)
        budget, more = conn.endpoint.budget, self.offer.offset_in_slot(capacity) - slots.slot_bytes(slot)
        if not budget.reserve(more):
            conn.refuse(tid, ErrorCode.TOO_LARGE, f"payload of {c.aux} bytes: growing receive slot {slot} to {capacity} "
                        f"bytes would exceed the receiver's memory budget ({budget.limit_bytes} bytes, "
                        f"{budget.held_bytes} held)")
            return
        try:
            rkey = slots.resize(slot, capacity)
        except (ev.EasyVerbsError, OSError) as exc:  # registered as it was
            budget.release(more)
            conn.refuse(tid, ErrorCode.TOO_LARGE, f"receive slot {slot} could not grow to {capacity} bytes: {exc}")
            return
        conn._reserved += more
        self._early.pop(slot, None)
        log.debug("%s: slot %d grew to %d bytes for transfer %d", conn.peer, slot, capacity, tid)
        conn.send_ctrl(self.pool.grown(slot, rkey, capacity, clock()))

    def on_return(self, c: P.Ctrl) -> None:
        """The peer handed a slot back that we asked for: shrink it and grant it again."""
        capacity = self.pool.on_return(c)  # every field checked; a RETURN we did not ask for ends the connection
        slot, slots, conn = int(c.value), self.conn.mem.slots, self.conn
        self._early.pop(slot, None)  # (a note's checksums over the old extent: granted anew below)
        before = slots.slot_bytes(slot)
        rkey = slots.resize(slot, capacity)
        less = before - slots.slot_bytes(slot)
        conn.endpoint.budget.release(less)
        conn._reserved -= less
        conn.send_ctrl(self.pool.granted(slot, rkey, capacity))

    def tick(self, now: float) -> None:
        reclaim = self.pool.idle(now)
        if reclaim:
            log.info("%s: receive pool idle for %g s: asking slot(s) %s back to shrink them", self.conn.peer,
                     self.pool.idle_s, [int(c.value) for c in reclaim])
        for c in reclaim:
            self.conn.send_ctrl(c)
