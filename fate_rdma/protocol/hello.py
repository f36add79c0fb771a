"""The hello: what each side of a connection says of itself before any QP exists (who it is, what receive
memory it offers, which checksum it requires), and the checks of the peer's. Sent as JSON over the bootstrap
connection (channel/handshake.py does the sending); every field of the peer's hello is checked here, and a
malformed one is a RemoteProtocolError naming the field.

Hello (version 1):
    fate_rdma  int   protocol version, 1
    name       str   the endpoint's name (its FATE party address), 1-256 characters
    qps        int   queue pairs it wants per connection, 1..MAX_QPS (the smaller offer wins)
    pool       null or {"slots", "slot_payload_bytes", "meta_cap"}: its FedRDMA-E receive slots, at their
               largest; each slot's MR (sent with the QPs) is as large as its grant now, and it grows
               on the sender's GROW (protocol/pool.py)
    staging    null or {"count", "buf_bytes", "meta_cap"}: its FedRDMA staging buffers
    checksum   "crc32c", "xxh3", "blake3", "blake2b" or "none": what it requires of every transfer it receives, which is
               also what it sends with (one setting per endpoint). Absent (an endpoint that predates
               it): not checked here; its frames still meet the receiver's rule one by one.
    placed_notes  true if it takes PLACED notes (frames.CtrlKind.PLACED: the sender says which payload
               bytes of a FedRDMA-E transfer are placed, and the receiver checksums them before the header
               arrives). Absent or false (an endpoint that predates it): none are sent to it.
    terms      null or {str: str} (at most MAX_TERMS, short): settings of the layer above the channel that
               both ends must share (the FATE wrapper's `descriptors`); a key both announce with different
               values fails the connection on both sides with a ConfigError naming both. Absent (an
               endpoint that predates it): not checked.

Checksum agreement: each side compares the peer's announced checksum with its own, and a difference
fails the connection on both sides with a ConfigError that names both settings, before any memory is
registered. A peer that does not announce one (or lies) and sends another checksum has each such
transfer refused by the receiver as a protocol error (protocol/integrity.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

from ..errors import ConfigError, RemoteProtocolError
from .frames import HEADER, MAX_META, Header
from .integrity import KINDS as CHECKSUMS

VERSION = 1
MAX_QPS = 64
MAX_TERMS, MAX_TERM_CHARS = 8, 64
MAX_NAME = 256
MAX_SLOTS = 1024
MAX_STAGING = 1024
#: a slot holds at most one payload; 1 TiB is far above any model and far below overflow
MAX_SLOT_PAYLOAD_BYTES = 1 << 40
#: a header with the largest metadata (a FedRDMA staging buffer holds one before its chunk)
HDR_SLOT = HEADER.size + MAX_META
#: a staging buffer holds one chunk and its header; chunk_bytes is capped at 1 GiB
MAX_STAGING_BUF_BYTES = (1 << 30) + HDR_SLOT


def _int(obj: Mapping[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RemoteProtocolError(f"hello from {where}: field {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise RemoteProtocolError(f"hello from {where}: field {key!r} = {v} is outside [{lo}, {hi}]")
    return v


def _section(obj: Mapping[str, Any], key: str, where: str) -> Optional[Mapping[str, Any]]:
    v = obj.get(key)
    if v is not None and not isinstance(v, dict):
        raise RemoteProtocolError(f"hello from {where}: field {key!r} must be an object or null")
    return v


@dataclasses.dataclass(frozen=True)
class PoolOffer:
    """The peer's FedRDMA-E receive pool: `slots` slots of [HEADER][meta_cap][payload], the payload
    room of each growing to at most `slot_payload_bytes`."""

    slots: int
    slot_payload_bytes: int
    meta_cap: int

    @property
    def slot_bytes(self) -> int:
        return HEADER.size + self.meta_cap + self.slot_payload_bytes

    def slot_base(self, slot: int) -> int:
        """Offset of slot `slot` in the pool MR (its header)."""
        return slot * self.slot_bytes

    def payload_offset(self, slot: int, offset: int) -> int:
        """Offset in the pool of payload byte `offset` of slot `slot`."""
        return self.slot_base(slot) + HEADER.size + self.meta_cap + offset

    def offset_in_slot(self, offset: int) -> int:
        """Offset in a slot's own MR of payload byte `offset`."""
        return HEADER.size + self.meta_cap + offset

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> "PoolOffer":
        return cls(_int(obj, "slots", 1, MAX_SLOTS, where),
                   _int(obj, "slot_payload_bytes", 1, MAX_SLOT_PAYLOAD_BYTES, where),
                   _int(obj, "meta_cap", 0, MAX_META, where))


@dataclasses.dataclass(frozen=True)
class StagingOffer:
    """The peer's FedRDMA staging buffers: `count` buffers of [HEADER][meta_cap][chunk]."""

    count: int
    buf_bytes: int
    meta_cap: int

    def base(self, index: int) -> int:
        return index * self.buf_bytes

    def data_offset(self, index: int) -> int:
        return self.base(index) + HEADER.size + self.meta_cap

    @property
    def chunk_capacity(self) -> int:
        return self.buf_bytes - HEADER.size - self.meta_cap

    def check_arrival(self, index: int) -> None:
        """A header WRITE_WITH_IMM named staging buffer `index` (packing.StagedWrite): one of these, or the
        peer's fault."""
        if not 0 <= index < self.count:
            raise RemoteProtocolError(f"WRITE_WITH_IMM names staging buffer {index}; this side has {self.count}")

    def check_chunk(self, hdr: Header) -> None:
        """The chunk that header `hdr` announces must fit a staging buffer."""
        if hdr.length > self.chunk_capacity:
            raise RemoteProtocolError(f"transfer {hdr.transfer_id} chunk {hdr.seq}: {hdr.length} bytes do not fit a "
                                      f"staging buffer of {self.chunk_capacity}")

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> "StagingOffer":
        meta_cap = _int(obj, "meta_cap", 0, MAX_META, where)
        buf = _int(obj, "buf_bytes", HEADER.size + meta_cap + 1, MAX_STAGING_BUF_BYTES, where)
        return cls(_int(obj, "count", 1, MAX_STAGING, where), buf, meta_cap)


@dataclasses.dataclass(frozen=True)
class Hello:
    """A side's hello, its fields as the module's docstring has them (`version`: the wire's `fate_rdma`)."""

    name: str
    qps: int
    pool: Optional[PoolOffer] = None
    staging: Optional[StagingOffer] = None
    checksum: Optional[str] = None
    terms: Optional[Dict[str, str]] = None
    placed_notes: bool = False
    version: int = VERSION

    def to_wire(self) -> Dict[str, Any]:
        return {"fate_rdma": self.version, "name": self.name, "qps": self.qps,
                "pool": dataclasses.asdict(self.pool) if self.pool else None,
                "staging": dataclasses.asdict(self.staging) if self.staging else None, "checksum": self.checksum,
                "terms": self.terms, "placed_notes": self.placed_notes}

    @classmethod
    def from_wire(cls, obj: Any, where: str) -> "Hello":
        """The peer's hello, every field checked; RemoteProtocolError names the first bad one."""
        if not isinstance(obj, dict):
            raise RemoteProtocolError(f"hello from {where} is not an object")
        version = obj.get("fate_rdma")
        if version != VERSION or isinstance(version, bool):
            raise RemoteProtocolError(f"peer at {where} is not a fate-rdma endpoint of this version "
                                      f"(hello field 'fate_rdma' = {version!r}, expected {VERSION})")
        name = obj.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
            raise RemoteProtocolError(f"hello from {where}: field 'name' must be a string of 1-{MAX_NAME} characters")
        pool = _section(obj, "pool", where)
        staging = _section(obj, "staging", where)
        checksum = obj.get("checksum")
        if checksum is not None and checksum not in CHECKSUMS:
            raise RemoteProtocolError(f"hello from {where}: field 'checksum' must be one of {CHECKSUMS} or null, "
                                      f"got {checksum!r}"[:300])
        terms = obj.get("terms")
        if terms is not None and not (isinstance(terms, dict) and len(terms) <= MAX_TERMS and all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_TERM_CHARS and len(v) <= MAX_TERM_CHARS
                for k, v in terms.items())):
            raise RemoteProtocolError(f"hello from {where}: field 'terms' must be null or an object of at most "
                                      f"{MAX_TERMS} strings of at most {MAX_TERM_CHARS} characters")
        return cls(name, _int(obj, "qps", 1, MAX_QPS, where),
                   PoolOffer.from_wire(pool, where) if pool is not None else None,
                   StagingOffer.from_wire(staging, where) if staging is not None else None, checksum, terms,
                   obj.get("placed_notes") is True)


def agree_checksum(mine: str, peer: Hello) -> None:
    """Both sides must use the same checksum: the receiver requires its own of every transfer."""
    if peer.checksum is not None and peer.checksum != mine:
        raise ConfigError(f"fate-rdma: {peer.name} has checksum {peer.checksum!r} and this side {mine!r}; a receiver "
                          f"requires its checksum of every transfer: set the same checksum at every party")


def agree_terms(mine: Optional[Mapping[str, str]], peer: Hello) -> None:
    """Settings of the layer above that both sides must share: a key both announce must match."""
    for key, value in (mine or {}).items():
        theirs = (peer.terms or {}).get(key)
        if theirs is not None and theirs != value:
            raise ConfigError(f"fate-rdma: {peer.name} uses {key}: {theirs} and this side {key}: {value}; set the same "
                              f"{key} at every party")
