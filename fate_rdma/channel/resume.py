"""Resume, don't restart: transfers that outlive a connection which broke under them.

When a connection ends mid-transfer for a reason of the path (PeerUnreachable: a reset, a data connection
or QP in error, a peer gone quiet), and resume_window_s is not 0, both ends keep what they had:
    the sender   each transfer it had not been told was delivered (`Pending`: the caller's buffers, the
                 future the caller holds, and for FedRDMA-E the slot and offset from which it knows every byte
                 placed), and every send to that peer meanwhile, in order. A thread dials the peer again with
                 backoff until the window has passed; the peers authenticate anew.
    the receiver what arrived of them (holding.py: FedRDMA's verified prefix, FedRDMA-E's receive slots), and
                 for twice the window the ids of the transfers it delivered.
On the new connection the sender asks (CTRL RESUME; FedRDMA-E: claiming the bytes it knows placed, with their
digest) what the receiver holds of each transfer that may have reached it; the receiver answers (RESUMED,
sealed under the new session key like every frame): all of it, delivered (the sender's future completes,
nothing is sent); its first bytes, verified (the sender sends the rest); its last bytes, verified against the
claim's digest (the sender sends the first); or nothing (sent whole again). What is sent goes as a transfer of
its own whose metadata says where it goes (`_resume`); the receiver puts it beside what it held and delivers
the transfer once, under its id. A process that restarts starts over: nothing of its transfers survives it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple

from .. import metrics
from ..errors import AuthenticationError, ConfigError, FateRdmaError, PeerUnreachable, TransferCancelled
from ..protocol.fedrdma_e import FedRdmaESender
from ..protocol.frames import ResumeState
from ..protocol.packing import SuffixClaim, suffix_digest
from .holding import Holdings, Keeper
from .transfer import Buffers, Fill, Payload, TransferFuture

log = logging.getLogger("fate_rdma.channel")

#: metadata bytes kept free for holding.RESUME_KEY: a transfer's metadata may take MAX_META less this
RESUME_ROOM = 64
#: a transfer resumed this many times in a row without the receiver holding more of it fails (a fault that
#: breaks every connection it goes over, not the path)
MAX_FRUITLESS = 4
#: the longest pause between dials of a peer that is not back yet
MAX_BACKOFF_S = 2.0


class Resuming(Protocol):
    """A connection as the resumer sends on it (connection.Connection)."""

    def ask_resume(self, tid: int, total: int, claim: Optional[SuffixClaim]) -> Tuple[ResumeState, int]: ...

    def resend(self, p: "Pending", start: int, end: Optional[int] = None) -> None: ...


class Cut(Protocol):
    """A transfer (or part of one) as it was when its connection broke (outgoing.Outgoing)."""

    @property
    def machine(self) -> Optional[object]: ...

    base: int
    payload: Payload
    slot: Optional[int]
    posted_any: bool
    posted_lo: int
    posted_hi: int


class Home(Keeper, Protocol):
    """What the resumer needs of its endpoint (endpoint.Endpoint)."""

    @property
    def closed(self) -> bool: ...

    def connect(self, address: str, timeout_s: Optional[float] = None) -> Any: ...


@dataclasses.dataclass
class Pending:
    """A transfer as its sender keeps it across connections: the caller's buffers and future."""

    fut: TransferFuture
    buffers: Buffers
    fill: Optional[Fill]
    metadata: Dict[str, Any]
    total: int
    #: a byte of it may have reached the peer: ask what it holds before sending again
    sent: bool = False
    #: the payload's byte range posted on the connection that broke (for `resent_bytes`)
    posted: Tuple[int, int] = (0, 0)
    #: FedRDMA-E: the slot of the connection that broke and the offset from which every byte is placed in it
    suffix: Optional[Tuple[int, int]] = None
    resumes: int = 0
    resent_bytes: int = 0
    #: seconds it waited for a connection again, all its resumes together
    waited_s: float = 0.0
    #: resumes in a row that found the receiver holding no more of it than the one before; what it held then
    fruitless: int = 0
    held: int = -1

    def lost_on(self, o: Cut) -> None:
        """Its connection broke under `o` (this transfer, or a part of it): what may have reached the peer."""
        self.sent = self.sent or o.posted_any
        self.posted = (o.base + o.posted_lo, o.base + o.posted_hi) if o.posted_any else (0, 0)
        m, self.suffix = o.machine, None
        if isinstance(m, FedRdmaESender) and o.slot is not None and (o.base, o.payload.total) == (0, self.total):
            placed = m.placed_from()  # (back to front: a suffix, by the WRITEs that completed)
            self.suffix = (o.slot, placed) if placed else None

    def views(self, start: int, end: Optional[int] = None) -> List[memoryview]:
        """The payload's bytes from `start` to `end` (its end), as views of the caller's buffers (no copy)."""
        from easypyverbs.buffers import as_byte_view

        end = self.total if end is None else end
        out, at = [], 0
        for b in Payload.listed(self.buffers):
            v = as_byte_view(b)
            if at + v.nbytes > start and at < end and v.nbytes:
                out.append(v[max(0, start - at):end - at])
            at += v.nbytes
        return out

    def claim(self) -> Optional[SuffixClaim]:
        """FedRDMA-E: the bytes it knows placed in the slot of the connection that broke, digested (RESUME)."""
        if self.suffix is None:
            return None
        slot, start = self.suffix
        return SuffixClaim(slot, start, suffix_digest(self.fut.transfer_id, self.total, start, self.views(start)))


@dataclasses.dataclass
class _Outage:
    """A peer whose connection broke: the transfers waiting for it, and until when."""

    cause: str
    since: float
    deadline: float
    pending: Deque[Pending] = dataclasses.field(default_factory=collections.deque)


class Resumer:
    """The resuming of one endpoint's transfers: its own (sending), and through `holdings` its peers'."""

    def __init__(self, endpoint: Home, window_s: float) -> None:
        self.endpoint, self.window_s = endpoint, window_s
        self._lock = threading.Lock()
        self._outages: Dict[str, _Outage] = {}
        #: the receiving side: what this endpoint keeps of transfers to it whose connection broke
        self.holdings = Holdings(endpoint, window_s)
        #: addresses whose connection broke (not closed), and when: a send that cannot dial one of them within
        #: the window waits for it as the transfers under way did
        self._broken: Dict[str, float] = {}
        self._closed = False
        #: what tests and `doctor` read: resumes done, bytes sent again, transfers that could not be resumed
        self.resumed, self.resent_bytes, self.failed = 0, 0, 0

    # -- sender ---------------------------------------------------------------------------------
    def broke(self, address: str) -> None:
        """The connection to `address` broke (the engine's thread), whether or not a transfer was under way."""
        with self._lock:
            self._broken[address] = time.monotonic()

    def orphan(self, address: str, p: Pending, cause: BaseException) -> bool:
        """The connection to `address` broke under `p` (the engine's thread): keep it; False if the endpoint
        is closing (the caller fails it)."""
        with self._lock:
            if self._closed:
                return False
            self._outage(address, str(cause), time.monotonic(), "mid-transfer").pending.append(p)
            p.fut.rebind(self._cancel)
        return True

    def _outage(self, address: str, cause: str, since: float, how: str) -> _Outage:
        """The outage of `address`, begun now if there is none (with the lock held): a thread dials it again."""
        outage = self._outages.get(address)
        if outage is None:
            outage = self._outages[address] = _Outage(cause, since, since + self.window_s)
            threading.Thread(target=self._redial, args=(address, outage), name=f"fate-rdma-resume-{address}",
                             daemon=True).start()
            log.warning("fate-rdma endpoint %s: connection to %s lost %s (%s); dialing it again for up to "
                        "resume_window_s (%g s)", self.endpoint.name, address, how, cause, self.window_s)
        return outage

    def after_failed_dial(self, address: str, make: Callable[[], Pending], cause: BaseException
                          ) -> Optional[TransferFuture]:
        """A send to `address` could not dial it: if its connection broke within the window (idle then, or the
        peer not back yet), the send waits for it like the transfers that were under way (its future); else None
        (the send fails: a dial that never got through, or that the peer refused, is not a dropped link)."""
        with self._lock:
            broke = self._broken.get(address)
            if self._closed or broke is None or time.monotonic() - broke > self.window_s:
                return None
            p = make()
            p.fut.rebind(self._cancel)
            self._outage(address, str(cause), broke, "and not back yet").pending.append(p)
            return p.fut

    def waiting(self, address: str, make: Callable[[], Pending]) -> Optional[TransferFuture]:
        """A send to `address` while its connection is being made again: queued behind the transfers that wait
        (their future), or None when there is no outage (send as usual)."""
        with self._lock:
            outage = self._outages.get(address)
            if outage is None:
                return None
            p = make()
            p.fut.rebind(self._cancel)
            outage.pending.append(p)
            return p.fut

    def _cancel(self, fut: TransferFuture) -> None:
        with self._lock:
            for outage in self._outages.values():
                for p in list(outage.pending):
                    if p.fut is fut:
                        outage.pending.remove(p)
        if not fut.done():
            fut.set_exception(TransferCancelled(f"transfer {fut.transfer_id} cancelled while its peer was away",
                                                fut.transfer_id))

    def _redial(self, address: str, outage: _Outage) -> None:
        """Dial `address` until it answers or the window passes; then resume what waits, in order."""
        ep, pause = self.endpoint, 0.2
        while True:
            left = outage.deadline - time.monotonic()
            if self._closed or ep.closed:
                return self._give_up(address, outage, PeerUnreachable(f"endpoint {ep.name} closed while its "
                                                                      f"connection to {address} was down"))
            if left <= 0:
                return self._give_up(address, outage, PeerUnreachable(
                    f"connection to {address} lost ({outage.cause}) and not back within resume_window_s "
                    f"({self.window_s:g} s)"))
            try:
                conn = ep.connect(address, min(left, ep.config.connect_timeout_s))
            except (AuthenticationError, ConfigError) as exc:  # (the peer is back but refuses us: not a blip)
                return self._give_up(address, outage, exc)
            except FateRdmaError as exc:
                log.info("fate-rdma endpoint %s: %s not back yet (%s); next try in %.1f s", ep.name, address, exc,
                         min(pause, left))
                time.sleep(min(pause, max(0.0, left)))
                pause = min(2 * pause, MAX_BACKOFF_S)
                continue
            try:
                self._resume_on(conn, address, outage)
            except FateRdmaError as exc:  # the new connection broke too: its engine kept what it had taken
                log.info("fate-rdma endpoint %s: resuming to %s: %s; dialing again", ep.name, address, exc)
                continue
            return None

    def _resume_on(self, conn: Resuming, address: str, outage: _Outage) -> None:
        """Send what waits for `address` on `conn`, in order; the outage ends when nothing waits."""
        while True:
            with self._lock:
                if not outage.pending:
                    self._outages.pop(address, None)
                    self._broken.pop(address, None)
                    break
                p = outage.pending[0]
            state, start = ResumeState.UNKNOWN, 0
            if p.sent:  # (raises PeerUnreachable if the connection breaks again; p is still first in line)
                state, start = conn.ask_resume(p.fut.transfer_id, p.total, p.claim())
            with self._lock:
                if not outage.pending or outage.pending[0] is not p:
                    continue  # (cancelled meanwhile)
                outage.pending.popleft()
            if p.fut.done():
                continue
            if not p.sent:  # (it waited: nothing of it left before, it goes as it would have)
                conn.resend(p, 0)
                continue
            held = start if state is ResumeState.PARTIAL else p.total - start if state is ResumeState.SUFFIX else 0
            p.fruitless, p.held = (0, held) if held > p.held else (p.fruitless + 1, p.held)
            if p.fruitless >= MAX_FRUITLESS and state is not ResumeState.DELIVERED:
                with self._lock:
                    self.failed += 1
                p.fut.set_exception(PeerUnreachable(
                    f"transfer {p.fut.transfer_id} to {address}: its connection broke {p.resumes + 1} times, the last "
                    f"{MAX_FRUITLESS} without the receiver holding more of it ({held} of {p.total} bytes); last "
                    f"cause: {outage.cause}"))
                continue
            lo, hi = p.posted  # (what is sent again: [start, total), or [0, start) where the receiver held a suffix)
            send = (0, 0) if state is ResumeState.DELIVERED else (0, start) if state is ResumeState.SUFFIX \
                else (start, p.total)
            resent = max(0, min(hi, send[1]) - max(lo, send[0]))
            p.resumes += 1
            p.resent_bytes += resent
            p.waited_s += time.monotonic() - outage.since
            with self._lock:
                self.resumed += 1
                self.resent_bytes += resent
            metrics.resumed(address, time.monotonic() - outage.since, resent)
            log.warning("fate-rdma endpoint %s: transfer %d to %s resumed after %.1f s: %s", self.endpoint.name,
                        p.fut.transfer_id, address, time.monotonic() - outage.since,
                        "the peer had it all" if state is ResumeState.DELIVERED else
                        f"{held} of {p.total} bytes were there, {p.total - held} sent again ({resent} of them had "
                        f"been sent before)")
            if state is ResumeState.DELIVERED:
                p.fut.set_result({"transfer_id": p.fut.transfer_id, "bytes": p.total, "seconds": 0.0,
                                  "mode": p.fut.mode, "window": p.fut.window, "chunks": p.fut.chunks,
                                  "chunk_bytes": p.fut.chunk_bytes, "qps": 0,
                                  "resumes": p.resumes, "resent_bytes": p.resent_bytes, "resume_wait_s": p.waited_s})
            else:
                conn.resend(p, *send)

    def _give_up(self, address: str, outage: _Outage, err: BaseException) -> None:
        with self._lock:
            self._outages.pop(address, None)
            lost = list(outage.pending)
            outage.pending.clear()
            self.failed += len(lost)
        for p in lost:
            if not p.fut.done():
                p.fut.set_exception(err)
        if lost:
            log.error("fate-rdma endpoint %s: %d transfer(s) to %s failed: %s", self.endpoint.name, len(lost),
                      address, err)

    # -- receiver (holding.py) -------------------------------------------------------------------
    def expire(self) -> None:
        """Let go of what the window no longer covers (the endpoint calls it every half second)."""
        now = time.monotonic()
        with self._lock:
            for address in [a for a, t in self._broken.items() if now - t > self.window_s]:
                del self._broken[address]
        self.holdings.expire()

    @property
    def held_bytes(self) -> int:
        return self.holdings.held_bytes

    def close(self) -> None:
        """The endpoint closes: what waits fails, what is held is let go of."""
        with self._lock:
            self._closed = True
        self.holdings.close()
