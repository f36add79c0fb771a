"""PLACED notes (frames.CtrlKind.PLACED; the frame's packing is in packing.py): a FedRDMA-E sender tells a
receiver that asked for them (hello `placed_notes`) from which payload offset on every byte of a transfer is in
its slot, so that the receiver checksums those blocks while the rest arrives, and verifies the header against
digests it mostly has already.

When a sender notes (`NoteSchedule`): only to a receiver that asked, under a block-wise checksum (crc32c,
xxh3), for a payload of at least PLACED_NOTE_MIN_BYTES, before the header is posted; each note once the
placed tail covers PLACED_NOTE_EVERY_BYTES of whole checksum blocks more than the last note did, or any
more once only chunk 0 is left. Notes travel on the control QP, so each arrives before the header.

What a receiver does with one (`NoteBook`, per slot): its fields are checked against the slot's grant
(the peer's fault if they do not fit); a note for a transfer already seen, for a slot that holds a transfer,
or for another transfer than the first one noted under the slot's grant is dropped, so a peer gets no more
checksum work out of notes than its transfers would cost (each block once per grant). Each accepted note
names the blocks placed since the one before: [first whole block at its offset, first block of the last
note).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from .integrity import BLOCK_BYTES, BLOCKWISE

#: notes go for payloads of at least this many bytes (below, the header's checksum pass is short anyway)
PLACED_NOTE_MIN_BYTES = 2 * BLOCK_BYTES
#: one note per this many bytes of newly placed whole checksum blocks (fewer frames, each starting more work)
PLACED_NOTE_EVERY_BYTES = 16 << 20
#: cores a machine needs for notes to a peer on the same host (the same-host copy keeps two busy)
SAME_HOST_NOTE_MIN_CPUS = 3


def notes_wanted(peer_asks: bool, same_host_copy: bool, cpus: int) -> bool:
    """Does a sender note to this peer? Where it asked (`peer_asks`), unless it copies our payloads on this
    host (`same_host_copy`) and this machine (`cpus` cores) has no core beyond the copy's threads: there
    the early checksums only compete with the copy, which was faster without them."""
    return peer_asks and not (same_host_copy and cpus < SAME_HOST_NOTE_MIN_CPUS)


def serves(kind: str) -> bool:
    """Do notes serve checksum `kind` (block-wise: a block's digest does not depend on the others)?"""
    return kind in BLOCKWISE


def blocks_from(offset: int) -> int:
    """The first checksum block that lies wholly at or after payload byte `offset`."""
    return -(-offset // BLOCK_BYTES)


class NoteSchedule:
    """When a FedRDMA-E transfer of `total` bytes notes: `due(placed_from)` says from which offset a note
    goes now, if one does. `second_chunk_offset`: where chunk 1 starts (once every chunk from there on is
    placed, only chunk 0 and the header are left: any new block is worth a note)."""

    def __init__(self, total: int, second_chunk_offset: Optional[int]) -> None:
        self.total, self.second_chunk_offset = total, second_chunk_offset
        #: the first block the last note covered (None: no note yet)
        self.noted: Optional[int] = None

    @staticmethod
    def applies_to(total: int) -> bool:
        """Do transfers of `total` bytes note (where their checksum is one notes serve: `serves`)?"""
        return total >= PLACED_NOTE_MIN_BYTES

    def due(self, placed_from: Optional[int]) -> Optional[int]:
        """`placed_from`: the sender's lowest offset from which every byte is placed (None: none yet). The
        offset a note names now, or None: not enough newly placed."""
        if placed_from is None:
            return None
        first = blocks_from(placed_from)
        before = self.noted if self.noted is not None else blocks_from(self.total)
        every = 1 if placed_from == self.second_chunk_offset else PLACED_NOTE_EVERY_BYTES // BLOCK_BYTES
        if before - first < every:
            return None
        self.noted = first
        return placed_from


@dataclasses.dataclass(frozen=True, slots=True)
class NoteWork:
    """An accepted note: digest blocks [first, upto) of the `total`-byte payload of `transfer_id` in `slot`."""

    slot: int
    transfer_id: int
    total: int
    first: int
    upto: int


@dataclasses.dataclass(slots=True)
class _Noted:
    transfer_id: int
    total: int
    covered: int  # the first block the notes so far covered


class NoteBook:
    """A receiver's record of the notes taken under each slot's current grant."""

    def __init__(self) -> None:
        self._noted: Dict[int, _Noted] = {}

    def take(self, slot: int, transfer_id: int, total: int, placed_from: int) -> Optional[NoteWork]:
        """A note whose fields fit the slot: the blocks it starts, or None (another transfer than the first
        noted under the grant, or nothing placed since the last note: notes go back to front)."""
        n = self._noted.setdefault(slot, _Noted(transfer_id, total, blocks_from(total)))
        if (n.transfer_id, n.total) != (transfer_id, total):
            return None
        first = blocks_from(placed_from)
        if first >= n.covered:
            return None
        work = NoteWork(slot, transfer_id, total, first, n.covered)
        n.covered = first
        return work

    def noted(self, slot: int) -> Optional[Tuple[int, int]]:
        """(transfer id, payload bytes) of the transfer noted under the slot's grant, if any."""
        n = self._noted.get(slot)
        return None if n is None else (n.transfer_id, n.total)

    def forget(self, slot: int) -> bool:
        """The slot's grant moved on (its transfer arrived, or it was granted anew): True if notes were kept."""
        return self._noted.pop(slot, None) is not None
