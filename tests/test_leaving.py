"""Digests taken as the bytes leave: the soft provider hands each piece of a WRITE to its `on_leave` before
sending it, a few pieces a send call (QP.post_write), and a FedRDMA-E sender over TCP builds its payload digest from those pieces
(fate_rdma/channel/leaving.py) instead of a separate pass on the digest pool; whatever does not leave that
way (chunk 0, which waits for the digest; a WRITE begun inside a block; a failed hook) is digested on the
pool, so the digest is always payload_digest's."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from easypyverbs.capabilities import ArrivalHook, LeavingWrites, PlacesWrites
from easypyverbs.providers.soft.landing import TCP_PIECE_BYTES
from easypyverbs.types import DataPath
from fate_rdma.channel import Endpoint
from fate_rdma.channel import leaving as L
from fate_rdma.channel.checksum import payload_digest
from fate_rdma.protocol.chunking import plan_chunks
from fate_rdma.protocol.integrity import BLOCK_BYTES, Integrity

from .conftest import require_same_host
from .test_channel import cfg_for
from .verbs_pair import close_pair, make_pair

MiB = 1 << 20
KiB = 1 << 10


def _write(sides, data: bytes, hook, sge_cut: int = 0) -> None:
    a, b = sides
    a.buf[:len(data)] = data
    sges = ([a.mr.sge(0, sge_cut), a.mr.sge(sge_cut, len(data) - sge_cut)] if sge_cut else [a.mr.sge(0, len(data))])
    a.qp.post_write(sges, b.mr.remote(), wr_id=7, on_leave=hook)
    (wc,) = a.cq.wait(10, max_entries=1)
    assert wc.ok and wc.wr_id == 7, wc


@pytest.mark.parametrize("provider", ["soft-tcp", "soft-tls"])
def test_each_piece_of_a_write_is_handed_to_on_leave_in_order_before_it_goes(provider):
    sides = make_pair(provider, size=4 * MiB)
    try:
        # the soft objects report their capabilities (easypyverbs.capabilities) and their data path
        assert isinstance(sides[0].qp, LeavingWrites) and isinstance(sides[1].mr, PlacesWrites)
        assert isinstance(sides[0].cq, ArrivalHook) and sides[0].qp.path_kind is DataPath.TCP_EMULATED
        assert sides[0].qp.calls_on_leave
        data = np.random.default_rng(1).integers(0, 256, 3 * MiB + 333, dtype=np.uint8).tobytes()
        seen = []
        _write(sides, data, lambda off, piece: seen.append((off, bytes(piece))), sge_cut=TCP_PIECE_BYTES // 3)
        assert [off for off, _ in seen] == [sum(len(p) for _, p in seen[:i]) for i in range(len(seen))]
        assert b"".join(p for _, p in seen) == data == bytes(sides[1].buf[:len(data)])
        assert max(len(p) for _, p in seen) <= TCP_PIECE_BYTES
    finally:
        close_pair(sides)


def test_a_write_of_several_send_calls_hands_every_piece_before_it_leaves(monkeypatch):
    """A WRITE larger than one send call (SEND_CALL_BYTES, made 2 MiB here): the pieces the hook has seen go to
    the socket a few at a time, no byte of a piece before the hook has seen it, and every byte lands."""
    from types import SimpleNamespace

    from easypyverbs.providers.soft import leave, wire
    sent, seen = [], []

    def spy(sock, bufs):
        sent.append(sum(b.nbytes for b in bufs))
        assert sum(sent) <= sum(len(p) for _, p in seen) + wire.REQ.size  # (the WRITE's header rides the first call)
        wire.send_buffers(sock, bufs)

    sides = make_pair("soft-tcp", size=8 * MiB)
    try:
        monkeypatch.setattr(leave, "wire", SimpleNamespace(send_buffers=spy, SEND_CALL_BYTES=2 * TCP_PIECE_BYTES))
        data = np.random.default_rng(2).integers(0, 256, 7 * MiB + 5, dtype=np.uint8).tobytes()
        _write(sides, data, lambda off, piece: seen.append((off, bytes(piece))))
        assert b"".join(p for _, p in seen) == data == bytes(sides[1].buf[:len(data)])
        assert len(sent) == 4 and max(sent) <= 2 * TCP_PIECE_BYTES + wire.REQ.size  # 8 pieces, 2 a call
    finally:
        monkeypatch.undo()
        close_pair(sides)


def test_on_the_same_host_path_the_peer_reads_the_bytes_and_on_leave_is_never_called():
    require_same_host()
    sides = make_pair("soft", size=2 * MiB)
    try:
        assert not sides[0].qp.calls_on_leave and sides[0].qp.path_kind is DataPath.SAME_HOST_EMULATED
        seen = []
        _write(sides, bytes(range(256)) * 4096, lambda off, piece: seen.append(off))
        assert seen == [] and bytes(sides[1].buf[:1 << 20]) == bytes(range(256)) * 4096
    finally:
        close_pair(sides)


def test_a_hook_that_raises_is_logged_once_and_the_write_goes_on(caplog):
    sides = make_pair("soft-tcp", size=2 * MiB)
    calls = []

    def bad(off, piece):
        calls.append(off)
        raise RuntimeError("hook broke")

    try:
        data = b"\x5a" * (2 * MiB)
        with caplog.at_level(logging.ERROR, logger="easypyverbs.soft"):
            _write(sides, data, bad)
        assert calls == [0] and bytes(sides[1].buf) == data
        assert [r.getMessage() for r in caplog.records] == ["on_leave of WR 7 failed at byte 0; not called again for it"]
    finally:
        close_pair(sides)


def _views(n: int, cut: int):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    return data, [memoryview(data[:cut]), memoryview(data[cut:])]


def _leave_chunk(d, flat, c, step=300_000):
    """What the soft provider does for chunk `c`'s WRITE: its pieces, in order, to the chunk's hook."""
    leave_at = d.hook_for(c)  # (posting.post_chunk: one WRITE here, from the chunk's first byte)
    if leave_at is not None:
        hook = leave_at(c.offset)
        for off in range(c.offset, c.offset + c.length, step):
            hook(off - c.offset, flat[off:min(off + step, c.offset + c.length)])


@pytest.mark.parametrize("kind", ["xxh3", "crc32c"])
def test_the_digest_built_from_leaving_pieces_is_payload_digests_whatever_left_how(kind):
    """Blocks wholly inside one chunk other than chunk 0 are digested as they leave (chunks back to front),
    the rest on the pool from the start; a hooked block that left begun inside or out of order is digested
    by settle. Always the same digest."""
    integ = Integrity(kind)
    n = 5 * BLOCK_BYTES + 777
    data, views = _views(n, BLOCK_BYTES + 5)
    want = payload_digest(integ, views)
    flat = memoryview(data)
    for chunk, hooked in ((2 * BLOCK_BYTES, {2, 3, 4, 5}), (6 * MiB, {2, 3, 5})):  # (6 MiB: blocks 1, 4 shared)
        chunks = plan_chunks(n, chunk, small_last=True)
        d = L.LeavingDigest.make(views, integ, chunks)
        assert d.hooked == hooked and d._pooled == set(range(6)) - hooked
        for c in reversed(chunks[1:]):
            _leave_chunk(d, flat, c)
        assert d.future.result(10) == want and not d._skipped
    d = L.LeavingDigest.make(views, integ, plan_chunks(n, 2 * BLOCK_BYTES, small_last=True))
    d.leave(2 * BLOCK_BYTES + 10, flat[2 * BLOCK_BYTES + 10:4 * BLOCK_BYTES])  # block 2 begun inside; 3 whole
    d.leave(5 * BLOCK_BYTES + 100, flat[5 * BLOCK_BYTES + 100:n])  # block 5's end before its start
    d.leave(4 * BLOCK_BYTES, flat[4 * BLOCK_BYTES:5 * BLOCK_BYTES + 100])
    time.sleep(0.05)
    assert not d.future.done() and d._skipped == {2, 5}
    d.settle()
    d.settle()  # (once)
    assert d.future.result(10) == want and d._pooled == {0, 1, 2, 5}
    # chunks of less than a block: none would be digested as it leaves
    assert L.LeavingDigest.make(views, integ, plan_chunks(n, MiB, small_last=True)) is None


@pytest.mark.parametrize("kind,chunk,qps", [("xxh3", 4 * MiB, 1), ("crc32c", 4 * MiB, 1), ("xxh3", 6 * MiB, 2)])
def test_fedrdma_e_over_tcp_digests_its_chunks_as_they_leave_and_still_verifies(kind, chunk, qps, monkeypatch):
    """A payload of several chunks over the soft provider's TCP: the blocks inside chunks 1.. are digested as
    they leave and only the others on the pool, and the receiver verifies the digest; with every piece's
    digest failing, the pool covers those blocks too (settle) and it still verifies."""
    cfg = cfg_for("fedrdma-e", "soft-tcp", checksum=kind, chunk_bytes=chunk, slot_bytes=32 * MiB,
                  slot_initial_bytes=32 * MiB, qps_per_peer=qps)
    made, real_init = [], L.LeavingDigest.__init__

    def init(self, *a, **kw):
        made.append(self)
        real_init(self, *a, **kw)

    monkeypatch.setattr(L.LeavingDigest, "__init__", init)
    a, b = Endpoint(cfg, "127.0.0.1"), Endpoint(cfg, "127.0.0.1")
    try:
        data, _ = _views(17 * MiB + 4321, 10)
        blocks = set(range(5))
        for broken in (False, True):
            if broken:
                monkeypatch.setattr(L.LeavingDigest, "leave", lambda self, off, piece: self._skipped.add(off // BLOCK_BYTES))
            fut = a.send(b.address, data)
            msg = b.recv(timeout=30)
            fut.result(30)
            assert bytes(msg.view) == data.tobytes()
            msg.release()
            d = made[-1]
            assert d.hooked and d.future.done()
            assert d._pooled == (blocks if broken else blocks - d.hooked)  # (nothing hooked read twice)
        assert len(made) == 2
    finally:
        a.close()
        b.close()


def test_where_the_bytes_do_not_leave_through_the_sender_the_pool_digests_them():
    """Same-host path, a fill (a buffered put digests as it copies), a payload digested at once, no check, one chunk."""
    def qp(leaves: bool) -> object:  # (capabilities.LeavingWrites: calls_on_leave, and a post_write that takes on_leave)
        return type("Q", (), {"calls_on_leave": leaves, "post_write": lambda *a, **kw: None})()

    qp_tcp, qp_host = qp(True), qp(False)
    assert not L.LeavingDigest.wanted(64 * MiB, Integrity("xxh3"), None, [object()], 32 * MiB)  # no such capability
    x = Integrity("xxh3")
    assert L.LeavingDigest.wanted(64 * MiB, x, None, [qp_tcp], 32 * MiB)
    assert not L.LeavingDigest.wanted(64 * MiB, x, None, [qp_tcp, qp_host], 32 * MiB)
    assert not L.LeavingDigest.wanted(64 * MiB, x, object(), [qp_tcp], 32 * MiB)
    assert not L.LeavingDigest.wanted(MiB, x, None, [qp_tcp], 32 * KiB)
    assert not L.LeavingDigest.wanted(64 * MiB, Integrity("none"), None, [qp_tcp], 32 * MiB)
    assert not L.LeavingDigest.wanted(32 * MiB, x, None, [qp_tcp], 32 * MiB)  # one chunk: nothing to hook
