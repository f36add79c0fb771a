"""The soft provider's WRITEs with an `on_leave` hook (QP.post_write): their bytes are handed to the hook piece by
piece (LEAVE_PIECE_BYTES, within a core's L2), and the pieces seen go to the socket a few at a time, in calls of
wire.SEND_CALL_BYTES, while they are still in cache, where the kernel's copy into the socket finds them. One
call per 1 MiB piece took 0.40-0.41 s for 1 GiB over loopback TCP with xxh3, 4 MiB calls 0.32-0.39 s, the sender's
CPU 0.36 -> 0.29 s/GB and the receiver's 0.26 -> 0.20 (`bench transfer --scenarios loopback-tcp`, three
alternations, 2-core test machine). Used by the requester's send thread (requester.py) over TCP, with TLS or not."""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

from . import wire
from .landing import TCP_PIECE_BYTES as LEAVE_PIECE_BYTES

log = logging.getLogger("easypyverbs.soft")


class Leaving:
    """A WRITE's payload in a frame, each piece handed to its `on_leave` before it goes, a few pieces a call
    (QP.post_write): the caller reads it from cache, where the kernel's copy then finds it."""
    __slots__ = ("views", "hook", "wr_id")

    def __init__(self, views: List[memoryview], hook: Callable[[int, memoryview], None], wr_id: int) -> None:
        self.hook: Optional[Callable[[int, memoryview], None]] = hook
        self.views, self.wr_id = views, wr_id

    def send(self, sock: Any, head: List[memoryview]) -> None:
        """Send `head` (the frames before it), then the payload: each piece to the hook, then the pieces seen
        in calls of up to wire.SEND_CALL_BYTES."""
        off, ready, ready_bytes = 0, [], 0
        for v in self.views:
            for p in range(0, v.nbytes, LEAVE_PIECE_BYTES):
                piece = v[p:p + LEAVE_PIECE_BYTES]
                if self.hook is not None:
                    try:
                        self.hook(off, piece)
                    except Exception:  # (the WRITE goes on; its caller finds the pieces it did not see)
                        log.exception("on_leave of WR %d failed at byte %d; not called again for it", self.wr_id, off)
                        self.hook = None
                ready.append(piece)
                ready_bytes += piece.nbytes
                off += piece.nbytes
                if ready_bytes >= wire.SEND_CALL_BYTES:  # the pieces seen go in one call (still in L3)
                    wire.send_buffers(sock, head + ready)
                    head, ready, ready_bytes = [], [], 0
        if head or ready:
            wire.send_buffers(sock, head + ready)


def send_out(sock: Any, bufs: List[Any]) -> None:
    """wire.send_buffers, but a WRITE with an on_leave hook (Leaving) is handed to its hook piece by piece."""
    head: List[memoryview] = []
    for b in bufs:
        if isinstance(b, Leaving):
            b.send(sock, head)
            head = []
        else:
            head.append(b)
    if head:
        wire.send_buffers(sock, head)
