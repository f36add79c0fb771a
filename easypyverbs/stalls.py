"""Holds: stretches of time in which this process's Python threads could not run, and a clock without them.

The soft provider's NIC, and fate-rdma's channel engine above it, are Python threads of the application's
process. Whatever holds that process's GIL without letting go (native code that does not release it: FATE's
secure aggregation sums a client's masked model in one such call, 3-9 s for GPT-2 small on a 2-core VM), or
stops the whole process (SIGSTOP, a paused VM), stops them too: nothing is placed, acknowledged or reposted
meanwhile. A real NIC places and acknowledges from hardware and does not stop.

A watchdog thread per process sleeps PERIOD_S at a time and notes how late it wakes: lateness beyond
GRACE_S is a hold. `clock()` is time.monotonic() less every hold so far, including one still under way as
seen from the thread that asks, so a deadline measured on it counts only time in which this process could
act: a receive-queue wait or a no-progress deadline does not expire because this process was held. It stays
continuous and never runs backwards. A peer held in its own process is not seen here: that shows as a peer
making no progress, and the deadlines for that (fate-rdma's no_progress_timeout_s) must exceed its holds.

`subscribe(fn)`: fn(seconds, ended_at_monotonic) after every hold of at least REPORT_S, from the watchdog
thread (fn must be quick).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Dict, Optional

log = logging.getLogger("easypyverbs.stalls")

PERIOD_S = 0.1
#: lateness of a wake-up that is scheduling noise on a busy machine, not a hold
GRACE_S = 0.25
#: holds at least this long are reported to subscribers
REPORT_S = 1.0


class _Watch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._beat = time.monotonic()
        self.held_s = 0.0  # holds so far, beyond GRACE_S each
        self.longest_s = 0.0
        self.count = 0  # holds of at least REPORT_S
        self._subs: Dict[int, Callable[[float, float], None]] = {}
        self._ids = 0

    def ensure(self) -> None:
        """Start the watchdog in this process (again after a fork: threads do not survive it)."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._beat = time.monotonic()
            threading.Thread(target=self._run, name="easypyverbs-stalls", daemon=True).start()

    def _note(self, now: float) -> float:
        """Account the time since the last beat (under the lock); returns the hold it found, 0 if none."""
        late = now - self._beat - PERIOD_S - GRACE_S
        if late <= 0:
            return 0.0
        self._beat = now
        self.held_s += late
        return late + GRACE_S  # (what the hold was, as a person would count it)

    def _run(self) -> None:
        while True:
            time.sleep(PERIOD_S)
            now = time.monotonic()
            with self._lock:
                held = self._note(now)
                self._beat = now
                if held >= REPORT_S:
                    self.count += 1
                    self.longest_s = max(self.longest_s, held)
                subs = list(self._subs.values()) if held >= REPORT_S else []
            for fn in subs:
                try:
                    fn(held, now)
                except Exception:  # a subscriber's bug must not end the watchdog
                    log.exception("stall subscriber failed")

    def clock(self) -> float:
        now = time.monotonic()
        if self._pid != os.getpid():
            return now  # (no watchdog here yet: nothing is known about holds)
        with self._lock:
            ongoing = max(0.0, now - self._beat - PERIOD_S - GRACE_S)
            return now - self.held_s - ongoing

    def subscribe(self, fn: Callable[[float, float], None]) -> int:
        self.ensure()
        with self._lock:
            self._ids += 1
            self._subs[self._ids] = fn
            return self._ids

    def unsubscribe(self, token: int) -> None:
        with self._lock:
            self._subs.pop(token, None)


    def after_fork_in_child(self) -> None:
        """Threads do not survive a fork, and the lock may have been held by one: start over (not watching)."""
        self._lock = threading.Lock()
        self._pid = -1


_watch = _Watch()
os.register_at_fork(after_in_child=_watch.after_fork_in_child)


def ensure_watching() -> None:
    """Start this process's watchdog (idempotent; the soft provider and fate-rdma's endpoints call it)."""
    _watch.ensure()


def clock() -> float:
    """time.monotonic() less the holds of this process so far (see the module's doc)."""
    return _watch.clock()


def held_seconds() -> float:
    """Seconds this process has been held, beyond scheduling noise, since its watchdog started."""
    return _watch.held_s


def longest_hold_s() -> float:
    return _watch.longest_s


def subscribe(fn: Callable[[float, float], None]) -> int:
    """fn(seconds, ended_at) after each hold of at least REPORT_S; held strongly until `unsubscribe(token)`
    (an object that subscribes should pass a function holding only a weak reference to it)."""
    return _watch.subscribe(fn)


def unsubscribe(token: Optional[int]) -> None:
    if token is not None:
        _watch.unsubscribe(token)
