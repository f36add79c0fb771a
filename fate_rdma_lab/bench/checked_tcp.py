"""Raw TCP with the channel's end-to-end check: the baseline that prices the check itself.

`bench transfer`'s raw TCP row checks nothing end to end (loopback TCP does not even checksum its
segments), while the channel's default (`checksum: xxh3`) digests every byte on both sides. This row
moves the same payload over the same kind of connection with the same check done as cheaply as Python
can: the blocks of the channel's integrity (4 MiB, protocol/integrity.py), each digested piece by piece
(the soft provider's TCP_PIECE_BYTES) by the thread that moves it, the sender right before a piece's
`sendall`, the receiver right after its `recv_into`, while the piece is still in that core's cache;
then the sender's digests follow the payload and the receiver compares them with its own. No windows,
no frames, no threads: what the check costs on this machine on top of the copies TCP does anyway, so
that a channel row with a checksum can be compared with a baseline that pays for one too.

Wire format after the payload: the digests' length (4 bytes, big-endian), then each block's digest in
order (XXH3-128: 16 bytes; crc32c: 4 bytes, big-endian; blake2b, blake3: 32 bytes).
"""
from __future__ import annotations

import socket
import struct
from typing import Any, Callable, List, Optional, Tuple

from easypyverbs.providers.soft.landing import TCP_PIECE_BYTES
from easypyverbs.providers.soft.wire import recv_exactly_into

from fate_rdma.channel.checksum import block_hasher
from fate_rdma.protocol.integrity import BLOCK_BYTES, BLOCKWISE, LEAF_BYTES, Integrity, tree_hash

#: checks this baseline can do: the block-wise ones, and blake2b's keyed leaves (the channel's default between
#: sites: a MAC), each block's keyed BLAKE2b-256 as the channel takes it, under BENCH_KEY (the baseline prices the
#: MAC's work, not its secrecy); none checks nothing
KINDS = BLOCKWISE + ("blake2b",)  # (BLOCKWISE: crc32c, xxh3, blake3)
BENCH_KEY = bytes(range(32))
_LEN = struct.Struct("!I")


def encode(digest: Any) -> bytes:
    return digest if isinstance(digest, bytes) else int(digest).to_bytes(4, "big")


def pieces_of_block(b: int, nbytes: int, piece_bytes: int = TCP_PIECE_BYTES) -> List[Tuple[int, int, int]]:
    """(block, offset, length) of each piece of block `b` of a payload of `nbytes`, in order."""
    start = b * BLOCK_BYTES
    end = min(start + BLOCK_BYTES, nbytes)
    return [(b, o, min(piece_bytes, end - o)) for o in range(start, end, piece_bytes)]


def _pieces(nbytes: int) -> List[Tuple[int, int, int]]:
    """(block, offset, length) of each piece, in order: none crosses a block or exceeds TCP_PIECE_BYTES."""
    return [p for b in range(-(-nbytes // BLOCK_BYTES)) for p in pieces_of_block(b, nbytes)]


def starter(kind: str, nbytes: int) -> Any:
    """`start(block)`: the hasher of a block of a payload of `nbytes` under check `kind`."""
    if kind == "blake2b":
        last = max(0, -(-nbytes // BLOCK_BYTES) - 1)
        return lambda b: tree_hash(BENCH_KEY, LEAF_BYTES, b, 0, b == last)
    start = block_hasher(Integrity(kind, BENCH_KEY if kind == "blake3" else b"")) if kind in BLOCKWISE else None
    if start is None:
        raise ValueError(f"raw TCP with a check: checksum {kind!r} has no block-wise digests (only {', '.join(KINDS)})")
    return start


def _move(view: memoryview, kind: str, move: Callable[[memoryview], Any], sending: bool) -> Tuple[bytes, int]:
    """Move `view` piece by piece with `move`, digesting each piece while it is in cache: before it goes
    (`sending`), else after it landed. Returns the digests, joined, and the number of blocks."""
    start = starter(kind, view.nbytes)
    digests: List[bytes] = []
    h: Any = None  # the hasher of the block in hand (block_hasher's start gives Any)
    block = -1
    for b, off, n in _pieces(view.nbytes):
        if b != block:
            if h is not None:
                digests.append(encode(h.digest()))
            h, block = start(b), b
        piece = view[off:off + n]
        if sending:
            h.update(piece)
        move(piece)
        if not sending:
            h.update(piece)
    if h is not None:
        digests.append(encode(h.digest()))
    return b"".join(digests), len(digests)


def digest(view: memoryview, kind: str) -> Tuple[bytes, int]:
    """The digests of every block of `view`, joined, and the number of blocks (nothing moved)."""
    return _move(view, kind, lambda piece: None, sending=True)


def send_blob(sock: socket.socket, blob: bytes) -> None:
    """The digests after the payload: their length, then them."""
    sock.sendall(_LEN.pack(len(blob)) + blob)


def send(sock: socket.socket, payload: memoryview, kind: str) -> None:
    """Send `payload`, each piece digested right before it goes, then the digests."""
    blob, _ = _move(payload, kind, sock.sendall, sending=True)
    send_blob(sock, blob)


def receive(sock: socket.socket, view: memoryview, kind: str) -> Optional[str]:
    """Fill `view` from `sock`, each piece digested right after it landed, and compare the sender's digests
    that follow; None if they match, else what differs."""
    mine, blocks = _move(view, kind, lambda piece: recv_exactly_into(sock, piece), sending=False)
    return compare(sock, mine, blocks, kind)


def compare(sock: socket.socket, mine: bytes, blocks: int, kind: str) -> Optional[str]:
    """Read the sender's digests from `sock` and compare them with `mine` (`blocks` of them); None if they
    match, else what differs."""
    head = bytearray(_LEN.size)
    recv_exactly_into(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length != len(mine):
        return f"the sender's digests are {length} bytes, {len(mine)} expected for {blocks} blocks"
    theirs = bytearray(length)
    recv_exactly_into(sock, memoryview(theirs))
    if bytes(theirs) != mine:
        size = len(mine) // max(1, blocks)
        bad = next(i for i in range(blocks) if theirs[i * size:(i + 1) * size] != mine[i * size:(i + 1) * size])
        return f"{kind} digest of block {bad} differs: the payload arrived corrupted"
    return None
