"""Numbers into which the wire packs several fields: a WRITE_WITH_IMM's immediate, the wr_id of a posted
receive, and a PLACED note's `value`. Each is one integer on the wire (verbs carries the immediate and the
wr_id as integers, CTRL's `value` is a u64: frames.py), so their layouts are bit fields, documented here.

WRITE_WITH_IMM immediate, 32 bits. A header WRITE_WITH_IMM announces a chunk or a slot; its immediate says
which of this side's receive areas the header was written to (the header itself says the rest):

    FedRDMA chunk (bit 31 set)
        bit  31      STAGING_BIT
        bits 0..30   the receiver's staging buffer that holds the chunk and its header (< MAX_STAGING_INDEX)
    FedRDMA-E slot (bit 31 clear)
        bits 16..30  the receiver's slot that holds the transfer (< MAX_IMM_SLOT)
        bits 0..15   the transfer's sequence: transfer_id & 0xFFFF (a label; the header's transfer_id counts)

Receive wr_id, 64 bits (this side's own: each receive it posts is named so; the peer never sees it):

    bit  62      RECV_TAG: a posted receive. Signalled send WRs are numbered from 1 and stay below it
    bits 20..27  the QP's index in its connection (QP 0 first; < MAX_RECV_QPS)
    bits 0..19   the receive buffer's index on that QP (< MAX_RECV_BUFFERS)

PLACED note `value`, 64 bits (frames.CtrlKind.PLACED; `aux` is the payload offset from which it is placed):

    bits 48..63  the slot the transfer is written to
    bits 0..47   the payload's bytes (PLACED_TOTAL_MASK)

RESUME `aux`, 64 bits (frames.CtrlKind.RESUME; `value` is the payload's bytes): a FedRDMA-E sender's claim
that every payload byte from an offset to the end is in a slot of the connection that broke (0: no claim)

    bits 48..63  the slot
    bits 0..47   the offset (> 0)
and its `reason` the claim's digest, 64 hex digits: BLAKE3-256 of "fate-rdma resume" || transfer_id, the
payload's bytes, the offset (u64 each, big-endian) || those bytes. The frame is sealed, so the digest is the
sender's; a receiver holds the bytes only if its own digest of them is the same (channel/holding.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple, Union

import blake3

from ..errors import LocalProtocolError, RemoteProtocolError
from .frames import PLACED_TOTAL_MASK, Ctrl, CtrlKind

STAGING_BIT = 1 << 31
MAX_STAGING_INDEX = STAGING_BIT
#: slots an immediate can name: 15 bits (bit 31 is STAGING_BIT)
MAX_IMM_SLOT = 1 << 15
SEQ_MASK = 0xFFFF

RECV_TAG = 1 << 62
RECV_QP_SHIFT = 20
MAX_RECV_QPS = 1 << 8
MAX_RECV_BUFFERS = 1 << RECV_QP_SHIFT

PLACED_SLOT_SHIFT = 48
MAX_PLACED_SLOT = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class StagedWrite:
    """A FedRDMA chunk's header arrived in staging buffer `index` (the immediate said so)."""

    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class SlotWrite:
    """A FedRDMA-E transfer's header arrived in slot `slot`; `seq`: its sequence label."""

    slot: int
    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class PlacedNote:
    """The sender's PLACED note: every payload byte of `transfer_id` from `placed_from` to the end of its
    `total` bytes is in slot `slot` (its fields as the note carries them, not yet checked against the pool)."""

    transfer_id: int
    slot: int
    total: int
    placed_from: int


def staged_imm(index: int) -> int:
    """The immediate of a FedRDMA chunk's header in the peer's staging buffer `index`."""
    if not 0 <= index < MAX_STAGING_INDEX:
        raise LocalProtocolError(f"staging buffer {index} does not fit an immediate")
    return STAGING_BIT | index


def make_imm(slot: int, seq: int) -> int:
    """The immediate of a FedRDMA-E header in slot `slot` (`seq`: the transfer's id; its low 16 bits go)."""
    if not 0 <= slot < MAX_IMM_SLOT:
        raise LocalProtocolError(f"slot {slot} does not fit an immediate (at most {MAX_IMM_SLOT - 1})")
    return slot << 16 | (seq & SEQ_MASK)


def split_imm(imm: int) -> Tuple[int, int]:
    """A FedRDMA-E immediate's (slot, seq) (a FedRDMA immediate reads as a slot beyond any pool)."""
    return imm >> 16, imm & SEQ_MASK


def decode_imm(imm: int) -> Union[StagedWrite, SlotWrite]:
    """What a WRITE_WITH_IMM announces: a FedRDMA chunk or a FedRDMA-E slot."""
    if imm & STAGING_BIT:
        return StagedWrite(imm & ~STAGING_BIT)
    slot, seq = split_imm(imm)
    return SlotWrite(slot, seq)


def recv_wr_id(qp_idx: int, index: int) -> int:
    """The wr_id of receive buffer `index` posted on QP `qp_idx`."""
    if not (0 <= qp_idx < MAX_RECV_QPS and 0 <= index < MAX_RECV_BUFFERS):
        raise LocalProtocolError(f"receive {index} on QP {qp_idx} does not fit a wr_id")
    return RECV_TAG | qp_idx << RECV_QP_SHIFT | index


def is_recv(wr_id: int) -> bool:
    """Is `wr_id` a posted receive's (else a signalled send WR's)?"""
    return bool(wr_id & RECV_TAG)


def split_recv_wr_id(wr_id: int) -> Tuple[int, int]:
    """A receive wr_id's (QP index, receive buffer index)."""
    return (wr_id >> RECV_QP_SHIFT) & (MAX_RECV_QPS - 1), wr_id & (MAX_RECV_BUFFERS - 1)


def encode_placed(note: PlacedNote) -> Ctrl:
    """The PLACED frame that carries `note`."""
    if not (0 <= note.slot < MAX_PLACED_SLOT and 0 <= note.total <= PLACED_TOTAL_MASK):
        raise LocalProtocolError(f"PLACED note for slot {note.slot} of {note.total} bytes does not fit its frame")
    return Ctrl(CtrlKind.PLACED, note.transfer_id, note.slot << PLACED_SLOT_SHIFT | note.total, note.placed_from)


def decode_placed(c: Ctrl) -> PlacedNote:
    """The note a PLACED frame carries (its fields unchecked: the receiver checks them against its pool)."""
    return PlacedNote(c.transfer_id, c.value >> PLACED_SLOT_SHIFT, c.value & PLACED_TOTAL_MASK, c.aux)


@dataclasses.dataclass(frozen=True, slots=True)
class SuffixClaim:
    """A FedRDMA-E sender's word, in its RESUME, that payload bytes `start` .. end are in slot `slot` of the
    connection that broke; `digest`: theirs (suffix_digest)."""

    slot: int
    start: int
    digest: bytes


def suffix_digest(transfer_id: int, total: int, start: int, views: Sequence[memoryview]) -> bytes:
    """BLAKE3-256 of a payload's bytes from `start` to its end (`views`), bound to the transfer and offset."""
    h = blake3.blake3(b"fate-rdma resume" + b"".join(x.to_bytes(8, "big") for x in (transfer_id, total, start)),
                      max_threads=blake3.blake3.AUTO)
    for v in views:
        h.update(v)
    return h.digest()


def encode_resume(transfer_id: int, total: int, claim: Optional[SuffixClaim]) -> Ctrl:
    """The RESUME frame asking what the peer holds of `transfer_id`, with the sender's claim if it has one."""
    if claim is None:
        return Ctrl(CtrlKind.RESUME, transfer_id, total)
    if not (0 <= claim.slot < MAX_PLACED_SLOT and 0 < claim.start < total <= PLACED_TOTAL_MASK
            and len(claim.digest) == 32):
        raise LocalProtocolError(f"RESUME claim of slot {claim.slot} from byte {claim.start} of {total} does not "
                                 f"fit its frame")
    return Ctrl(CtrlKind.RESUME, transfer_id, total, claim.slot << PLACED_SLOT_SHIFT | claim.start,
                claim.digest.hex())


def decode_resume(c: Ctrl) -> Tuple[int, Optional[SuffixClaim]]:
    """A RESUME's payload bytes and claim, every field checked (RemoteProtocolError naming the one that is not)."""
    total = int(c.value)
    if not c.aux:
        if c.reason:
            raise RemoteProtocolError(f"RESUME of transfer {c.transfer_id}: a digest without a claim")
        return total, None
    slot, start = c.aux >> PLACED_SLOT_SHIFT, c.aux & PLACED_TOTAL_MASK
    if not 0 < start < total:
        raise RemoteProtocolError(f"RESUME of transfer {c.transfer_id}: field 'aux' claims bytes from {start} of "
                                  f"{total}")
    try:
        digest = bytes.fromhex(c.reason)
    except ValueError:
        digest = b""
    if len(digest) != 32 or len(c.reason) != 64:
        raise RemoteProtocolError(f"RESUME of transfer {c.transfer_id}: its digest is not 64 hex digits")
    return total, SuffixClaim(slot, start, digest)
