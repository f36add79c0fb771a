"""The receivers' transition tables (protocol/fedrdma.py, protocol/fedrdma_e.py) in memory, the PLACED note rules
(protocol/placed.py), the wire's packed numbers (protocol/packing.py) and the ERROR code table
(protocol/refusal.py): no device, no socket."""
from __future__ import annotations

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fate_rdma import errors as E
from fate_rdma import protocol as P
from fate_rdma.protocol import packing, placed, policy, refusal
from fate_rdma.protocol.fedrdma import RecvEvent, RecvState
from fate_rdma.protocol.fedrdma_e import SlotRecvEvent, SlotRecvState, slot_payload_offset
from fate_rdma.protocol.frames import CtrlKind, ErrorCode
from fate_rdma.protocol.integrity import BLOCK_BYTES

PEER_STAGED = {RecvEvent.CHUNK, RecvEvent.LAST, RecvEvent.DUPLICATE, RecvEvent.CANCEL}
PEER_SLOT = {SlotRecvEvent.NOTE, SlotRecvEvent.ARRIVE, SlotRecvEvent.REFUSE}


# -- FedRDMA's receiver ---------------------------------------------------------------------------------
def chunk(tid, seq, data: bytes, nchunks: int, total: int, offset: int):
    h = P.Header(P.HeaderKind.CHUNK, tid, seq, nchunks, offset, len(data), 0, total, crc32c.crc32c(data), 0, True)
    return h, memoryview(data)


def test_staged_receiver_follows_a_transfer_to_done_and_answers_duplicates():
    r = P.FedRdmaReceiver(1 << 20)
    assert r.state(1) is RecvState.NEW
    a, b = b"a" * 10, b"b" * 5
    assert r.on_chunk(*chunk(1, 1, b, 2, 15, 10), 0.0).first
    assert r.state(1) is RecvState.ARRIVING
    assert r.on_chunk(*chunk(1, 1, b, 2, 15, 10), 0.0) is None  # a resent chunk: re-ACKed, not copied
    done = r.on_chunk(*chunk(1, 0, a, 2, 15, 0), 0.0)
    assert done.complete and r.state(1) is RecvState.DONE
    assert r.on_chunk(*chunk(1, 0, a, 2, 15, 0), 0.0) is None and r.state(1) is RecvState.DONE
    assert r.cancel(1) is False and r.state(1) is RecvState.DONE  # a CANCEL that crossed the last ACK


def test_staged_receiver_drops_cancelled_refused_and_expired_transfers():
    r = P.FedRdmaReceiver(100, no_progress_s=1.0)
    r.on_chunk(*chunk(1, 0, b"x" * 10, 2, 20, 0), 0.0)
    assert r.cancel(1) is True and r.state(1) is RecvState.DROPPED
    assert r.on_chunk(*chunk(1, 1, b"y" * 10, 2, 20, 10), 0.0) is None  # its late chunks: ACKed, never placed
    with pytest.raises(E.PayloadTooLarge):
        r.on_chunk(*chunk(2, 0, b"x" * 10, 20, 200, 0), 0.0)
    assert r.state(2) is RecvState.DROPPED
    r.on_chunk(*chunk(3, 0, b"x" * 10, 2, 20, 0), 0.0)
    with pytest.raises(E.RemoteProtocolError, match="disagrees on size"):
        r.on_chunk(*chunk(3, 1, b"x" * 10, 3, 30, 10), 0.0)
    assert r.state(3) is RecvState.DROPPED and r.received_bytes(3) == 0
    r.on_chunk(*chunk(4, 0, b"x" * 10, 2, 20, 0), 0.0)
    assert r.expired(0.5) == [] and r.expired(2.0) == [4] and r.state(4) is RecvState.DROPPED
    r.on_chunk(*chunk(5, 0, b"x" * 10, 1, 10, 0), 0.0)
    r.refuse(5)  # whole in one chunk, refused before delivery (the memory budget)
    assert r.state(5) is RecvState.DROPPED


def test_staged_receiver_table_is_closed():
    r = P.FedRdmaReceiver(1 << 20)
    for state in RecvState:
        for event in RecvEvent:
            if (state, event) in r.TRANSITIONS:
                continue
            if state is RecvState.NEW:
                r._state.pop(9, None)
            else:
                r._state[9] = state
            err = E.RemoteProtocolError if event in PEER_STAGED else E.LocalProtocolError
            with pytest.raises(err, match="not allowed in state"):
                r._move(9, event)
    r._state[10] = RecvState.DONE
    with pytest.raises(E.RemoteProtocolError, match="'chunk' not allowed in state done"):
        r._move(10, RecvEvent.CHUNK)  # a new chunk of a transfer already whole: the peer's fault


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 4), st.integers(0, 40),
                          st.integers(0, 12), st.sampled_from(["chunk", "cancel", "expire", "refuse"])),
                max_size=30))
def test_fuzz_staged_receiver_only_protocol_errors_escape(events):
    r = P.FedRdmaReceiver(100, no_progress_s=1.0)
    now = 0.0
    for tid, seq, nchunks, offset, length, what in events:
        now += 0.3
        try:
            if what == "chunk":
                r.on_chunk(*chunk(tid, seq, bytes(length), nchunks, 40, offset), now)
            elif what == "cancel":
                r.cancel(tid)
            elif what == "expire":
                r.expired(now)
            else:
                r.refuse(tid)
        except (E.RemoteProtocolError, E.LocalProtocolError, E.TransferError):
            pass
        assert all(r.state(t) is RecvState.ARRIVING for t in r._partial)


# -- FedRDMA-E's receiver -------------------------------------------------------------------------------
def slot_header(tid: int, total: int, crc: int = 0, has_crc: bool = True) -> memoryview:
    return memoryview(P.encode_header(P.Header(P.HeaderKind.SLOT, tid, 0, 1, 0, total, 0, total, crc, 0, has_crc)))


def placed_note(tid: int, slot: int, total: int, placed_from: int) -> P.Ctrl:
    return packing.encode_placed(packing.PlacedNote(tid, slot, total, placed_from))


def test_slot_receiver_notes_checks_delivers_and_releases():
    total = 3 * BLOCK_BYTES + 5
    rx = P.FedRdmaEReceiver(2, 4 * BLOCK_BYTES, meta_cap=0)
    work = rx.on_placed(placed_note(7, 1, total, 2 * BLOCK_BYTES))
    assert (work.slot, work.first, work.upto) == (1, 2, 4) and rx.slot_state[1] is SlotRecvState.NOTED
    assert rx.on_placed(placed_note(7, 1, total, 2 * BLOCK_BYTES)) is None  # nothing placed since
    assert rx.on_placed(placed_note(8, 1, total, 0)) is None  # another transfer under the grant: no work
    work = rx.on_placed(placed_note(7, 1, total, 1))
    assert (work.first, work.upto) == (1, 2)  # only the blocks placed since the last note
    msg = rx.on_write_imm(packing.make_imm(1, 7), slot_header(7, total, 42))
    assert msg.noted and rx.slot_state[1] is SlotRecvState.CHECKING and rx.notes.noted(1) is None
    assert rx.on_placed(placed_note(7, 1, total, 0)) is None  # a note its header overtook: dropped
    done = rx.verify(msg, 0, 42)
    assert done == P.Ctrl(CtrlKind.DONE, 7) and rx.slot_state[1] is SlotRecvState.HELD and rx.held == {1}
    with pytest.raises(E.RemoteProtocolError, match="still held"):
        rx.on_write_imm(packing.make_imm(1, 8), slot_header(8, 10))
    rx.release(1)
    assert rx.slot_state[1] is SlotRecvState.EMPTY and rx.held == set()
    with pytest.raises(E.LocalProtocolError, match="'release' not allowed in state empty"):
        rx.release(1)


def test_slot_receiver_mismatch_refusal_and_regrant_empty_the_slot():
    rx = P.FedRdmaEReceiver(1, 1000, meta_cap=0)
    msg = rx.on_write_imm(0, slot_header(1, 10, 5))
    with pytest.raises(E.IntegrityError):
        rx.verify(msg, 0, 6)
    assert rx.slot_state[0] is SlotRecvState.EMPTY and rx.held == set()
    with pytest.raises(E.LocalProtocolError, match="'verify' not allowed in state empty"):
        rx.verify(msg, 0, 5)  # a verdict for a transfer that is gone
    with pytest.raises(E.RemoteProtocolError, match="header claims"):
        rx.on_write_imm(0, slot_header(2, 1001))
    rx.refuse(0)  # its fields were refused: granted again
    assert rx.slot_state[0] is SlotRecvState.EMPTY
    rx.on_placed(placed_note(3, 0, 1000, 0))
    rx.regrant(0)  # grown or shrunk: notes of the old grant are void
    assert rx.slot_state[0] is SlotRecvState.EMPTY and rx.notes.noted(0) is None
    with pytest.raises(E.LocalProtocolError, match="checked transfers only"):
        rx.unchecked(rx.on_write_imm(0, slot_header(4, 10)))


def test_slot_receiver_without_a_checksum_delivers_unchecked():
    rx = P.FedRdmaEReceiver(1, 1000, meta_cap=0, verify_crc=False)
    assert rx.on_placed(placed_note(1, 0, 100, 0)) is None and rx.slot_state[0] is SlotRecvState.EMPTY
    msg = rx.on_write_imm(0, slot_header(1, 10, has_crc=False))
    assert not msg.noted and rx.unchecked(msg).kind is CtrlKind.DONE and rx.slot_state[0] is SlotRecvState.HELD


@pytest.mark.parametrize("value, aux, why", [((9 << 48) | 100, 0, "slot 9"), (1 << 40, 0, "1099511627776 bytes"),
                                             (100, 101, "101 of 100 bytes")])
def test_slot_receiver_refuses_a_note_that_does_not_fit(value, aux, why):
    rx = P.FedRdmaEReceiver(2, 1 << 20, meta_cap=0)
    with pytest.raises(E.RemoteProtocolError, match=why):
        rx.on_placed(P.Ctrl(CtrlKind.PLACED, 1, value, aux))


def test_slot_receiver_table_is_closed():
    rx = P.FedRdmaEReceiver(1, 1000, meta_cap=0)
    for state in SlotRecvState:
        for event in SlotRecvEvent:
            if (state, event) in rx.TRANSITIONS:
                continue
            rx.slot_state[0] = state
            err = E.RemoteProtocolError if event in PEER_SLOT else E.LocalProtocolError
            with pytest.raises(err, match="not allowed in state"):
                rx._move(0, event)


def test_slot_receiver_in_memory_with_a_sender_that_notes():
    """A sender machine that notes and the receiver machine: every note the sender's schedule sends starts
    blocks not started before, and together they cover the payload from the last note's offset to its end."""
    total, chunk_bytes = 10 * BLOCK_BYTES + 3, BLOCK_BYTES // 2
    s = P.FedRdmaESender(5, 5, 0, total, chunk_bytes, 4, 0.0, slot_payload_bytes=total, placed_notes=True)
    rx = P.FedRdmaEReceiver(1, total, meta_cap=0)
    started, notes = [], []
    while not s.finished:
        batch = s.next_chunks()
        for c in batch:
            s.on_write_complete(c.seq, 0.0)
            note = s.placed_note()
            if note is not None:
                notes.append(note)
                work = rx.on_placed(note)
                started += list(range(work.first, work.upto))
    assert notes and len(started) == len(set(started))
    last = packing.decode_placed(notes[-1])
    assert sorted(started) == list(range(placed.blocks_from(last.placed_from), -(-total // BLOCK_BYTES)))
    pool = bytearray(slot_payload_offset(0))
    pool[:64] = P.encode_header(s.header(0, 0))
    assert rx.on_write_imm(s.imm, memoryview(pool)).noted


# -- PLACED rules, packed numbers, the ERROR table, slot rules ------------------------------------------
def test_note_schedule():
    assert not placed.NoteSchedule.applies_to(2 * BLOCK_BYTES - 1) and placed.NoteSchedule.applies_to(2 * BLOCK_BYTES)
    assert placed.serves("crc32c") and placed.serves("xxh3") and placed.serves("blake3")
    assert not placed.serves("blake2b")
    total = 40 << 20
    sched = placed.NoteSchedule(total, 1 << 20)
    assert sched.due(None) is None
    assert sched.due(total - (8 << 20)) is None  # 2 blocks placed: fewer than PLACED_NOTE_EVERY_BYTES
    assert sched.due(total - (16 << 20)) == total - (16 << 20) and sched.noted == 6
    assert sched.due(total - (20 << 20)) is None
    assert sched.due(1 << 20) == 1 << 20  # only chunk 0 left: any new block is worth a note
    assert placed.notes_wanted(True, False, 1) and not placed.notes_wanted(False, False, 8)
    assert not placed.notes_wanted(True, True, 2) and placed.notes_wanted(True, True, 8)


def test_packed_numbers_round_trip():
    assert packing.decode_imm(packing.staged_imm(7)) == packing.StagedWrite(7)
    assert packing.decode_imm(packing.make_imm(1023, (1 << 40) | 0x1234)) == packing.SlotWrite(1023, 0x1234)
    assert packing.make_imm(3, 9) < packing.STAGING_BIT
    with pytest.raises(E.LocalProtocolError):
        packing.make_imm(packing.MAX_IMM_SLOT, 0)
    wr = packing.recv_wr_id(63, 255)
    assert packing.is_recv(wr) and packing.split_recv_wr_id(wr) == (63, 255) and not packing.is_recv(1 << 40)
    with pytest.raises(E.LocalProtocolError):
        packing.recv_wr_id(256, 0)
    note = packing.PlacedNote(9, 5, (1 << 48) - 1, 12)
    c = packing.encode_placed(note)
    assert c.kind is CtrlKind.PLACED and P.decode_ctrl(P.encode_ctrl(c)) == c and packing.decode_placed(c) == note
    with pytest.raises(E.LocalProtocolError):
        packing.encode_placed(packing.PlacedNote(9, 5, 1 << 48, 0))


@pytest.mark.parametrize("exc, code, cls", [
    (E.IntegrityError("x", 1), ErrorCode.INTEGRITY, E.IntegrityError),
    (E.PayloadTooLarge("x", 1), ErrorCode.TOO_LARGE, E.PayloadTooLarge),
    (E.RemoteProtocolError("x"), ErrorCode.PROTOCOL, E.RemoteProtocolError),
    (E.TransferTimeout("x", 1), ErrorCode.TIMEOUT, E.TransferTimeout),
])
def test_error_codes_read_alike_at_both_ends(exc, code, cls):
    assert refusal.code_for(exc) is code
    frame = refusal.error_frame(4, code, "why" * 300)
    assert len(frame.reason) == 500
    back = refusal.refusal(P.decode_ctrl(P.encode_ctrl(frame)), "peer")
    assert type(back) is cls and "transfer 4 refused by peer" in str(back)
    assert type(refusal.refusal(P.Ctrl(CtrlKind.ERROR, 4, 99), "peer")) is E.TransferError  # a newer peer's code


def test_slot_rules():
    gib = 1 << 30
    assert policy.wait_for_room(0.4, 2 * gib) and not policy.wait_for_room(1.0, 2 * gib)
    assert not policy.wait_for_room(0.0, 0)
    assert policy.may_lend(0, 2, 100, 100) and not policy.may_lend(1, 2, 100, 100)  # one stays in circulation
    assert not policy.may_lend(0, 3, 99, 100)  # the budget could not grow another as large
