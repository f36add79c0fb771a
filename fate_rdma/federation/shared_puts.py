"""Buffered puts of the same arrays again share one copy.

FATE's aggregators send one average to each client in turn (`ctx.guest.put(...); ctx.hosts.put(...)` in
fate.ml.aggregator, SecureAggregatorServer's loop over ranks). With buffered puts each of those copied the
whole model again: N copies made, and N held at once, for N clients. A put whose arrays lie where the
copy of an earlier put (still held by its transfers) was taken from, at the same sizes, shares that copy
when its bytes are still the same: the XXH3 leaves of the arrays now (one parallel read, no write, no new
memory) must equal the leaves the copy took of each of its blocks while it was made (transfer.Fill.digests).
A put of arrays changed in between (a leaf differs) gets a copy of its own, as before.

Only where the copy's digests are XXH3 (the copier takes them under xxh3 and under the MACs, blake3 and
blake2b, which are keyed per connection): crc32c's 32 bits are too few to vouch that a caller's bytes did
not change, and none takes no digests while copying. The copy's room under
put_buffer_bytes is given back once the last put that shares it is done; a copy is pinned while a new put
compares its bytes with it, so the first put's transfers finishing meanwhile do not let it go.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from easypyverbs.buffers import address_of, as_byte_view

from ..channel.checksum import map_blocks
from ..channel.transfer import Fill
from ..protocol.integrity import BLOCK_BYTES, blocks, xxh_leaf, xxh_leaves


def xxh3_leaves(views: Sequence[memoryview], first: bytes = b"") -> bytes:
    """Every block's XXH3 leaf of `views`, in parallel: what the copy's Fill.digests hold, in order; with
    `first`, the first block's leaf already taken (only the others are read: none, for one block)."""
    return xxh_leaves(views, map_blocks, first)


def signature(bufs: Sequence[Any], views: Optional[Sequence[memoryview]] = None) -> List[Any]:
    """What must be equal for two puts to be candidates: each buffer's address and size; a bytes object
    (an array frame's header pickle and padding, made anew by every put) by value. `views`: the buffers'
    byte views (as_byte_view), where the caller has them."""
    views = views if views is not None else [as_byte_view(b) for b in bufs]
    return [b if isinstance(b, bytes) else (address_of(v), v.nbytes) for b, v in zip(bufs, views)]


class _Copy:
    __slots__ = ("sig", "copy", "fill", "users", "leaves")

    def __init__(self, sig: List[Any], copy: np.ndarray, fill: Fill) -> None:
        self.sig, self.copy, self.fill = sig, copy, fill
        self.users = 1
        #: the copy's XXH3 leaves once it is complete and shareable, else None
        self.leaves: Optional[bytes] = None


class SharedCopies:
    """The buffered puts' copies that their transfers still hold, by copy. `hold` before the first
    transfer can finish, `ready` once the copy is complete, `share` to find one for a new put, `release`
    when a put's transfers are all over. `on_free(nbytes)` gives a held copy's room back once its last
    user lets go (from whichever thread that is)."""

    def __init__(self, on_free: Callable[[int], None]) -> None:
        self._on_free = on_free
        self._copies: Dict[int, _Copy] = {}
        self._lock = threading.Lock()
        self.shared_puts = 0
        self.shared_bytes = 0

    def hold(self, bufs: Sequence[Any], copy: np.ndarray, fill: Optional[Fill]) -> None:
        """A put copying `bufs` into `copy` (its room reserved) has queued its transfers."""
        if fill is None or fill.digest is None or fill.digest[0] != "xxh3":
            return
        with self._lock:
            self._copies[id(copy)] = _Copy(signature(bufs), copy, fill)

    def ready(self, copy: np.ndarray) -> None:
        """`copy` is complete: later puts of the same bytes may share it."""
        with self._lock:
            c = self._copies.get(id(copy))
            if c is None or c.copy is not copy or not c.fill.done or c.fill.error is not None:
                return
            n = -(-c.fill.total // BLOCK_BYTES)
            if sorted(c.fill.digests) == list(range(n)):  # every block's leaf, taken where it was copied
                c.leaves = b"".join(c.fill.digests[i] for i in range(n))

    def share(self, bufs: Sequence[Any]) -> Optional[Tuple[np.ndarray, Fill]]:
        """A held, complete copy of exactly the bytes of `bufs` now, with its (finished) fill, counted as
        one more user; None if there is none (nothing held from these buffers, or their bytes changed)."""
        if not self._copies:  # (the common case, without the views: a first put)
            return None
        views = [as_byte_view(b) for b in bufs]
        sig = signature(bufs, views)
        with self._lock:
            found = [c for c in self._copies.values() if c.leaves is not None and c.sig == sig]
            for c in found:  # pinned while compared
                c.users += 1
        if not found:
            return None
        match: Optional[_Copy] = None
        try:  # outside the lock: the one pass over the bytes, the first block's first (arrays changed in place
            # since differ there: no need to read the rest)
            first = xxh_leaf(0, blocks(views, BLOCK_BYTES, 1)[0])
            if any(c.leaves is not None and c.leaves[:len(first)] == first for c in found):
                leaves = xxh3_leaves(views, first)
                match = next((c for c in reversed(found) if c.leaves == leaves), None)
        finally:
            for c in found:
                if c is not match:
                    self.release(c.copy)
        if match is None:
            return None
        with self._lock:
            self.shared_puts += 1
            self.shared_bytes += match.copy.nbytes
        return match.copy, match.fill

    def release(self, copy: Optional[np.ndarray]) -> bool:
        """One user of `copy` is done. True if the caller gives the room back itself (a copy never held
        here, or no copy); a held copy's room goes back through `on_free` when its last user is done."""
        if copy is None:
            return True
        with self._lock:
            c = self._copies.get(id(copy))
            if c is None or c.copy is not copy:
                return True
            c.users -= 1
            if c.users > 0:
                return False
            del self._copies[id(copy)]
        self._on_free(c.fill.total)
        return False

    def held(self) -> int:
        with self._lock:
            return len(self._copies)
