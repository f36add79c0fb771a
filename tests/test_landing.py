"""Digests taken where the bytes land (easypyverbs `MR.track_writes`, soft provider: landing.py): the pieces
a tracked WRITE is placed in, which WRITEs leave a block a digest and which drop it (a rewrite, a WRITE
beginning inside a block, overlapping or failed WRITEs), WRITEs through both soft paths digested as the
memory reads afterwards, and FedRDMA-E transfers verified from those digests (crc32c and xxh3), with bytes
corrupted where they land still refused. In-process; "soft" is the same-host path, "soft-tcp" the wire."""
from __future__ import annotations

import itertools
import logging
import os

import crc32c
import numpy as np
import pytest
import xxhash

import easypyverbs as ev
from easypyverbs.providers.soft import landing as L
from fate_rdma.channel import Endpoint
from fate_rdma.channel import checksum as C
from fate_rdma.channel import fedrdma_e as fe
from fate_rdma.errors import IntegrityError
from fate_rdma.protocol.integrity import BLOCKWISE, Integrity

from .conftest import require_same_host
from .test_channel import cfg_for
from .verbs_pair import close_pair, make_pair

MiB = 1 << 20
T = 10.0
B = 64 << 10  # block size of the unit tests: several pieces per block with a small PIECE_BYTES


class _Crc:
    def __init__(self) -> None:
        self.v = 0

    def update(self, p) -> None:
        self.v = crc32c.crc32c(p, self.v)

    def digest(self) -> int:
        return self.v


def _tracked(size: int = 16 * B, origin: int = 100):
    mem = bytearray(os.urandom(size))
    return mem, L.WriteDigests(memoryview(mem), origin, B, lambda _b: _Crc())


def _write(wd, mem, offset: int, data: bytes, ok: bool = True):
    """What the soft responder does for one WRITE: place piece by piece, digest each, end."""
    w = wd.begin(offset, len(data))
    for at, n, _first in w.pieces():
        mem[offset + at:offset + at + n] = data[at:at + n]
        w.landed(at, n)
    w.end(ok)


def _crc_at(mem, origin: int, block: int, length: int) -> int:
    start = origin + block * B
    return crc32c.crc32c(bytes(mem[start:start + length]))


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(L, "PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(L, "TCP_PIECE_BYTES", 24 << 10)  # a socket's pieces: their own size, not dividing a block


def test_pieces_cover_the_write_in_order_and_never_cross_a_block(small_pieces):
    _mem, wd = _tracked(origin=100)
    for (offset, length), over_tcp in itertools.product(
            ((0, 5 * B + 7), (100, 2 * B), (100 + B // 2, 3 * B), (50, 60), (100 + 3 * B, 1)), (False, True)):
        pieces = wd.begin(offset, length).pieces(over_tcp)
        assert [p[0] for p in pieces] == [sum(p[1] for p in pieces[:i]) for i in range(len(pieces))]
        assert sum(p[1] for p in pieces) == length
        assert (max(p[1] for p in pieces) == 24 << 10) == (over_tcp and length >= 2 * B)
        for at, n, first in pieces:
            lo, hi = offset + at, offset + at + n
            assert n <= (L.TCP_PIECE_BYTES if over_tcp else L.PIECE_BYTES)
            if hi > 100:  # past the origin: within one block
                assert lo >= 100 and (lo - 100) // B == (hi - 1 - 100) // B
            assert first == (lo >= 100 and (lo - 100) % B == 0)


def test_one_write_digests_every_block_it_begins_and_nothing_else(small_pieces):
    mem, wd = _tracked(origin=100)
    _write(wd, mem, 40, os.urandom(60 + 3 * B + 500))  # header area, blocks 0-2 whole, 500 bytes of block 3
    for b in range(3):
        assert wd.take(b, B) == _crc_at(mem, 100, b, B)
    assert wd.take(3, 500) == _crc_at(mem, 100, 3, 500)
    assert wd.take(3, B) is None  # covered only in part: the caller reads the rest itself
    assert wd.take(4, B) is None
    _write(wd, mem, 100 + 4 * B + 8, os.urandom(B))  # begins inside block 4
    assert wd.take(4, B) is None and wd.take(4, B - 8) is None and wd.take(5, 8) == _crc_at(mem, 100, 5, 8)


def test_a_rewrite_replaces_or_drops_the_digest(small_pieces):
    mem, wd = _tracked(origin=0)
    _write(wd, mem, 0, os.urandom(2 * B))
    _write(wd, mem, B + 10, b"x" * 10)  # a later WRITE into block 1, not from its start
    assert wd.take(0, B) == _crc_at(mem, 0, 0, B) and wd.take(1, B) is None
    _write(wd, mem, B, os.urandom(B))  # block 1 written whole again
    assert wd.take(1, B) == _crc_at(mem, 0, 1, B)
    _write(wd, mem, 0, os.urandom(B), ok=False)  # a failed WRITE: what landed is unknown
    assert wd.take(0, B) is None


def test_overlapping_writes_leave_no_digest_in_either_order(small_pieces):
    mem, wd = _tracked(origin=0)
    for first_ends_first in (True, False):
        a, b = wd.begin(0, B), wd.begin(0, B)
        for w, fill in ((a, b"a"), (b, b"b")):
            for at, n, _ in w.pieces():
                mem[at:at + n] = fill * n
                w.landed(at, n)
        (a.end(True), b.end(True)) if first_ends_first else (b.end(True), a.end(True))
        assert wd.take(0, B) is None
    _write(wd, mem, 0, os.urandom(B))  # alone again: digested
    assert wd.take(0, B) == _crc_at(mem, 0, 0, B)


def test_a_closed_mr_digests_nothing_more(small_pieces):
    mem, wd = _tracked(origin=0)
    w = wd.begin(0, B)
    wd.close()
    for at, n, _ in w.pieces():
        w.landed(at, n)
    w.end(True)
    assert wd.take(0, B) is None


@pytest.mark.parametrize("provider", ["soft", "soft-tcp"])
def test_writes_through_the_soft_provider_are_digested_as_the_memory_reads(provider, small_pieces):
    """Blocks of 1 MiB: the same-host copy of the first WRITE (5 MiB) is split over the copy threads, each
    taking whole blocks. A later WRITE into the middle of a digested block drops its digest."""
    if provider == "soft":
        require_same_host()
    blk_bytes = 1 << 20
    a, b = make_pair(provider, size=8 * blk_bytes + 300)
    try:
        assert a.ctx.tracks_writes
        wd = b.mr.track_writes(300, blk_bytes, lambda _b: _Crc())
        a.buf[:] = os.urandom(len(a.buf))
        a.qp.post_write(a.mr.sge(0, 300 + 5 * blk_bytes), b.mr.remote(), wr_id=1)  # header area + blocks 0-4
        b.qp.post_recv([], wr_id=9)
        a.qp.post_write_with_imm(a.mr.sge(300 + 5 * blk_bytes, 3 * blk_bytes), b.mr.remote(), imm=7,
                                 remote_offset=300 + 5 * blk_bytes, wr_id=2)
        wcs = []
        while len(wcs) < 2:
            wcs += a.cq.wait(T)
        assert all(wc.ok for wc in wcs)
        b.cq.wait(T)
        assert bytes(b.buf) == bytes(a.buf)
        for blk in range(8):
            start = 300 + blk * blk_bytes
            assert wd.take(blk, blk_bytes) == crc32c.crc32c(bytes(b.buf[start:start + blk_bytes])), blk
        a.buf[:16] = b"rewritten bytes!"
        a.qp.post_write(a.mr.sge(0, 16), b.mr.remote(), remote_offset=300 + 2 * blk_bytes + 4096, wr_id=3)
        assert a.cq.wait(T)[0].ok
        assert wd.take(2, blk_bytes) is None and wd.take(1, blk_bytes) is not None
    finally:
        close_pair([a, b])


def test_tracking_starts_only_once_no_write_is_being_placed(monkeypatch):
    from easypyverbs.providers.soft.context import SoftMR

    monkeypatch.setattr(SoftMR, "_bound", lambda self: 0.2)
    a, b = make_pair("soft-tcp", size=B)
    try:
        assert b.mr.begin_remote(b.mr.rkey, 0, 16) is not None  # a WRITE being placed (stalled)
        with pytest.raises(ev.EasyVerbsError, match="still being placed"):
            b.mr.track_writes(0, B, lambda _b: _Crc())
        b.mr.end_remote()
        assert b.mr.track_writes(0, B, lambda _b: _Crc()) is not None
    finally:
        close_pair([a, b])


def test_a_slot_closed_with_a_write_still_landing_is_never_tracked_again(monkeypatch):
    """A WRITE that outlives its MR's close (a peer stalling mid-WRITE past the bound) could still change
    bytes of the next grant after they were digested: that slot is read from memory from then on."""
    from easypyverbs.providers.soft.context import SoftMR
    from fate_rdma.protocol.hello import PoolOffer
    from fate_rdma.channel.slots import SlotMemory

    monkeypatch.setattr(SoftMR, "_bound", lambda self: 0.2)
    with ev.open_device(provider="soft") as ctx:
        pd = ctx.alloc_pd()
        slots = SlotMemory(pd, PoolOffer(2, 8 * MiB, 4096), 8 * MiB, pin=False, track=lambda _b: _Crc())
        try:
            assert all(d is not None for d in slots.landed)
            stalled = slots.mrs[0]
            assert stalled.begin_remote(stalled.rkey, 0, 16) is not None
            slots.revoke(0)  # gives up waiting after the bound
            assert stalled.placing_after_close
            slots.grant(0)
            slots.grant(1)
            assert slots.landed[0] is None and slots.landed[1] is not None
            assert slots.mrs[0] is not stalled and stalled.closed  # (the stalled WRITE's MR is not given out again)
            stalled.end_remote()
        finally:
            slots.close()


def test_a_slot_granted_again_keeps_its_registration_under_a_new_rkey():
    """Soft provider: a revoked slot keeps its MR, and its next grant is a new rkey on it (MR.rekey) with write
    tracking begun anew; a new extent (resize) is a new registration."""
    from fate_rdma.protocol.hello import PoolOffer
    from fate_rdma.channel.slots import SlotMemory

    with ev.open_device(provider="soft") as ctx:
        pd = ctx.alloc_pd()
        slots = SlotMemory(pd, PoolOffer(2, 8 * MiB, 4096), 8 * MiB, pin=False, track=lambda _b: _Crc())
        try:
            mr, old, digests = slots.mrs[0], slots.mrs[0].rkey, slots.landed[0]
            slots.revoke(0)
            slots.revoke(0)  # (twice: nothing more)
            assert ctx.mr_by_rkey(old) is None and slots.mrs[0] is mr and not mr.closed
            rkey = slots.grant(0)
            assert slots.mrs[0] is mr and rkey == mr.rkey != old and ctx.mr_by_rkey(rkey) is mr
            assert slots.landed[0] is not None and slots.landed[0] is not digests
            slots.revoke(0)
            slots.resize(0, 4 * MiB)
            assert slots.mrs[0] is not mr and mr.closed and ctx.mr_by_rkey(slots.mrs[0].rkey) is slots.mrs[0]
        finally:
            slots.close()


def test_a_slot_whose_new_key_cannot_be_given_is_registered_anew(monkeypatch, caplog):
    """A rekey that fails (pyverbs: a memory window that cannot be bound) does not lose the slot: it is
    registered anew, under a key that works, and the log says so."""
    from fate_rdma.protocol.hello import PoolOffer
    from fate_rdma.channel.slots import SlotMemory
    from easypyverbs.providers.soft.context import SoftMR

    def refuse(self):
        raise ev.EasyVerbsError("bind_mw: completion MW_BIND_ERR (vendor error 0)")

    with ev.open_device(provider="soft") as ctx:
        pd = ctx.alloc_pd()
        slots = SlotMemory(pd, PoolOffer(2, 8 * MiB, 4096), 8 * MiB, pin=False, track=lambda _b: _Crc())
        try:
            mr, old = slots.mrs[0], slots.mrs[0].rkey
            slots.revoke(0)
            monkeypatch.setattr(SoftMR, "rekey", refuse)
            with caplog.at_level(logging.WARNING, logger="fate_rdma.channel.slots"):
                rkey = slots.grant(0)
            assert "receive slot 0: a new key could not be given (bind_mw: completion MW_BIND_ERR" in caplog.text
            assert mr.closed and slots.mrs[0] is not mr and rkey == slots.mrs[0].rkey != old
            assert ctx.mr_by_rkey(rkey) is slots.mrs[0] and slots.landed[0] is not None

            def misused(self):
                raise ev.UsageError("PyverbsPD is closing")

            slots.revoke(1)  # a usage error (a closing PD, a misuse) is not answered by registering anew
            monkeypatch.setattr(SoftMR, "rekey", misused)
            with pytest.raises(ev.UsageError, match="closing"):
                slots.grant(1)
        finally:
            slots.close()


def test_pyverbs_cannot_track_writes():
    from easypyverbs.providers.pyverbs_provider import PyverbsContext, PyverbsMR  # importable without pyverbs
    from easypyverbs.providers.soft.context import SoftMR

    # a NIC places the WRITEs: its MRs are no capabilities.PlacesWrites, and the verbs API has no such hook
    assert PyverbsContext.tracks_writes is False and not hasattr(PyverbsMR, "track_writes")
    assert hasattr(SoftMR, "track_writes") and not hasattr(ev.MR, "track_writes")


def _spy(monkeypatch):
    seen = {"landed": 0, "read": 0}
    real = fe.payload_digest_with

    def spy(integrity, payload, known, landed):
        for i, blk in enumerate(C._blocks([payload])):
            n = sum(p.nbytes for p in blk)
            seen["landed" if landed is not None and landed.take(i, n) is not None else "read"] += 1
        return real(integrity, payload, known, landed)

    monkeypatch.setattr(fe, "payload_digest_with", spy)
    return seen


def _send_and_check(cfg, sizes):
    """Send payloads of `sizes` from one endpoint to another; each arrives intact."""
    with Endpoint(cfg, name="rx") as rx, Endpoint(cfg, name="tx") as tx:
        rx.name = rx.address
        for n in sizes:
            data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            tx.send(rx.address, data).result(60)
            msg = rx.recv(timeout=30)
            assert bytes(msg.view) == data.tobytes()
            msg.release()


@pytest.mark.parametrize("checksum", ["crc32c", "xxh3", "blake3"])
@pytest.mark.parametrize("provider", ["soft", "soft-tcp"])
def test_a_transfer_is_verified_from_the_digests_taken_where_it_landed(monkeypatch, provider, checksum):
    if provider == "soft":
        require_same_host()
    seen = _spy(monkeypatch)
    cfg = cfg_for("fedrdma-e", provider, slot_bytes=64 * MiB, checksum=checksum, chunk_bytes=4 * MiB,
                  same_host_chunk_bytes=32 * MiB)
    _send_and_check(cfg, [40 * MiB + 5, 3 * MiB, 12 * MiB])
    blocks = sum(-(-n // (4 * MiB)) for n in (40 * MiB + 5, 3 * MiB, 12 * MiB))
    assert seen["landed"] + seen["read"] == blocks
    assert seen["read"] <= 3  # the last block of each (its tail and its short rest come in two WRITEs)
    assert seen["landed"] >= blocks - 3


@pytest.mark.parametrize("provider", ["soft", "soft-tcp"])
def test_a_frame_of_many_arrays_is_verified_from_where_it_landed(monkeypatch, provider):
    """A payload of many arrays (as FATE's frames are: GPT-2's 148 tensors, small biases between large
    weights) needs several WRs per chunk; they are cut at block boundaries (posting.group_sges), so every
    block is still placed by one WRITE and its digest taken where it landed, not read again from memory."""
    if provider == "soft":
        require_same_host()
    seen = _spy(monkeypatch)
    rng = np.random.default_rng(5)
    sizes = [int(x) for x in rng.choice([3 * 1024, 9 * 1024, 300 * 1024, MiB + 12], 150)]
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    total = sum(sizes)
    cfg = cfg_for("fedrdma-e", provider, slot_bytes=64 * MiB, chunk_bytes=16 * MiB, same_host_chunk_bytes=32 * MiB)
    with Endpoint(cfg, name="rx") as rx, Endpoint(cfg, name="tx") as tx:
        rx.name = rx.address
        tx.send(rx.address, arrays).result(60)
        msg = rx.recv(timeout=30)
        assert bytes(msg.view) == b"".join(a.tobytes() for a in arrays)
        msg.release()
    blocks = -(-total // (4 * MiB))
    assert seen["landed"] + seen["read"] == blocks
    assert seen["read"] <= 1, seen  # the last block (Link-Enable's 4 KiB chunk ends it in a WRITE of its own)


def test_chunks_smaller_than_a_block_are_checked_from_memory_with_notes(monkeypatch):
    """1 MiB chunks: no single WRITE places a block, so no block has a landing digest; the PLACED notes
    start each block's checksum early instead, and the transfer is verified all the same."""
    seen, started = _spy(monkeypatch), []
    real = fe.block_checksums_async
    monkeypatch.setattr(fe, "block_checksums_async", lambda *a, **kw: started.append(a[1]) or real(*a, **kw))
    cfg = cfg_for("fedrdma-e", "soft-tcp", slot_bytes=64 * MiB, chunk_bytes=MiB)
    _send_and_check(cfg, [40 * MiB])
    assert seen == {"landed": 0, "read": 10} and started


def test_a_failing_hasher_leaves_its_block_to_be_read_from_memory(monkeypatch):
    from fate_rdma.channel import connection

    class Flaky(C._Crc):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def update(self, piece):
            if self.block == 1:
                raise RuntimeError("hasher fault")
            super().update(piece)

    monkeypatch.setattr(connection, "block_hasher", lambda integrity: Flaky)
    seen = _spy(monkeypatch)
    cfg = cfg_for("fedrdma-e", "soft-tcp", slot_bytes=32 * MiB, chunk_bytes=4 * MiB, checksum="crc32c")  # (a _Crc)
    _send_and_check(cfg, [16 * MiB])
    assert seen["landed"] >= 2 and seen["read"] >= 1


def test_the_digest_helpers_agree_with_the_whole_payload_digest():
    data = memoryview(np.random.default_rng(1).integers(0, 256, 9 * MiB + 3, dtype=np.uint8))
    for kind in ("crc32c", "xxh3"):
        integ, start = Integrity(kind), C.block_hasher(Integrity(kind))
        landed = {}
        for i, blk in enumerate(C._blocks([data])):
            h = start(i)
            for p in blk:
                h.update(p)
            landed[i] = (sum(p.nbytes for p in blk), h.digest())

        class Landed:
            def take(self, i, n):
                return landed[i][1] if i != 1 and landed[i][0] == n else None  # block 1 read from memory

        assert C.payload_digest_with(integ, data, {}, Landed()) == C.payload_digest(integ, [data])
    assert C.block_hasher(Integrity("none")) is None
    assert xxhash.xxh3_128(seed=0).digest() == C.block_hasher(Integrity("xxh3"))(0).digest()


@pytest.mark.parametrize("provider", ["soft", "soft-tcp"])
@pytest.mark.parametrize("checksum", BLOCKWISE)
def test_bytes_corrupted_where_they_land_are_refused(monkeypatch, provider, checksum):
    """One byte flipped as a piece lands (before it is digested, as a faulty placement would): the digest
    no longer matches the sender's, the transfer fails as an integrity error, nothing reaches the
    application and the connection stays usable. (Bytes changed after their digest are the rewrite cases
    above: the digest is dropped, and the block is read from memory.)"""
    real, flipped = L.Landing.landed, []

    def corrupt(self, at, n):
        view = self.digests._view
        if not flipped and view is not None and self.offset + at >= self.digests.origin and n > 1:
            flipped.append(at)
            view[self.offset + at] ^= 0xFF
        return real(self, at, n)

    monkeypatch.setattr(L.Landing, "landed", corrupt)
    cfg = cfg_for("fedrdma-e", provider, slot_bytes=32 * MiB, checksum=checksum)
    with Endpoint(cfg, name="rx") as rx, Endpoint(cfg, name="tx") as tx:
        rx.name = rx.address
        data = np.full(20 * MiB, 7, dtype=np.uint8)
        with pytest.raises(IntegrityError, match=f"{checksum} mismatch"):
            tx.send(rx.address, data).result(60)
        assert flipped
        with pytest.raises(Exception):
            rx.recv(timeout=0.5)
        tx.send(rx.address, b"after").result(30)
        assert bytes(rx.recv(timeout=30).detach()) == b"after"
