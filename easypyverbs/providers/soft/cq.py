"""Soft provider: the completion queue."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, List, Optional

from ...api import CQ, Context
from ...errors import EasyVerbsError
from ...types import WC

log = logging.getLogger("easypyverbs.soft")


class SoftCQ(CQ):
    """Completions in a deque; a condition variable wakes waiters (no busy polling).

    `on_arrival` (capabilities.ArrivalHook): a callable that the emulated NIC's thread which completed work calls
    once its completions of a request (or a cumulative ACK) are queued and its answer is on the wire, so that
    a consumer may handle them in that thread (no wake-up of its own: a thread hand-off less per completion);
    it returns True if it did, else waiters are woken as without it. It must not block."""

    on_arrival: Optional[Callable[[], bool]] = None

    def __init__(self, ctx: Context, cqe: int) -> None:
        super().__init__(ctx, cqe)
        self._q: Deque[WC] = collections.deque()
        self._cv = threading.Condition()
        self._overrun = False

    def push(self, wc: WC, defer: bool = False) -> None:
        """Queue `wc`; `defer`: the pushing thread calls `arrived()` next (waiters are woken there)."""
        with self._cv:
            if len(self._q) >= self.cqe:
                self._overrun = True  # like a real CQ overrun: fatal for the CQ
                log.error("soft CQ overrun (cqe=%d): completion of wr_id %d lost", self.cqe, wc.wr_id)
            else:
                self._q.append(wc)
            if not defer or self.on_arrival is None:
                self._cv.notify_all()

    def arrived(self) -> None:
        """After `push(..., defer=True)`: let `on_arrival` handle the queue here, or wake the waiters."""
        hook = self.on_arrival
        if hook is not None and not hook():
            self._notify()

    def _take(self, n: int) -> List[WC]:
        if self._overrun:
            raise EasyVerbsError(f"CQ overrun: more than {self.cqe} completions were not polled")
        return [self._q.popleft() for _ in range(min(n, len(self._q)))]

    def _poll(self, max_entries: int) -> List[WC]:
        with self._cv:
            return self._take(max_entries)

    def _wait(self, timeout_s: float, max_entries: int) -> List[WC]:
        from ...errors import PollTimeout

        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._q and not self._overrun and not self.closed:
                if self._woken:
                    self._woken = False
                    return []
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PollTimeout(f"no completion within {timeout_s:.3f} s")
                self._cv.wait(left)
            self._check_open()
            return self._take(max_entries)

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _close_impl(self) -> None:
        self._notify()
