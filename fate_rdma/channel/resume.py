"""Resume, don't restart: transfers that outlive a connection which broke under them.

When a connection ends mid-transfer for a reason of the path (PeerUnreachable: a reset, a data connection
or QP in error, a peer gone quiet), and resume_window_s is not 0, both ends keep what they had:
    the sender   each transfer it had not been told was delivered (`Pending`: the caller's buffers, the
                 future the caller holds), and every send to that peer meanwhile, in order. A thread dials
                 the peer again with backoff until the window has passed; the peers authenticate anew.
    the receiver each FedRDMA transfer whose first bytes had arrived and been verified (`Held`: its
                 reassembly buffer, counted against the memory budget), and for twice the window the ids
                 of the transfers it delivered.
On the new connection the sender asks (CTRL RESUME) what the receiver holds of each transfer that may have
reached it; the receiver answers (RESUMED, sealed under the new session key like every frame): all of it,
delivered (the sender's future completes, nothing is sent); its first bytes, verified (the sender sends the
rest, as a transfer of its own whose metadata says where it goes, `_resume`); or nothing (sent whole again).
The receiver puts the rest behind what it held and delivers the transfer once, under its id.

A FedRDMA-E transfer is not held at the receiver (its bytes are in the old connection's receive slot,
verified only as a whole): it is sent whole again, and delivered once. A process that restarts starts over:
nothing of its transfers survives it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

from numpy.typing import NDArray

from .. import metrics
from ..config import ChannelConfig
from ..errors import AuthenticationError, ConfigError, FateRdmaError, PeerUnreachable, TransferCancelled
from ..protocol.frames import ResumeState
from .buffers import Budget, copy_into
from .transfer import Buffers, Fill, Message, Payload, TransferFuture

log = logging.getLogger("fate_rdma.channel")

#: the metadata key of a transfer that carries the rest of an earlier one: [its offset, the whole's bytes]
RESUME_KEY = "_resume"
#: metadata bytes kept free for RESUME_KEY: a transfer's metadata may take MAX_META less this
RESUME_ROOM = 64
#: a transfer resumed this many times in a row without the receiver holding more of it fails (a fault that
#: breaks every connection it goes over, not the path)
MAX_FRUITLESS = 4
#: the longest pause between dials of a peer that is not back yet
MAX_BACKOFF_S = 2.0


class PeerEngine(Protocol):
    """What the resumer needs of a connection's engine (engine.Engine)."""

    @property
    def dead(self) -> Optional[BaseException]: ...

    @property
    def thread(self) -> threading.Thread: ...

    def break_off(self, why: PeerUnreachable) -> None: ...

    def answer_resume(self, tid: int, state: ResumeState, held: int) -> None: ...


class Resuming(Protocol):
    """A connection as the resumer sends on it (connection.Connection)."""

    def ask_resume(self, tid: int, total: int) -> Tuple[ResumeState, int]: ...

    def resend(self, p: "Pending", start: int) -> None: ...


class Home(Protocol):
    """What the resumer needs of its endpoint (endpoint.Endpoint)."""

    @property
    def name(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    @property
    def config(self) -> ChannelConfig: ...

    @property
    def budget(self) -> Budget: ...

    def recv_alloc(self, n: int) -> Any: ...

    def connect(self, address: str, timeout_s: Optional[float] = None) -> Any: ...

    def engines_of(self, peer: str) -> Sequence[PeerEngine]: ...


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
    resumes: int = 0
    resent_bytes: int = 0
    #: seconds it waited for a connection again, all its resumes together
    waited_s: float = 0.0
    #: resumes in a row that found the receiver holding no more of it than the one before; what it held then
    fruitless: int = 0
    held: int = -1

    def views(self, start: int) -> List[memoryview]:
        """The payload's bytes from `start` to its end, as views of the caller's buffers (no copy)."""
        from easypyverbs.buffers import as_byte_view

        out, at = [], 0
        for b in Payload.listed(self.buffers):
            v = as_byte_view(b)
            if at + v.nbytes > start and v.nbytes:
                out.append(v[max(0, start - at):])
            at += v.nbytes
        return out


@dataclasses.dataclass
class Held:
    """What a receiver keeps of a FedRDMA transfer whose connection broke: its first `prefix` bytes, verified."""

    total: int
    dest: NDArray[Any]
    prefix: int
    deadline: float
    reserved: int


@dataclasses.dataclass
class _Outage:
    """A peer whose connection broke: the transfers waiting for it, and until when."""

    cause: str
    since: float
    deadline: float
    pending: Deque[Pending] = dataclasses.field(default_factory=collections.deque)


class Resumer:
    """The resuming of one endpoint's transfers, both sides (see the module's docstring)."""

    def __init__(self, endpoint: Home, window_s: float) -> None:
        self.endpoint, self.window_s = endpoint, window_s
        self._lock = threading.Lock()
        self._outages: Dict[str, _Outage] = {}
        self._held: Dict[Tuple[str, int], Held] = {}
        self._delivered: Dict[Tuple[str, int], float] = {}
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
                state, start = conn.ask_resume(p.fut.transfer_id, p.total)
            with self._lock:
                if not outage.pending or outage.pending[0] is not p:
                    continue  # (cancelled meanwhile)
                outage.pending.popleft()
            if p.fut.done():
                continue
            if not p.sent:  # (it waited: nothing of it left before, it goes as it would have)
                conn.resend(p, 0)
                continue
            p.fruitless, p.held = (0, start) if start > p.held else (p.fruitless + 1, p.held)
            if p.fruitless >= MAX_FRUITLESS and state is not ResumeState.DELIVERED:
                with self._lock:
                    self.failed += 1
                p.fut.set_exception(PeerUnreachable(
                    f"transfer {p.fut.transfer_id} to {address}: its connection broke {p.resumes + 1} times, the last "
                    f"{MAX_FRUITLESS} without the receiver holding more of it ({start} of {p.total} bytes); last "
                    f"cause: {outage.cause}"))
                continue
            lo, hi = p.posted
            resent = max(0, hi - max(lo, start)) if state is not ResumeState.DELIVERED else 0
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
                        f"{start} of {p.total} bytes were there, {p.total - start} sent again ({resent} of them had "
                        f"been sent before)")
            if state is ResumeState.DELIVERED:
                p.fut.set_result({"transfer_id": p.fut.transfer_id, "bytes": p.total, "seconds": 0.0,
                                  "mode": p.fut.mode, "window": p.fut.window, "chunks": p.fut.chunks, "qps": 0,
                                  "resumes": p.resumes, "resent_bytes": p.resent_bytes, "resume_wait_s": p.waited_s})
            else:
                conn.resend(p, start)

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

    # -- receiver -------------------------------------------------------------------------------
    def keep(self, peer: str, tid: int, total: int, meta: Optional[bytes], dest: NDArray[Any], prefix: int) -> None:
        """A FedRDMA transfer from `peer` whose connection broke after its first `prefix` bytes arrived and were
        verified (the engine's thread): hold them for the window, within the memory budget."""
        from easypyverbs.bootstrap import loads_object

        try:
            md = loads_object(meta or b"{}")
        except ValueError:
            md = {}
        part = _resume_field(md.get(RESUME_KEY), total) if isinstance(md, dict) else None
        with self._lock:
            if part is not None:  # the rest of an earlier transfer: what arrived goes behind what was held
                start, whole = part
                held = self._held.get((peer, tid))
                if held is not None and held.total == whole and start <= held.prefix:
                    copy_into(held.dest, start, dest.data.cast("B")[:prefix])
                    held.prefix = max(held.prefix, start + prefix)
                    held.deadline = time.monotonic() + self.window_s
                return
            if prefix <= 0 or self._closed or not self.endpoint.budget.reserve(total, peer):
                return
            self._held[(peer, tid)] = Held(total, dest, prefix, time.monotonic() + self.window_s, total)
        log.info("fate-rdma endpoint %s: holding %d of %d bytes of transfer %d from %s for resume_window_s (%g s)",
                 self.endpoint.name, prefix, total, tid, peer, self.window_s)

    def answer(self, engine: PeerEngine, peer: str, tid: int, total: int) -> None:
        """`peer` asks on `engine`'s connection what this side holds of its transfer `tid` (RESUME; in the
        engine's turn). Where another connection from it is still up here (this side has not seen it break
        yet), that one is ended first, its transfers kept, so that nothing arrives on it after the answer."""
        others = [e for e in self.endpoint.engines_of(peer) if e is not engine and e.dead is None]
        if not others:
            engine.answer_resume(tid, *self.query(peer, tid, total))
            return

        def after_break() -> None:
            for e in others:
                e.break_off(PeerUnreachable(f"{peer} resumed its transfers on a new connection"))
            for e in others:
                e.thread.join(timeout=self.endpoint.config.connect_timeout_s / 2)  # (the asker waits connect_timeout_s)
            engine.answer_resume(tid, *self.query(peer, tid, total))

        threading.Thread(target=after_break, name=f"fate-rdma-resume-answer-{peer}", daemon=True).start()

    def query(self, peer: str, tid: int, total: int) -> Tuple[ResumeState, int]:
        """What this side holds of `peer`'s transfer `tid` of `total` bytes (its RESUME); held bytes stay held
        for another window (the rest is on its way)."""
        with self._lock:
            if (peer, tid) in self._delivered:
                return ResumeState.DELIVERED, 0
            held = self._held.get((peer, tid))
            if held is None:
                return ResumeState.UNKNOWN, 0
            if held.total != total:
                log.warning("fate-rdma endpoint %s: %s resumes transfer %d as %d bytes, %d were arriving: sent whole "
                            "again", self.endpoint.name, peer, tid, total, held.total)
                self._drop((peer, tid))
                return ResumeState.UNKNOWN, 0
            held.deadline = time.monotonic() + self.window_s
            return ResumeState.PARTIAL, held.prefix

    def arrived(self, msg: Message) -> Optional[Message]:
        """A complete message (the endpoint's deliver): the message to deliver, None if there is none (a
        duplicate, or the rest of a transfer whose start is gone: logged)."""
        key = (msg.peer, msg.transfer_id)
        md = msg.metadata if isinstance(msg.metadata, dict) else {}
        raw = md.pop(RESUME_KEY, None) if RESUME_KEY in md else None
        with self._lock:
            if key in self._delivered:
                log.warning("fate-rdma endpoint %s: transfer %d from %s arrived again after its delivery: dropped",
                            self.endpoint.name, msg.transfer_id, msg.peer)
                msg.release()
                return None
            self._delivered[key] = time.monotonic() + 2 * self.window_s
            if raw is None:
                return msg
            part = _resume_field(raw, None)
            if part is None or part[0] + msg.nbytes != part[1]:
                self._delivered.pop(key)
                log.error("fate-rdma endpoint %s: transfer %d from %s: its %s field %r does not describe its %d "
                          "bytes: dropped", self.endpoint.name, msg.transfer_id, msg.peer, RESUME_KEY, raw, msg.nbytes)
                msg.release()
                return None
            start, total = part
            if start == 0:
                return msg
            held = self._held.pop(key, None)
            if held is None or held.total != total or start > held.prefix:
                self._delivered.pop(key)
                log.error("fate-rdma endpoint %s: transfer %d from %s: the rest of it arrived (from byte %d), but "
                          "what was held of it %s: dropped", self.endpoint.name, msg.transfer_id, msg.peer, start,
                          "is gone (resume_window_s passed)" if held is None else "does not fit")
                if held is not None:
                    self._release(msg.peer, held)
                msg.release()
                return None
        copy_into(held.dest, start, msg.view)
        msg.release()
        self._release(msg.peer, held)  # (the application's memory from here on, as any delivered message's)
        return Message(msg.peer, msg.transfer_id, md, held.dest.data.cast("B"), "fedrdma", None,
                       self.endpoint.recv_alloc)

    def expire(self) -> None:
        """Let go of what the window no longer covers (the endpoint calls it every half second)."""
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self._delivered.items() if t < now]:
                del self._delivered[key]
            for address in [a for a, t in self._broken.items() if now - t > self.window_s]:
                del self._broken[address]
            gone = [k for k, h in self._held.items() if h.deadline < now]
            for key in gone:
                log.warning("fate-rdma endpoint %s: transfer %d from %s not resumed within resume_window_s (%g s): "
                            "the %d bytes held of it are let go of", self.endpoint.name, key[1], key[0],
                            self.window_s, self._held[key].prefix)
                self._drop(key)

    def _drop(self, key: Tuple[str, int]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._release(key[0], held)

    def _release(self, peer: str, held: Held) -> None:
        if held.reserved:
            self.endpoint.budget.release(held.reserved, peer)
            held.reserved = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.reserved for h in self._held.values())

    def close(self) -> None:
        """The endpoint closes: what waits fails, what is held is let go of."""
        with self._lock:
            self._closed = True
            keys = list(self._held)
        for key in keys:
            with self._lock:
                self._drop(key)


def _resume_field(raw: Any, total: Optional[int]) -> Optional[Tuple[int, int]]:
    """[start, whole] of a `_resume` field read from the wire, checked; None if it is not one (`total`: the
    bytes of the transfer that carries it, where known: the rest of a whole must be whole - start bytes)."""
    if not (isinstance(raw, list) and len(raw) == 2 and all(type(x) is int for x in raw)):
        return None
    start, whole = raw
    if not 0 <= start < whole or (total is not None and whole - start != total):
        return None
    return start, whole

