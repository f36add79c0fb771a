"""The wrapper's store: objects that arrived over the channel, kept until FATE's get() asks for them, each
for a bounded time (federation/wrapper.py puts and takes them)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, Optional

from ..errors import IntegrityError, PeerUnreachable, TransferTimeout

log = logging.getLogger("fate_rdma.federation")


class Store:
    """Payloads that arrived over the channel, by transfer id (descriptors: fate) or by (session, name, tag,
    source party) (descriptors: channel), until FATE's get() asks for them. Nothing stays for ever: an
    item nobody asked for within `keep_s` of its arrival is dropped, and one that arrives after its get
    gave up is dropped at once (each logged), so a peer cannot make this party hold memory without end."""

    def __init__(self, keep_s: float = 86400.0) -> None:
        self._items: Dict[Any, Any] = {}
        self._arrived: Dict[Any, float] = {}  # key -> when it arrived, oldest first
        self._gave_up: Dict[Any, float] = {}  # keys whose get timed out -> when, oldest first
        self._cv = threading.Condition()
        self._failed: Optional[BaseException] = None
        self.keep_s = keep_s
        self.dropped = 0

    def put(self, key: Any, data: Any) -> None:
        with self._cv:
            now = time.monotonic()
            self._expire(now)
            if key in self._gave_up:
                self.dropped += 1
                log.warning("fate-rdma: dropped %s: it arrived after its get gave up waiting", _what(key))
                return
            if isinstance(key, tuple) and key in self._items:  # an announced (name, tag) twice: its get picks neither
                data = IntegrityError(f"fate-rdma: {key[2]!r} (tag {key[3]!r}) from party {key[4]} arrived twice "
                                      "before its get")
            self._items[key] = data
            self._arrived.pop(key, None)
            self._arrived[key] = now
            self._cv.notify_all()

    def _expire(self, now: float) -> None:
        for book in (self._arrived, self._gave_up):
            while book:
                key = next(iter(book))  # the oldest
                if now - book[key] < self.keep_s:
                    break
                del book[key]
                if book is self._arrived and self._items.pop(key, None) is not None:
                    self.dropped += 1
                    log.warning("fate-rdma: dropped %s: no get asked for it within %g s of its arrival", _what(key),
                                self.keep_s)

    def fail(self, exc: BaseException) -> None:
        """Nothing more can arrive: every waiting and later `take` of a missing key raises at once."""
        with self._cv:
            self._failed = exc
            self._cv.notify_all()

    def take(self, key: Any, timeout_s: float, what: str = "", remind_s: float = 0.0) -> Any:
        """The item under `key`, waiting up to `timeout_s`; every `remind_s` (0: never) of waiting, a log line
        says what it still waits for, so a long wait is never silent."""
        what = what or f"payload {key} announced by its descriptor"
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cv:
            self._expire(t0)
            self._gave_up.pop(key, None)  # asked for again: what arrives now is for this get
            while True:
                left = deadline - time.monotonic()
                step = min(left, remind_s) if remind_s > 0 else left
                if self._cv.wait_for(lambda: key in self._items or self._failed is not None, max(0.0, step)):
                    break
                if time.monotonic() >= deadline:
                    self._gave_up.pop(key, None)
                    self._gave_up[key] = time.monotonic()  # the newest: the book stays oldest first
                    raise TransferTimeout(f"{what} did not arrive within {timeout_s:g} s")
                log.info("fate-rdma: still waiting for %s after %.0f s (at most %g s)", what, time.monotonic() - t0,
                         timeout_s)
            if key not in self._items:
                raise PeerUnreachable(f"{what} cannot arrive: fate-rdma's receive loop failed: "
                                      f"{self._failed!r}") from self._failed
            item = self._items.pop(key)
            self._arrived.pop(key, None)
        if isinstance(item, BaseException):
            raise item
        return item

    def __len__(self) -> int:
        return len(self._items)


def _what(key: Any) -> str:
    if isinstance(key, tuple):
        return f"{key[2]!r} (tag {key[3]!r}) from party {key[4]}"
    return f"payload {key}"
