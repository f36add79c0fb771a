"""The sans-IO protocol: frames, both modes' machines in memory, adversarial schedulers, fuzzing."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import random

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easypyverbs.types import DataPath
from fate_rdma import errors as E
from fate_rdma import protocol as P
from fate_rdma.protocol.fedrdma_e import slot_payload_offset

PROTOCOL_DIR = pathlib.Path(P.__file__).parent
FORBIDDEN = {"socket", "threading", "asyncio", "time", "grpc", "fate", "easypyverbs", "selectors", "subprocess"}


def test_protocol_imports_no_io():
    for path in PROTOCOL_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for n in names:
                assert n.split(".")[0] not in FORBIDDEN, f"{path.name} imports {n}"


def test_header_round_trip_and_every_truncation_rejected():
    h = P.Header(P.HeaderKind.CHUNK, 7, 2, 5, 8192, 4096, 0, 20000, 123, 0, True)
    raw = P.encode_header(h)
    assert len(raw) == P.HEADER.size == 64 and P.decode_header(raw) == h
    for n in range(len(raw)):  # fed one byte at a time: every prefix is refused, none crashes
        with pytest.raises(E.RemoteProtocolError):
            P.decode_header(raw[:n])
    c = P.Ctrl(P.CtrlKind.ERROR, 9, 1, 0, "checksum mismatch")
    raw = P.encode_ctrl(c)
    assert P.decode_ctrl(raw) == c
    for n in range(P.CTRL.size + 3):
        with pytest.raises(E.RemoteProtocolError):
            P.decode_ctrl(raw[:n])


KEY, OTHER_KEY = b"k" * 32, b"o" * 32


@given(st.sampled_from(list(P.CtrlKind)), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
       st.text(max_size=40), st.integers(0, 1000), st.data())
@settings(max_examples=200, deadline=None)
def test_a_sealed_control_frame_opens_only_unaltered_in_its_place(kind, value, aux, reason, number, data):
    """Sealed under a connection's control key, a frame is accepted only as that frame number, under that key,
    byte for byte: any flipped bit (the tag included), another number (a replay, a reordering, a frame dropped
    before it), the other direction's key, a missing tag, or the MAC's flag without a key is refused."""
    c = P.Ctrl(kind, 3, value, aux, reason)
    raw = P.encode_ctrl(c, KEY, number)
    assert P.decode_ctrl(raw, KEY, number) == dataclasses.replace(c, reason=raw[P.CTRL.size:-16].decode())
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    flipped = bytearray(raw)
    flipped[bit // 8] ^= 1 << bit % 8
    for bad, key, n in ((bytes(flipped), KEY, number), (raw, KEY, number + 1), (raw, OTHER_KEY, number),
                        (raw[:-16], KEY, number), (P.encode_ctrl(c), KEY, number)):
        with pytest.raises(E.RemoteProtocolError, match="control frame"):
            P.decode_ctrl(bad, key, n)
    with pytest.raises(E.RemoteProtocolError, match="no session key"):
        P.decode_ctrl(raw)


@pytest.mark.parametrize("field,value,match", [
    ("seq", 5, "out of range"), ("offset", 19000, "beyond total"), ("meta_len", 1 << 20, "metadata"),
])
def test_inconsistent_headers_rejected(field, value, match):
    import dataclasses

    h = dataclasses.replace(P.Header(P.HeaderKind.CHUNK, 1, 0, 5, 0, 4096, 0, 20000), **{field: value})
    with pytest.raises(E.RemoteProtocolError, match=match):
        P.decode_header(P.encode_header(h))


def test_plan_chunks():
    assert [c.length for c in P.plan_chunks(10, 4)] == [4, 4, 2]
    assert [c.length for c in P.plan_chunks(10, 4, first_bytes=1)] == [1, 4, 4, 1]
    assert [c.length for c in P.plan_chunks(10, 4, first_bytes=1, small_last=True)] == [4, 4, 1, 1]
    assert P.plan_chunks(0, 4) == [P.Chunk(0, 0, 0)]
    for total in (1, 3, 4, 5, 99):
        chunks = P.plan_chunks(total, 4, first_bytes=2)
        assert sum(c.length for c in chunks) == total
        assert all(a.offset + a.length == b.offset for a, b in zip(chunks, chunks[1:]))


class Net:
    """A scheduler between two machines: may reorder, duplicate and drop frames."""

    def __init__(self, seed: int, reorder: bool = False, dup: float = 0.0, drop: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.q = []
        self.reorder, self.dup, self.drop = reorder, dup, drop

    def put(self, frame) -> None:
        if self.rng.random() < self.drop:
            return
        self.q.append(frame)
        if self.rng.random() < self.dup:
            self.q.append(frame)

    def take(self):
        if not self.q:
            return None
        i = self.rng.randrange(len(self.q)) if self.reorder else 0
        return self.q.pop(i)


def run_fedrdma(payload: bytes, chunk: int, window: int, net: Net, first: int = 0):
    now = [0.0]
    s = P.FedRdmaSender(1, len(payload), chunk, window, now[0], first_chunk_bytes=first, no_progress_s=5)
    r = P.FedRdmaReceiver(1 << 30)
    dest = bytearray(len(payload))
    back = Net(net.rng.randrange(1 << 30), net.reorder, net.dup, 0.0)
    copies = 0
    while not s.finished:
        for c in s.next_chunks():
            data = payload[c.offset:c.offset + c.length]
            net.put(P.encode_header(s.header(c, 0, crc32c.crc32c(data))) + data)
        frame = net.take()
        if frame is not None:
            hdr = P.decode_header(frame[:64])
            placed = r.on_chunk(hdr, memoryview(frame[64:]), now[0])
            if placed is not None:
                dest[hdr.offset:hdr.offset + hdr.length] = frame[64:]
                copies += 1
            back.put(P.encode_ctrl(P.Ctrl(P.CtrlKind.ACK, hdr.transfer_id, hdr.seq)))
        ack = back.take()
        if ack is not None:
            s.on_ack(P.decode_ctrl(ack).value, now[0])
        now[0] += 0.01
        s.tick(now[0])
    return bytes(dest), copies, s


@pytest.mark.parametrize("window", [1, 3, 16])
@pytest.mark.parametrize("sched", ["inorder", "reorder", "dup"])
def test_fedrdma_in_memory(window, sched):
    payload = bytes(random.Random(window).randbytes(10_000))
    net = Net(window, reorder=sched == "reorder", dup=0.3 if sched == "dup" else 0.0)
    dest, copies, s = run_fedrdma(payload, 1024, window, net, first=100)
    assert dest == payload and s.state is P.fedrdma.SendState.DONE
    assert copies == len(s.chunks)  # duplicates were re-ACKed, never copied twice


def test_fedrdma_drop_ends_in_timeout_not_a_hang():
    with pytest.raises(E.TransferTimeout, match="no progress"):
        run_fedrdma(bytes(5000), 1000, 2, Net(1, drop=0.5))


def test_fedrdma_corrupt_chunk_detected():
    r = P.FedRdmaReceiver(1 << 20)
    data = b"x" * 100
    hdr = P.Header(P.HeaderKind.CHUNK, 3, 0, 1, 0, 100, 0, 100, crc32c.crc32c(data) ^ 1, 0, True)
    with pytest.raises(E.IntegrityError, match="crc32c"):
        r.on_chunk(hdr, memoryview(data), 0.0)


def test_sender_rejects_bogus_acks_and_bad_transitions():
    s = P.FedRdmaSender(1, 100, 10, 2, 0.0)
    s.next_chunks()
    with pytest.raises(E.RemoteProtocolError, match="never sent"):
        s.on_ack(5, 0.0)
    with pytest.raises(E.RemoteProtocolError, match="chunk 99"):
        s.on_ack(99, 0.0)
    s.cancel()
    assert isinstance(s.error, E.TransferCancelled)
    with pytest.raises(E.LocalProtocolError):
        s._move("complete")


def test_fedrdma_e_in_memory_back_to_front():
    payload = bytes(random.Random(2).randbytes(9000))
    meta = b'{"name":"w"}'
    ring = P.SlotRing(2)
    slot = ring.acquire()
    recv = P.FedRdmaEReceiver(2, 16384, meta_cap=256)
    pool = bytearray(2 * recv.slot_bytes)
    base = slot * recv.slot_bytes
    pay_off = base + slot_payload_offset(256)
    s = P.FedRdmaESender(5, 5, slot, len(payload), 2048, 3, 0.0, slot_payload_bytes=16384, first_chunk_bytes=64)
    order = []
    while not s.finished:
        batch = s.next_chunks()
        for c in batch:
            order.append(c.seq)
            pool[pay_off + c.offset:pay_off + c.offset + c.length] = payload[c.offset:c.offset + c.length]
            if c.seq == 0:
                raw = P.encode_header(s.header(len(meta), 42, crc32c.crc32c(meta))) + meta
                pool[base:base + len(raw)] = raw
        for c in batch:
            s.on_write_complete(c.seq, 0.0)
    assert order[0] == len(s.chunks) - 1 and order[-1] == 0 and s.chunks[-1].length == 64
    msg = recv.on_write_imm(s.imm, memoryview(pool)[base:base + 64])
    assert msg.slot == slot and msg.header.total == len(payload)
    got = bytes(pool[pay_off:pay_off + len(payload)])
    assert got == payload
    recv.verify(msg, crc32c.crc32c(meta), 42)
    with pytest.raises(E.RemoteProtocolError, match="still held"):
        recv.on_write_imm(s.imm, memoryview(pool)[base:base + 64])
    recv.release(slot)
    with pytest.raises(E.LocalProtocolError):
        recv.release(slot)


def test_fedrdma_e_checks():
    with pytest.raises(E.PayloadTooLarge, match="exceeds the peer"):
        P.FedRdmaESender(1, 1, 0, 100, 10, 1, 0.0, slot_payload_bytes=99)
    recv = P.FedRdmaEReceiver(1, 100)
    with pytest.raises(E.RemoteProtocolError, match="slot 3"):
        recv.on_write_imm(3 << 16, memoryview(bytes(64)))
    ring = P.SlotRing(2)
    assert ring.acquire() == 0 and ring.acquire() == 1 and ring.acquire() is None
    ring.credit(0)
    assert ring.acquire() == 0
    with pytest.raises(E.RemoteProtocolError, match="not in use"):
        ring.credit(0) or ring.credit(0)
    msg = None
    hdr = P.encode_header(P.Header(P.HeaderKind.SLOT, 1, 0, 1, 0, 10, 0, 10, 5, 0, True))
    msg = recv.on_write_imm(0, memoryview(hdr))
    with pytest.raises(E.IntegrityError):
        recv.verify(msg, 0, 6)


def test_fedrdma_e_header_waits_with_several_qps():
    s = P.FedRdmaESender(1, 1, 0, 50, 10, 10, 0.0, slot_payload_bytes=100, header_after_all=True)
    first = s.next_chunks()
    assert 0 not in [c.seq for c in first] and len(first) == 4
    for c in first:
        s.on_write_complete(c.seq, 0.0)
    assert [c.seq for c in s.next_chunks()] == [0]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_frames_only_protocol_errors_escape(data):
    for fn in (P.decode_header, P.decode_ctrl):
        try:
            fn(data)
        except E.RemoteProtocolError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-2, 40)), max_size=60))
def test_fuzz_machines_only_package_errors_escape(events):
    s = P.FedRdmaSender(1, 100, 10, 4, 0.0, no_progress_s=1)
    r = P.FedRdmaReceiver(1000)
    for kind, v in events:
        try:
            if kind == 0:
                s.next_chunks()
            elif kind == 1:
                s.on_ack(v, 0.0)
            elif kind == 2:
                s.tick(float(v))
            else:
                h = P.Header(P.HeaderKind.CHUNK, 1, max(v, 0) % 12, 11, max(v, 0) * 10, 10, 0, 110)
                r.on_chunk(P.decode_header(P.encode_header(h)), memoryview(bytes(10)), 0.0)
        except E.FateRdmaError:
            pass


# -- FedRDMA-E's PLACED state and the receiver's verdict ----------------------------------------------
SS = P.fedrdma.SendState


def placed_sender(total=30, chunk=10, window=4):
    s = P.FedRdmaESender(7, 7, 0, total, chunk, window, 0.0, slot_payload_bytes=100, no_progress_s=5)
    for c in s.next_chunks():
        s.on_write_complete(c.seq, 0.0)
    return s


def test_fedrdma_e_placed_then_confirmed():
    s = placed_sender()
    assert s.state is SS.PLACED and s.finished and not s.settled
    assert s.on_confirm() is True
    assert s.state is SS.DONE and s.settled
    assert s.on_confirm() is False  # a duplicate DONE changes nothing


def test_fedrdma_e_done_overtaking_the_last_completion():
    s = P.FedRdmaESender(7, 7, 0, 30, 10, 4, 0.0, slot_payload_bytes=100)
    chunks = s.next_chunks()
    for c in chunks[:-1]:
        s.on_write_complete(c.seq, 0.0)
    assert s.on_confirm() is False and s.state is SS.SENDING  # noted, not yet DONE
    s.on_write_complete(chunks[-1].seq, 0.0)
    assert s.state is SS.DONE


def test_fedrdma_e_done_before_the_header_is_a_protocol_error():
    s = P.FedRdmaESender(7, 7, 0, 30, 10, 1, 0.0, slot_payload_bytes=100)
    s.next_chunks()  # chunk 2 only: the header (chunk 0) is not written yet
    with pytest.raises(E.RemoteProtocolError, match="before its header"):
        s.on_confirm()


def test_fedrdma_e_placed_without_verdict_times_out():
    s = placed_sender()
    s.tick(4.0)
    with pytest.raises(E.TransferTimeout, match="did not confirm"):
        s.tick(6.0)
    assert s.state is SS.FAILED and s.settled


@pytest.mark.parametrize("event", ["cancel", "fail"])
def test_fedrdma_e_placed_can_be_cancelled_or_failed(event):
    s = placed_sender()
    s.cancel("bye") if event == "cancel" else s.fail(E.IntegrityError("refused", 7))
    assert s.state is (SS.CANCELLED if event == "cancel" else SS.FAILED)
    assert s.on_confirm() is False  # a late DONE does not resurrect it


def test_fedrdma_e_transition_table_is_closed():
    s = placed_sender()
    with pytest.raises(E.LocalProtocolError, match="not allowed in state placed"):
        s._move("complete")  # FedRDMA's event means nothing to FedRDMA-E
    s.on_confirm()
    for ev in ("placed", "confirm", "cancel", "fail", "room"):
        with pytest.raises(E.LocalProtocolError):
            s._move(ev)


def run_fedrdma_e(payload: bytes, chunk: int, window: int, net: Net, qps: int = 1):
    """Sender and receiver over an adversarial network: WRITE completions and the receiver's DONE
    arrive in any order (the DONE travels on another path than the completions)."""
    ring = P.SlotRing(1)
    recv = P.FedRdmaEReceiver(1, 1 << 16, meta_cap=64)
    pool = bytearray(recv.slot_bytes)
    pay = slot_payload_offset(64)
    s = P.FedRdmaESender(9, 9, ring.acquire(), len(payload), chunk, window, 0.0, slot_payload_bytes=1 << 16,
                         header_after_all=qps > 1, no_progress_s=5)
    now = 0.0
    crc = crc32c.crc32c(payload)
    while not s.settled:
        for c in s.next_chunks():
            pool[pay + c.offset:pay + c.offset + c.length] = payload[c.offset:c.offset + c.length]
            if c.seq == 0:
                pool[:64] = P.encode_header(s.header(0, crc))
                msg = recv.on_write_imm(s.imm, memoryview(pool)[:64])  # the WRITE_WITH_IMM's notice
                recv.verify(msg, 0, crc32c.crc32c(bytes(pool[pay:pay + msg.header.total])))
                net.put(("done", 0))
            net.put(("wc", c.seq))
        ev = net.take()
        if ev is not None:
            kind, seq = ev
            if kind == "wc":
                s.on_write_complete(seq, now)
            else:
                s.on_confirm()
        now += 0.01
        s.tick(now)
    return bytes(pool[pay:pay + len(payload)]), s


@pytest.mark.parametrize("window", [1, 3, 16])
@pytest.mark.parametrize("sched", ["inorder", "reorder", "dup"])
def test_fedrdma_e_in_memory_with_verdicts(window, sched):
    payload = bytes(random.Random(window).randbytes(5000))
    net = Net(window, reorder=sched == "reorder", dup=0.3 if sched == "dup" else 0.0)
    got, s = run_fedrdma_e(payload, 512, window, net, qps=1 + window % 2)
    assert got == payload and s.state is SS.DONE


def test_fedrdma_e_lost_verdict_ends_in_timeout_not_a_hang():
    class DropDone(Net):
        def put(self, frame):
            if frame[0] != "done":
                super().put(frame)

    with pytest.raises(E.TransferTimeout, match="did not confirm"):
        run_fedrdma_e(bytes(3000), 512, 4, DropDone(3))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(-2, 12)), max_size=60))
def test_fuzz_fedrdma_e_sender_only_package_errors_escape(events):
    s = P.FedRdmaESender(1, 1, 0, 100, 10, 4, 0.0, slot_payload_bytes=100, no_progress_s=1)
    for kind, v in events:
        try:
            if kind == 0:
                s.next_chunks()
            elif kind == 1:
                s.on_write_complete(v, 0.0)
            elif kind == 2:
                s.on_confirm()
            elif kind == 3:
                s.tick(float(v))
            else:
                s.cancel()
        except E.FateRdmaError:
            pass
        assert s.state in SS


# -- policy: mode, window, Link-Enable, staging credit --------------------------------------------------
from fate_rdma.protocol import policy  # noqa: E402


def test_choose_mode():
    M = policy.Mode
    assert policy.choose_mode("fedrdma-e", 10, 10, False, "error") is M.FEDRDMA_E
    with pytest.raises(E.PayloadTooLarge, match="exceeds host:1's FedRDMA-E receive slot of 10"):
        policy.choose_mode("fedrdma-e", 11, 10, False, "error", peer="host:1")
    with pytest.raises(E.PayloadTooLarge, match="too_large: fedrdma"):
        policy.choose_mode("fedrdma-e", 11, 10, False, "fedrdma")  # no staging offered: cannot fall back
    assert policy.choose_mode("fedrdma-e", 11, 10, True, "fedrdma") is M.FEDRDMA
    assert policy.choose_mode("fedrdma-e", 5, None, True, "fedrdma") is M.FEDRDMA
    assert policy.choose_mode("fedrdma", 1 << 40, None, True, "error") is M.FEDRDMA
    with pytest.raises(E.ConfigError, match="no FedRDMA staging"):
        policy.choose_mode("fedrdma", 5, 10, False, "error")


def test_auto_window_fills_the_bandwidth_delay_product():
    # 10 Gbit/s x 20 ms = 25 MB: 6 chunks of 4 MiB, plus one
    assert policy.auto_window(10e9, 0.020, 4 << 20, 2, 64) == 7
    assert policy.auto_window(10e9, 0.0, 4 << 20, 2, 64) == 2  # loopback: the minimum
    assert policy.auto_window(100e9, 1.0, 4 << 20, 2, 64) == 64  # clamped
    with pytest.raises(E.LocalProtocolError):
        policy.auto_window(1e9, 0.01, 4096, 5, 4)


def test_auto_window_keeps_several_bdps_in_flight_over_the_soft_providers_tcp():
    # 100 Mbit/s x 20 ms = 250 KB = 3.8 chunks of 64 KiB: one BDP on a real QP, six over TCP
    assert policy.auto_window(100e6, 0.020, 64 << 10, 4, 64, policy.window_bdps(DataPath.RDMA)) == 4 + 1
    assert policy.auto_window(100e6, 0.020, 64 << 10, 4, 64, policy.window_bdps(DataPath.TCP_EMULATED)) == 23 + 1
    assert policy.auto_window(100e6, 0.0, 64 << 10, 4, 64, policy.window_bdps(DataPath.TCP_EMULATED)) == 4  # loopback
    # every emulated path completes through software over TCP: the same BDPs
    assert {policy.window_bdps(k) for k in DataPath if k.emulated} == {policy.SOFTWARE_WINDOW_BDPS}
    with pytest.raises(E.LocalProtocolError):
        policy.auto_window(1e9, 0.01, 4096, 1, 4, 0.0)


def test_link_enable_first_chunk():
    assert policy.first_chunk_bytes("auto", 10e9) == policy.LINK_ENABLE_BYTES
    assert policy.first_chunk_bytes("auto", 1e9) == 0
    assert policy.first_chunk_bytes(True, 1e6) == policy.LINK_ENABLE_BYTES
    assert policy.first_chunk_bytes(False, 100e9) == 0
    assert policy.first_chunk_bytes("auto", 10e9, no_link=True) == 0  # no link to bring up
    assert policy.first_chunk_bytes(True, 10e9, no_link=True) == policy.LINK_ENABLE_BYTES  # asked for: kept


def test_staging_credits():
    c = policy.StagingCredits(2)
    a, b = c.take(), c.take()
    assert {a, b} == {0, 1} and c.available == 0
    with pytest.raises(E.LocalProtocolError):
        c.take()
    c.give_back(a)
    with pytest.raises(E.RemoteProtocolError, match="not in use"):
        c.give_back(a)  # a duplicate ACK naming the same buffer
    with pytest.raises(E.RemoteProtocolError, match="not in use"):
        c.give_back(7)
    assert c.available == 1


def test_fedrdma_sender_respects_staging_credit():
    s = P.FedRdmaSender(1, 100, 10, 8, 0.0)
    assert len(s.next_chunks(credit=3)) == 3
    assert len(s.next_chunks(credit=0)) == 0
    assert len(s.next_chunks()) == 5  # the window (8) is the other bound


def test_received_bytes_counts_bytes():
    r = P.FedRdmaReceiver(1000, verify_crc=False)
    h = P.Header(P.HeaderKind.CHUNK, 4, 1, 3, 10, 10, 0, 25)
    r.on_chunk(h, memoryview(bytes(10)), 0.0)
    assert r.received_bytes(4) == 10 and r.received_bytes(5) == 0


# -- what a receiver accepts: its own integrity rule, exact tiling ---------------------------------------
def chunk_hdr(tid, seq, n, off, length, total, crc=True, data=None):
    data = bytes(length) if data is None else data
    return P.Header(P.HeaderKind.CHUNK, tid, seq, n, off, length, 0, total, crc32c.crc32c(data) if crc else 0, 0, crc)


def test_receiver_requires_its_checksum():
    r = P.FedRdmaReceiver(1000)  # configured with crc32c
    with pytest.raises(E.RemoteProtocolError, match="no checksum"):
        r.on_chunk(chunk_hdr(1, 0, 1, 0, 10, 10, crc=False), memoryview(bytes(10)), 0.0)
    assert r.on_chunk(chunk_hdr(1, 0, 1, 0, 10, 10), memoryview(bytes(10)), 0.0) is None  # dropped for good
    rx = P.FedRdmaEReceiver(1, 100)
    raw = P.encode_header(P.Header(P.HeaderKind.SLOT, 2, 0, 1, 0, 10, 0, 10, 0, 0, False))
    with pytest.raises(E.RemoteProtocolError, match="no checksum"):
        rx.on_write_imm(0, memoryview(raw))
    assert rx.held == set()


def test_chunks_with_a_gap_are_never_delivered():
    r = P.FedRdmaReceiver(1000)
    r.on_chunk(chunk_hdr(1, 0, 2, 0, 10, 30), memoryview(bytes(10)), 0.0)
    with pytest.raises(E.RemoteProtocolError, match="a gap"):
        r.on_chunk(chunk_hdr(1, 1, 2, 20, 10, 30), memoryview(bytes(10)), 0.0)  # bytes 10..20 never written


def test_overlapping_chunks_are_refused():
    r = P.FedRdmaReceiver(1000)
    r.on_chunk(chunk_hdr(1, 0, 3, 0, 10, 30), memoryview(bytes(10)), 0.0)
    with pytest.raises(E.RemoteProtocolError, match="overlap"):
        r.on_chunk(chunk_hdr(1, 1, 3, 5, 10, 30), memoryview(bytes(10)), 0.0)
    with pytest.raises(E.RemoteProtocolError, match="overlap"):
        r2 = P.FedRdmaReceiver(1000)
        r2.on_chunk(chunk_hdr(2, 1, 3, 10, 10, 30), memoryview(bytes(10)), 0.0)
        r2.on_chunk(chunk_hdr(2, 2, 3, 0, 15, 30), memoryview(bytes(15)), 0.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(0, 20)), min_size=1, max_size=8))
def test_fuzz_delivered_transfers_tile_exactly(chunks):
    """Whatever chunks a sender invents, a transfer is only ever complete when they tile it exactly."""
    total, n = 40, 6
    r = P.FedRdmaReceiver(1000)
    covered = bytearray(total)
    for seq, off, length in chunks:
        length = min(length, total - off)
        try:
            placed = r.on_chunk(chunk_hdr(1, seq, n, off, length, total), memoryview(bytes(length)), 0.0)
        except E.RemoteProtocolError:
            return
        if placed is not None:
            for i in range(off, off + length):
                covered[i] += 1
            if placed.complete:
                assert all(c == 1 for c in covered)


def test_auto_qps_uses_every_qp_on_a_long_path_only():
    from fate_rdma.protocol.policy import LONG_PATH_RTT_S, auto_qps

    assert auto_qps(0.0002, 4) == 1  # loopback, one site
    assert auto_qps(LONG_PATH_RTT_S, 4) == 4 and auto_qps(0.08, 4) == 4
    assert auto_qps(0.08, 1) == 1 and auto_qps(0.08, 0) == 1  # the peer offered fewer


def test_auto_sets_up_one_qp_to_a_peer_on_this_host():
    from fate_rdma.protocol.policy import AUTO_QPS_MAX, one_host, qps_offer

    assert one_host("127.0.0.1", "127.0.0.1") and one_host("127.0.0.1", "127.0.0.9") and one_host("::1", "::1")
    assert one_host("10.1.2.3", "10.1.2.3")  # this host's own address: routed locally
    assert not one_host("198.18.0.1", "198.18.1.2")  # another namespace (the testbed's sites), another host
    assert not one_host("198.18.0.1", "not an address")
    assert qps_offer("auto", near=True) == 1 and qps_offer("auto", near=False) == AUTO_QPS_MAX
    assert qps_offer(3, near=True) == 3  # a number is taken as set


def test_the_paths_rate_window_and_qps_in_use():
    assert policy.path_rate_bps(5e8, 1e9) == 5e8  # configured wins
    assert policy.path_rate_bps(None, 1e9) == 1e9  # then the emulated link's
    assert policy.path_rate_bps(None, None) == policy.NOMINAL_RATE_BPS
    assert policy.window_for(3, 100e6, 0.020, 64 << 10, 4, 64, DataPath.TCP_EMULATED) == 3  # a configured window stands
    assert policy.window_for("auto", 100e6, 0.020, 64 << 10, 4, 64, DataPath.LINK_EMULATED) == 24
    assert policy.window_for("auto", 100e6, 0.020, 64 << 10, 4, 64, DataPath.RDMA) == 5
    assert policy.qps_in_use(2, 0.05, 2) == 2
    assert policy.qps_in_use("auto", None, 4) == 1  # until the probe has measured the RTT
    assert policy.qps_in_use("auto", 0.05, 4) == 4 and policy.qps_in_use("auto", 0.001, 4) == 1


def test_fedrdma_e_copies_same_host_payloads_in_larger_chunks():
    assert policy.slot_chunk_bytes(4 << 20, 32 << 20, same_host=False) == 4 << 20  # across hosts: as configured
    assert policy.slot_chunk_bytes(4 << 20, 32 << 20, same_host=True) == 32 << 20
    assert policy.slot_chunk_bytes(1 << 30, 32 << 20, same_host=True) == 1 << 30  # never smaller than configured
    assert policy.slot_chunk_bytes(4 << 20, 0, same_host=True) == 4 << 20  # 0: off


def test_fedrdma_e_writes_larger_chunks_over_the_soft_providers_tcp_only():
    assert policy.slot_chunk_bytes(4 << 20, 32 << 20, False, 16 << 20, short_tcp=True) == 16 << 20
    assert policy.slot_chunk_bytes(4 << 20, 32 << 20, False, 16 << 20, short_tcp=False) == 4 << 20
    assert policy.slot_chunk_bytes(4 << 20, 32 << 20, True, 16 << 20, short_tcp=False) == 32 << 20  # same host
    assert policy.slot_chunk_bytes(64 << 20, 0, False, 16 << 20, short_tcp=True) == 64 << 20  # never smaller
    assert policy.slot_chunk_bytes(4 << 20, 0, False, 0, short_tcp=True) == 4 << 20  # 0: off
    assert policy.short_tcp_path(True, 0.0002)  # loopback, a LAN
    assert not policy.short_tcp_path(True, 0.020)  # a long path keeps the paper's chunk
    assert not policy.short_tcp_path(True, None)  # until the probe has measured it
    assert not policy.short_tcp_path(False, 0.0002)  # RDMA, the link model
    # the automatic window keeps the same bytes in flight with the larger chunk (not four times as many)
    assert policy.window_for("auto", 10e9, 0.020, 16 << 20, 4, 64, DataPath.TCP_EMULATED) == 10
    assert policy.window_for("auto", 10e9, 0.020, 4 << 20, 4, 64, DataPath.TCP_EMULATED) == 37
