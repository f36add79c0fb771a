"""Wire frames. Every frame starts with magic 0xFD4A and a version byte, so garbage fails fast.

HEADER `!HBBHHQIIQIIQIIII` (64 bytes): precedes every FedRDMA chunk, and sits at offset 0 of a
FedRDMA-E receive slot (written once, with the first chunk, by the last WRITE_WITH_IMM).

    magic        u16  0xFD4A
    version      u8   1
    kind         u8   HeaderKind: CHUNK (FedRDMA) or SLOT (FedRDMA-E)
    flags        u16  bit 0 FLAG_CRC: crc and meta_crc are set (checksum crc32c);
                      bit 1 FLAG_MAC: the last 16 bytes are a BLAKE2b tag (checksum blake2b);
                      bit 2 FLAG_XXH: the last 16 bytes are an XXH3-128 tag (checksum xxh3);
                      bit 3 FLAG_B3: the last 16 bytes are a keyed BLAKE3 tag (checksum blake3);
                      none: no checksum. More than one, or any other bit: a protocol error
    reserved     u16  0 (anything else is a protocol error)
    transfer_id  u64  unique per sending endpoint (a transfer resumed on a new connection keeps its id)
    seq          u32  chunk number (0-based); FedRDMA-E: always 0
    nchunks      u32  chunks in the transfer
    offset       u64  where this chunk's bytes go in the payload
    length       u32  bytes of payload in this chunk
    meta_len     u32  bytes of metadata after the header (chunk 0 / the slot only)
    total        u64  payload bytes of the whole transfer
    -- bytes 48..63: FLAG_CRC or no checksum --
    crc          u32  crc32c: of this chunk (FedRDMA) or of the whole payload (FedRDMA-E)
    meta_crc     u32  crc32c of the metadata bytes (0 when there are none)
    reserved2    u32  0
    reserved3    u32  0 (keeps the header 64 bytes)
    -- bytes 48..63: FLAG_MAC --
    tag          16 B keyed BLAKE2b-128 over bytes 0..47 of this header (every field above, FLAG_MAC
                      included), the metadata and the payload bytes (FedRDMA: this chunk's; FedRDMA-E:
                      the whole payload's), keyed per direction by the connection's session key. The
                      construction is in integrity.py.
    -- bytes 48..63: FLAG_B3 --
    tag          16 B keyed BLAKE3 over the same bytes as the MAC, keyed alike (integrity.py)
    -- bytes 48..63: FLAG_XXH --
    tag          16 B XXH3-128 over the same bytes as the MAC (unkeyed: against accidents, as crc32c,
                      at half its CPU cost and with a 128-bit tag; integrity.py)

The MAC takes the four u32 that crc32c leaves to two checksums and two reserved fields: the header
keeps its size and version, and one flag bit says which reading applies. Decoding is canonical
(reserved fields and unknown flags are refused), so `encode_header(decode_header(raw)) == raw` for
every header accepted and the receiver may MAC the re-encoded fields.

CTRL `!HBBHHQQQ` (32 bytes), then `reason_len` bytes of UTF-8 (ERROR and CANCEL, a RESUME's digest; at most
`MAX_REASON`): control messages that travel as SENDs on the first QP of a connection.

    magic        u16  0xFD4A
    version      u8   1
    kind         u8   CtrlKind
    flags        u16  bit 0 CTRL_FLAG_MAC: a 16-byte tag follows the reason (set exactly when the connection
                      has a session key: authenticated by the secret or by TLS); no other bit
    reason_len   u16  bytes of reason text after the frame
    transfer_id  u64  the transfer concerned (ACK, CANCEL, ERROR, DONE, GROW, PLACED, RESUME, RESUMED);
                      CREDIT: the slot's payload capacity in bytes under this grant; else 0
    value        u64  ACK: chunk seq; CREDIT, GROW, RECLAIM, RETURN: slot; ERROR: ErrorCode;
                      PROBE/PROBE_REPLY: nonce; PLACED: slot << 48 | the payload's bytes; RESUME: the
                      payload's bytes; RESUMED: ResumeState
    aux          u64  ACK: the staging buffer the chunk used (its credit goes back); CREDIT: the rkey
                      under which the slot is granted again; GROW: payload bytes the transfer needs;
                      RECLAIM, RETURN: the rkey of the grant asked back / handed back; PLACED: the
                      payload offset from which every byte is placed; RESUME: slot << 48 | payload offset
                      (a FedRDMA-E claim: packing.py; 0: none); RESUMED: the offset held to or from
                      (PARTIAL, SUFFIX); else 0

    tag          16 B CTRL_FLAG_MAC only: keyed BLAKE2b-128 of (the frame's number on this connection in
                      this direction, u64 big-endian, counted from 0) || the frame and its reason, keyed
                      per direction by the connection's session key (auth.direction_keys, "ctrl"). The
                      number is not sent: both sides count, and control frames travel in order (SENDs on
                      one RC QP), so an altered, forged, replayed or reordered frame, or one after a frame
                      that was dropped, fails its check and the connection with it.

GROW, RECLAIM and RETURN resize FedRDMA-E receive slots; who sends which, and when, is in pool.py.
RESUME and RESUMED travel on a connection made again after one broke mid-transfer (channel/resume.py):
sealed like every frame, under the new connection's session key, so a relay cannot fake progress.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import struct

from ..errors import LocalProtocolError, RemoteProtocolError

MAGIC = 0xFD4A
VERSION = 1
HEADER = struct.Struct("!HBBHHQIIQIIQIIII")
CTRL = struct.Struct("!HBBHHQQQ")
FLAG_CRC = 1
FLAG_MAC = 2
FLAG_XXH = 4
FLAG_B3 = 8
CTRL_FLAG_MAC = 1
#: bytes of a BLAKE2b tag: the header's last four u32
TAG_BYTES = 16
#: the header's bytes that every checksum's MAC covers: all but the crc / tag area
HEADER_FIELDS_BYTES = HEADER.size - TAG_BYTES
_TAIL = struct.Struct("!IIII")
#: metadata rides in the header area of a FedRDMA-E slot; 64 KiB is plenty for names, tags and gRPC metadata
MAX_META = 64 * 1024
MAX_REASON = 1024
PLACED_TOTAL_MASK = (1 << 48) - 1
MAX_CHUNK = (1 << 32) - 1


class HeaderKind(enum.IntEnum):
    CHUNK = 1
    SLOT = 2


class CtrlKind(enum.IntEnum):
    ACK = 1  # FedRDMA: chunk `value` of `transfer_id` is placed
    CREDIT = 2  # FedRDMA-E: slot `value` is free again: rkey `aux`, room for `transfer_id` payload bytes
    CANCEL = 3  # either side: abandon `transfer_id`
    ERROR = 4  # receiver -> sender: `transfer_id` failed with code `value` (ErrorCode), reason follows
    PROBE = 5  # RTT probe, echoed as PROBE_REPLY with the same nonce in `value`
    PROBE_REPLY = 6
    DONE = 7  # receiver -> sender (FedRDMA-E): `transfer_id` arrived, verified, delivered
    GROW = 8  # sender -> receiver (FedRDMA-E): make slot `value` hold `aux` payload bytes for `transfer_id`
    RECLAIM = 9  # receiver -> sender (FedRDMA-E): hand slot `value` (granted under rkey `aux`) back, to shrink it
    RETURN = 10  # sender -> receiver (FedRDMA-E): slot `value` (rkey `aux`) is not written until its next CREDIT
    #: sender -> receiver (FedRDMA-E, to a receiver whose hello asked for them): every payload byte of
    #: `transfer_id` from offset `aux` to its end is placed in slot `value >> 48`, whose payload has
    #: `value & PLACED_TOTAL_MASK` bytes: the receiver may checksum them before the header arrives
    PLACED = 11
    #: sender -> receiver, on a connection made again after one broke mid-transfer: what is held of
    #: `transfer_id` (`value` payload bytes)? With a FedRDMA-E claim in `aux` and its digest as the reason
    #: (packing.py). Answered by RESUMED
    RESUME = 12
    #: receiver -> sender: of `transfer_id`, this side holds state `value` (ResumeState), and with PARTIAL
    #: the payload's first `aux` bytes, verified, with SUFFIX its bytes from `aux` on
    RESUMED = 13


class ErrorCode(enum.IntEnum):
    """Why a receiver refused a transfer (CTRL ERROR); an unknown code reads as a plain TransferError."""

    INTEGRITY = 1  # a checksum did not match
    TOO_LARGE = 2  # the payload exceeds what this receiver accepts
    PROTOCOL = 3  # the sender's frames were malformed or inconsistent
    TIMEOUT = 4  # the receiver dropped the transfer: no progress within its deadline


class ResumeState(enum.IntEnum):
    """What a receiver holds of a transfer it is asked to resume (CTRL RESUMED)."""

    UNKNOWN = 0  # nothing: send it whole
    PARTIAL = 1  # its first `aux` bytes, verified: send the rest
    DELIVERED = 2  # all of it, delivered: nothing to send
    SUFFIX = 3  # its bytes from `aux` to the end, verified (FedRDMA-E: against the RESUME's digest): send the first


@dataclasses.dataclass(frozen=True)
class Header:
    kind: HeaderKind
    transfer_id: int
    seq: int
    nchunks: int
    offset: int
    length: int
    meta_len: int
    total: int
    crc: int = 0
    meta_crc: int = 0
    has_crc: bool = False
    #: FLAG_MAC: `tag` (TAG_BYTES) replaces crc and meta_crc; zeros until the sender seals the header
    has_mac: bool = False
    tag: bytes = b""
    #: FLAG_XXH: `tag` is an XXH3-128 tag (as has_mac's, unkeyed)
    has_xxh: bool = False
    #: FLAG_B3: `tag` is a keyed BLAKE3 tag
    has_b3: bool = False

    @property
    def checksum(self) -> str:
        """The checksum this header carries, named as ChannelConfig.checksum names it."""
        return ("blake2b" if self.has_mac else "blake3" if self.has_b3 else "xxh3" if self.has_xxh
                else "crc32c" if self.has_crc else "none")

    @property
    def tagged(self) -> bool:
        """The header's last 16 bytes are a tag (blake2b, blake3, xxh3), not crc32c's fields."""
        return self.has_mac or self.has_xxh or self.has_b3


@dataclasses.dataclass(frozen=True)
class Ctrl:
    kind: CtrlKind
    transfer_id: int
    value: int = 0
    aux: int = 0
    reason: str = ""


def encode_header(h: Header) -> bytes:
    if h.has_crc + h.has_mac + h.has_xxh + h.has_b3 > 1:
        raise LocalProtocolError("a header carries one checksum: crc32c, a MAC tag or an XXH3 tag")
    if h.tagged:
        tag = h.tag or bytes(TAG_BYTES)
        if len(tag) != TAG_BYTES:
            raise LocalProtocolError(f"tag of {len(tag)} bytes, the header holds {TAG_BYTES}")
        tail = _TAIL.unpack(tag)
    else:
        tail = (h.crc, h.meta_crc, 0, 0)
    flags = (FLAG_CRC if h.has_crc else 0) | (FLAG_MAC if h.has_mac else 0) | (FLAG_XXH if h.has_xxh else 0) \
        | (FLAG_B3 if h.has_b3 else 0)
    return HEADER.pack(MAGIC, VERSION, int(h.kind), flags, 0, h.transfer_id, h.seq, h.nchunks, h.offset, h.length,
                       h.meta_len, h.total, *tail)


def decode_header(buf: bytes) -> Header:
    """Parse and validate a HEADER; anything inconsistent is a RemoteProtocolError."""
    if len(buf) < HEADER.size:
        raise RemoteProtocolError(f"header of {len(buf)} bytes, need {HEADER.size}")
    (magic, version, kind, flags, reserved, tid, seq, nchunks, offset, length, meta_len, total, crc, meta_crc,
     r2, r3) = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad magic {magic:#06x} in header (expected {MAGIC:#06x})")
    if version != VERSION:
        raise RemoteProtocolError(f"header version {version}, this side speaks {VERSION}")
    if kind not in HeaderKind.__members__.values():
        raise RemoteProtocolError(f"unknown header kind {kind}")
    if flags not in (0, FLAG_CRC, FLAG_MAC, FLAG_XXH, FLAG_B3):
        raise RemoteProtocolError(f"header field 'flags' = {flags:#x}: unknown bits, or more than one checksum at once")
    has_mac, has_xxh, has_b3 = bool(flags & FLAG_MAC), bool(flags & FLAG_XXH), bool(flags & FLAG_B3)
    if reserved or (not (has_mac or has_xxh or has_b3) and (r2 or r3)):
        raise RemoteProtocolError("header reserved fields are not zero")
    if nchunks < 1 or seq >= nchunks:
        raise RemoteProtocolError(f"chunk {seq} of {nchunks}: out of range")
    if offset + length > total:
        raise RemoteProtocolError(f"chunk [{offset}, {offset + length}) beyond total {total}")
    if meta_len > MAX_META:
        raise RemoteProtocolError(f"metadata of {meta_len} bytes exceeds {MAX_META}")
    if meta_len and seq != 0:
        raise RemoteProtocolError("metadata on a chunk other than chunk 0")
    if has_mac or has_xxh or has_b3:
        return Header(HeaderKind(kind), tid, seq, nchunks, offset, length, meta_len, total, 0, 0, False, has_mac,
                      bytes(buf[HEADER_FIELDS_BYTES:HEADER.size]), has_xxh, has_b3)
    return Header(HeaderKind(kind), tid, seq, nchunks, offset, length, meta_len, total, crc, meta_crc,
                  bool(flags & FLAG_CRC))


def _ctrl_tag(key: bytes, number: int, frame: bytes) -> bytes:
    return hashlib.blake2b(number.to_bytes(8, "big") + frame, key=key, digest_size=TAG_BYTES).digest()


def encode_ctrl(c: Ctrl, key: bytes = b"", number: int = 0) -> bytes:
    """The frame of `c`; with `key` (this direction's control key), sealed as the `number`-th frame this
    side sends on the connection."""
    reason = c.reason.encode()[:MAX_REASON]
    frame = CTRL.pack(MAGIC, VERSION, int(c.kind), CTRL_FLAG_MAC if key else 0, len(reason), c.transfer_id, c.value,
                      c.aux) + reason
    return frame + _ctrl_tag(key, number, frame) if key else frame


def decode_ctrl(buf: bytes, key: bytes = b"", number: int = 0) -> Ctrl:
    """Parse and validate a control frame; with `key` (the peer's direction), check that it is the peer's
    `number`-th frame, unaltered. Anything else is a RemoteProtocolError naming the problem."""
    if len(buf) < CTRL.size:
        raise RemoteProtocolError(f"control frame of {len(buf)} bytes, need {CTRL.size}")
    magic, version, kind, flags, rlen, tid, value, aux = CTRL.unpack_from(buf)
    if magic != MAGIC or version != VERSION:
        raise RemoteProtocolError(f"bad control frame (magic {magic:#06x}, version {version})")
    if flags not in (0, CTRL_FLAG_MAC):
        raise RemoteProtocolError(f"control frame field 'flags' = {flags:#x}: unknown bits")
    if rlen > MAX_REASON or CTRL.size + rlen > len(buf):
        raise RemoteProtocolError(f"control frame reason of {rlen} bytes does not fit")
    if key:
        end = CTRL.size + rlen
        if not flags & CTRL_FLAG_MAC or len(buf) != end + TAG_BYTES:
            raise RemoteProtocolError(f"control frame #{number} carries no MAC, though this connection is "
                                      f"authenticated: forged or altered on the way")
        if not hmac.compare_digest(bytes(buf[end:]), _ctrl_tag(key, number, bytes(buf[:end]))):
            raise RemoteProtocolError(f"control frame #{number} fails its MAC: altered, forged, replayed or "
                                      f"reordered on the way, or a frame before it was dropped")
    elif flags & CTRL_FLAG_MAC:
        raise RemoteProtocolError("control frame carries a MAC, though this connection has no session key "
                                  "(one side authenticated, the other not)")
    if kind not in CtrlKind.__members__.values():
        raise RemoteProtocolError(f"unknown control kind {kind}")
    reason = bytes(buf[CTRL.size:CTRL.size + rlen]).decode("utf-8", "replace")
    return Ctrl(CtrlKind(kind), tid, value, aux, reason)
