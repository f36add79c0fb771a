"""Control frames of a connection (SENDs on QP 0), and the RTT probe that sizes the auto window."""
from __future__ import annotations

import collections
import logging
from typing import Callable, Deque, Dict, List, Optional

import easypyverbs as ev

from .. import protocol as P
from ..protocol.frames import CtrlKind
from .layout import LocalMemory

log = logging.getLogger("fate_rdma.channel")


class ControlSender:
    """Posts control frames from a fixed set of buffers; when all are in flight, frames wait in order
    in a backlog until a completion frees one."""

    def __init__(self, mem: LocalMemory, qp: Callable[[], ev.QP], wr_id: Callable[[int], int]) -> None:
        self.mem, self._qp, self._wr_id = mem, qp, wr_id
        self._backlog: Deque[bytes] = collections.deque()

    def send(self, c: P.Ctrl) -> None:
        raw = P.encode_ctrl(c)
        if not self.mem.ctrl_free or self._backlog:
            self._backlog.append(raw)
            return
        self._post(raw)

    def _post(self, raw: bytes) -> None:
        idx = self.mem.ctrl_free.pop()
        self._qp().post_send(self.mem.put_ctrl(idx, raw), wr_id=self._wr_id(idx))

    def on_complete(self, idx: int) -> None:
        """The SEND from buffer `idx` completed: reuse it, for the backlog first."""
        self.mem.ctrl_free.append(idx)
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
