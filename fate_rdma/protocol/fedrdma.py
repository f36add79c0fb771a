"""FedRDMA (paper §3.1): chunks with a header each, staged and reassembled, one ACK per chunk.

Beyond the paper: a window of W chunks in flight (W=1 is the paper's stop-and-wait), a no-progress
deadline and a total deadline, cancellation, and a checksum of every chunk (crc32c or a BLAKE2b MAC:
integrity.py).

Sender states (transitions in `FedRdmaSender.TRANSITIONS`; anything else is a LocalProtocolError):
    SENDING --all ACKed--> DONE;  SENDING --cancel--> CANCELLED;  SENDING --fail--> FAILED
(FedRDMA-E adds GROWING and PLACED: see fedrdma_e.py.)
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
from typing import Dict, List, Optional, Set

from ..errors import (IntegrityError, LocalProtocolError, PayloadTooLarge, RemoteProtocolError, TransferCancelled,
                      TransferTimeout)
from .chunking import Chunk, plan_chunks
from .frames import Header, HeaderKind
from .integrity import Integrity


class SendState(enum.Enum):
    GROWING = "growing"  # FedRDMA-E: the peer's slot is too small; waiting for it to grow (GROW sent)
    SENDING = "sending"
    PLACED = "placed"  # FedRDMA-E: every WRITE completed; waiting for the receiver's verdict (DONE)
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


class SendEvent(enum.Enum):
    ROOM = "room"  # FedRDMA-E: the receiver granted the slot with room for the payload
    COMPLETE = "complete"  # FedRDMA: the last chunk was ACKed
    PLACED = "placed"  # FedRDMA-E: the last WRITE completed
    CONFIRM = "confirm"  # FedRDMA-E: the receiver's DONE (verified and delivered)
    CANCEL = "cancel"
    FAIL = "fail"


#: states in which a transfer is over, for good or ill
TERMINAL = frozenset({SendState.DONE, SendState.CANCELLED, SendState.FAILED})


class _Deadlines:
    """No-progress and total deadlines, fed by the caller's clock."""

    def __init__(self, now: float, no_progress_s: float, total_s: float) -> None:
        self.start = self.last_progress = now
        self.no_progress_s, self.total_s = no_progress_s, total_s

    def progress(self, now: float) -> None:
        self.last_progress = now

    def check(self, now: float, tid: int) -> None:
        if now - self.last_progress > self.no_progress_s:
            raise TransferTimeout(f"transfer {tid}: no progress for {now - self.last_progress:.1f} s "
                                  f"(limit {self.no_progress_s:g} s): the peer is stuck, or its process was held "
                                  f"that long (code keeping its GIL; its log says so): raise "
                                  f"no_progress_timeout_s above its holds", tid)
        if now - self.start > self.total_s:
            raise TransferTimeout(f"transfer {tid}: not done after {now - self.start:.1f} s "
                                  f"(limit {self.total_s:g} s)", tid)


class SenderBase:
    """State shared by both modes' senders: the plan, the state table, deadlines and progress.

    Each subclass names its transitions in `TRANSITIONS`, {(state, event): next state}."""

    TRANSITIONS = {
        (SendState.SENDING, SendEvent.COMPLETE): SendState.DONE,
        (SendState.SENDING, SendEvent.CANCEL): SendState.CANCELLED,
        (SendState.SENDING, SendEvent.FAIL): SendState.FAILED,
    }

    def __init__(self, transfer_id: int, chunks: List[Chunk], window: int, now: float,
                 no_progress_s: float, total_s: float) -> None:
        if window < 1:
            raise LocalProtocolError(f"window must be >= 1, got {window}")
        self.transfer_id = transfer_id
        self.chunks = chunks
        self.total = sum(c.length for c in chunks)
        self.window = window
        self.state = SendState.SENDING
        self.error: Optional[BaseException] = None
        self._deadlines = _Deadlines(now, no_progress_s, total_s)
        self.done_bytes = 0
        self._in_flight: Set[int] = set()
        self._done: Set[int] = set()

    def _move(self, event: "SendEvent | str") -> None:
        ev = SendEvent(event)
        nxt = self.TRANSITIONS.get((self.state, ev))
        if nxt is None:
            raise LocalProtocolError(f"transfer {self.transfer_id}: {ev.value!r} not allowed in state "
                                     f"{self.state.value}")
        self.state = nxt

    @property
    def finished(self) -> bool:
        """No more chunks to post or complete (DONE, PLACED, CANCELLED or FAILED)."""
        return self.state not in (SendState.SENDING, SendState.GROWING)

    @property
    def settled(self) -> bool:
        """The transfer is over: DONE, CANCELLED or FAILED."""
        return self.state in TERMINAL

    def cancel(self, reason: str = "cancelled by sender") -> None:
        if self.state not in TERMINAL:
            self._move(SendEvent.CANCEL)
            self.error = TransferCancelled(f"transfer {self.transfer_id}: {reason}", self.transfer_id)

    def fail(self, exc: BaseException) -> None:
        if self.state not in TERMINAL:
            self._move(SendEvent.FAIL)
            self.error = exc

    def tick(self, now: float) -> None:
        """Check the deadlines; a passed deadline fails the transfer (and is raised)."""
        if self.state in (SendState.SENDING, SendState.GROWING):
            try:
                self._deadlines.check(now, self.transfer_id)
            except TransferTimeout as exc:
                self.fail(exc)
                raise

    def _chunk_done(self, seq: int, now: float) -> bool:
        """Mark a chunk done; False for a duplicate. Unknown chunks are the peer's fault."""
        if not 0 <= seq < len(self.chunks):
            raise RemoteProtocolError(f"transfer {self.transfer_id}: completion for chunk {seq} of {len(self.chunks)}")
        if seq in self._done:
            return False
        if seq not in self._in_flight:
            raise RemoteProtocolError(f"transfer {self.transfer_id}: chunk {seq} completed but was never sent")
        self._in_flight.discard(seq)
        self._done.add(seq)
        self.done_bytes += self.chunks[seq].length
        self._deadlines.progress(now)
        if len(self._done) == len(self.chunks):
            self._all_chunks_done()
        return True

    def _all_chunks_done(self) -> None:
        self._move(SendEvent.COMPLETE)


class FedRdmaSender(SenderBase):
    """Posts chunks in order, at most `window` un-ACKed."""

    def __init__(self, transfer_id: int, total: int, chunk_bytes: int, window: int, now: float,
                 first_chunk_bytes: int = 0, no_progress_s: float = 30.0, total_s: float = 3600.0) -> None:
        super().__init__(transfer_id, plan_chunks(total, chunk_bytes, first_chunk_bytes), window, now,
                         no_progress_s, total_s)
        self._next = 0

    def next_chunks(self, credit: Optional[int] = None) -> List[Chunk]:
        """Chunks to post now (the window, and `credit` free staging buffers of the peer, permitting);
        each becomes in flight."""
        out: List[Chunk] = []
        limit = len(self.chunks) if credit is None else credit
        while (self.state is SendState.SENDING and self._next < len(self.chunks) and len(self._in_flight) < self.window
               and len(out) < limit):
            c = self.chunks[self._next]
            self._in_flight.add(c.seq)
            self._next += 1
            out.append(c)
        return out

    def header(self, chunk: Chunk, meta_len: int, crc: Optional[int], meta_crc: int = 0) -> Header:
        return Header(HeaderKind.CHUNK, self.transfer_id, chunk.seq, len(self.chunks), chunk.offset, chunk.length,
                      meta_len if chunk.seq == 0 else 0, self.total, crc or 0, meta_crc if chunk.seq == 0 else 0,
                      crc is not None)

    def on_ack(self, seq: int, now: float) -> bool:
        """An ACK arrived; returns False for a duplicate ACK (ignored)."""
        if self.state is not SendState.SENDING:
            return False
        return self._chunk_done(seq, now)


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """Chunk bytes to copy into the transfer's destination at `offset`; then ACK `seq`."""

    transfer_id: int
    seq: int
    offset: int
    first: bool  # the first chunk seen of this transfer: allocate the destination (hdr.total) first
    complete: bool  # the last missing chunk: the transfer is whole


@dataclasses.dataclass
class _Partial:
    total: int
    nchunks: int
    got: Set[int]
    last_progress: float
    meta_len: int
    got_bytes: int = 0
    #: byte ranges received so far, sorted by offset: chunks must tile the payload exactly once
    starts: List[int] = dataclasses.field(default_factory=list)
    ends: List[int] = dataclasses.field(default_factory=list)

    def place(self, offset: int, length: int) -> bool:
        """Record [offset, offset+length); False if it overlaps a range already received."""
        if length == 0:
            return True
        i = bisect.bisect_right(self.starts, offset)
        if i > 0 and self.ends[i - 1] > offset:
            return False
        if i < len(self.starts) and self.starts[i] < offset + length:
            return False
        self.starts.insert(i, offset)
        self.ends.insert(i, offset + length)
        return True


class RecvState(enum.Enum):
    """A FedRDMA transfer as the receiver follows it."""

    NEW = "new"  # no chunk of it seen (never stored: an id not in the receiver's table is NEW)
    ARRIVING = "arriving"  # chunks arrive and are placed; some are missing
    DONE = "done"  # every chunk arrived: delivered
    DROPPED = "dropped"  # cancelled, refused or expired: its chunks are ACKed, never placed


class RecvEvent(enum.Enum):
    CHUNK = "chunk"  # a new chunk placed, more missing (peer)
    LAST = "last"  # the last missing chunk placed (peer)
    DUPLICATE = "duplicate"  # a chunk seen before, or of a transfer that is over: re-ACKed (peer)
    CANCEL = "cancel"  # the sender's CANCEL (peer), or this side gave it up
    REFUSE = "refuse"  # its chunk failed a check, or this side refused it (memory budget): ERROR sent
    EXPIRE = "expire"  # no chunk for no_progress_s: ERROR sent


#: events the peer's frames cause: one not in the table is the peer's fault (RemoteProtocolError), any
#: other this side's (LocalProtocolError)
_PEER_EVENTS = frozenset({RecvEvent.CHUNK, RecvEvent.LAST, RecvEvent.DUPLICATE, RecvEvent.CANCEL})


class FedRdmaReceiver:
    """Reassembly bookkeeping for every transfer arriving on one connection.

    `on_chunk` validates a chunk against what is known of its transfer and says where it goes; a
    duplicate (a resent chunk) answers None: re-ACK it, do not copy it again. `integrity`: the checksum
    this receiver requires of every chunk (default crc32c, or none when `verify_crc` is false).

    Receiver states, per transfer (`TRANSITIONS`; anything else is a protocol error):
        NEW --chunk--> ARRIVING --chunk or duplicate--> ARRIVING --last chunk--> DONE;  NEW --last chunk--> DONE
        NEW or ARRIVING --cancel, refuse--> DROPPED;  ARRIVING --expire--> DROPPED
        DONE --refuse (whole in one chunk, refused before delivery)--> DROPPED
        DONE or DROPPED --duplicate, cancel--> unchanged (a resent chunk, a CANCEL that crossed the last ACK)
    """

    TRANSITIONS = {
        (RecvState.NEW, RecvEvent.CHUNK): RecvState.ARRIVING,
        (RecvState.NEW, RecvEvent.LAST): RecvState.DONE,
        (RecvState.NEW, RecvEvent.CANCEL): RecvState.DROPPED,
        (RecvState.NEW, RecvEvent.REFUSE): RecvState.DROPPED,
        (RecvState.ARRIVING, RecvEvent.CHUNK): RecvState.ARRIVING,
        (RecvState.ARRIVING, RecvEvent.DUPLICATE): RecvState.ARRIVING,
        (RecvState.ARRIVING, RecvEvent.LAST): RecvState.DONE,
        (RecvState.ARRIVING, RecvEvent.CANCEL): RecvState.DROPPED,
        (RecvState.ARRIVING, RecvEvent.REFUSE): RecvState.DROPPED,
        (RecvState.ARRIVING, RecvEvent.EXPIRE): RecvState.DROPPED,
        (RecvState.DONE, RecvEvent.DUPLICATE): RecvState.DONE,
        (RecvState.DONE, RecvEvent.CANCEL): RecvState.DONE,
        (RecvState.DONE, RecvEvent.REFUSE): RecvState.DROPPED,
        (RecvState.DROPPED, RecvEvent.DUPLICATE): RecvState.DROPPED,
        (RecvState.DROPPED, RecvEvent.CANCEL): RecvState.DROPPED,
    }

    def __init__(self, max_total_bytes: int, no_progress_s: float = 30.0, verify_crc: bool = True,
                 integrity: "Integrity | None" = None) -> None:
        self.max_total_bytes = max_total_bytes
        self.no_progress_s = no_progress_s
        self.integrity = integrity or Integrity("crc32c" if verify_crc else "none")
        self._partial: Dict[int, _Partial] = {}
        #: each transfer seen and its state (over ones too: their late chunks are duplicates)
        self._state: Dict[int, RecvState] = {}

    @property
    def verify_crc(self) -> bool:
        return self.integrity.on

    def state(self, transfer_id: int) -> RecvState:
        return self._state.get(transfer_id, RecvState.NEW)

    def _move(self, transfer_id: int, event: RecvEvent) -> None:
        st = self.state(transfer_id)
        nxt = self.TRANSITIONS.get((st, event))
        if nxt is None:
            err = RemoteProtocolError if event in _PEER_EVENTS else LocalProtocolError
            raise err(f"transfer {transfer_id}: {event.value!r} not allowed in state {st.value}")
        self._state[transfer_id] = nxt
        if nxt is not RecvState.ARRIVING:
            self._partial.pop(transfer_id, None)

    def on_chunk(self, hdr: Header, data: memoryview, now: float, meta: bytes = b"") -> Optional[Placed]:
        """`meta`: the metadata that arrived with chunk 0 (its checksum covers it)."""
        tid = hdr.transfer_id
        if hdr.kind is not HeaderKind.CHUNK:
            raise RemoteProtocolError(f"transfer {tid}: FedRDMA expects CHUNK headers, got {hdr.kind.name}")
        if len(data) != hdr.length:
            raise RemoteProtocolError(f"transfer {tid} chunk {hdr.seq}: header says {hdr.length} bytes, "
                                      f"{len(data)} arrived")
        if self.state(tid) in (RecvState.DONE, RecvState.DROPPED):
            self._move(tid, RecvEvent.DUPLICATE)  # a late duplicate of a finished or dropped transfer
            return None
        try:  # integrity is the receiver's decision, not the sender's
            self.integrity.require(hdr, f"transfer {tid} chunk {hdr.seq}")
        except RemoteProtocolError:
            self._move(tid, RecvEvent.REFUSE)
            raise
        if not self.integrity.verify(hdr, meta, self.integrity.chunk_digest([data])):
            self._move(tid, RecvEvent.REFUSE)
            raise IntegrityError(f"transfer {tid} chunk {hdr.seq}: {self.integrity.kind} mismatch "
                                 f"(payload, metadata or header fields)", tid)
        p = self._partial.get(tid)
        first = p is None
        if p is None:
            if hdr.total > self.max_total_bytes:
                self._move(tid, RecvEvent.REFUSE)
                raise PayloadTooLarge(f"transfer {tid}: {hdr.total} bytes exceed this receiver's "
                                      f"limit of {self.max_total_bytes}", tid)
            p = _Partial(hdr.total, hdr.nchunks, set(), now, 0)
        elif (p.total, p.nchunks) != (hdr.total, hdr.nchunks):
            self._move(tid, RecvEvent.REFUSE)
            raise RemoteProtocolError(f"transfer {tid}: chunk {hdr.seq} disagrees on size "
                                      f"({hdr.total}/{hdr.nchunks} vs {p.total}/{p.nchunks})")
        if hdr.seq in p.got:
            self._move(tid, RecvEvent.DUPLICATE)
            return None
        if not p.place(hdr.offset, hdr.length):
            self._move(tid, RecvEvent.REFUSE)
            raise RemoteProtocolError(f"transfer {tid} chunk {hdr.seq}: bytes [{hdr.offset}, "
                                      f"{hdr.offset + hdr.length}) overlap a chunk already received")
        p.got.add(hdr.seq)
        p.got_bytes += hdr.length
        p.last_progress = now
        complete = len(p.got) == p.nchunks
        if complete and p.got_bytes != p.total:  # no overlaps, so the chunks cover exactly got_bytes of the payload
            self._move(tid, RecvEvent.REFUSE)
            raise RemoteProtocolError(f"transfer {tid}: its {p.nchunks} chunks cover {p.got_bytes} of "
                                      f"{p.total} bytes (a gap): not delivered")
        self._move(tid, RecvEvent.LAST if complete else RecvEvent.CHUNK)
        if not complete:
            self._partial[tid] = p
        return Placed(tid, hdr.seq, hdr.offset, first, complete)

    def received_bytes(self, transfer_id: int) -> int:
        """Payload bytes of a transfer in progress that have arrived so far (0 when none is)."""
        p = self._partial.get(transfer_id)
        return 0 if p is None else p.got_bytes

    def held_prefix(self, transfer_id: int) -> int:
        """Bytes from the start of a transfer in progress that have all arrived, verified (what may be resumed)."""
        p = self._partial.get(transfer_id)
        end = 0
        if p is not None:
            for lo, hi in zip(p.starts, p.ends):
                if lo != end:
                    break
                end = hi
        return end

    def cancel(self, transfer_id: int) -> bool:
        """The sender cancelled the transfer (its CANCEL): forget it. True if it was in progress."""
        arriving = self.state(transfer_id) is RecvState.ARRIVING
        self._move(transfer_id, RecvEvent.CANCEL)
        return arriving

    def refuse(self, transfer_id: int) -> None:
        """This side refused the transfer after its chunk was placed (the memory budget): forget it."""
        self._move(transfer_id, RecvEvent.REFUSE)

    def expired(self, now: float) -> List[int]:
        """Partial transfers with no chunk for `no_progress_s`: dropped, ids returned."""
        dead = [tid for tid, p in self._partial.items() if now - p.last_progress > self.no_progress_s]
        for tid in dead:
            self._move(tid, RecvEvent.EXPIRE)
        return dead
