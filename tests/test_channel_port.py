"""The transfer modes against fake ports (port.SendPort, port.RecvPort): no device, no socket, no engine thread.

A fake port stands for the connection: what a mode posts is written into plain memory, and what it asks of the
connection (control frames, finishing and failing transfers, deliveries) is recorded. FedRDMA's sender and
receiver are wired back to back through two such ports; FedRDMA-E's sender is driven through its completions and
the receiver's verdict."""
from __future__ import annotations

import collections
import contextlib

import pytest

import easypyverbs as ev
from fate_rdma import protocol as P
from fate_rdma.channel.buffers import Budget, RecvBuffers, Share
from fate_rdma.channel.fedrdma import StagedReceiver, StagedSender
from fate_rdma.channel.fedrdma_e import SlotSender
from fate_rdma.channel.outgoing import Outgoing
from fate_rdma.channel.port import Plan
from fate_rdma.channel.transfer import TransferFuture
from fate_rdma.protocol.frames import MAX_META, CtrlKind
from fate_rdma.protocol.hello import PoolOffer, StagingOffer
from fate_rdma.protocol.integrity import Integrity
from fate_rdma.protocol.packing import StagedWrite, decode_imm
from fate_rdma.protocol.policy import Mode

KiB = 1024
WHERE = {"provider": "fake", "emulated": True, "path": "memory"}


class _Sge:
    def __init__(self, view: memoryview) -> None:
        self._view = view

    def view(self) -> memoryview:
        return self._view


class FakePayload:
    """What a mode reads of transfer.Payload, over bytes in memory (no MR)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.total, self.fill, self.closed = memoryview(data), len(data), None, False

    def sges(self, offset: int, length: int):
        return [_Sge(self.data[offset:offset + length])]

    def views(self):
        return [self.data]

    def ready_from(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class FakePort:
    """Both ports: WRITEs land in `remote` (the peer's memory, by rkey), the rest is recorded."""

    def __init__(self, remote=None) -> None:
        self.remote = remote if remote is not None else {}
        self.events = collections.deque()  # (what, ...) in posting order, for the test to play out
        self.ctrl, self.finished, self.failed, self.aside, self.delivered, self.refused = [], [], [], [], [], []

    # SendPort
    def next_qp(self):
        return "data-qp"

    def control_qp(self):
        return "qp0"

    def batched(self):
        return contextlib.nullcontext()

    def post_data(self, qp, o, c, remote, roff, signal_last, seq, in_place=False):
        mem = self.remote.get(remote.rkey)
        if mem is not None:
            mem[roff:roff + c.length] = o.payload.data[c.offset:c.offset + c.length]
        self.events.append(("data", qp, c.seq, roff, signal_last))

    def post_header(self, qp, o, hdr, seq, remote, roff, imm):
        mem = self.remote.get(remote.rkey)
        if mem is not None:
            raw = P.encode_header(hdr) + (o.meta if hdr.meta_len else b"")
            mem[roff:roff + len(raw)] = raw
        self.events.append(("header", qp, seq, roff, imm))

    def send_ctrl(self, c):
        self.ctrl.append(c)

    def wake(self):
        pass

    def finish(self, o):
        self.finished.append(o)
        o.fut.set_result({"bytes": o.payload.total})

    def step_aside(self, o):
        self.aside.append(o)

    def fail(self, o, exc, tell_peer):
        self.failed.append((o, exc, tell_peer))

    # RecvPort
    def refuse(self, tid, code, reason):
        self.refused.append((tid, code, reason))

    def deliver(self, tid, meta, view, mode, releaser, lend=None):
        self.delivered.append((tid, bytes(meta), bytes(view), mode))

    def release_slot(self, slot):
        pass


def _outgoing(data: bytes, meta: bytes, integrity: Integrity, tid: int = 7) -> Outgoing:
    fut = TransferFuture(tid, len(data), lambda f: None)
    fut.set_running_or_notify_cancel()
    return Outgoing(fut, FakePayload(data), meta, integrity)


def _plan(chunk_bytes: int, window: int = 8) -> Plan:
    return Plan(now=0.0, window=window, chunk_bytes=chunk_bytes, qps=1, first_chunk_bytes=0, no_progress_s=30.0,
                total_s=3600.0)


@pytest.mark.parametrize("checksum", ["none", "crc32c", "xxh3"])
def test_fedrdma_sender_and_receiver_back_to_back_through_fake_ports(checksum):
    """The sender fills 3 staging buffers with 10 chunks, one credit each; the receiver copies each chunk into
    place and ACKs it; the ACKs give the credits back, and the transfer completes and is delivered whole."""
    chunk = 4 * KiB
    offer = StagingOffer(3, P.HEADER.size + MAX_META + chunk, MAX_META)
    staging = bytearray(offer.count * offer.buf_bytes)
    tx_port, rx_port = FakePort({99: staging}), FakePort()
    sender = StagedSender(tx_port, offer, ev.RemoteMR(0x1000, 99, len(staging)))
    receiver = StagedReceiver(rx_port, "tx", offer,
                              lambda i: memoryview(staging)[offer.base(i):offer.base(i) + offer.buf_bytes],
                              Share(Budget(1 << 30), "tx"), RecvBuffers(1 << 20), 1 << 30, 30.0, Integrity(checksum))
    data = bytes(range(256)) * (10 * chunk // 256 - 3)  # 10 chunks, the last one short
    o = _outgoing(data, b'{"w":1}', Integrity(checksum))
    m = sender.machine(o, _plan(chunk))
    o.begin(m, Mode.FEDRDMA, WHERE)
    assert len(m.chunks) == 10
    sender.pump(o)
    assert [e[0] for e in tx_port.events] == ["data", "header"] * 3  # one chunk per credit
    progress = []
    o.fut.add_progress_callback(lambda done, total: progress.append(done))
    while tx_port.events:
        kind, _qp, seq, roff, imm = tx_port.events.popleft()
        if kind != "header":
            continue
        arrival = decode_imm(imm)
        assert isinstance(arrival, StagedWrite) and roff == offer.base(arrival.index)
        receiver.on_chunk(arrival.index)  # the WRITE_WITH_IMM arrives
        (ack,) = [rx_port.ctrl.pop()]
        assert ack.kind is CtrlKind.ACK and ack.value == seq
        sender.on_ack(ack, o)
        if not tx_port.finished:
            sender.pump(o)
    assert tx_port.finished == [o] and o.fut.result(0)["bytes"] == len(data)
    assert progress[-1] == len(data) and sender.credits.available == offer.count
    assert rx_port.delivered == [(7, b'{"w":1}', data, "fedrdma")] and not rx_port.refused
    assert not receiver.busy


def test_a_fedrdma_chunk_altered_in_the_staging_buffer_is_refused_and_still_acked():
    chunk = 4 * KiB
    offer = StagingOffer(2, P.HEADER.size + MAX_META + chunk, MAX_META)
    staging = bytearray(offer.count * offer.buf_bytes)
    tx_port, rx_port = FakePort({5: staging}), FakePort()
    sender = StagedSender(tx_port, offer, ev.RemoteMR(0, 5, len(staging)))
    receiver = StagedReceiver(rx_port, "tx", offer,
                              lambda i: memoryview(staging)[offer.base(i):offer.base(i) + offer.buf_bytes],
                              Share(Budget(1 << 30), "tx"), RecvBuffers(1 << 20), 1 << 30, 30.0, Integrity("crc32c"))
    o = _outgoing(b"x" * chunk * 2, b"{}", Integrity("crc32c"))
    o.begin(sender.machine(o, _plan(chunk)), Mode.FEDRDMA, WHERE)
    sender.pump(o)
    staging[offer.data_offset(0) + 10] ^= 0xFF  # a byte changed on the way
    receiver.on_chunk(0)
    assert [r[0] for r in rx_port.refused] == [7] and "mismatch" in rx_port.refused[0][2]
    assert [c.kind for c in rx_port.ctrl] == [CtrlKind.ACK]  # the buffer goes back all the same
    assert not rx_port.delivered


def test_fedrdma_e_sender_posts_back_to_front_then_waits_for_the_verdict():
    """Chunks go to their final offsets in a free slot of the peer, back to front, chunk 0 and the header last on
    QP 0; once every WRITE completed the transfer steps aside (PLACED), and the receiver's DONE finishes it."""
    chunk = 64 * KiB
    offer = PoolOffer(2, 1 << 20, MAX_META)
    remote = {f"slot{i}": ev.RemoteMR(0x10000 * (i + 1), 40 + i, offer.slot_bytes) for i in range(offer.slots)}
    port = FakePort()
    sender = SlotSender(port, "rx", offer, remote, placed_notes=False, same_host_copy=False)
    o = _outgoing(bytes(5 * chunk - 100), b"{}", Integrity("none"), tid=(1 << 40) | 9)
    m = sender.machine(o, _plan(chunk))
    assert m is not None and o.slot == 0
    o.begin(m, Mode.FEDRDMA_E, WHERE)
    sender.pump(o)
    posted = list(port.events)
    assert [(e[0], e[2]) for e in posted] == [("data", 4), ("data", 3), ("data", 2), ("data", 1), ("data", 0),
                                             ("header", 0)]
    assert [e[3] for e in posted[:5]] == [offer.offset_in_slot(c.offset) for c in reversed(m.chunks)]
    assert posted[-1][1] == "qp0" and posted[-1][4] == m.imm
    for _kind, _qp, seq, _roff, signalled in posted:
        if signalled is True or _kind == "header":  # the signalled WRs complete
            sender.on_write_complete(o, seq)
    assert port.aside == [o] and sender.placed == {o.fut.transfer_id: o} and not port.finished
    sender.on_done(o.fut.transfer_id, None)
    assert port.finished == [o] and not sender.placed and not port.failed


def test_fedrdma_e_sender_fails_a_placed_transfer_whose_verdict_never_comes():
    offer = PoolOffer(1, 1 << 20, MAX_META)
    port = FakePort()
    sender = SlotSender(port, "rx", offer, {"slot0": ev.RemoteMR(0, 1, offer.slot_bytes)}, False, False)
    o = _outgoing(b"y" * 1000, b"{}", Integrity("none"))
    m = sender.machine(o, _plan(64 * KiB))
    o.begin(m, Mode.FEDRDMA_E, WHERE)
    sender.pump(o)
    for _kind, _qp, seq, _roff, _sig in list(port.events):
        if _kind == "header":
            sender.on_write_complete(o, seq)
    assert sender.placed
    sender.tick(1e6)  # long past the deadlines
    ((failed, exc, tell_peer),) = port.failed
    assert failed is o and not tell_peer and "transfer" in str(exc)
