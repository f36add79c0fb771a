"""End-to-end checksums of payloads, computed in parallel blocks (crc32c and hashlib's BLAKE2b release
the GIL).

crc32c: a transfer's checksum is crc32c over the big-endian crc32c of each 4 MiB block of the
payload. xxh3, blake3 and blake2b: the payload's part of the tag is the list of (for the last two
keyed) leaf digests of the same blocks (protocol/integrity.py; the tag over the header, metadata and leaves is cheap). Either
way both sides split the work across cores and the sender computes it while chunks are already on
the wire (the header, which carries it, is posted last).
"""
from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import crc32c

from ..errors import ConfigError
from ..protocol.integrity import (BLOCK_BYTES, BLOCKWISE, KEYED, UNKEYED_BLOCKWISE, Digest, Integrity, b3_hasher, b3_leaf,
                                  b3_leaves, blocks as _blocks, leaves, xxh_hasher, xxh_leaf, xxh_leaves)
from .auth import Identity, mac_keys

_POOLS: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def digest_pool(kind: str) -> concurrent.futures.ThreadPoolExecutor:
    """Two pools, so that no task ever waits on its own pool: "payload" runs whole-payload checksums
    (which wait for their blocks), "block" runs block checksums (which wait for nothing). One shared
    pool deadlocked as soon as every worker held a payload task waiting for blocks queued behind it."""
    with _POOLS_LOCK:
        pool = _POOLS.get(kind)
        if pool is None:
            workers = max(1, min(4, os.cpu_count() or 1))
            pool = _POOLS[kind] = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                                        thread_name_prefix=f"fate-rdma-crc-{kind}")
        return pool


#: a payload at most this large is digested in the thread that sends it: a pool's hand-offs cost more
#: than hashing it (1 MiB: about 0.04 ms of XXH3, 0.07 ms of crc32c here)
INLINE_DIGEST_BYTES = 1 << 20


def map_blocks(fn: Callable[[Any], Any], items: Iterable[Any]) -> List[Any]:
    """[fn(x) for x in items]: on the block pool when there are several, else in this thread (one block
    gains nothing from a worker but the hand-offs)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    return list(digest_pool("block").map(fn, items))


def _crc_pieces(pieces: List[memoryview]) -> int:
    crc = 0
    for p in pieces:
        crc = crc32c.crc32c(p, crc)
    return crc


def payload_checksum(views: Sequence[memoryview]) -> int:
    """crc32c of the per-block crc32c list; independent of how the payload is split into buffers."""
    return _combine(map_blocks(_crc_pieces, _blocks(views)))


def _combine(crcs: List[int]) -> int:
    """The transfer's checksum from its blocks' crc32c, in order."""
    return crc32c.crc32c(struct.pack(f"!{len(crcs)}I", *crcs))


def block_digest_fn(integrity: Integrity) -> Callable[[int, List[memoryview]], Any]:
    """(block index, the block's pieces) -> that block's digest, for a BLOCKWISE checksum."""
    if integrity.kind == "crc32c":
        return lambda _i, pieces: _crc_pieces(pieces)
    if integrity.kind == "xxh3":
        return xxh_leaf
    if integrity.kind == "blake3":
        key = integrity.key
        return lambda i, pieces: b3_leaf(key, i, pieces)
    raise ValueError(f"checksum {integrity.kind!r} has no block-wise digests (only {', '.join(BLOCKWISE)})")


def block_checksums_async(payload: memoryview, first: int, known: Dict[int, Any], landed: Optional[Any],
                          integrity: Integrity, upto: Optional[int] = None) -> None:
    """Start the digest (a BLOCKWISE `integrity`'s) of every block of `payload` (one buffer) from block `first`
    up to block `upto` (exclusive; None: the last) that `known` (block index -> future) lacks and `landed`
    (digests taken where the blocks landed, payload_digest_with) has none for, on the block pool: the
    receiver's share of payload_digest for bytes a PLACED note says are placed, computed while the rest
    arrives. Only the blocks asked for are looked at (a transfer's notes each name the blocks placed since
    the one before)."""
    fn = block_digest_fn(integrity)
    n = payload.nbytes
    last = -(-n // BLOCK_BYTES) if upto is None else min(upto, -(-n // BLOCK_BYTES))
    for b in range(first, last):
        lo, hi = b * BLOCK_BYTES, min((b + 1) * BLOCK_BYTES, n)
        if b not in known and (landed is None or landed.take(b, hi - lo) is None):
            known[b] = digest_pool("block").submit(fn, b, [payload[lo:hi]])


class _Crc:
    """A block's crc32c, piece by piece (a hasher for block_hasher)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, piece: memoryview) -> None:
        self.value = crc32c.crc32c(piece, self.value)

    def digest(self) -> int:
        return self.value


def block_hasher(integrity: Integrity) -> Optional[Callable[[int], Any]]:
    """`start(block)`: a hasher (`update`, `digest`) whose digest is block `block`'s share of the payload
    digest, for a check whose blocks are digested on their own (crc32c, xxh3: the receive slots digest
    each block where it lands, easypyverbs MR.track_writes; blake3 keyed); None for blake2b (its last leaf is
    marked) and none."""
    if integrity.kind == "crc32c":
        return lambda _block: _Crc()
    if integrity.kind == "xxh3":
        return xxh_hasher
    if integrity.kind == "blake3":
        key = integrity.key
        return lambda block: b3_hasher(key, block)
    return None


def payload_digest_with(integrity: Integrity, payload: memoryview, known: Dict[int, Any],
                        landed: Optional[Any] = None) -> Digest:
    """payload_digest(integrity, [payload]) (crc32c or xxh3) from each block's digest taken where it landed
    (`landed.take`, block_hasher), else started early (`known`: block -> future, block_checksums_async),
    else computed now, in parallel."""
    blocks = _blocks([payload])
    got: Dict[int, Any] = {}
    for i, b in enumerate(blocks):
        d = landed.take(i, sum(p.nbytes for p in b)) if landed is not None else None
        if d is not None:
            got[i] = d
        elif i in known:
            got[i] = known[i].result()
    todo = [i for i in range(len(blocks)) if i not in got]
    fn = block_digest_fn(integrity)
    got.update(zip(todo, map_blocks(lambda i: fn(i, blocks[i]), todo)))
    return from_blocks(integrity.kind, got)


def payload_leaves(views: Sequence[memoryview], key: bytes) -> bytes:
    """The keyed BLAKE2b leaf digests of the payload's blocks (integrity.leaves), in parallel."""
    return leaves(key, views, map_blocks)


def payload_digest(integrity: Integrity, views: Sequence[memoryview]) -> Digest:
    """The payload's part of a FedRDMA-E header's checksum: payload_checksum, leaves, or None."""
    if integrity.kind == "crc32c":
        return payload_checksum(views)
    if integrity.kind == "xxh3":
        return xxh_leaves(views, map_blocks)
    if integrity.kind == "blake3":
        return b3_leaves(integrity.key, views, map_blocks)
    return payload_leaves(views, integrity.key) if integrity.kind == "blake2b" else None


def block_digest(kind: str) -> Optional[Tuple[str, Callable[[int, memoryview], Any]]]:
    """(kind, the digest of block i of a payload) for a checksum whose blocks one copy can serve to every
    peer (crc32c, xxh3: unkeyed), else None (blake2b and blake3 are keyed per connection; none has no blocks)."""
    if kind not in UNKEYED_BLOCKWISE:
        return None
    fn = block_digest_fn(Integrity(kind))
    return kind, lambda i, block: fn(i, [block])


def from_blocks(kind: str, digests: Dict[int, Any]) -> Digest:
    """A payload's digest from all of its blocks' digests (block_digest, block_digest_fn), in order."""
    ordered = [digests[i] for i in range(len(digests))]
    return _combine(ordered) if kind == "crc32c" else b"".join(ordered)


def payload_checksum_async(views: Sequence[memoryview], integrity: Integrity,
                           fill: Any = None) -> "concurrent.futures.Future[Digest]":
    """payload_digest on a worker thread (the sender overlaps it with the first chunks on the wire; a
    payload of at most INLINE_DIGEST_BYTES in this thread, at once); of a
    payload still being copied in (`fill`, transfer.Fill), once every byte is final, from the digests the
    copier took of each block where it took them for this checksum. If the copy fails the future stays
    pending: the transfer fails on the copy's error instead."""
    if fill is None and sum(v.nbytes for v in views) <= INLINE_DIGEST_BYTES:
        done: "concurrent.futures.Future[Digest]" = concurrent.futures.Future()
        try:
            done.set_result(payload_digest(integrity, list(views)))
        except Exception as exc:  # as the pool's future would carry it
            done.set_exception(exc)
        return done
    if fill is None:
        return digest_pool("payload").submit(payload_digest, integrity, list(views))
    out: "concurrent.futures.Future[Digest]" = concurrent.futures.Future()

    def start() -> None:
        if fill.error is not None:
            return
        if fill.digest is not None and fill.digest[0] == integrity.kind and not integrity.key:
            out.set_result(from_blocks(integrity.kind, fill.digests))
            return
        concurrent.futures.Future.add_done_callback(payload_checksum_async(views, integrity),
                                                    lambda f: _settle(out, f))
    fill.when_done(start)
    return out


def _settle(out: "concurrent.futures.Future[Any]", f: "concurrent.futures.Future[Any]") -> None:
    exc = f.exception()
    out.set_exception(exc) if exc is not None else out.set_result(f.result())


def integrities(kind: str, identity: Identity, dialer: bool) -> Tuple[Integrity, Integrity]:
    """(what this side's transfers carry, what it requires of the peer's) on a connection: for a MAC (blake3, blake2b)
    each direction's MAC key, from the session key the authentication derived."""
    if kind not in KEYED:
        return Integrity(kind), Integrity(kind)
    if not identity.session_key:
        raise ConfigError(f"fate-rdma: checksum {kind} needs an authenticated connection (secret_file or tls), "
                          f"and the one with {identity.name} is not")
    send_key, recv_key = mac_keys(identity.session_key, dialer)
    return Integrity(kind, send_key), Integrity(kind, recv_key)
