"""A FedRDMA-E payload's digest taken as its bytes leave, on a QP that sends them itself (capabilities.LeavingWrites
with calls_on_leave: the soft provider over TCP), instead of in a separate pass over the payload on the digest pool.

The pool's pass reads the payload from memory apart from the kernel's copy of it into the socket, on another
thread: a second read of every byte, which a small machine pays for in CPU time and throughput (docs/benchmarks.md
has the figures). Here the soft provider's send thread hands each piece of a WRITE to `leave` shortly before
it goes, and the piece is digested while it is in cache, as the receiver digests each piece where it lands.

Only the blocks that lie wholly inside one chunk other than chunk 0 go this way (the transfer's chunks are
known: the digest is made with its FedRDMA-E machine). The header carries the digest and leaves with chunk 0
(the payload's front, FedRDMA-E's last chunk), which the sender holds until the digest is known, so chunk
0's blocks, and every block that two chunks share (chunks go back to front: such a block is first reached in
its middle), are digested on the pool from the start, beside the other chunks. Any hooked block not seen
whole and in order as it left (a WRITE that began inside it, a hook that failed) is digested on the pool by
`settle`, which the sender calls once every chunk but chunk 0 has completed: no block is left undigested, and
the digest is the one payload_digest gives.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from typing import Any, Dict, List, Sequence, Set

from easypyverbs.capabilities import LeavingWrites

from ..protocol.chunking import Chunk
from ..protocol.integrity import BLOCK_BYTES, Digest, Integrity, blocks as _blocks
from .checksum import INLINE_DIGEST_BYTES, block_digest_fn, block_hasher, digest_pool, from_blocks

log = logging.getLogger("fate_rdma.channel")


class LeavingDigest:
    """The digest of one outgoing payload, block by block, as its WRITEs leave (`leave`) or on the pool."""

    def __init__(self, views: Sequence[memoryview], integrity: Integrity, hooked: Dict[int, int]) -> None:
        """`hooked`: the blocks to digest as they leave, each with its chunk's seq (hooked_blocks)."""
        start = block_hasher(integrity)
        if start is None:
            raise ValueError(f"checksum {integrity.kind!r} has no block-wise digests")
        self._start = start
        self.kind = integrity.kind
        self._integrity = integrity
        self._views = list(views)
        self.total = sum(v.nbytes for v in self._views)
        self._n = -(-self.total // BLOCK_BYTES)
        #: the blocks digested as they leave: wholly inside one chunk other than chunk 0
        self.hooked = set(hooked)
        self._chunks_hooked = set(hooked.values())
        self._digests: Dict[int, Any] = {}
        self._hashing: Dict[int, List[Any]] = {}  # block -> [hasher, bytes fed]: one sending thread's each
        self._skipped: Set[int] = set()  # hooked blocks not seen whole and in order: settle digests them
        self._pooled: Set[int] = set()
        self._lock = threading.Lock()
        self._settled = False
        #: the payload's digest (payload_digest's), once every block has one
        self.future: "concurrent.futures.Future[Digest]" = concurrent.futures.Future()
        self._pool_blocks([b for b in range(self._n) if b not in self.hooked])

    @staticmethod
    def wanted(total: int, integrity: Integrity, fill: Any, qps: Sequence[Any], chunk_bytes: int) -> bool:
        """May a payload of `total` bytes sent over `qps` be digested this way (if its chunks allow: `make`)? A
        block-wise check, no copy-in digesting it already (`fill`), above the size digested at once and more than
        one chunk of `chunk_bytes` (the connection's now: one chunk has nothing to hook, and is better digested
        at once, while it may still wait for a slot), every QP sending the bytes itself."""
        return (integrity.on and block_hasher(integrity) is not None and fill is None
                and total > max(INLINE_DIGEST_BYTES, chunk_bytes)
                and all(isinstance(q, LeavingWrites) and q.calls_on_leave for q in qps))

    @classmethod
    def make(cls, views: Sequence[memoryview], integrity: Integrity, chunks: Sequence[Chunk]) -> "LeavingDigest | None":
        """One for a payload cut into `chunks`, or None where less than a whole block's bytes would be digested
        as they leave (chunks smaller than a block: every block is shared, but perhaps a short last one)."""
        total = sum(v.nbytes for v in views)
        hooked = hooked_blocks(chunks, total)
        nbytes = sum(min((b + 1) * BLOCK_BYTES, total) - b * BLOCK_BYTES for b in hooked)
        return cls(views, integrity, hooked) if nbytes >= min(BLOCK_BYTES, total) else None

    def hook_for(self, c: Chunk) -> Any:
        """`leave_at` for chunk `c`'s WRITEs (posting.post_chunk), or None where it holds no hooked block."""
        return self.at if c.seq in self._chunks_hooked else None

    def leave(self, off: int, piece: memoryview) -> None:
        """A WRITE's on_leave (LeavingWrites.post_write), in payload offsets: digest `piece` (at `off`) on its way out."""
        try:
            while piece.nbytes:
                b = off // BLOCK_BYTES
                lo, end = b * BLOCK_BYTES, min((b + 1) * BLOCK_BYTES, self.total)
                n = min(piece.nbytes, end - off)
                h = self._hashing.get(b)
                if h is None and b in self.hooked and b not in self._skipped and b not in self._digests:
                    if off == lo:
                        h = self._hashing[b] = [self._start(b), 0]
                    else:
                        self._skipped.add(b)  # (its start left in another WRITE, or not through here)
                elif h is not None and lo + h[1] != off:  # not in order: left to settle
                    self._hashing.pop(b, None)
                    self._skipped.add(b)
                    h = None
                if h is not None:
                    h[0].update(piece[:n])
                    h[1] += n
                    if lo + h[1] == end:
                        self._hashing.pop(b, None)
                        self._done(b, h[0].digest())
                off += n
                piece = piece[n:]
        except Exception:  # (the blocks it touched are digested by settle instead)
            log.exception("digest of an outgoing piece at byte %d failed; its block is read again", off)
            self._skipped.add(off // BLOCK_BYTES)

    def settle(self) -> None:
        """Every byte that was going to leave has (every chunk but chunk 0 completed): digest on the pool each
        block that still has no digest and is not being digested there. Once; later calls do nothing."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
            todo = [b for b in range(self._n) if b not in self._digests and b not in self._pooled]
        for b in todo:
            self._hashing.pop(b, None)
        self._pool_blocks(todo)

    def _pool_blocks(self, which: Sequence[int]) -> None:
        which = [b for b in which if b < self._n]
        if not which:
            return
        blocks = _blocks(self._views)
        fn = block_digest_fn(self._integrity)
        with self._lock:
            self._pooled.update(which)
        for b in which:
            f = digest_pool("block").submit(fn, b, blocks[b])
            f.add_done_callback(functools.partial(self._pooled_done, b))

    def _pooled_done(self, b: int, f: "concurrent.futures.Future[Any]") -> None:
        try:
            d = f.result()
        except BaseException as exc:  # (the transfer fails on it, as on the pool's whole-payload digest)
            with self._lock:
                if not self.future.done():
                    self.future.set_exception(exc)
            return
        self._done(b, d)

    def _done(self, b: int, digest: Any) -> None:
        with self._lock:  # (held while the future is set: a pool failure sets it too)
            if b in self._digests or self.future.done():
                return  # (a block digested both ways: the same digest)
            self._digests[b] = digest
            if len(self._digests) == self._n:
                self.future.set_result(from_blocks(self.kind, self._digests))

    def at(self, base: int) -> Any:
        """on_leave for a WRITE whose first byte is payload byte `base`."""
        return lambda off, piece: self.leave(base + off, piece)


def hooked_blocks(chunks: Sequence[Chunk], total: int) -> Dict[int, int]:
    """The blocks that lie wholly inside one chunk other than chunk 0 (the last block may be short), each with
    that chunk's seq."""
    out: Dict[int, int] = {}
    for c in chunks:
        if c.seq == 0 or not c.length:
            continue
        end = c.offset + c.length
        b = -(-c.offset // BLOCK_BYTES)
        while b * BLOCK_BYTES < end and min((b + 1) * BLOCK_BYTES, total) <= end:
            out[b] = c.seq
            b += 1
    return out
