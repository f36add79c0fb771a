"""The soft provider's WRITEs with an `on_leave` hook (QP.post_write): their bytes go piece by piece, each piece
handed to the hook just before it is sent, so the caller reads it from cache (a digest) where the kernel's copy
into the socket then finds it. Used by the requester's send thread (requester.py) over TCP, with TLS or not."""
from __future__ import annotations

import logging
from typing import Any, Callable, List

from . import wire
from .landing import TCP_PIECE_BYTES as LEAVE_PIECE_BYTES

log = logging.getLogger("easypyverbs.soft")


class Leaving:
    """A WRITE's payload in a frame, to go piece by piece, each piece handed to its `on_leave` just before it
    goes (QP.post_write): the caller reads it from cache, where the kernel's copy then finds it."""
    __slots__ = ("views", "hook", "wr_id")

    def __init__(self, views: List[memoryview], hook: Callable[[int, memoryview], None], wr_id: int) -> None:
        self.views, self.hook, self.wr_id = views, hook, wr_id

    def send(self, sock: Any, head: List[memoryview]) -> None:
        """Send `head` (the frames before it), then the payload, a piece at a time."""
        off = 0
        for v in self.views:
            for p in range(0, v.nbytes, LEAVE_PIECE_BYTES):
                piece = v[p:p + LEAVE_PIECE_BYTES]
                if self.hook is not None:
                    try:
                        self.hook(off, piece)
                    except Exception:  # (the WRITE goes on; its caller finds the pieces it did not see)
                        log.exception("on_leave of WR %d failed at byte %d; not called again for it", self.wr_id, off)
                        self.hook = None
                wire.send_buffers(sock, head + [piece])
                head = []
                off += piece.nbytes
        if head:
            wire.send_buffers(sock, head)


def send_out(sock: Any, bufs: List[Any]) -> None:
    """wire.send_buffers, but a WRITE with an on_leave hook (Leaving) goes piece by piece."""
    head: List[memoryview] = []
    for b in bufs:
        if isinstance(b, Leaving):
            b.send(sock, head)
            head = []
        else:
            head.append(b)
    if head:
        wire.send_buffers(sock, head)
