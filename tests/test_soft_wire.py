"""The soft provider's read-ahead Reader and its batched sender: frames split anywhere, timeouts that lose
nothing, many small WRITEs in flight, and a bad WR in the middle of a batch."""
from __future__ import annotations

import socket
import struct
import threading

import pytest

import easypyverbs as ev
from easypyverbs.providers.soft import wire

from .verbs_pair import close_pair, make_pair


def _frames(sizes):
    """(header, payload) pairs: an 8-byte header (index, length), then `length` bytes."""
    return [(struct.pack("!II", i, n), bytes((i + k) % 251 for k in range(n))) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_reader_frames_split_anywhere(chunk):
    """Headers and payloads short and long (around the read-ahead size) come out intact however the
    stream is cut (one byte at a time included)."""
    ra = wire.READ_AHEAD_BYTES
    frames = _frames([0, 1, 40, 4096, ra // 4, ra // 4 + 1, ra - 1, ra, ra + 3, 3 * ra, 5])
    stream = b"".join(h + p for h, p in frames)
    a, b = socket.socketpair()
    try:
        def feed():
            for i in range(0, len(stream), chunk):
                a.sendall(stream[i:i + chunk])

        t = threading.Thread(target=feed, daemon=True)
        t.start()
        rd = wire.Reader(b)
        for i, (h, p) in enumerate(frames):
            hdr = memoryview(bytearray(8))
            rd.read_into(hdr)
            idx, n = struct.unpack("!II", hdr)
            assert (idx, n) == (i, len(p))
            got = bytearray(n)
            rd.read_into(memoryview(got))
            assert bytes(got) == p
        assert rd.buffered() == 0
        t.join(10)
    finally:
        a.close()
        b.close()


def test_reader_timeout_keeps_a_partial_header():
    """SO_RCVTIMEO in the middle of a header: the call fails, nothing is consumed, and a retry reads it whole."""
    a, b = socket.socketpair()
    try:
        wire.set_kernel_timeouts(b, 0.05)
        rd = wire.Reader(b)
        a.sendall(b"\x01\x02\x03")
        hdr = memoryview(bytearray(8))
        with pytest.raises((BlockingIOError, socket.timeout)):
            rd.read_into(hdr)
        assert rd.more_pending()  # three bytes of it are here
        a.sendall(b"\x04\x05\x06\x07\x08tail")
        rd.read_into(hdr)
        assert bytes(hdr) == b"\x01\x02\x03\x04\x05\x06\x07\x08"
        assert rd.read(4) == b"tail" and not rd.more_pending()
    finally:
        a.close()
        b.close()


def test_reader_peer_closed_mid_frame():
    a, b = socket.socketpair()
    try:
        rd = wire.Reader(b)
        a.sendall(b"\x00" * 5)
        a.close()
        with pytest.raises(wire.PeerClosed):
            rd.read_into(memoryview(bytearray(8)))
    finally:
        b.close()


@pytest.mark.parametrize("provider", ["soft-tcp", "soft-tls"])
def test_many_small_writes_in_flight(provider):
    """A full send queue of small WRITEs (batched into few vectored writes, answered by coalesced ACKs):
    every WR completes once, in order, and every byte lands."""
    cap = ev.QPCap(max_send_wr=256, max_recv_wr=16)
    a, b = make_pair(provider, size=1 << 16, cap=cap)
    try:
        for i in range(len(a.buf)):
            a.buf[i] = (i * 7) % 256
        n, size = 256, 256
        for i in range(n):
            a.qp.post_write(a.mr.sge(i * size, size), b.mr.remote(), remote_offset=i * size, wr_id=i)
        wcs = a.cq.wait_n(n, 20)
        assert [wc.wr_id for wc in wcs] == list(range(n)) and all(wc.ok for wc in wcs)
        assert bytes(b.buf[:n * size]) == bytes(a.buf[:n * size])
    finally:
        close_pair([a, b])


def test_bad_wr_in_a_batch_fails_the_qp_and_flushes_the_rest():
    """A WR whose MR was closed after posting, among WRs posted at the same moment (one batch): the QP
    errors with LOC_PROT_ERR and every WR still completes exactly once."""
    a, b = make_pair("soft-tcp", size=1 << 16, cap=ev.QPCap(max_send_wr=64, max_recv_wr=16))
    try:
        other = a.pd.reg_mr(bytearray(4096), ev.Access.LOCAL_WRITE)
        with a.qp._cv:  # the sender thread cannot take any WR until all are posted
            for i in range(6):
                sge = other.sge(0, 512) if i == 3 else a.mr.sge(i * 512, 512)
                a.qp.post_write(sge, b.mr.remote(), remote_offset=i * 512, wr_id=i)
            other.close()
        wcs = a.cq.wait_n(6, 20)
        assert sorted(wc.wr_id for wc in wcs) == list(range(6))
        assert any(wc.status == ev.WCStatus.LOC_PROT_ERR for wc in wcs)
        assert a.qp.state == ev.QPState.ERR
    finally:
        close_pair([a, b])


def test_small_and_large_writes_mixed_in_flight():
    """WRs around the sender's batch limits (count and bytes) and the reader's read-ahead, posted at once:
    each completes once, in order, and lands where it was addressed."""
    a, b = make_pair("soft-tcp", size=4 << 20, cap=ev.QPCap(max_send_wr=256, max_recv_wr=16))
    try:
        a.buf[:] = bytes(i % 253 for i in range(len(a.buf)))
        sizes = [100, 300 << 10, 5, 2 << 20, 1] + [16 << 10] * 40 + [(1 << 20) - 40, 3]  # 3.9 MiB
        off = 0
        with a.qp._cv:  # all posted before the sender takes any: the batches are as large as they can be
            for i, n in enumerate(sizes):
                a.qp.post_write(a.mr.sge(off, n), b.mr.remote(), remote_offset=off, wr_id=i)
                off += n
        wcs = a.cq.wait_n(len(sizes), 20)
        assert [wc.wr_id for wc in wcs] == list(range(len(sizes))) and all(wc.ok for wc in wcs)
        assert bytes(b.buf[:off]) == bytes(a.buf[:off])
    finally:
        close_pair([a, b])
