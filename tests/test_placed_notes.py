"""PLACED notes: a FedRDMA-E sender tells a receiver that asked for them (hello `placed_notes`) from which
offset its payload is placed, and the receiver digests those blocks (crc32c, xxh3) while the rest arrives,
so that only the last chunks are left to verify when the header comes. The machine's watermark, the
hello field, a transfer that uses the notes (and still catches bytes corrupted on the way), no notes
to a peer that did not ask or under another checksum, none to a same-host peer where its copy keeps
every core busy, and malformed notes refused naming the frame (in-process, soft provider over TCP unless named).

Notes serve providers whose NIC writes memory without the CPU (pyverbs): the soft provider digests the
blocks a single WRITE places where they land instead (tests/test_landing.py; a noted block with such a
digest starts no checksum), so these tests turn that off."""
from __future__ import annotations

import crc32c
import numpy as np
import pytest

from easypyverbs.providers.soft.context import SoftContext
from fate_rdma import protocol as P
from fate_rdma.channel import Endpoint
from fate_rdma.channel.auth import write_secret
from fate_rdma.channel import fedrdma_e as fe
from fate_rdma.protocol.hello import Hello
from fate_rdma.errors import IntegrityError
from fate_rdma.protocol.integrity import BLOCKWISE
from fate_rdma.protocol.frames import CtrlKind

from .conftest import require_same_host
from .test_channel import cfg_for, wait_for

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _notes_not_landing(monkeypatch):
    """The soft provider as a NIC would be: no digests where the bytes land, so receivers ask for notes."""
    monkeypatch.setattr(SoftContext, "tracks_writes", False)


def test_placed_from_is_the_lowest_offset_with_everything_after_it_placed():
    s = P.FedRdmaESender(1, 1, 0, 10 * MiB, 2 * MiB, 8, 0.0, slot_payload_bytes=16 * MiB)  # chunks at 0, 2, 4, 6, 8 MiB
    assert [c.seq for c in s.next_chunks()] == [4, 3, 2, 1, 0]
    assert s.placed_from() is None
    s.on_write_complete(3, 0.0)  # out of order (several QPs): the last chunk is not placed yet
    assert s.placed_from() is None
    s.on_write_complete(4, 0.0)
    assert s.placed_from() == 6 * MiB
    s.on_write_complete(1, 0.0)  # a gap at chunk 2 stops the watermark
    assert s.placed_from() == 6 * MiB
    s.on_write_complete(2, 0.0)
    assert s.placed_from() == 2 * MiB  # chunk 0 (the header's) never counts
    s.on_write_complete(0, 0.0)
    assert s.placed_from() == 2 * MiB


def test_hello_field_is_true_only_when_announced_as_true():
    h = Hello("a", 1, placed_notes=True)
    assert Hello.from_wire(h.to_wire(), "peer").placed_notes is True
    for value in (None, 1, "true", False):
        assert Hello.from_wire(dict(h.to_wire(), placed_notes=value), "peer").placed_notes is False
    wire = h.to_wire()
    del wire["placed_notes"]  # an endpoint that predates the field
    assert Hello.from_wire(wire, "peer").placed_notes is False


def _pair(provider="soft-tcp", **kw):
    cfg = cfg_for("fedrdma-e", provider, **dict(dict(slot_bytes=32 * MiB, chunk_bytes=MiB, window=8), **kw))
    rx, tx = Endpoint(cfg, name="rx"), Endpoint(cfg, name="tx")
    rx.name = rx.address
    return rx, tx


def _connected(rx, tx):
    """(the sender's connection, the receiver's) once the receiver has its side of it."""
    conn = tx.connect(rx.address)
    wait_for(lambda: any(c.slot_receiver is not None for c in rx._conns.values()), 10, "the receiver's side")
    (rconn,) = [c for c in rx._conns.values() if c.slot_receiver is not None]
    return conn, rconn


def _spy(monkeypatch):
    """Record each PLACED note the receiver takes and the blocks known early at each verification."""
    seen = {"notes": [], "known": []}
    on_placed, verify = fe.SlotReceiver.on_placed, fe.payload_digest_with

    def placed(self, c):
        seen["notes"].append((c.transfer_id, c.value, c.aux))
        return on_placed(self, c)

    def checked(integrity, payload, known, landed):
        if integrity.kind in BLOCKWISE:
            seen["known"].append(sorted(known))
        return verify(integrity, payload, known, landed)

    monkeypatch.setattr(fe.SlotReceiver, "on_placed", placed)
    monkeypatch.setattr(fe, "payload_digest_with", checked)
    return seen


@pytest.mark.parametrize("checksum", BLOCKWISE)
def test_a_transfer_is_verified_from_blocks_checksummed_before_its_header(monkeypatch, checksum):
    seen = _spy(monkeypatch)
    rx, tx = _pair(checksum=checksum)
    with rx, tx:
        data = np.random.default_rng(3).integers(0, 256, 24 * MiB + 5, dtype=np.uint8)
        info = tx.send(rx.address, data).result(60)
        msg = rx.recv(timeout=30)
        assert bytes(msg.view) == data.tobytes() and info["mode"] == "fedrdma-e"
        msg.release()
    assert seen["notes"], "the sender sent no PLACED note"
    tid, value, start = seen["notes"][-1]
    assert value & P.frames.PLACED_TOTAL_MASK == data.nbytes and tid == info["transfer_id"]
    (known,) = seen["known"]
    blocks = -(-data.nbytes // (4 * MiB))
    # checksummed early: every block from the last note's offset to the end, the last (short) one included
    assert known == list(range(-(-start // (4 * MiB)), blocks)) and known


@pytest.mark.parametrize("checksum", BLOCKWISE)
def test_bytes_corrupted_before_a_note_are_still_caught(monkeypatch, checksum):
    """Corruption on the way (here: one byte of the slot flipped just before the receiver checksums the
    noted blocks) fails the transfer as an integrity error; nothing reaches the application."""
    start_blocks, flipped = fe.block_checksums_async, []

    def corrupt_then_checksum(payload, first, known, landed, integrity, upto=None):
        if not flipped:
            flipped.append(first)
            payload[-1] ^= 0xFF
        return start_blocks(payload, first, known, landed, integrity, upto)

    monkeypatch.setattr(fe, "block_checksums_async", corrupt_then_checksum)
    rx, tx = _pair(checksum=checksum)
    with rx, tx:
        data = np.full(24 * MiB, 7, dtype=np.uint8)
        with pytest.raises(IntegrityError, match=f"{checksum} mismatch"):
            tx.send(rx.address, data).result(60)
        assert flipped, "no PLACED note arrived"
        with pytest.raises(Exception):
            rx.recv(timeout=0.5)
        tx.send(rx.address, b"after").result(30)  # the connection stays usable
        assert bytes(rx.recv(timeout=30).detach()) == b"after"


@pytest.mark.parametrize("checksum", ["none", "blake2b"])
def test_no_notes_under_another_checksum(monkeypatch, tmp_path, checksum):
    seen = _spy(monkeypatch)
    secret = None
    if checksum == "blake2b":  # keyed from the connection's session key: endpoints that prove a secret
        secret = str(tmp_path / "secret")
        write_secret(secret)
    rx, tx = _pair(checksum=checksum, secret_file=secret)
    with rx, tx:
        assert tx.connect(rx.address).slot_sender.notes is False  # the receiver did not ask for them
        data = np.ones(16 * MiB, dtype=np.uint8)
        tx.send(rx.address, data).result(60)
        assert rx.recv(timeout=30).detach().nbytes == data.nbytes
    assert seen["notes"] == []


def test_no_notes_to_a_peer_that_did_not_ask(monkeypatch):
    seen = _spy(monkeypatch)
    real = Hello.to_wire
    monkeypatch.setattr(Hello, "to_wire", lambda self: dict(real(self), placed_notes=None))  # both predate the field
    rx, tx = _pair()
    with rx, tx:
        data = np.ones(16 * MiB, dtype=np.uint8)
        tx.send(rx.address, data).result(60)
        assert crc32c.crc32c(rx.recv(timeout=30).detach()) == crc32c.crc32c(data)
    assert seen["notes"] == [] and seen["known"] == [[]]


@pytest.mark.parametrize("value, aux, why", [((9 << 48) | 100, 0, "slot 9"),
                                             ((0 << 48) | (1 << 40), 0, "of 1099511627776 bytes"),
                                             ((0 << 48) | 100, 101, "101 of 100 bytes")])
def test_a_malformed_note_ends_the_connection_naming_it(value, aux, why):
    rx, tx = _pair()
    with rx, tx:
        conn, rconn = _connected(rx, tx)
        conn.send_ctrl(P.Ctrl(CtrlKind.PLACED, 77, value, aux))
        wait_for(lambda: rconn.dead is not None, 10, "the receiver ending the connection")
        assert "PLACED note" in str(rconn.dead) and why in str(rconn.dead)


def test_notes_for_a_second_transfer_under_one_grant_start_no_work(monkeypatch):
    """Only the first transfer noted under a slot's grant gets early checksums: a peer cannot make the
    receiver checksum the slot over and over by naming new transfer ids. The next transfer into the slot
    is verified in full at its header, and later ones use notes again."""
    seen = _spy(monkeypatch)
    rx, tx = _pair()
    with rx, tx:
        conn, rconn = _connected(rx, tx)
        started = []
        monkeypatch.setattr(fe, "block_checksums_async", lambda p, first, known, landed=None, kind="", upto=None: started.append(first))
        for tid in (1000, 1001, 1002):
            conn.send_ctrl(P.Ctrl(CtrlKind.PLACED, tid, (0 << 48) | 4096, 0))
        wait_for(lambda: len(seen["notes"]) == 3, 10, "three notes at the receiver")
        assert started == [0] and rconn.slot_receiver.machine.notes.noted(0) == (1000, 4096)
        monkeypatch.undo()
        seen = _spy(monkeypatch)
        for i in range(3):
            data = np.random.default_rng(i).integers(0, 256, 24 * MiB, dtype=np.uint8)
            tx.send(rx.address, data).result(60)
            msg = rx.recv(timeout=30)
            assert bytes(msg.view) == data.tobytes()
            msg.release()
        assert rconn.slot_receiver.machine.notes.noted(0) != (1000, 4096)
        assert any(seen["known"])  # notes were used again after the stale entry went


@pytest.mark.parametrize("cpus, notes", [(2, False), (8, True)])
def test_a_same_host_peer_gets_notes_only_where_cores_are_left_beside_its_copy(monkeypatch, cpus, notes):
    require_same_host()
    monkeypatch.setattr(fe.os, "cpu_count", lambda: cpus)
    seen = _spy(monkeypatch)
    rx, tx = _pair("soft")
    with rx, tx:
        conn = tx.connect(rx.address)
        assert conn.path.kind.same_host and conn.slot_sender.notes is notes
        data = np.random.default_rng(5).integers(0, 256, 24 * MiB, dtype=np.uint8)
        tx.send(rx.address, data).result(60)
        assert crc32c.crc32c(rx.recv(timeout=30).detach()) == crc32c.crc32c(data)
    assert bool(seen["notes"]) is notes


def test_each_note_starts_only_the_blocks_placed_since_the_one_before(monkeypatch):
    """Notes go back to front: each one names the blocks from its offset up to where the one before began,
    no block twice; a note that names nothing new (repeated, or out of order) starts nothing."""
    seen = _spy(monkeypatch)
    rx, tx = _pair()
    with rx, tx:
        conn, rconn = _connected(rx, tx)
        tx.send(rx.address, np.ones(20 * MiB, dtype=np.uint8)).result(60)  # grows a slot to take the notes' extent
        rx.recv(timeout=30).release()
        slot, total = max(enumerate(rconn.slot_receiver.pool.capacity), key=lambda sc: sc[1])
        assert total >= 3 * 4 * MiB, total
        calls = []
        monkeypatch.setattr(fe, "block_checksums_async",
                            lambda p, first, known, landed=None, kind="", upto=None: calls.append((first, upto)))
        starts = [total - 4 * MiB, total - 4 * MiB, total - 8 * MiB - 5, total - 4 * MiB, 0]
        for start in starts:
            conn.send_ctrl(P.Ctrl(CtrlKind.PLACED, 1000, (slot << 48) | total, start))
        wait_for(lambda: len([n for n in seen["notes"] if n[0] == 1000]) == len(starts), 10, "the notes at the receiver")
        blocks = -(-total // (4 * MiB))
        # (a note 5 bytes into block blocks - 3 places none of it whole: its blocks start at blocks - 2)
        assert calls == [(blocks - 1, blocks), (blocks - 2, blocks - 1), (0, blocks - 2)]
