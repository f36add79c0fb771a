"""Control frames of a connection (SENDs on QP 0): sending them, and the RTT probe that sizes the auto window.
The engine dispatches the peer's frames (engine.py); what the peer's ERROR means is the protocol's
(protocol/refusal.py)."""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Deque, Dict, Iterator, List, Optional

import easypyverbs as ev

from .. import protocol as P
from ..protocol.frames import CtrlKind
from .layout import LocalMemory


class ControlSender:
    """Posts control frames from a fixed set of buffers; when all are in flight, frames wait in order
    in a backlog until a completion frees one.

    Only every SIGNAL_EVERY-th SEND (and each while buffers run short) asks for a completion: a
    completion on the QP means every earlier SEND on it completed too, so it frees the buffers of all
    frames posted before it, and the others cost the engine no completion to handle. Inside `held()`
    (an engine's turn) frames wait until `flush()` posts them in the turn's batch of WRITEs, or until
    the turn ends: a slot's CREDIT leaves with the next message's chunks in one write.

    With `key` (the connection's control key of this direction) every frame is sealed with its number
    (frames.encode_ctrl): frames are numbered as sent here and posted in that order."""

    #: at most this many SENDs in a row without a completion (fewer than the buffers: one always comes)
    SIGNAL_EVERY = 16

    def __init__(self, mem: LocalMemory, qp: Callable[[], ev.QP], wr_id: Callable[[int], int], key: bytes = b"") -> None:
        self.mem, self._qp, self._wr_id, self._key = mem, qp, wr_id, key
        self._number = 0
        self._backlog: Deque[bytes] = collections.deque()
        self._posted: Deque[int] = collections.deque()  # buffers in flight, in posting order
        self._unsignaled = 0
        self._held: Optional[List[bytes]] = None

    def send(self, c: P.Ctrl) -> None:
        raw = P.encode_ctrl(c, self._key, self._number)
        self._number += 1
        if self._held is not None:
            self._held.append(raw)
        else:
            self._send_raw(raw)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Frames sent inside wait for `flush()` or the end (not posted if it ends in an error: the
        connection is going down)."""
        self._held = []
        try:
            yield
            self.flush()
        finally:
            self._held = None

    def flush(self) -> None:
        """Post the frames held so far, in order (inside a QP.batch: with its WRs)."""
        if self._held:
            held, self._held = self._held, []
            for raw in held:
                self._send_raw(raw)

    def _send_raw(self, raw: bytes) -> None:
        if not self.mem.ctrl_free or self._backlog:
            self._backlog.append(raw)
        else:
            self._post(raw)

    def _post(self, raw: bytes) -> None:
        free = self.mem.ctrl_free
        idx = free.pop()
        self._posted.append(idx)
        signal = self._unsignaled + 1 >= self.SIGNAL_EVERY or len(free) < self.SIGNAL_EVERY
        self._unsignaled = 0 if signal else self._unsignaled + 1
        self._qp().post_send(self.mem.put_ctrl(idx, raw), wr_id=self._wr_id(idx) if signal else 0, signaled=signal)

    def on_complete(self, idx: int) -> None:
        """The SEND from buffer `idx` completed, and with it every SEND posted before it: reuse their
        buffers, for the backlog first."""
        while self._posted:
            done = self._posted.popleft()
            self.mem.ctrl_free.append(done)
            if done == idx:
                break
        while self._backlog and self.mem.ctrl_free:
            self._post(self._backlog.popleft())


class RttProbe:
    """Three PROBE / PROBE_REPLY round trips when a connection starts; the RTT is their minimum."""

    ROUNDS = 3

    def __init__(self, send: Callable[[P.Ctrl], None]) -> None:
        self._send = send
        self._sent: Dict[int, float] = {}
        self._rtts: List[float] = []
        self.rtt_s: Optional[float] = None

    def start(self, now: float) -> None:
        nonce = len(self._rtts) + 1
        self._sent[nonce] = now
        self._send(P.Ctrl(CtrlKind.PROBE, 0, nonce))

    def on_reply(self, nonce: int, now: float) -> bool:
        """A PROBE_REPLY; True when it completed the measurement."""
        sent = self._sent.pop(nonce, None)
        if sent is None:
            return False  # unknown or repeated nonce: ignored
        self._rtts.append(now - sent)
        if len(self._rtts) < self.ROUNDS:
            self.start(now)
            return False
        self.rtt_s = min(self._rtts)
        return True

    def overdue(self, now: float, timeout_s: float) -> bool:
        """A probe has gone unanswered for `timeout_s`."""
        return self.rtt_s is None and bool(self._sent) and now - min(self._sent.values()) > timeout_s
