"""The connection handshake: who the peer is and what receive memory it offers, before any QP exists.

Both sides send a hello over the bootstrap connection (JSON, easypyverbs' framing) and read the
peer's; the QPs are then established over the same connection (easypyverbs.establish), and a last
exchange says that both sides have posted their receives. Every field of the peer's hello is checked
here, and a malformed one is a RemoteProtocolError naming the field. This is where peer
authentication belongs.

Hello (version 1):
    fate_rdma  int   protocol version, 1
    name       str   the endpoint's name (its FATE party address), 1-256 characters
    qps        int   queue pairs it wants per connection, 1..MAX_QPS (the smaller offer wins)
    pool       null or {"slots", "slot_payload_bytes", "meta_cap"}: its FedRDMA-E receive slots, at their
               largest; each slot's MR (sent with the QPs) is as large as its grant now, and it grows
               on the sender's GROW (protocol/pool.py)
    staging    null or {"count", "buf_bytes", "meta_cap"}: its FedRDMA staging buffers
    checksum   "crc32c", "xxh3", "blake2b" or "none": what it requires of every transfer it receives, which is
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
import select
import socket
from typing import Any, Dict, Mapping, Optional

import easypyverbs as ev

from ..errors import ConfigError, RemoteProtocolError
from ..protocol.frames import HEADER, MAX_META
from ..protocol.integrity import BLOCKWISE, KINDS as CHECKSUMS
from ..protocol.policy import one_host, qps_offer

VERSION = 1
MAX_QPS = 64
MAX_TERMS, MAX_TERM_CHARS = 8, 64
MAX_NAME = 256
MAX_SLOTS = 1024
MAX_STAGING = 1024
#: a slot holds at most one payload; 1 TiB is far above any model and far below overflow
MAX_SLOT_PAYLOAD_BYTES = 1 << 40
#: a staging buffer holds one chunk and its header; chunk_bytes is capped at 1 GiB
#: a header with the largest metadata (a FedRDMA staging buffer holds one before its chunk)
HDR_SLOT = HEADER.size + MAX_META
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

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any], where: str) -> "StagingOffer":
        meta_cap = _int(obj, "meta_cap", 0, MAX_META, where)
        buf = _int(obj, "buf_bytes", HEADER.size + meta_cap + 1, MAX_STAGING_BUF_BYTES, where)
        return cls(_int(obj, "count", 1, MAX_STAGING, where), buf, meta_cap)


@dataclasses.dataclass(frozen=True)
class Hello:
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


def exchange_hello(boot: ev.BootstrapConn, mine: Hello, timeout_s: float) -> Hello:
    """Send our hello, read and validate the peer's."""
    return Hello.from_wire(boot.exchange(mine.to_wire(), timeout_s), f"{boot.peer[0]}:{boot.peer[1]}")


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


@dataclasses.dataclass(frozen=True)
class Agreed:
    """What two sides agreed in their hellos: the peer's hello, this side's receive offers, the QPs to set up."""

    peer: Hello
    pool: Optional[PoolOffer]
    staging: Optional[StagingOffer]
    qps: int
    #: the peer is a process of this host with no link model between (its RTT probe reads scheduling noise)
    near: bool = False


def negotiate(boot: ev.BootstrapConn, cfg: Any, name: str, terms: Optional[Mapping[str, str]], proven: str) -> Agreed:
    """This side's offers (a FedRDMA-E pool, FedRDMA staging, QPs: cfg, a ChannelConfig) and hello, the peer's
    read and checked: it must name the party authentication proved (`proven`) and share the checksum and
    `terms`."""
    pool = PoolOffer(cfg.pool_slots, cfg.slot_bytes, MAX_META) if cfg.mode == "fedrdma-e" else None
    staging = (StagingOffer(cfg.max_window, HDR_SLOT + cfg.chunk_bytes, MAX_META)
               if cfg.mode == "fedrdma" or cfg.too_large == "fedrdma" else None)
    near = one_host(boot.local[0], boot.peer[0]) and not cfg.soft_link
    offer_qps = qps_offer(cfg.qps_per_peer, near)
    peer = exchange_hello(boot, Hello(name, offer_qps, pool, staging, cfg.checksum, terms,
                                      placed_notes=pool is not None and cfg.checksum in BLOCKWISE), cfg.connect_timeout_s)
    if peer.name != proven:
        raise RemoteProtocolError(f"peer authenticated as {proven!r} names itself {peer.name!r} in its hello")
    agree_checksum(cfg.checksum, peer)
    agree_terms(terms, peer)
    return Agreed(peer, pool, staging, max(1, min(offer_qps, peer.qps)), near)


def confirm_posted(boot: ev.BootstrapConn, timeout_s: float) -> None:
    """Both sides have posted their receives: from now on neither side's first SEND can find none."""
    reply = boot.exchange({"posted": True}, timeout_s)
    if not isinstance(reply, dict) or reply.get("posted") is not True:
        raise RemoteProtocolError(f"peer at {boot.peer} did not finish connection set-up")


def bootstrap_closed(boot: ev.BootstrapConn) -> bool:
    """Both sides keep the bootstrap socket for the connection's lifetime, so its end of file means the
    peer is gone. An RC QP alone notices that only when a WR of ours goes unanswered, which an
    idle sender waiting for ACKs (FedRDMA) never posts: a real NIC's QP would wait for the
    no-progress deadline."""
    sock = boot.sock
    try:
        if not select.select([sock], [], [], 0)[0]:  # (a peek on a socket with a timeout would wait)
            return False
        # the TCP stream itself, also under TLS (an SSLSocket takes no recv flags): nothing but the peer's
        # end of file is due there once the connection is set up (tls.py: no session tickets)
        return socket.socket.recv(sock, 1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True
