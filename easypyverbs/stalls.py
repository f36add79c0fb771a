"""Holds: stretches of time in which this process's Python threads could not run, and a clock without them.

The soft provider's NIC, and fate-rdma's channel engine above it, are Python threads of the application's
process. Whatever holds that process's GIL without letting go (native code that does not release it: FATE's
secure aggregation sums a client's masked model in one such call: 8.6-9.1 s at the arbiter of the GPT-2
small example on a 2-core VM), or
stops the whole process (SIGSTOP, a paused VM), stops them too: nothing is placed, acknowledged or reposted
meanwhile. A real NIC places and acknowledges from hardware and does not stop.

A watchdog thread per process sleeps PERIOD_S at a time and notes how late it wakes: lateness beyond
GRACE_S is a hold; so is such a gap seen by any thread that asks the clock (it runs, so the hold is over).
`clock()` is time.monotonic() less every hold so far, so a deadline measured on it counts only time in
which this process could act: a receive-queue wait or a no-progress deadline does not expire because this
process was held. It is continuous and never runs backwards. A peer held in its own process is not seen
here: that shows as a peer making no progress, and the deadlines for that (fate-rdma's
no_progress_timeout_s) must exceed its holds.

`subscribe(fn)`: fn(seconds, ended_at_monotonic) after every hold of at least REPORT_S, from the watchdog
thread (fn must be quick). `watch_gaps(fn)`: fn(began_at, ended_at) for every gap of at least GAP_S past the
watchdog's due wake-up in which no thread of this process ran, or ran unseen by the watchdog: native code
keeping the GIL, or the process not scheduled (what fate-rdma's trace records, to tell how long a transfer's
bytes waited on a held process). A lower bound: a hold shorter than GAP_S plus PERIOD_S can pass unseen, and
one is dated from the watchdog's due wake-up, up to PERIOD_S after it began.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

log = logging.getLogger("easypyverbs.stalls")

PERIOD_S = 0.1
#: lateness of a wake-up that is scheduling noise on a busy machine, not a hold
GRACE_S = 0.25
#: holds at least this long are reported to subscribers
REPORT_S = 1.0
#: gaps at least this long past the watchdog's due wake-up go to `watch_gaps` listeners
GAP_S = 0.05


class _Watch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1  # the process whose watchdog runs (none yet, or gone with a fork)
        self._beat = time.monotonic()
        self.held_s = 0.0  # holds so far, beyond PERIOD_S + GRACE_S each
        self._reports: List[Tuple[float, float]] = []  # (seconds, ended at) not yet told to subscribers
        self._subs: Dict[int, Callable[[float, float], None]] = {}
        self._gaps: List[Tuple[float, float]] = []  # (began, ended) not yet told to gap listeners
        self._gap_subs: List[Callable[[float, float], None]] = []
        self._ids = 0

    def ensure(self) -> None:
        """Start the watchdog in this process (again after a fork: threads do not survive it)."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            self._beat = time.monotonic()  # (holds before it are not known: the clock keeps its offset)
            threading.Thread(target=self._run, name="easypyverbs-stalls", daemon=True).start()
            self._pid = os.getpid()  # (only once it runs: if it could not start, the next call tries again)

    def _beat_now(self) -> float:
        """Under the lock: account the time since the last beat (a hold beyond PERIOD_S + GRACE_S), beat, and
        return the time. Any thread that runs may beat: it proves the process runs now, so the clock moves
        even if the watchdog is late; a hold is accounted by whichever thread runs first after it."""
        now = time.monotonic()  # (read under the lock: a stale reading could put the clock back)
        if self._gap_subs and now - self._beat - PERIOD_S >= GAP_S:
            self._gaps.append((self._beat + PERIOD_S, now))
        late = now - self._beat - PERIOD_S - GRACE_S
        if late > 0:
            self.held_s += late
            held = late + PERIOD_S + GRACE_S  # (the whole gap, as a person would count it)
            if held >= REPORT_S:
                self._reports.append((held, now))
        self._beat = now
        return now

    def _run(self) -> None:
        while True:
            time.sleep(PERIOD_S)
            with self._lock:
                self._beat_now()
                reports, self._reports = self._reports, []
                subs = list(self._subs.values()) if reports else []
                gaps, self._gaps = self._gaps, []
                gap_subs = list(self._gap_subs) if gaps else []
            calls = [(fn, r) for r in reports for fn in subs] + [(fn, g) for g in gaps for fn in gap_subs]
            for fn, args in calls:
                try:
                    fn(*args)
                except Exception:  # a subscriber's bug must not end the watchdog
                    log.exception("stall subscriber failed")
            if calls:  # the next wake-up is due a period from now, not from before the calls (their time is
                with self._lock:  # this thread's own work, not a hold, unless it ran into one)
                    self._beat_now()

    def clock(self) -> float:
        if self._pid != os.getpid():
            return time.monotonic() - self.held_s  # not watching (yet, or since a fork): no holds are known
        with self._lock:
            return self._beat_now() - self.held_s

    def subscribe(self, fn: Callable[[float, float], None]) -> int:
        self.ensure()
        with self._lock:
            self._ids += 1
            self._subs[self._ids] = fn
            return self._ids

    def unsubscribe(self, token: int) -> None:
        with self._lock:
            self._subs.pop(token, None)

    def watch_gaps(self, fn: Callable[[float, float], None]) -> None:
        self.ensure()
        with self._lock:
            self._gap_subs.append(fn)

    def after_fork_in_child(self) -> None:
        """Threads do not survive a fork, and the lock may have been taken by one: start over, not watching,
        with no subscribers (the parent's objects are not this process's); the clock keeps its offset."""
        self._lock = threading.Lock()
        self._pid = -1
        self._subs, self._reports = {}, []
        self._gap_subs, self._gaps = [], []


_watch = _Watch()
os.register_at_fork(after_in_child=_watch.after_fork_in_child)


def ensure_watching() -> None:
    """Start this process's watchdog (idempotent; the soft provider and fate-rdma's endpoints call it)."""
    _watch.ensure()


def clock() -> float:
    """time.monotonic() less the holds of this process so far (see the module's doc)."""
    return _watch.clock()


def subscribe(fn: Callable[[float, float], None]) -> int:
    """fn(seconds, ended_at) after each hold of at least REPORT_S; held strongly until `unsubscribe(token)`
    (an object that subscribes should pass a function holding only a weak reference to it)."""
    return _watch.subscribe(fn)


def watch_gaps(fn: Callable[[float, float], None]) -> None:
    """fn(began_at, ended_at) (time.monotonic()) for every gap of at least GAP_S past the watchdog's due wake-up
    in which no thread of this process ran, from the watchdog thread, for the life of the process (not in a
    child made by fork: register there again). fn must be quick (well under PERIOD_S + GAP_S: a call that takes
    longer reads as a gap itself, which calls it again) and never raise."""
    _watch.watch_gaps(fn)


def unsubscribe(token: Optional[int]) -> None:
    if token is not None:
        _watch.unsubscribe(token)
