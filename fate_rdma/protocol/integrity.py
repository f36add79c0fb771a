"""What proves a transfer's bytes, and the receiver's rule that every transfer carries the proof it requires.

Five settings (ChannelConfig.checksum), one per endpoint, announced in the connection hello:

    crc32c   accidents: crc32c of each chunk (FedRDMA) or of the whole payload (FedRDMA-E), and of the metadata
    xxh3     accidents, at half crc32c's CPU: an XXH3-128 tag built as the BLAKE2b tag below, unkeyed
    blake3   a man in the middle: a keyed BLAKE3 tag built as the XXH3 tag (the default where connections
             have a session key: ~5 x BLAKE2b's speed per core here)
    blake2b  a man in the middle: a keyed BLAKE2b tag that he cannot recompute without the key
    none     nothing (trusted links, or the application checks)

The receiver decides: a header that carries another checksum than the receiver's is a
RemoteProtocolError naming the header field ('flags'), whatever the sender thinks.

The BLAKE2b tag (128 bits, in the header's last 16 bytes; frames.py) uses BLAKE2's tree mode, so the
payload is hashed in parallel 4 MiB blocks as crc32c is (hashlib releases the GIL):

    leaf i  keyed BLAKE2b-256 of block i of the payload (FedRDMA: of the chunk), tree parameters
            fanout 0, depth 2, leaf_size 4 MiB, inner_size 32, node_offset i, node_depth 0,
            last_node on the last block
    tag     keyed BLAKE2b-128, node_depth 1, last_node, over
            header bytes 0..47 || metadata (meta_len bytes) || leaf 0 || leaf 1 || ...

Header bytes 0..47 hold every field that says what the bytes are and where they go (transfer_id, seq,
nchunks, offset, length, meta_len, total, flags), so a forger can neither alter bytes nor move them
to another offset, chunk or transfer. The encoding is unambiguous: the header fixes the metadata's
length and, through `length` or `total`, the number of leaves. The key is one direction's MAC key
(auth.mac_keys: from the connection's session key, which never leaves the process), so a tag does
not verify in the other direction or on another connection.

The XXH3 tag (xxh3; 128 bits in the same 16 bytes, FLAG_XXH) has the same shape without a key, so it
guards against accidents only, as crc32c does (a forger can recompute it):

    leaf i  XXH3-128 of block i with seed i (a block moved to another place gets another leaf)
    tag     XXH3-128 (seed 0) over header bytes 0..47 (FLAG_XXH set) || metadata || leaf 0 || leaf 1 || ...

XXH3 hashes 4 MiB blocks at about 28 GB/s per core here against crc32c's 14.5 (both release the GIL),
and a 128-bit tag misses a random corruption with probability 2^-128 against crc32c's 2^-32.

The BLAKE3 tag (blake3; 128 bits, FLAG_B3) has the XXH3 tag's shape under the direction's MAC key (32
bytes), so its blocks are digested one by one, where they land or as placed notes arrive, as XXH3's:

    leaf i  keyed BLAKE3-256 of "L" || i (u64, big-endian) || block i
    tag     keyed BLAKE3-128 of "T" || header bytes 0..47 (FLAG_B3 set) || metadata || leaf 0 || leaf 1 || ...

The leading letter keeps leaf and tag inputs apart; the index binds a block to its place; the header
fixes the number of leaves through `length` or `total`, so no leaf needs marking as the last.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Callable, Iterable, List, Protocol, Sequence, Union

import blake3
import crc32c
import xxhash

from ..errors import LocalProtocolError, RemoteProtocolError
from .frames import HEADER_FIELDS_BYTES, TAG_BYTES, Header, encode_header

KINDS = ("crc32c", "xxh3", "blake3", "blake2b", "none")
#: the checksums keyed by the connection's session key (a MAC: a relay cannot recompute them)
KEYED = ("blake3", "blake2b")
#: the checksums made of independent per-block digests, which a receiver can take one by one ahead of the
#: header (PLACED notes) or where the bytes land (MR.track_writes); blake2b marks its last leaf
BLOCKWISE = ("crc32c", "xxh3", "blake3")
#: ... of those, the ones without a key: one copy's block digests serve every peer (federation/shared_puts.py)
UNKEYED_BLOCKWISE = ("crc32c", "xxh3")
#: a BLAKE3 key is 32 bytes (auth.direction_keys gives 32)
B3_KEY_BYTES = 32
#: the parallel block: large enough that a block's hashing outweighs handing it to a thread
BLOCK_BYTES = 4 << 20
LEAF_BYTES = 32
MIN_KEY_BYTES = 16
_NAMES = {"crc32c": "crc32c", "xxh3": "an XXH3 tag", "blake3": "a BLAKE3 MAC", "blake2b": "a BLAKE2b MAC",
          "none": "no checksum"}


class Hasher(Protocol):
    """What a block or tag digest is taken with: hashlib.blake2b, xxhash.xxh3_128."""

    def update(self, data: bytes, /) -> object: ...

    def digest(self) -> bytes: ...


#: what a payload's checksum is before it goes into a header: crc32c (int), leaf digests (bytes), or None
Digest = Union[int, bytes, None]


def tree_hash(key: bytes, digest_size: int, node_offset: int, node_depth: int, last_node: bool) -> "hashlib.blake2b":
    """A keyed BLAKE2b node of the tree (fanout 0, depth 2, leaf_size BLOCK_BYTES, inner_size LEAF_BYTES)."""
    return hashlib.blake2b(digest_size=digest_size, key=key, node_offset=node_offset, node_depth=node_depth,
                           last_node=last_node, fanout=0, depth=2, leaf_size=BLOCK_BYTES, inner_size=LEAF_BYTES)


def blocks(views: Sequence[memoryview], size: int = BLOCK_BYTES, most: int = 0) -> List[List[memoryview]]:
    """Fixed `size` (BLOCK_BYTES) blocks of the concatenated payload, each as the pieces of the buffers it
    covers (no copy); with `most`, only the first `most` blocks."""
    out: List[List[memoryview]] = []
    room = 0
    for v in views:
        pos = 0
        while pos < v.nbytes:
            if room == 0:
                if most and len(out) == most:
                    return out
                out.append([])
                room = size
            take = min(room, v.nbytes - pos)
            out[-1].append(v[pos:pos + take])
            pos += take
            room -= take
    return out


def leaf(key: bytes, index: int, last: bool, pieces: Sequence[memoryview]) -> bytes:
    """The keyed BLAKE2b-256 digest of block `index` (the pieces of the buffers it covers)."""
    h = tree_hash(key, LEAF_BYTES, index, 0, last)
    for p in pieces:
        h.update(p)
    return h.digest()


def leaves(key: bytes, views: Sequence[memoryview], map_: Callable[..., Iterable[bytes]] = map) -> bytes:
    """Every block's leaf digest, one after another; `map_` may run them in parallel (channel/checksum.py
    passes a thread pool's map: hashlib releases the GIL)."""
    bs = blocks(views)
    last = len(bs) - 1
    return b"".join(map_(lambda ib: leaf(key, ib[0], ib[0] == last, ib[1]), enumerate(bs)))


def xxh_hasher(index: int) -> xxhash.xxh3_128:
    """The hasher (`update`, `digest`) of block `index`'s XXH3-128 leaf: seeded with its index."""
    return xxhash.xxh3_128(seed=index)


def xxh_leaf(index: int, pieces: Sequence[memoryview]) -> bytes:
    """The XXH3-128 digest of block `index` (xxh_hasher)."""
    h = xxh_hasher(index)
    for p in pieces:
        h.update(p)
    return h.digest()


def xxh_leaves(views: Sequence[memoryview], map_: Callable[..., Iterable[bytes]] = map, first: bytes = b"") -> bytes:
    """Every block's XXH3 leaf, one after another; `map_` may run them in parallel (xxhash releases the GIL).
    `first`: the first block's leaf, already taken (that block is not read again)."""
    todo = list(enumerate(blocks(views)))[1 if first else 0:]
    return first + b"".join(map_(lambda ib: xxh_leaf(ib[0], ib[1]), todo))


def _tagged(h: Hasher, header: Header, meta: bytes, leaf_digests: bytes, kind: str) -> bytes:
    """Feed hash `h` header bytes 0..47 (with the flag of the tag's `kind`), the metadata and the leaves; its
    digest (its first TAG_BYTES) is the tag."""
    if len(meta) != header.meta_len:
        raise LocalProtocolError(f"metadata of {len(meta)} bytes, the header says {header.meta_len}")
    h.update(encode_header(dataclasses.replace(header, has_crc=False, has_mac=kind == "blake2b",
                                               has_xxh=kind == "xxh3", has_b3=kind == "blake3",
                                               tag=b""))[:HEADER_FIELDS_BYTES])
    h.update(meta)
    h.update(leaf_digests)
    return h.digest()[:TAG_BYTES]


def xxh_tag(header: Header, meta: bytes, leaf_digests: bytes) -> bytes:
    """The XXH3-128 tag of a header (its first 48 bytes), its metadata and its payload's leaves."""
    return _tagged(xxhash.xxh3_128(seed=0), header, meta, leaf_digests, "xxh3")


def tag(key: bytes, header: Header, meta: bytes, leaf_digests: bytes) -> bytes:
    """The BLAKE2b tag of a header (its first 48 bytes), its metadata and its payload's leaves."""
    h = tree_hash(key, TAG_BYTES, 0, 1, True)
    return _tagged(h, header, meta, leaf_digests, "blake2b")


def b3_hasher(key: bytes, index: int) -> "blake3.blake3":
    """The hasher (`update`, `digest`) of block `index`'s keyed BLAKE3 leaf ("L" and the index come first)."""
    h = blake3.blake3(key=key)
    h.update(b"L" + index.to_bytes(8, "big"))
    return h


def b3_leaf(key: bytes, index: int, pieces: Sequence[memoryview]) -> bytes:
    """The keyed BLAKE3-256 digest of block `index` (b3_hasher)."""
    h = b3_hasher(key, index)
    for p in pieces:
        h.update(p)
    return h.digest()


def b3_leaves(key: bytes, views: Sequence[memoryview], map_: Callable[..., Iterable[bytes]] = map) -> bytes:
    """Every block's keyed BLAKE3 leaf, one after another; `map_` may run them in parallel (blake3 releases
    the GIL on large inputs)."""
    return b"".join(map_(lambda ib: b3_leaf(key, ib[0], ib[1]), enumerate(blocks(views))))


def b3_tag(key: bytes, header: Header, meta: bytes, leaf_digests: bytes) -> bytes:
    """The keyed BLAKE3 tag of a header (its first 48 bytes), its metadata and its payload's leaves."""
    h = blake3.blake3(key=key)
    h.update(b"T")
    return _tagged(h, header, meta, leaf_digests, "blake3")


@dataclasses.dataclass(frozen=True)
class Integrity:
    """One direction's checksum: `kind`, and for blake2b the direction's MAC key (never printed)."""

    kind: str = "crc32c"
    key: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LocalProtocolError(f"checksum must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "blake2b" and not MIN_KEY_BYTES <= len(self.key) <= 64:
            raise LocalProtocolError("checksum blake2b needs a key of 16-64 bytes (an authenticated connection's)")
        if self.kind == "blake3" and len(self.key) != B3_KEY_BYTES:
            raise LocalProtocolError(f"checksum blake3 needs a key of {B3_KEY_BYTES} bytes (an authenticated "
                                     f"connection's)")

    @property
    def on(self) -> bool:
        return self.kind != "none"

    def require(self, h: Header, where: str) -> None:
        """The receiver's rule: `h` carries exactly the checksum this side requires."""
        if h.checksum != self.kind:
            raise RemoteProtocolError(f"{where}: header field 'flags' says {_NAMES[h.checksum]}, and this receiver "
                                      f"requires {_NAMES[self.kind]} (checksum: {self.kind}) of every transfer")

    def chunk_digest(self, views: Sequence[memoryview]) -> Digest:
        """The payload part of a FedRDMA chunk's checksum, in this thread (FedRDMA-E's whole payload:
        channel/checksum.py, in parallel blocks)."""
        if self.kind == "crc32c":
            crc = 0
            for v in views:
                crc = crc32c.crc32c(v, crc)
            return crc
        if self.kind == "xxh3":
            return xxh_leaves(views)
        if self.kind == "blake3":
            return b3_leaves(self.key, views)
        return leaves(self.key, views) if self.kind == "blake2b" else None

    def seal(self, h: Header, meta: bytes, digest: Digest) -> Header:
        """The sender's header with this checksum in it; `digest` is chunk_digest of a FedRDMA chunk, or
        channel/checksum.payload_digest of a FedRDMA-E payload."""
        if self.kind == "crc32c":
            return dataclasses.replace(h, crc=int(digest or 0), meta_crc=crc32c.crc32c(meta),
                                       has_crc=True, has_mac=False, has_xxh=False, tag=b"")
        h = dataclasses.replace(h, crc=0, meta_crc=0, has_crc=False, has_mac=self.kind == "blake2b",
                                has_xxh=self.kind == "xxh3", has_b3=self.kind == "blake3", tag=b"")
        if self.kind == "blake2b":
            return dataclasses.replace(h, tag=tag(self.key, h, meta, bytes(digest or b"")))
        if self.kind == "blake3":
            return dataclasses.replace(h, tag=b3_tag(self.key, h, meta, bytes(digest or b"")))
        if self.kind == "xxh3":
            return dataclasses.replace(h, tag=xxh_tag(h, meta, bytes(digest or b"")))
        return h

    def verify(self, h: Header, meta: bytes, digest: Digest) -> bool:
        """Whether `h` (which passed `require`) matches the metadata and the payload `digest` that arrived."""
        if self.kind == "crc32c":
            return digest == h.crc and crc32c.crc32c(meta) == h.meta_crc
        if self.kind == "blake2b":
            return hmac.compare_digest(tag(self.key, h, meta, bytes(digest or b"")), h.tag)
        if self.kind == "blake3":
            return hmac.compare_digest(b3_tag(self.key, h, meta, bytes(digest or b"")), h.tag)
        if self.kind == "xxh3":
            return xxh_tag(h, meta, bytes(digest or b"")) == h.tag
        return True

