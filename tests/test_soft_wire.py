"""The soft provider's read-ahead Reader and its batched sender: frames split anywhere, timeouts that lose
nothing, many small WRITEs in flight, and a bad WR in the middle of a batch."""
from __future__ import annotations

import dataclasses
import socket
import struct
import threading

import pytest

import easypyverbs as ev
from easypyverbs.providers.soft import qp as qpmod, responder as respmod, wire

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
        first = qpmod.DOORBELL_INFLIGHT  # WRs before it leave from this thread, by the doorbell
        bad, n = first + 1, first + 4  # the send thread's batch is [first, bad, ...]: the bad WR in its middle
        with a.qp.cv:  # the sender thread cannot take any WR until all are posted
            for i in range(n):
                sge = other.sge(0, 512) if i == bad else a.mr.sge(i * 512, 512)
                a.qp.post_write(sge, b.mr.remote(), remote_offset=i * 512, wr_id=i)
            other.close()
        wcs = a.cq.wait_n(n, 20)
        assert sorted(wc.wr_id for wc in wcs) == list(range(n))
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
        with a.qp.cv:  # all posted before the sender takes any: the batches are as large as they can be
            for i, n in enumerate(sizes):
                a.qp.post_write(a.mr.sge(off, n), b.mr.remote(), remote_offset=off, wr_id=i)
                off += n
        wcs = a.cq.wait_n(len(sizes), 20)
        assert [wc.wr_id for wc in wcs] == list(range(len(sizes))) and all(wc.ok for wc in wcs)
        assert bytes(b.buf[:off]) == bytes(a.buf[:off])
    finally:
        close_pair([a, b])


def test_send_without_waiting_returns_what_did_not_fit():
    """Against a peer that reads nothing, the write takes what fits in the socket's buffers and hands back
    the rest, in order; a blocking send of that rest delivers the whole stream intact."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        data = bytes(i % 251 for i in range(4 << 20))
        bufs = [memoryview(data[:100]), memoryview(data[100:(1 << 20)]), memoryview(data[1 << 20:])]
        rest = wire.send_without_waiting(a, bufs)
        left = sum(r.nbytes for r in rest)
        assert 0 < left < len(data) and bytes(b"".join(bytes(r) for r in rest)) == data[len(data) - left:]
        got = bytearray()
        t = threading.Thread(target=lambda: [got.extend(b.recv(1 << 20)) for _ in iter(lambda: len(got) < len(data), False)],
                             daemon=True)
        t.start()
        wire.send_buffers(a, rest)
        t.join(20)
        assert bytes(got) == data
    finally:
        a.close()
        b.close()


class _PartialSock:
    """A socket stand-in whose every sendmsg takes a random share of what it is given, recording each call."""

    def __init__(self, seed: int) -> None:
        import random
        self.rng, self.out, self.calls = random.Random(seed), bytearray(), []

    def sendmsg(self, bufs):
        self.calls.append((len(bufs), sum(b.nbytes for b in bufs)))
        left = n = self.rng.randint(1, self.calls[-1][1])
        for b in bufs:
            k = min(left, b.nbytes)
            self.out += bytes(b[:k])
            left -= k
            if not left:
                break
        return n


@pytest.mark.parametrize("seed", range(6))
def test_send_buffers_caps_each_call_and_keeps_the_stream(monkeypatch, seed):
    """A WRITE larger than SEND_CALL_BYTES goes in calls of at most that many bytes (one large sendmsg per chunk
    was slower over loopback TCP), small buffers still share a call (up to 512 iovecs), and partial sends lose
    or reorder nothing."""
    monkeypatch.setattr(wire, "SEND_CALL_BYTES", 64 << 10)
    import random
    rng = random.Random(seed)
    bufs = [memoryview(bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 40, 4096, 70000, 300000]))))
            for _ in range(rng.randint(1, 12))] + [memoryview(bytes(range(40))) for _ in range(600)]
    sock = _PartialSock(seed)
    wire.send_buffers(sock, bufs)
    assert bytes(sock.out) == b"".join(bytes(b) for b in bufs)
    assert all(n <= 512 and (total <= 64 << 10 or n == 1) for n, total in sock.calls)
    assert max(total for _, total in sock.calls) <= 64 << 10  # a buffer above the cap is cut, never sent whole
    assert any(n > 1 for n, _ in sock.calls)  # small buffers share calls


def test_send_buffers_takes_views_of_wider_items_as_their_bytes(monkeypatch):
    """A view whose items are wider than a byte (an int32 array) is cut and resumed by bytes, not items."""
    import array
    monkeypatch.setattr(wire, "SEND_CALL_BYTES", 1000)
    ints = array.array("i", range(3000))
    sock = _PartialSock(7)
    wire.send_buffers(sock, [memoryview(b"head"), memoryview(ints)])
    assert bytes(sock.out) == b"head" + ints.tobytes()


def _spy_doorbell(monkeypatch, keep_bytes=None):
    """Count the posting thread's writes; with `keep_bytes`, each takes only that many bytes (as when the
    socket's buffer is full) and hands the rest to the send thread."""
    calls = []
    real = wire.send_without_waiting

    def spy(sock, bufs):
        calls.append(threading.current_thread().name)
        if keep_bytes is None:
            return real(sock, bufs)
        head = b"".join(bytes(v) for v in bufs)
        sock.sendall(head[:keep_bytes])
        return [memoryview(head[keep_bytes:])]

    monkeypatch.setattr(wire, "send_without_waiting", spy)
    return calls


def test_a_lone_small_write_leaves_from_the_posting_thread(monkeypatch):
    """An idle requester writes a small WR from the posting thread (no hand-off to its send thread); a
    large one, and the WRs of a stream, still go through the send thread. All land, in order."""
    calls = _spy_doorbell(monkeypatch)
    a, b = make_pair("soft-tcp", size=1 << 20, cap=ev.QPCap(max_send_wr=64, max_recv_wr=16))
    try:
        a.buf[:] = bytes(i % 249 for i in range(len(a.buf)))
        a.qp.post_write(a.mr.sge(0, 512), b.mr.remote(), wr_id=1)
        assert a.cq.wait_n(1, 10)[0].ok and calls == [threading.current_thread().name]
        a.qp.post_write(a.mr.sge(0, 512 << 10), b.mr.remote(), wr_id=2)  # larger than INLINE_SEND_BYTES
        assert a.cq.wait_n(1, 10)[0].ok and len(calls) == 1
        with a.qp.cv:  # nothing is answered while we hold the lock: the first WRs fill the doorbell's room
            assert a.qp.cv.wait_for(lambda: not a.qp.requester._tx_busy, 10)  # (the send thread may not have let go yet)
            for i in range(20):
                a.qp.post_write(a.mr.sge(i * 1024, 1024), b.mr.remote(), remote_offset=i * 1024, wr_id=10 + i)
        wcs = a.cq.wait_n(20, 10)
        assert [wc.wr_id for wc in wcs] == list(range(10, 30)) and all(wc.ok for wc in wcs)
        assert len(calls) == 1 + qpmod.DOORBELL_INFLIGHT  # the stream's first WRs, then the send thread
        assert bytes(b.buf[:512 << 10]) == bytes(a.buf[:512 << 10])
    finally:
        close_pair([a, b])


def test_a_doorbell_write_cut_short_is_finished_before_the_next_wr(monkeypatch):
    """When the socket takes only part of a posting thread's write, the send thread writes the rest before
    any WR posted after it: the byte stream stays whole, every WR completes once, in order."""
    calls = _spy_doorbell(monkeypatch, keep_bytes=7)  # not even a whole request header
    a, b = make_pair("soft-tcp", size=1 << 20, cap=ev.QPCap(max_send_wr=64, max_recv_wr=16))
    try:
        a.buf[:] = bytes(i % 241 for i in range(len(a.buf)))
        for i in range(40):
            a.qp.post_write(a.mr.sge(i * 4096, 4096), b.mr.remote(), remote_offset=i * 4096, wr_id=i)
            if i < 6:  # idle in between: the doorbell rings again once the send thread has written the rest
                assert a.cq.wait_n(1, 10)[0].ok
                with a.qp.cv:
                    assert a.qp.cv.wait_for(lambda: not a.qp.requester._tx_busy, 10)
        wcs = a.cq.wait_n(34, 10)
        assert all(wc.ok for wc in wcs) and a.qp.state == ev.QPState.RTS
        assert len(calls) >= 7  # each idle moment rang the doorbell; the stream's WRs went by the send thread
        assert bytes(b.buf[:40 * 4096]) == bytes(a.buf[:40 * 4096])
    finally:
        close_pair([a, b])


def test_writes_posted_from_several_threads_all_land():
    """Four threads post small and large WRITEs at once (doorbell and send thread racing for the wire):
    every WR completes exactly once and each thread's bytes land where addressed."""
    a, b = make_pair("soft-tcp", size=16 << 20, cap=ev.QPCap(max_send_wr=256, max_recv_wr=16))
    try:
        a.buf[:] = bytes(i % 239 for i in range(len(a.buf)))
        sizes = [100, 64 << 10, 3, 300 << 10, 4096] * 8
        region = 4 << 20  # each thread's 2.9 MiB

        def poster(t):
            off = t * region
            for k, n in enumerate(sizes):
                a.qp.post_write(a.mr.sge(off, n), b.mr.remote(), remote_offset=off, wr_id=t << 16 | k)
                off += n

        threads = [threading.Thread(target=poster, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        wcs = a.cq.wait_n(4 * len(sizes), 20)
        assert sorted(wc.wr_id for wc in wcs) == sorted(t << 16 | k for t in range(4) for k in range(len(sizes)))
        assert all(wc.ok for wc in wcs)
        for t in range(4):
            n = sum(sizes)
            assert bytes(b.buf[t * region:t * region + n]) == bytes(a.buf[t * region:t * region + n])
        by_thread = {}
        for wc in wcs:
            by_thread.setdefault(wc.wr_id >> 16, []).append(wc.wr_id & 0xFFFF)
        assert all(v == sorted(v) for v in by_thread.values())
    finally:
        close_pair([a, b])


def test_a_field_that_does_not_fit_is_refused_at_post():
    """An imm outside 32 bits (post_send too), an rkey outside 32 or an address outside 64 is a
    UsageError at the call, and the QP goes on working (such a field once reached the wire header's
    packing in whichever thread sent the WR)."""
    a, b = make_pair("soft-tcp", size=1 << 16, cap=ev.QPCap(max_send_wr=16, max_recv_wr=16))
    try:
        for imm in (1 << 32, -1):
            with pytest.raises(ev.UsageError, match="imm must fit 32 bits"):
                a.qp.post_send(a.mr.sge(0, 64), wr_id=1, imm=imm)
        good = b.mr.remote()
        for bad in (dataclasses.replace(good, rkey=1 << 32), dataclasses.replace(good, addr=(1 << 64) - 8)):
            with pytest.raises(ev.UsageError, match="outside 32 / 64 bits"):
                a.qp.post_write(a.mr.sge(0, 64), bad, wr_id=1)
        a.qp.post_write(a.mr.sge(0, 64), b.mr.remote(), wr_id=2)
        assert a.cq.wait_n(1, 10)[0].ok and a.qp.state == ev.QPState.RTS
    finally:
        close_pair([a, b])


def _spy_answers(monkeypatch):
    """The kinds of the responders' answers (ACK, NAK, ...), in order."""
    answers = []
    real_answer = respmod.Responder._answer
    monkeypatch.setattr(respmod.Responder, "_answer", lambda self, *a, **k: (answers.append(a[2]), real_answer(self, *a, **k)))
    return answers


def test_sends_followed_by_more_requests_share_one_ack(monkeypatch):
    """SENDs posted in one batch with a WRITE (a control frame and a message's chunk): each SEND's
    receive completes at once, in order, with its bytes, but the responder answers only the last request
    (one cumulative ACK), and every signaled WR completes at the requester, in order."""
    answers = _spy_answers(monkeypatch)
    a, b = make_pair("soft-tcp", size=1 << 20, cap=ev.QPCap(max_send_wr=64, max_recv_wr=16))
    try:
        a.buf[:] = bytes(i % 241 for i in range(len(a.buf)))
        for k in range(2):
            b.qp.post_recv(b.mr.sge(k * 4096, 4096), wr_id=k)
        with a.qp.batch():
            a.qp.post_send(a.mr.sge(8192, 100), wr_id=1, signaled=False)
            a.qp.post_send(a.mr.sge(12288, 200), wr_id=2)
            a.qp.post_write(a.mr.sge(16384, 4096), b.mr.remote(), remote_offset=16384, wr_id=3)
        recvs = b.cq.wait_n(2, 10)
        assert [(wc.wr_id, wc.byte_len, wc.ok) for wc in recvs] == [(0, 100, True), (1, 200, True)]
        assert bytes(b.buf[:100]) == bytes(a.buf[8192:8292]) and bytes(b.buf[4096:4296]) == bytes(a.buf[12288:12488])
        assert [(wc.wr_id, wc.ok) for wc in a.cq.wait_n(2, 10)] == [(2, True), (3, True)]
        assert bytes(b.buf[16384:20480]) == bytes(a.buf[16384:20480])
        assert answers == [wire.ACK]
        b.qp.post_recv(b.mr.sge(8192, 4096), wr_id=5)
        a.qp.post_send(a.mr.sge(0, 10), wr_id=4)  # alone (nothing after it): answered at once
        assert b.cq.wait_n(1, 10)[0].ok and a.cq.wait_n(1, 10)[0].wr_id == 4 and answers == [wire.ACK, wire.ACK]
    finally:
        close_pair([a, b])


def test_a_stream_of_sends_is_answered_often_and_a_nak_after_a_deferred_send_fails_only_its_wr(monkeypatch):
    """Back-to-back small SENDs are answered at least once per ACK_EVERY_REQUESTS (their signaled
    completions come in step, not all at the end); a SEND deferred to the next request's answer, when that
    request is refused (no receive posted: RNR), completes successfully and only the next one fails."""
    answers = _spy_answers(monkeypatch)
    n = 40
    a, b = make_pair("soft-tcp", size=1 << 20, cap=ev.QPCap(max_send_wr=64, max_recv_wr=64))
    try:
        for k in range(n + 1):
            b.qp.post_recv(b.mr.sge(k * 64, 64), wr_id=k)
        with a.qp.batch():  # more than the doorbell takes: the send thread writes them in one go
            for k in range(n):
                a.qp.post_send(a.mr.sge(k * 64, 64), wr_id=k)
        assert all(wc.ok for wc in b.cq.wait_n(n, 10))
        assert [wc.wr_id for wc in a.cq.wait_n(n, 10)] == list(range(n))
        assert n >= 2 * respmod.ACK_EVERY_REQUESTS  # (a stream longer than two bounds)
        assert len(answers) >= n // respmod.ACK_EVERY_REQUESTS and set(answers) == {wire.ACK}
        answers.clear()
        with a.qp.batch():  # the last receive, then none: RNR for the second SEND only
            a.qp.post_send(a.mr.sge(0, 64), wr_id=100)
            a.qp.post_send(a.mr.sge(0, 64), wr_id=101)
        assert b.cq.wait_n(1, 10)[0].ok
        wcs = a.cq.wait_n(2, 10)
        assert [(wc.wr_id, wc.status) for wc in wcs] == [(100, ev.WCStatus.SUCCESS), (101, ev.WCStatus.RNR_RETRY_EXC_ERR)]
        assert answers == [wire.NAK]  # one answer for both
    finally:
        close_pair([a, b])


def test_a_batch_of_small_wrs_leaves_in_one_write_and_is_answered_once(monkeypatch):
    """QP.batch on an idle requester: the WRs leave in one write from the posting thread, and the responder,
    finding each next request already there, answers only the last (a cumulative ACK). A batch too large
    for the doorbell goes to the send thread; another thread's posts during a batch are not held by it; a
    batch on a QP that left RTS meanwhile is flushed; batches do not nest."""
    calls = _spy_doorbell(monkeypatch)
    answers = _spy_answers(monkeypatch)
    a, b = make_pair("soft-tcp", size=1 << 20, cap=ev.QPCap(max_send_wr=64, max_recv_wr=16))
    try:
        a.buf[:] = bytes(i % 239 for i in range(len(a.buf)))
        b.qp.post_recv([], wr_id=0)
        with a.qp.batch():
            for i in (3, 2, 1):
                a.qp.post_write(a.mr.sge(i * 4096, 4096), b.mr.remote(), remote_offset=i * 4096, wr_id=i, signaled=i == 1)
            a.qp.post_write_with_imm(a.mr.sge(0, 4096), b.mr.remote(), imm=5, wr_id=4)
            assert calls == []  # held until the batch ends
        assert b.cq.wait_n(1, 10)[0].imm_data == 5 and bytes(b.buf[:4 * 4096]) == bytes(a.buf[:4 * 4096])
        assert [wc.wr_id for wc in a.cq.wait_n(2, 10)] == [1, 4]
        assert calls == [threading.current_thread().name] and answers == [wire.ACK]
        calls.clear()
        with a.qp.batch():  # more WRs than the doorbell takes at once: the send thread writes them
            for i in range(qpmod.DOORBELL_BATCH_WRS + 1):
                a.qp.post_write(a.mr.sge(i * 512, 512), b.mr.remote(), remote_offset=i * 512, wr_id=20 + i)
            other = threading.Thread(target=a.qp.post_write, args=(a.mr.sge(0, 8), b.mr.remote()),
                                     kwargs={"remote_offset": 1 << 19, "wr_id": 99})
            other.start()
            other.join(10)
            assert a.cq.wait_n(1, 10)[0].wr_id == 99  # another thread's post went at once
        wcs = a.cq.wait_n(qpmod.DOORBELL_BATCH_WRS + 1, 10)
        assert [wc.wr_id for wc in wcs] == list(range(20, 21 + qpmod.DOORBELL_BATCH_WRS)) and all(wc.ok for wc in wcs)
        assert calls == ["other"] or (len(calls) == 1 and calls[0] != threading.current_thread().name)
        with pytest.raises(ev.UsageError, match="do not nest"):
            with a.qp.batch():
                with a.qp.batch():
                    pass
        with a.qp.batch():
            a.qp.post_write(a.mr.sge(0, 8), b.mr.remote(), wr_id=40)
            a.qp.enter_error(ev.WCStatus.WR_FLUSH_ERR, "test: the QP fails while a batch is open")
        (wc,) = a.cq.wait_n(1, 10)
        assert wc.wr_id == 40 and wc.status == ev.WCStatus.WR_FLUSH_ERR
    finally:
        close_pair([a, b])

