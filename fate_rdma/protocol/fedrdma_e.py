"""FedRDMA-E (paper §3.2): a pool of pre-registered receive slots, chunks written back to front
straight to their final offsets, one header.

Slot layout at the receiver: [HEADER (64 B)][metadata (meta_cap B)][payload (slot_payload_bytes)].
The sender writes chunks n-1 .. 1 to their final offsets, then chunk 0 together with the header and
metadata as one WRITE_WITH_IMM (its immediate names the slot: packing.py). The receiver
learns of the transfer from that completion alone: no staging copy, no reassembly. The consumer
gets a view of the slot and releases it, which sends a CREDIT back; the sender's `SlotRing` pointer
moves to the next slot after each transfer and wraps around, waiting for credit when the next slot
is still held.

Beyond the paper: W chunks in flight (W=1 is stop-and-wait), a whole-payload checksum (crc32c or a
BLAKE2b MAC: integrity.py), deadlines, cancellation, and a refusal of transfer ids seen before (a
replayed slot write). With several QPs, placement order across QPs is not guaranteed, so the header chunk
waits until every other chunk has completed (RC completion = placed at the responder).

Slots follow the traffic (pool.py): a payload larger than the slot's current grant starts in
GROWING, and the GROW it sends is answered by a CREDIT with room (SENDING) or refused (FAILED).

Sender states (`FedRdmaESender.TRANSITIONS`; anything else is a LocalProtocolError):
    GROWING --the receiver granted room--> SENDING;  GROWING --cancel / fail / deadline--> CANCELLED / FAILED
    SENDING --last WRITE completed--> PLACED --receiver's DONE--> DONE
    SENDING --DONE (overtook the last WRITE's completion; noted)--> SENDING, then --placed--> DONE
    SENDING or PLACED --cancel--> CANCELLED;  SENDING or PLACED --fail / deadline--> FAILED
The receiver answers DONE only after its checksum, so PLACED (bytes in the slot) is not success:
a PLACED transfer that the receiver does not confirm within the no-progress deadline fails.

Receiver: each slot's transfer in `FedRdmaEReceiver.TRANSITIONS` (its grants in pool.py); PLACED notes on
the way (placed.py) let it checksum a transfer's placed blocks before the header arrives.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Deque, List, Optional, Set

from ..errors import IntegrityError, LocalProtocolError, PayloadTooLarge, RemoteProtocolError, TransferTimeout
from .chunking import Chunk, plan_chunks
from .fedrdma import TERMINAL, SendEvent, SenderBase, SendState
from .frames import HEADER, MAX_META, Ctrl, CtrlKind, Header, HeaderKind, decode_header
from .integrity import Integrity
from .packing import PlacedNote, decode_placed, encode_placed, make_imm, split_imm
from .placed import NoteBook, NoteSchedule, NoteWork, serves
from .pool import GrantState, ReceivePool


def slot_payload_offset(meta_cap: int) -> int:
    return HEADER.size + meta_cap


class FedRdmaESender(SenderBase):
    """Back-to-front WRITEs into one slot of the peer, header chunk last; DONE on the receiver's verdict."""

    TRANSITIONS = {
        (SendState.GROWING, SendEvent.ROOM): SendState.SENDING,
        (SendState.GROWING, SendEvent.CANCEL): SendState.CANCELLED,
        (SendState.GROWING, SendEvent.FAIL): SendState.FAILED,
        (SendState.SENDING, SendEvent.PLACED): SendState.PLACED,
        (SendState.SENDING, SendEvent.CONFIRM): SendState.SENDING,  # DONE overtook the last completion
        (SendState.PLACED, SendEvent.CONFIRM): SendState.DONE,
        (SendState.SENDING, SendEvent.CANCEL): SendState.CANCELLED,
        (SendState.PLACED, SendEvent.CANCEL): SendState.CANCELLED,
        (SendState.SENDING, SendEvent.FAIL): SendState.FAILED,
        (SendState.PLACED, SendEvent.FAIL): SendState.FAILED,
    }

    def __init__(self, transfer_id: int, seq16: int, slot: int, total: int, chunk_bytes: int, window: int,
                 now: float, slot_payload_bytes: int, first_chunk_bytes: int = 0, header_after_all: bool = False,
                 no_progress_s: float = 30.0, total_s: float = 3600.0, room_bytes: Optional[int] = None,
                 placed_notes: bool = False) -> None:
        """`slot_payload_bytes`: the most the peer's slot takes; `room_bytes`: what its grant holds now
        (None: as much). A larger payload starts GROWING: send `ring.grow(...)`, then `on_room`.
        `placed_notes`: the peer takes PLACED notes and this transfer's checksum is one they serve
        (placed.py): `placed_note` says when one goes."""
        if total > slot_payload_bytes:
            raise PayloadTooLarge(f"payload of {total} bytes exceeds the peer's FedRDMA-E receive slot of "
                                  f"{slot_payload_bytes} bytes", transfer_id)
        super().__init__(transfer_id, plan_chunks(total, chunk_bytes, first_chunk_bytes, small_last=True), window,
                         now, no_progress_s, total_s)
        self.slot = slot
        self.imm = make_imm(slot, seq16)
        self.header_after_all = header_after_all
        self._order = list(range(len(self.chunks) - 1, -1, -1))  # back to front; chunk 0 last
        self._tail = len(self.chunks)  # placed_from: chunks _tail .. n-1 have completed
        #: set while the checksum that the header carries is still being computed
        self.hold_header = False
        #: the lowest payload offset from which every byte is final (a payload still being copied in, back to
        #: front, by its sender: transfer.Fill); a chunk goes only once all of its bytes are
        self.ready_from = 0
        self._confirmed = False  # the receiver's DONE arrived before our last WRITE completed
        self._placed_at: Optional[float] = None
        self._notes = NoteSchedule(self.total, self.chunks[1].offset if len(self.chunks) > 1 else None) \
            if placed_notes and NoteSchedule.applies_to(self.total) else None
        if room_bytes is not None and self.total > room_bytes:
            self.state = SendState.GROWING

    def on_room(self, capacity: int, now: float) -> None:
        """The receiver granted the slot with room for `capacity` payload bytes."""
        if capacity < self.total:
            raise RemoteProtocolError(f"transfer {self.transfer_id}: the slot grew to {capacity} bytes, "
                                      f"the payload has {self.total}")
        self._move(SendEvent.ROOM)
        self._deadlines.progress(now)

    def next_chunks(self) -> List[Chunk]:
        out = []
        while self.state is SendState.SENDING and self._order and len(self._in_flight) < self.window:
            seq = self._order[0]
            if self.chunks[seq].offset < self.ready_from:
                break  # its bytes are still being copied in (chunks go back to front, so all later ones too)
            if seq == 0 and (self.hold_header or (self.header_after_all and len(self._done) < len(self.chunks) - 1)):
                # chunk 0 (with the header) only once its checksum is known and, with several QPs, every other
                # chunk is placed
                break
            self._order.pop(0)
            self._in_flight.add(seq)
            out.append(self.chunks[seq])
        return out

    def others_done(self) -> bool:
        """Has every chunk but chunk 0 (which goes with the header) completed?"""
        return len(self._done) >= len(self.chunks) - 1

    def placed_from(self) -> Optional[int]:
        """The lowest payload offset from which every byte to the payload's end is placed (the WRITEs of
        chunks 1 .. n-1 from there on have completed: chunks go back to front), or None while the last
        chunk is not; chunk 0, which carries the header, never counts. What a PLACED note tells the
        receiver, so that it can checksum those bytes before the header arrives."""
        while self._tail > 1 and self._tail - 1 in self._done:
            self._tail -= 1
        return self.chunks[self._tail].offset if self._tail < len(self.chunks) else None

    def placed_note(self) -> Optional[Ctrl]:
        """The PLACED note to send now, if this transfer notes and one is due (placed.NoteSchedule); none once
        the header is posted (it arrives after the header anyway)."""
        if self._notes is None or self.header_posted:
            return None
        x = self._notes.due(self.placed_from())
        return None if x is None else encode_placed(PlacedNote(self.transfer_id, self.slot, self.total, x))

    def header(self, meta_len: int, crc: Optional[int], meta_crc: int = 0) -> Header:
        return Header(HeaderKind.SLOT, self.transfer_id, 0, len(self.chunks), 0, self.chunks[0].length, meta_len,
                      self.total, crc or 0, meta_crc, crc is not None)

    def on_write_complete(self, seq: int, now: float) -> bool:
        """A WRITE of chunk `seq` completed (placed at the peer); False for one that no longer counts."""
        if self.state is not SendState.SENDING:
            return False
        return self._chunk_done(seq, now)

    def _all_chunks_done(self) -> None:
        self._move(SendEvent.PLACED)
        self._placed_at = self._deadlines.last_progress
        if self._confirmed:
            self._move(SendEvent.CONFIRM)

    def on_confirm(self) -> bool:
        """The receiver's DONE: it verified and delivered the transfer. True if that made it DONE;
        False if it arrived before the last WRITE's completion (it then completes on PLACED)."""
        if self.state in TERMINAL:
            return False
        if self.state is SendState.SENDING and (0 not in self._in_flight and 0 not in self._done):
            raise RemoteProtocolError(f"transfer {self.transfer_id}: DONE before its header was written")
        self._move(SendEvent.CONFIRM)
        if self.state is SendState.SENDING:
            self._confirmed = True
            return False
        return True

    def tick(self, now: float) -> None:
        if self.state is SendState.GROWING and now - self._deadlines.last_progress > self._deadlines.no_progress_s:
            exc = TransferTimeout(f"transfer {self.transfer_id}: the receiver did not answer its GROW (room for "
                                  f"{self.total} bytes) within {self._deadlines.no_progress_s:g} s", self.transfer_id)
            self.fail(exc)
            raise exc
        if self.state is SendState.PLACED and self._placed_at is not None \
                and now - self._placed_at > self._deadlines.no_progress_s:
            exc = TransferTimeout(f"transfer {self.transfer_id}: placed, but the receiver did not confirm it within "
                                  f"{self._deadlines.no_progress_s:g} s", self.transfer_id)
            self.fail(exc)
            raise exc
        super().tick(now)

    @property
    def placed(self) -> bool:
        return self.state is SendState.PLACED

    @property
    def header_posted(self) -> bool:
        return 0 in self._in_flight or 0 in self._done


@dataclasses.dataclass(frozen=True, slots=True)
class SlotMessage:
    """A complete FedRDMA-E transfer sitting in receive slot `slot`; `noted`: PLACED notes under the slot's
    grant were of this transfer (the receiver's early digests are its)."""

    slot: int
    header: Header
    meta_offset: int
    payload_offset: int
    noted: bool = False


class SlotRecvState(enum.Enum):
    """What a receive slot holds, as the receiver follows its transfers (its grants: pool.GrantState)."""

    EMPTY = "empty"  # granted; no transfer of the grant known yet
    NOTED = "noted"  # PLACED notes named a transfer: its placed blocks are being digested
    CHECKING = "checking"  # the header arrived: the transfer is whole in the slot, its checksum is checked
    HELD = "held"  # verified, DONE sent, delivered: the consumer holds it until it releases it


class SlotRecvEvent(enum.Enum):
    NOTE = "note"  # a PLACED note accepted (peer)
    ARRIVE = "arrive"  # the header's WRITE_WITH_IMM, accepted (peer)
    REFUSE = "refuse"  # the header's WRITE_WITH_IMM, refused for its fields: granted again (peer)
    VERIFY = "verify"  # the checksum matched (or there is none): DONE, delivered
    MISMATCH = "mismatch"  # it did not: ERROR, granted again
    RELEASE = "release"  # the consumer released it: granted again
    REGRANT = "regrant"  # the slot grew or shrank (GROW, RETURN): granted anew, its notes void


#: events the peer's frames cause: one not in the table is the peer's fault (RemoteProtocolError), any
#: other this side's (LocalProtocolError)
_PEER_EVENTS = frozenset({SlotRecvEvent.NOTE, SlotRecvEvent.ARRIVE, SlotRecvEvent.REFUSE})

#: transfer ids a FedRDMA-E receiver remembers: a sender's ids count up, so one older than the last
#: REPLAY_WINDOW seen, or one of them, is a replay (ids of one connection arrive nearly in order)
REPLAY_WINDOW = 4096


class FedRdmaEReceiver:
    """Validates WRITE_WITH_IMM arrivals and PLACED notes against the slot pool (`pool`: each slot's grant),
    and follows each slot's transfer (`slot_state`; transitions in TRANSITIONS, anything else a protocol
    error). `integrity`: the checksum this receiver requires (default crc32c, or none when `verify_crc` is
    false); `slot_payload_bytes`: the most a slot grows to; `initial_payload_bytes` (default: that much),
    `idle_s`, `now`, `rkeys`: as ReceivePool takes them.

    Slot states (SlotRecvState):
        EMPTY --note--> NOTED --note--> NOTED;  EMPTY or NOTED --header accepted--> CHECKING
        CHECKING --checksum matched--> HELD --released--> EMPTY;  CHECKING --mismatch--> EMPTY
        EMPTY or NOTED --header refused (its fields)--> EMPTY;  EMPTY or NOTED --grown or shrunk--> EMPTY
    A header for a slot in CHECKING or HELD is the peer writing memory the consumer holds."""

    TRANSITIONS = {
        (SlotRecvState.EMPTY, SlotRecvEvent.NOTE): SlotRecvState.NOTED,
        (SlotRecvState.NOTED, SlotRecvEvent.NOTE): SlotRecvState.NOTED,
        (SlotRecvState.EMPTY, SlotRecvEvent.ARRIVE): SlotRecvState.CHECKING,
        (SlotRecvState.NOTED, SlotRecvEvent.ARRIVE): SlotRecvState.CHECKING,
        (SlotRecvState.EMPTY, SlotRecvEvent.REFUSE): SlotRecvState.EMPTY,
        (SlotRecvState.NOTED, SlotRecvEvent.REFUSE): SlotRecvState.EMPTY,
        (SlotRecvState.CHECKING, SlotRecvEvent.VERIFY): SlotRecvState.HELD,
        (SlotRecvState.CHECKING, SlotRecvEvent.MISMATCH): SlotRecvState.EMPTY,
        (SlotRecvState.HELD, SlotRecvEvent.RELEASE): SlotRecvState.EMPTY,
        (SlotRecvState.EMPTY, SlotRecvEvent.REGRANT): SlotRecvState.EMPTY,
        (SlotRecvState.NOTED, SlotRecvEvent.REGRANT): SlotRecvState.EMPTY,
    }

    def __init__(self, nslots: int, slot_payload_bytes: int, meta_cap: int = MAX_META, verify_crc: bool = True,
                 integrity: Optional[Integrity] = None, initial_payload_bytes: Optional[int] = None,
                 idle_s: float = 0.0, now: float = 0.0, rkeys: Optional[List[int]] = None) -> None:
        if meta_cap > MAX_META:
            raise LocalProtocolError(f"meta_cap {meta_cap} exceeds {MAX_META}")
        self.nslots, self.slot_payload_bytes, self.meta_cap = nslots, slot_payload_bytes, meta_cap
        self.integrity = integrity or Integrity("crc32c" if verify_crc else "none")
        self.pool = ReceivePool(nslots, slot_payload_bytes, initial_payload_bytes, idle_s, now, rkeys)
        self.slot_state = [SlotRecvState.EMPTY] * nslots
        self.notes = NoteBook()
        self._seen: Set[int] = set()
        self._seen_order: Deque[int] = collections.deque()
        self._forgotten = -1  # the largest id that left the window

    def _move(self, slot: int, event: SlotRecvEvent) -> None:
        nxt = self.TRANSITIONS.get((self.slot_state[slot], event))
        if nxt is None:
            err = RemoteProtocolError if event in _PEER_EVENTS else LocalProtocolError
            raise err(f"slot {slot}: {event.value!r} not allowed in state {self.slot_state[slot].value}")
        self.slot_state[slot] = nxt
        if nxt is not SlotRecvState.NOTED:
            self.notes.forget(slot)

    @property
    def verify_crc(self) -> bool:
        return self.integrity.on

    def seen(self, tid: int) -> bool:
        """Has transfer `tid` arrived before (or left the replay window)?"""
        return tid in self._seen or tid <= self._forgotten

    def _replay_check(self, tid: int, slot: int) -> None:
        if self.seen(tid):
            raise RemoteProtocolError(f"slot {slot}: transfer {tid} arrived before (a replayed slot write)")
        self._seen.add(tid)
        self._seen_order.append(tid)
        if len(self._seen_order) > REPLAY_WINDOW:
            old = self._seen_order.popleft()
            self._seen.discard(old)
            self._forgotten = max(self._forgotten, old)

    @property
    def slot_bytes(self) -> int:
        """A slot's bytes at its largest."""
        return slot_payload_offset(self.meta_cap) + self.slot_payload_bytes

    def on_placed(self, c: Ctrl) -> Optional[NoteWork]:
        """The sender's PLACED note (placed.py): every field checked against the slot's grant, then the blocks
        to digest now, or None where the note starts nothing (dropped)."""
        note = decode_placed(c)
        slot, total, start = note.slot, note.total, note.placed_from
        if slot >= self.nslots or total > self.pool.capacity[slot] or start > total:
            raise RemoteProtocolError(f"PLACED note for slot {slot} ({start} of {total} bytes) does not fit this "
                                      f"side's pool")
        if not self.verify_crc or not serves(self.integrity.kind) or self.seen(note.transfer_id) \
                or self.slot_state[slot] in (SlotRecvState.CHECKING, SlotRecvState.HELD):
            return None  # (a slot that holds a transfer: a note of the one before, its header overtook it)
        # (the first note under the slot's grant names its transfer)
        work = self.notes.take(slot, note.transfer_id, total, start)
        self._move(slot, SlotRecvEvent.NOTE)
        return work

    def on_write_imm(self, imm: int, slot_header: memoryview, now: float = 0.0) -> SlotMessage:
        """The header WRITE_WITH_IMM completed: the whole transfer is in the slot. A header whose fields
        are refused leaves the slot to be granted again (`refuse`)."""
        slot, _ = split_imm(imm)
        if slot >= self.nslots:
            raise RemoteProtocolError(f"WRITE_WITH_IMM names slot {slot}; this side has {self.nslots}")
        if self.pool.state[slot] is GrantState.HELD:
            raise RemoteProtocolError(f"peer wrote slot {slot} while it was still held by the consumer")
        hdr = decode_header(bytes(slot_header[:HEADER.size]))
        if hdr.kind is not HeaderKind.SLOT:
            raise RemoteProtocolError(f"slot {slot}: expected a SLOT header, got {hdr.kind.name}")
        # integrity is the receiver's decision, not the sender's
        self.integrity.require(hdr, f"slot {slot}: transfer {hdr.transfer_id}")
        room = self.pool.capacity[slot]  # as granted: the sender wrote within this, or the NIC refused it
        if hdr.total > room or hdr.meta_len > self.meta_cap:
            raise RemoteProtocolError(f"slot {slot}: header claims {hdr.total} payload / {hdr.meta_len} metadata "
                                      f"bytes; the slot holds {room} / {self.meta_cap}")
        self._replay_check(hdr.transfer_id, slot)
        noted = self.notes.noted(slot) == (hdr.transfer_id, hdr.total)
        self._move(slot, SlotRecvEvent.ARRIVE)
        self.pool.arrive(slot, now)
        return SlotMessage(slot, hdr, HEADER.size, slot_payload_offset(self.meta_cap), noted)

    def refuse(self, slot: int) -> None:
        """The header in `slot` was refused for its fields (on_write_imm raised): the slot is granted again."""
        self._move(slot, SlotRecvEvent.REFUSE)
        self.pool.refuse(slot)

    def verify(self, msg: SlotMessage, meta_crc: int, payload_crc: int) -> Ctrl:
        """crc32c: compare the checksums the caller computed over the slot with the header's; on
        mismatch the slot is freed and IntegrityError raised. (Computing them is I/O-free but
        parallel, so the caller does it.) Returns the DONE to send."""
        h = msg.header
        if self.verify_crc and (payload_crc != h.crc or meta_crc != h.meta_crc):
            self._mismatch(msg)
        return self._verified(msg)

    def verify_tag(self, msg: SlotMessage, meta: bytes, leaf_digests: bytes) -> Ctrl:
        """blake2b, blake3, xxh3: check the header's tag against the metadata and the payload's block digests, which
        the caller computed in parallel (channel/checksum.py); on mismatch as `verify`."""
        if not self.integrity.verify(msg.header, meta, leaf_digests):
            self._mismatch(msg)
        return self._verified(msg)

    def unchecked(self, msg: SlotMessage) -> Ctrl:
        """A receiver without a checksum takes the transfer as it is: the DONE to send."""
        if self.integrity.on:
            raise LocalProtocolError(f"slot {msg.slot}: a {self.integrity.kind} receiver delivers checked transfers "
                                     f"only")
        return self._verified(msg)

    def _verified(self, msg: SlotMessage) -> Ctrl:
        self._move(msg.slot, SlotRecvEvent.VERIFY)
        return Ctrl(CtrlKind.DONE, msg.header.transfer_id)

    def _mismatch(self, msg: SlotMessage) -> None:
        h = msg.header
        self._move(msg.slot, SlotRecvEvent.MISMATCH)
        self.pool.release(msg.slot, self.pool.last_active)  # never delivered: granted again as it is
        raise IntegrityError(f"transfer {h.transfer_id} (slot {msg.slot}): {self.integrity.kind} mismatch "
                             f"(payload, metadata or header fields)", h.transfer_id)

    def release(self, slot: int, now: float = 0.0) -> None:
        if not 0 <= slot < self.nslots:
            raise LocalProtocolError(f"slot {slot} released twice or never held")
        self._move(slot, SlotRecvEvent.RELEASE)
        self.pool.release(slot, now)

    def regrant(self, slot: int) -> None:
        """The slot grew or shrank (pool.grown, pool.on_return): granted anew, so notes taken under the old
        grant are void."""
        self._move(slot, SlotRecvEvent.REGRANT)

    @property
    def held(self) -> Set[int]:
        return set(self.pool.held)
