"""Ownership and lifetime of verbs objects (STYLE.md §3).

Each object is made from its parent and the parent keeps its children in a `WeakSet`; `close()`
closes the children first (QP, MR, CQ, PD, then the Context), is idempotent, and runs from
`__exit__`. `live_resources()` lists what is still open, so tests can assert nothing leaked.
"""
from __future__ import annotations

import abc
import threading
import weakref
from typing import List, Optional, TypeVar

from .errors import UsageError

_R = TypeVar("_R", bound="Resource")
_LIVE: "weakref.WeakSet[Resource]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def live_resources() -> List["Resource"]:
    """Every easypyverbs object that is not closed yet (for leak checks)."""
    with _LIVE_LOCK:
        return [r for r in list(_LIVE) if not r.closed]


class Resource(abc.ABC):
    """Base of Context, PD, MR, CQ and QP."""

    #: lower closes first among siblings: QPs before MRs before CQs before PDs
    close_rank = 50

    def __init__(self, parent: Optional["Resource"] = None) -> None:
        self._closed = False
        self._close_lock = threading.RLock()
        self._children: "weakref.WeakSet[Resource]" = weakref.WeakSet()
        self.parent = parent
        if parent is not None:
            parent._check_open()
            parent._children.add(self)
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Close children first, then this object. Safe to call twice."""
        with self._close_lock:
            if self._closed:
                return
            if self._children:  # (an MR has none: most closes)
                for child in sorted(list(self._children), key=lambda c: c.close_rank):
                    child.close()
            try:
                self._close_impl()
            finally:
                self._closed = True
                if self.parent is not None:
                    self.parent._children.discard(self)

    def abort(self) -> None:
        """Close now without draining (same as close for objects with nothing to drain)."""
        self.close()

    def _close_impl(self) -> None:  # overridden by providers
        pass

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{' closed' if self._closed else ''}>"
