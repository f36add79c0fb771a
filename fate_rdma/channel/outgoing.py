"""What the engine keeps of a transfer it sends, and the names of its requests and work requests."""
from __future__ import annotations

import concurrent.futures
import enum
import time
from typing import TYPE_CHECKING, Optional, TypedDict, Union

from .. import trace
from ..protocol.fedrdma import FedRdmaSender
from ..protocol.fedrdma_e import FedRdmaESender
from ..protocol.integrity import Digest, Integrity
from ..protocol.policy import Mode
from .leaving import LeavingDigest
from .transfer import Payload, TransferFuture

if TYPE_CHECKING:
    from .resume import Pending

#: a transfer's sending machine: FedRDMA's (staged chunks) or FedRDMA-E's (one receive slot)
Machine = Union[FedRdmaSender, FedRdmaESender]


class Where(TypedDict):
    """What a connection's transfers go over, for the trace (`bench timeline` names it on every row)."""

    provider: str
    emulated: bool
    path: str


class Request(enum.Enum):
    SEND = "send"
    CANCEL = "cancel"
    RELEASE = "release"
    STOP = "stop"
    ASK = "ask"  # what does the peer hold of a transfer to resume (CTRL RESUME)
    ANSWER = "answer"  # what this side holds of the peer's (CTRL RESUMED)
    BREAK = "break"  # end the connection as if its path had broken (the peer resumed on a new one)


class Wr(enum.Enum):
    """What a signalled send WR was, so its completion goes to the right place."""

    CTRL = "ctrl"  # a control frame: frees its ctrl buffer
    DATA = "data"  # the last WRITE of a chunk's data (FedRDMA-E)
    HEADER = "header"  # a header WRITE_WITH_IMM: frees its header buffer


class Outgoing:
    """An outgoing transfer as the engine sees it."""

    def __init__(self, fut: TransferFuture, payload: Payload, meta: bytes, integrity: Integrity,
                 source: "Optional[Pending]" = None, base: int = 0) -> None:
        """`source`: the transfer as its sender keeps it across connections (resume.py); `base`: where this
        payload starts in it (the rest of a transfer resumed after a broken connection)."""
        self.fut, self.payload, self.meta = fut, payload, meta
        self.source, self.base = source, base
        #: the checksum (and for a MAC the key) this side's transfers to the peer carry
        self.integrity = integrity
        self.checksums = integrity.on
        #: FedRDMA-E whole-payload checksum (crc32c, or BLAKE2b leaves), computed while the first chunks are on the wire
        self.crc_future: Optional["concurrent.futures.Future[Digest]"] = None
        #: where the digest is taken as the chunks leave (leaving.py): its on_leave hooks, settle; `leave_ok`: it may be
        self.leaving: Optional[LeavingDigest] = None
        self.leave_ok = False
        self.mode: Optional[Mode] = None
        self.machine: Optional[Machine] = None
        self.slot: Optional[int] = None
        self.first_try: Optional[float] = None  # when it first asked for a FedRDMA-E slot
        self.pending_wrs = 0
        self.posted_any = False  # (a chunk of it was posted)
        self.posted_lo, self.posted_hi = payload.total, 0  # the payload's bytes posted so far lie within
        self.error: Optional[BaseException] = None
        self.started = 0.0

    def begin(self, machine: Machine, mode: Mode, where: Where) -> None:
        """It becomes its connection's active transfer (a receive slot granted, where FedRDMA-E needs one);
        `where`: the connection's provider, whether it is emulated, and its data path (for the trace)."""
        self.machine, self.mode, self.started = machine, mode, time.monotonic()  # (not the held clock: for the result)
        trace.event("c_start", tid=self.fut.transfer_id, mode=mode.value, **where)

    def finished(self) -> float:
        """Its verdict arrived: seconds since it began."""
        trace.event("c_done", tid=self.fut.transfer_id)
        return time.monotonic() - self.started

    def note_posted(self, offset: int, length: int) -> None:
        """Bytes [offset, offset+length) of it are being posted: the first is the transfer's first byte on the
        wire (trace)."""
        self.posted_lo, self.posted_hi = min(self.posted_lo, offset), max(self.posted_hi, offset + length)
        if not self.posted_any:
            self.posted_any = True
            trace.event("c_first", tid=self.fut.transfer_id)

    def report_progress(self, done_bytes: int) -> None:
        """Its machine's word that `done_bytes` of this payload are through (of the whole, where it is a part of
        a resumed transfer: with what the peer held of it)."""
        held = self.source.total - self.payload.total if self.source is not None else 0
        self.fut.report_progress(held + done_bytes)
