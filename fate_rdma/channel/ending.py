"""The end of a connection (a part of engine.Engine): what becomes of its transfers and of what it was receiving.

A connection that ends for a reason of its path (PeerUnreachable, a verbs error; not a close, not the peer's
misbehaviour) is resumable where resume_window_s is not 0: its outgoing transfers wait for the next connection
(resume.py) and what arrived of its incoming ones is kept (holding.py); else every transfer fails.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

import easypyverbs as ev

from ..errors import PeerLeft, PeerUnreachable
from ..protocol.frames import ResumeState
from .inbound import Modes
from .outgoing import Outgoing, Request

if TYPE_CHECKING:
    from .resume import Resumer
    from .wire import Wire

log = logging.getLogger("fate_rdma.channel")


class Ending:
    """Engine's end (its state is the engine's)."""

    def _left(self) -> bool:
        """Did the peer say goodbye (handshake.say_bye: its endpoint closed)? Also where the connection ended of
        something else first (its queue pairs torn down as the peer closed), with the goodbye already here."""
        if isinstance(self.dead, PeerLeft):
            return True
        try:
            self._closed()
        except PeerLeft:
            return True
        except Exception:  # (the bootstrap connection in any other state: not a goodbye)
            return False
        return False

    peer: str
    address: str
    modes: Modes
    wire: "Wire"
    resume: Optional["Resumer"]
    dead: Optional[BaseException]
    _active: Optional[Outgoing]
    _outq: Deque[Outgoing]
    _draining: List[Outgoing]
    _requests: Deque[Tuple[Request, Any]]
    _asked: Dict[int, Deque[Tuple[int, "concurrent.futures.Future[Tuple[ResumeState, int]]"]]]
    _resumable: bool
    _dead_err: Optional[BaseException]
    # the engine's own (engine.Engine, inbound.Inbound define them)
    _on_dead: Callable[[], None]
    _closed: Callable[[], bool]
    _first_error_completion: Callable[[BaseException], BaseException]

    def _fail_requests(self, err: BaseException) -> None:
        while True:  # (a user's thread may drain beside _die: each request is taken once)
            try:
                kind, arg = self._requests.popleft()
            except IndexError:
                return
            if kind is Request.SEND and isinstance(arg, Outgoing):
                self._lose(arg, err)
            elif kind is Request.ASK and isinstance(arg, tuple) and isinstance(arg[-1], concurrent.futures.Future):
                arg[-1].set_exception(err)

    def _lose(self, o: Outgoing, err: BaseException) -> None:
        """The connection ended under `o`: it waits for the next connection (resume.py) or fails with `err`."""
        o.payload.close()
        if o.fut.done():
            return
        p = o.source
        if self._resumable and self.resume is not None and p is not None:
            p.lost_on(o)
            if self.resume.orphan(self.address, p, err):
                return
        o.fut.set_exception(err)

    def _stop_qps(self, why: str) -> None:
        """Every QP of the connection to the error state: nothing more is placed through them."""
        for rc in self.wire.rcs:
            try:
                rc.qp.to_error(why)
            except Exception as exc:  # (closed, or a provider without it: the teardown ends it)
                log.debug("%s: a QP not moved to error: %s", self.peer, exc)

    def _die(self, exc: BaseException, quiet: bool = False) -> None:
        if self.dead is None:
            self.dead = exc = self._first_error_completion(exc)
        modes = self.modes
        busy = self._active is not None or bool(self._outq) or bool(modes.staged_receiver and modes.staged_receiver.busy)
        if not quiet:
            # a peer that closes while idle is a normal end; losing it mid-transfer is not
            (log.warning if busy else log.info)("connection to %s lost: %s", self.peer, exc)
        err = exc if isinstance(exc, PeerUnreachable) else PeerUnreachable(f"connection to {self.peer} lost: {exc}")
        # a broken path (not a close, not the peer's misbehaviour): the transfers wait for the next connection
        self._resumable = not quiet and isinstance(self.dead, (PeerUnreachable, ev.EasyVerbsError)) \
            and self.resume is not None
        self._dead_err = err
        if self._resumable and self.resume is not None:
            self.resume.broke(self.address)
        placed = list(modes.slot_sender.placed.values()) if modes.slot_sender is not None else []
        # (in the order they were sent: a transfer whose verdict is due, the active one, then the queue)
        lost = {id(o): o for o in placed + ([self._active] if self._active else []) + list(self._outq)}
        for o in self._draining:  # (failed before: their errors stand)
            o.payload.close()
            if not o.fut.done() and o.error is not None:
                o.fut.set_exception(o.error)
        self._active, self._outq, self._draining = None, collections.deque(), []
        if modes.slot_sender is not None:
            modes.slot_sender.placed.clear()
        for o in lost.values():
            self._lose(o, err)
        self._fail_requests(err)
        for asks in self._asked.values():
            for _total, fut in asks:
                fut.set_exception(err)
        self._asked.clear()
        # (a peer that left, and said so, resumes nothing it was sending: nothing of it is kept)
        holdings = self.resume.holdings if self._resumable and self.resume is not None and not self._left() else None
        if modes.staged_receiver is not None:
            modes.staged_receiver.clear(holdings.keep if holdings is not None else None)
        if modes.slot_receiver is not None and holdings is not None:
            # (the QPs first: a WRITE being placed from a path that broke only at the peer's end, say a reset
            # that reached it alone, would hold the slot's revoke until the provider's bound)
            self._stop_qps(f"connection to {self.peer} lost")
            modes.slot_receiver.keep(holdings.keep_slot)
        self._on_dead()

