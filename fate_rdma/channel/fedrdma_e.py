"""FedRDMA-E over a connection: chunks written straight into a receive slot of the peer, one header.

Sending: chunks n-1 .. 1 to their final offsets in the slot the SlotRing gives us, then chunk 0 and
[HEADER|meta] as WRITE_WITH_IMM(imm = slot << 16 | seq) on QP 0. The header carries the whole
payload's checksum, computed on a worker while the first chunks are on the wire. When every WRITE
has completed the transfer is PLACED; the receiver's DONE (sent after its own checksum) makes it
DONE, an ERROR fails it. To a receiver that asked for them (crc32c, xxh3), PLACED notes on the way say from
which offset the payload is placed; the receiver checksums those blocks before the header arrives (when notes
go, and which blocks one starts, is the protocol's: protocol/placed.py).
Receiving: the WRITE_WITH_IMM says a slot is complete: verify, answer DONE, hand out a view of the
slot; releasing it sends the slot's CREDIT back.
Slots follow the traffic (protocol/pool.py, slots.py): a payload larger than its slot's grant first
sends GROW; the receiver reserves the room from its memory budget, within what one peer may hold of it,
registers the slot larger and CREDITs it (or refuses the transfer). A receiver idle for pool_idle_s RECLAIMs
its grown slots; the sender RETURNs each once no transfer of its uses it, and the receiver shrinks it and
CREDITs it again.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Set

import crc32c
from numpy.typing import NDArray

import easypyverbs as ev
from easypyverbs.stalls import clock

from .. import protocol as P
from .. import trace
from ..errors import IntegrityError, RemoteProtocolError
from ..protocol.fedrdma import SendState
from ..protocol.frames import ErrorCode
from ..protocol.hello import PoolOffer
from ..protocol.integrity import BLOCKWISE, Digest, Integrity
from ..protocol.packing import split_imm
from ..protocol.placed import notes_wanted, serves
from ..protocol.policy import may_lend, wait_for_room
from .buffers import Share, clear
from .checksum import block_checksums_async, payload_checksum_async, payload_digest, payload_digest_with
from .leaving import LeavingDigest
from .outgoing import Outgoing
from .port import Plan, RecvPort, SendPort
from .slots import SlotMemory

log = logging.getLogger("fate_rdma.channel")

def _machine(o: Outgoing) -> P.FedRdmaESender:
    m = o.machine
    assert isinstance(m, P.FedRdmaESender), "a slot transfer is FedRDMA-E's"
    return m


class SlotSender:
    """Posts FedRDMA-E transfers into the peer's receive slots and follows them to the peer's verdict."""

    def __init__(self, port: SendPort, peer: str, offer: PoolOffer, remote: Mapping[str, ev.RemoteMR],
                 placed_notes: bool, same_host_copy: bool) -> None:
        """`offer`: the peer's pool, `remote`: the MRs its hello names (one per slot); `placed_notes`: the peer
        asks for PLACED notes; `same_host_copy`: it copies our payloads on this host (DataPath.same_host)."""
        self.port, self.peer, self.offer = port, peer, offer
        #: each slot's MR at the peer, as last granted (its CREDIT carries the new rkey and room)
        self.slot_mrs: List[ev.RemoteMR] = []
        for i in range(offer.slots):
            mr = remote.get(f"slot{i}")
            if mr is None or not offer.offset_in_slot(0) <= mr.length <= offer.slot_bytes:
                raise RemoteProtocolError(f"{peer}: receive slot {i} of {offer.slots} has no MR of "
                                          f"{offer.offset_in_slot(0)} to {offer.slot_bytes} bytes "
                                          f"(got {mr.length if mr else 'none'})")
            self.slot_mrs.append(mr)
        self.ring = P.SlotRing(offer.slots, [mr.length - offer.offset_in_slot(0) for mr in self.slot_mrs],
                               offer.slot_payload_bytes, [mr.rkey for mr in self.slot_mrs])
        #: PLACED transfers, waiting for the receiver's DONE, by transfer id
        self.placed: Dict[int, Outgoing] = {}
        #: PLACED notes go to the peer (placed.notes_wanted: it asked, and cores are left beside a same-host copy)
        self.notes = notes_wanted(placed_notes, same_host_copy, os.cpu_count() or 1)

    def machine(self, o: Outgoing, plan: Plan) -> Optional[P.FedRdmaESender]:
        """A machine for `o` in the next free slot, or None while no slot is free (wait for CREDIT). A
        payload larger than the slot's grant asks the peer for room first (GROW): the machine waits."""
        now = plan.now
        if o.first_try is None:
            o.first_try = now
        slot = self.ring.acquire(o.payload.total, wait_for_room=wait_for_room(now - o.first_try, o.payload.total))
        if slot is None:
            return None
        o.slot = slot
        tid = o.fut.transfer_id
        m = P.FedRdmaESender(tid, tid & 0xFFFF, slot, o.payload.total, plan.chunk_bytes, plan.window,
                             slot_payload_bytes=self.offer.slot_payload_bytes, room_bytes=self.ring.capacity[slot],
                             header_after_all=plan.qps > 1, now=now, first_chunk_bytes=plan.first_chunk_bytes,
                             no_progress_s=plan.no_progress_s, total_s=plan.total_s,
                             placed_notes=self.notes and serves(o.integrity.kind))
        if m.state is SendState.GROWING:
            self.port.send_ctrl(self.ring.grow(slot, tid, o.payload.total))
        return m

    def pump(self, o: Outgoing) -> None:
        m = _machine(o)
        crc = o.crc_future
        if o.checksums and crc is None:  # digested as it leaves, if its chunks allow; or fell back to this mode late
            o.leaving = LeavingDigest.make(o.payload.views(), o.integrity, m.chunks) if o.leave_ok else None
            crc = o.crc_future = (o.leaving.future if o.leaving is not None
                                  else payload_checksum_async(o.payload.views(), o.integrity, o.payload.fill))
            crc.add_done_callback(self._wake)
        if o.leaving is not None and crc is not None and not crc.done() and m.others_done():
            o.leaving.settle()  # (every byte that leaves before the header has: digest what it did not cover)
        m.hold_header = o.checksums and not (crc is not None and crc.done())
        m.ready_from = o.payload.ready_from()
        chunks = m.next_chunks()
        if not chunks:
            return
        # one list per QP: a small message's chunks and header in one write, after the turn's control frames
        # (a slot's CREDIT)
        with self.port.batched():
            for c in chunks:
                self._post(o, m, c)

    def _wake(self, _f: "concurrent.futures.Future[Digest]") -> None:
        self.port.wake()

    def _post(self, o: Outgoing, m: P.FedRdmaESender, c: P.Chunk) -> None:
        port = self.port
        qp = port.next_qp() if c.seq else port.control_qp()
        assert o.slot is not None, "a started FedRDMA-E transfer has its slot"
        slot_mr = self.slot_mrs[o.slot]
        data_off = self.offer.offset_in_slot(c.offset)
        if c.seq != 0:
            port.post_data(qp, o, c, slot_mr, data_off, True, c.seq, in_place=True)
            return
        port.post_data(qp, o, c, slot_mr, data_off, False, 0, in_place=True)
        digest = o.crc_future.result() if o.checksums and o.crc_future is not None else None
        hdr = o.integrity.seal(m.header(len(o.meta), None), o.meta, digest)
        port.post_header(qp, o, hdr, 0, slot_mr, 0, m.imm)

    def on_write_complete(self, o: Outgoing, seq: int) -> None:
        m = _machine(o)
        m.on_write_complete(seq, clock())
        o.report_progress(m.done_bytes)
        # (a note goes on the control QP: one sent before the header arrives before it)
        self._send(m.placed_note())
        if m.state is SendState.DONE:  # the receiver's DONE overtook this completion
            self.port.finish(o)
        elif m.placed:
            self.port.step_aside(o)
            self.placed[o.fut.transfer_id] = o

    def on_done(self, tid: int, active: Optional[Outgoing]) -> None:
        o = self.placed.pop(tid, None)
        if o is not None:
            if _machine(o).on_confirm():
                self.port.finish(o)
        elif active is not None and active.fut.transfer_id == tid and active.machine is not None \
                and isinstance(active.machine, P.FedRdmaESender) and active.error is None:
            active.machine.on_confirm()  # noted; completes when its last WRITE does

    def on_credit(self, c: P.Ctrl, active: Optional[Outgoing]) -> None:
        """The peer granted a slot again (its new rkey and room); maybe the room `active` waits for."""
        grew = self.ring.on_credit(c)  # every field checked
        slot = int(c.value)
        self.slot_mrs[slot] = dataclasses.replace(self.slot_mrs[slot], rkey=self.ring.rkey[slot],
                                                  length=self.offer.offset_in_slot(self.ring.capacity[slot]))
        if grew is not None and active is not None and active.fut.transfer_id == grew and active.error is None:
            _machine(active).on_room(self.ring.capacity[slot], clock())

    def on_reclaim(self, c: P.Ctrl) -> None:
        """The peer wants a grown slot back, to shrink it: returned now, or when our transfer in it ends."""
        self._send(self.ring.on_reclaim(c))

    def on_refused(self, tid: int) -> None:
        """An ERROR for `tid`: if it waited for room, the slot's old grant stands (before the transfer fails)."""
        self._send(self.ring.on_refused(tid))

    def _send(self, c: Optional[P.Ctrl]) -> None:
        if c is not None:
            self.port.send_ctrl(c)

    def forget(self, o: Outgoing) -> None:
        """`o` failed: stop waiting for its verdict, and take its slot back if the peer never saw it."""
        self.placed.pop(o.fut.transfer_id, None)

    def give_back_unused(self, o: Outgoing) -> None:
        if o.slot is not None and not _machine(o).header_posted:
            self._send(self.ring.give_back(o.slot))

    def tick(self, now: float) -> None:
        for tid, o in list(self.placed.items()):
            m = _machine(o)
            try:
                m.tick(now)
            except Exception as exc:  # placed, but no verdict in time
                self.port.fail(o, exc, tell_peer=False)


class SlotReceiver:
    """Validates and delivers transfers that arrive complete in this side's receive slots, and grows and
    shrinks the slots (the memory in `slots`, the grants in machine.pool)."""

    def __init__(self, port: RecvPort, peer: str, offer: PoolOffer, slots: SlotMemory, share: Share,
                 integrity: Integrity, idle_s: float) -> None:
        """`offer`: this side's pool, `slots`: its memory; `share`: the connection's part of the memory budget,
        which the slots grow within; `idle_s`: how long the pool idles before it asks grown slots back."""
        self.port, self.peer, self.offer, self.slots, self.share = port, peer, offer, slots, share
        rkeys = [mr.rkey for mr in slots.mrs if mr is not None]
        assert len(rkeys) == offer.slots, "each slot is registered as it is made"
        self.machine = P.FedRdmaEReceiver(offer.slots, offer.slot_payload_bytes, offer.meta_cap,
                                          integrity=integrity, initial_payload_bytes=slots.initial_payload_bytes,
                                          idle_s=idle_s, now=clock(), rkeys=rkeys)
        self.pool = self.machine.pool
        self._written: Dict[int, int] = {}  # slot -> bytes its last transfer announced (header to payload end)
        self._lent: Set[int] = set()  # slots whose payload the application holds in place (Message.detach)
        self._lent_lock = threading.Lock()
        #: slot -> {block: digest future} started on the sender's PLACED notes under the slot's grant (which
        #: blocks, and for which transfer: machine.notes)
        self._early: Dict[int, Dict[int, Digest]] = {}

    def on_placed(self, c: P.Ctrl) -> None:
        """The sender's PLACED note (protocol/placed.py): payload bytes `c.aux` .. end of transfer
        `c.transfer_id` are in its slot; start the block digests (crc32c, xxh3) the machine says the note
        adds. A note that does not fit the pool ends the connection. The checksum proves what crossed the
        wire, not that the sender left those bytes alone afterwards."""
        try:
            work = self.machine.on_placed(c)
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(f"{self.peer}: {exc}") from exc
        if work is None:
            return
        slot, base = work.slot, self.offer.offset_in_slot(0)
        # only the blocks placed since the last note; blocks digested where they landed need no second pass
        # (the soft provider's, MR.track_writes): looking at every block on every note cost a large part of the
        # receiving process's Python time
        block_checksums_async(self.slots.view(slot)[base:base + work.total], work.first, self._early.setdefault(slot, {}),
                              self.slots.landed[slot], self.machine.integrity, upto=work.upto)

    def on_write_imm(self, imm: int) -> None:
        port = self.port
        slot, _ = split_imm(imm)
        # a slot out of range is refused by the machine before it reads the (empty) view
        view = self.slots.view(slot) if slot < self.machine.nslots else memoryview(b"")
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
            port.refuse(tid, ErrorCode.PROTOCOL, str(exc))
            self.machine.refuse(slot)
            self._credit(slot)
            return
        trace.event("c_arrived", tid=msg.header.transfer_id, peer=self.peer)
        landed = self.slots.landed[slot]  # (of the grant the transfer came under)
        self.slots.revoke(slot)  # before the checksum: nothing the peer writes from now on lands here
        h = msg.header
        self._written[slot] = msg.payload_offset + h.total
        meta = view[msg.meta_offset:msg.meta_offset + h.meta_len]
        payload = view[msg.payload_offset:msg.payload_offset + h.total]
        integrity = self.machine.integrity
        early = self._early.pop(slot, {})
        try:
            if integrity.kind in BLOCKWISE:
                digest = payload_digest_with(integrity, payload, early if msg.noted else {}, landed)
                if integrity.kind == "crc32c":
                    assert isinstance(digest, int), "a crc32c digest is an int"
                    done = self.machine.verify(msg, crc32c.crc32c(meta), digest)
                else:
                    assert isinstance(digest, bytes), "an xxh3 or blake3 digest is its blocks' digests"
                    done = self.machine.verify_tag(msg, bytes(meta), digest)
            elif integrity.kind == "blake2b":
                leaves = payload_digest(integrity, [payload])
                assert isinstance(leaves, bytes), "a blake2b digest is its leaves"
                done = self.machine.verify_tag(msg, bytes(meta), leaves)
            else:
                done = self.machine.unchecked(msg)
        except IntegrityError as exc:
            port.refuse(h.transfer_id, ErrorCode.INTEGRITY, str(exc))
            self._credit(slot)
            return
        trace.event("c_verified", tid=h.transfer_id, peer=self.peer)  # (before the verdict leaves: the sender's c_done follows it)
        port.send_ctrl(done)
        port.deliver(h.transfer_id, bytes(meta), payload, "fedrdma-e", lambda: port.release_slot(slot),
                     lambda: self.lend(slot))

    def lend(self, slot: int) -> bool:
        """May the application keep `slot`'s payload in place (any thread)? As policy.may_lend says."""
        with self._lent_lock:  # (what the other slot could still grow to: within this peer's part of the budget)
            if not may_lend(len(self._lent), self.machine.nslots, self.share.free_bytes, self.slots.slot_bytes(slot)):
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
            clear(self.slots.view(slot)[:written])
        self._credit(slot)

    def _credit(self, slot: int) -> None:
        """Grant `slot` to the peer again, under a new rkey, and tell it."""
        self._early.pop(slot, None)
        rkey = self.slots.grant(slot)
        self.port.send_ctrl(self.pool.granted(slot, rkey, self.pool.capacity[slot]))

    def keep(self, keep_slot: Callable[[str, int, NDArray[Any], int], None]) -> None:
        """The connection broke (resume.py): hand each slot that may hold the last bytes of a transfer to
        `keep_slot` (holding.Holdings.keep_slot) with its part of the budget. Such a slot was grown for a large
        transfer, or PLACED notes named one, and holds no transfer that arrived; the peer's WRITEs to it end."""
        base, lent = self.offer.offset_in_slot(0), self.lent_slots()
        for i in range(self.machine.nslots):
            state, capacity = self.machine.slot_state[i], self.pool.capacity[i]
            if i in lent or i in self.machine.held or state not in (P.SlotRecvState.EMPTY, P.SlotRecvState.NOTED) \
                    or (capacity <= self.slots.initial_payload_bytes and state is not P.SlotRecvState.NOTED):
                continue
            try:
                self.slots.revoke(i)
            except (ev.EasyVerbsError, OSError) as exc:  # (its queue pairs are down: closing the connection ends it)
                log.debug("%s: receive slot %d kept unrevoked: %s", self.peer, i, exc)
            nbytes = self.slots.slot_bytes(i)
            self.share.release(nbytes)  # (the holdings reserve it under the peer's name)
            keep_slot(self.peer, i, self.slots.array(i)[base:base + capacity], nbytes)

    # -- the pool follows the traffic -------------------------------------------------------------
    def on_grow(self, c: P.Ctrl) -> None:
        """The peer's transfer `c.transfer_id` needs room in slot `c.value`: grant it within what this peer may
        hold of the memory budget, or refuse the transfer (the old grant stands). The refusal names the request
        only: what is left of the budget, and how much the other peers hold, is not this peer's to know (this
        side's log says it, once per peer: buffers.Budget.reserve)."""
        port, slots, tid = self.port, self.slots, c.transfer_id
        try:
            capacity = self.pool.room_for(c)  # every field checked before anything is allocated
        except RemoteProtocolError as exc:
            port.refuse(tid, ErrorCode.PROTOCOL, str(exc))
            return
        slot = int(c.value)
        more = self.offer.offset_in_slot(capacity) - slots.slot_bytes(slot)
        if not self.share.reserve(more):
            port.refuse(tid, ErrorCode.TOO_LARGE, f"payload of {c.aux} bytes: growing receive slot {slot} to {capacity} "
                        f"bytes exceeds the receiver's limit for this peer")
            return
        try:
            rkey = slots.resize(slot, capacity)
        except (ev.EasyVerbsError, OSError) as exc:  # registered as it was
            self.share.release(more)
            port.refuse(tid, ErrorCode.TOO_LARGE, f"receive slot {slot} could not grow to {capacity} bytes: {exc}")
            return
        self._early.pop(slot, None)
        self.machine.regrant(slot)
        log.debug("%s: slot %d grew to %d bytes for transfer %d", self.peer, slot, capacity, tid)
        port.send_ctrl(self.pool.grown(slot, rkey, capacity, clock()))

    def on_return(self, c: P.Ctrl) -> None:
        """The peer handed a slot back that we asked for: shrink it and grant it again."""
        capacity = self.pool.on_return(c)  # every field checked; a RETURN we did not ask for ends the connection
        slot, slots = int(c.value), self.slots
        self._early.pop(slot, None)  # (a note's checksums over the old extent: granted anew below)
        self.machine.regrant(slot)
        before = slots.slot_bytes(slot)
        rkey = slots.resize(slot, capacity)
        self.share.release(before - slots.slot_bytes(slot))
        self.port.send_ctrl(self.pool.granted(slot, rkey, capacity))

    def tick(self, now: float) -> None:
        reclaim = self.pool.idle(now)
        if reclaim:
            log.info("%s: receive pool idle for %g s: asking slot(s) %s back to shrink them", self.peer,
                     self.pool.idle_s, [int(c.value) for c in reclaim])
        for c in reclaim:
            self.port.send_ctrl(c)
