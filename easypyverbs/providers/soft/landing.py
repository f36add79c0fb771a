"""Soft provider: digests of remote WRITEs taken as they land (`MR.track_writes`).

The emulated NIC places a tracked MR's WRITEs in pieces of at most PIECE_BYTES that never cross a block
boundary (blocks of `block_bytes` from `origin` in the MR), and feeds each piece to its block's hasher
right after placing it, while the bytes are still in this core's cache. A block gets a digest only
from a single WRITE that began at or before the block's start; the digest covers the block from its
start to the end of that WRITE, which `take` checks against the length the caller expects.

What a peer can do to that: nothing it could not do to memory read afterwards. A WRITE that overlaps a
block another WRITE is placing, or that begins inside a block, or that fails, leaves the block with no
digest (the caller reads the memory itself), and every WRITE touching a block drops its digest when it
begins. Once the MR is closed (every WRITE placed, no more can land), the digests are final.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

log = logging.getLogger("easypyverbs.soft")

#: placed and digested at a time on the same-host path, whose copies run on two threads at once: within a
#: core's L2 here (1 MiB per core on the 2-core test machine)
PIECE_BYTES = 512 << 10
#: read from a socket and digested at a time (and sent at a time where the sender digests as bytes leave,
#: leave.py): each piece costs each end a few dozen lines of Python and a system call, and the piece is
#: still in cache when it is digested; 1 MiB did better than 512 KiB and 2 MiB over loopback TCP with xxh3
#: (`bench transfer`, docs/benchmarks.md)
TCP_PIECE_BYTES = 1 << 20


class WriteDigests:
    """Per-block digests of the WRITEs that land in one MR. `start(block)` makes a hasher (`update(view)`,
    `digest()`) for block `block`, counted from `origin`."""

    def __init__(self, view: memoryview, origin: int, block_bytes: int, start: Callable[[int], Any]) -> None:
        if block_bytes < 1 or origin < 0:
            raise ValueError(f"track_writes: block_bytes must be >= 1 and origin >= 0, got {block_bytes}, {origin}")
        self._view: Optional[memoryview] = view
        self.origin, self.block_bytes, self.start = origin, block_bytes, start
        self._lock = threading.Lock()
        self._digests: Dict[int, Tuple[int, Any]] = {}  # block -> (bytes covered from its start, digest)
        self._active: Dict[int, int] = {}  # block -> WRITEs being placed into it
        self._epoch: Dict[int, int] = {}  # block -> WRITEs that ever began on it

    def _blocks(self, offset: int, length: int) -> range:
        lo, hi = max(offset, self.origin), offset + length
        if hi <= lo:
            return range(0)
        return range((lo - self.origin) // self.block_bytes, (hi - 1 - self.origin) // self.block_bytes + 1)

    def begin(self, offset: int, length: int) -> "Landing":
        """A WRITE of `length` bytes at `offset` of the MR is about to be placed."""
        blocks = self._blocks(offset, length)
        alone: Dict[int, int] = {}
        with self._lock:
            for b in blocks:
                self._digests.pop(b, None)
                was_idle = not self._active.get(b)
                self._active[b] = self._active.get(b, 0) + 1
                self._epoch[b] = self._epoch.get(b, 0) + 1
                if was_idle:
                    alone[b] = self._epoch[b]
        return Landing(self, offset, length, blocks, alone)

    def _end(self, w: "Landing", ok: bool) -> None:
        with self._lock:
            for b in w.blocks:
                self._active[b] -= 1
            for b in w.blocks:
                h = w.hashers.get(b)
                start = self.origin + b * self.block_bytes
                covered = min(w.offset + w.length, start + self.block_bytes) - start
                self._digests.pop(b, None)
                if ok and h is not None and w.fed.get(b, 0) == covered and self._epoch[b] == w.alone.get(b) \
                        and not self._active[b]:
                    try:
                        self._digests[b] = (covered, h.digest())
                    except Exception:  # a hasher that fails leaves the block to be read from memory
                        log.exception("digest of block %d failed; it will be read from memory", b)

    def take(self, block: int, length: int) -> Optional[Any]:
        """The digest of `length` bytes from block `block`'s start, if one WRITE placed exactly those alone."""
        with self._lock:
            got = self._digests.get(block)
        return got[1] if got is not None and got[0] == length else None

    def close(self) -> None:
        """The MR is closed: no more WRITEs (the digests stay readable)."""
        self._view = None


class Landing:
    """One WRITE's placement into a tracked MR: its pieces, and the hashers of the blocks it begins."""

    def __init__(self, digests: WriteDigests, offset: int, length: int, blocks: range, alone: Dict[int, int]) -> None:
        self.digests, self.offset, self.length, self.blocks, self.alone = digests, offset, length, blocks, alone
        self.hashers: Dict[int, Any] = {}
        self.fed: Dict[int, int] = {}

    def pieces(self, over_tcp: bool = False) -> List[Tuple[int, int, bool]]:
        """(offset in the WRITE, length, begins a block) of each piece, in order: no piece crosses a block
        boundary or is longer than PIECE_BYTES (`over_tcp`: read from a socket, TCP_PIECE_BYTES)."""
        piece_bytes = TCP_PIECE_BYTES if over_tcp else PIECE_BYTES
        d, out = self.digests, []
        pos, end = self.offset, self.offset + self.length
        while pos < end:
            if pos < d.origin:
                bound = d.origin
            else:
                bound = d.origin + ((pos - d.origin) // d.block_bytes + 1) * d.block_bytes
            seg_end = min(bound, end)
            first = pos >= d.origin and (pos - d.origin) % d.block_bytes == 0
            for p in range(pos, seg_end, piece_bytes):
                out.append((p - self.offset, min(piece_bytes, seg_end - p), first and p == pos))
            pos = seg_end
        return out

    def landed(self, at: int, nbytes: int) -> None:
        """Bytes [at, at + nbytes) of the WRITE (one piece, `pieces`) are placed: digest them now. The
        pieces of one block come in order, from one thread."""
        d = self.digests
        pos = self.offset + at
        view = d._view
        if pos < d.origin or view is None:
            return
        b = (pos - d.origin) // d.block_bytes
        if self.fed.get(b) == -1:
            return  # its hasher failed
        try:
            h = self.hashers.get(b)
            if h is None:
                if pos != d.origin + b * d.block_bytes:
                    return  # the WRITE began inside this block: no digest for it
                h = self.hashers[b] = d.start(b)
            h.update(view[pos:pos + nbytes])
        except Exception:  # the block is read from memory instead; placing goes on
            log.exception("digest of block %d failed; it will be read from memory", b)
            self.fed[b] = -1
            return
        self.fed[b] = self.fed.get(b, 0) + nbytes

    def end(self, ok: bool) -> None:
        """The WRITE is placed (`ok`) or failed."""
        self.digests._end(self, ok)
