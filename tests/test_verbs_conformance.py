"""One conformance suite for every provider: an RC pair in one process, bounded polling throughout."""
from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

import easypyverbs as ev
from easypyverbs import WCOpcode, WCStatus

from .verbs_pair import PROVIDERS, close_pair, make_pair, require

T = 5.0  # every wait in this suite is bounded by this


@pytest.fixture(params=PROVIDERS)
def provider(request):
    require(request.param)
    return request.param


@pytest.fixture
def pair(provider):
    sides = make_pair(provider)
    yield sides
    close_pair(sides)


def test_register_buffers_zero_copy(provider):
    require(provider)
    from .verbs_pair import open_ctx

    with open_ctx(provider) as ctx:
        pd = ctx.alloc_pd()
        arr = np.arange(1024, dtype=np.float32)
        mm = mmap.mmap(-1, 8192)
        ba = bytearray(b"abc" * 100)
        for buf, n in ((arr, 4096), (mm, 8192), (ba, 300), (memoryview(ba)[10:20], 10)):
            mr = pd.reg_mr(buf, ev.Access.all_rdma())
            assert mr.length == n and mr.addr != 0
            mr.view(0, 1)[0:1] = b"\x7f"  # the view aliases the caller's memory
            assert bytes(memoryview(buf).cast("B")[0:1]) == b"\x7f"
            mr.close()
            mr.close()  # idempotent
        mm.close()


def test_register_rejects_bad_buffers(provider):
    require(provider)
    from .verbs_pair import open_ctx

    with open_ctx(provider) as ctx:
        pd = ctx.alloc_pd()
        with pytest.raises(ev.UsageError, match="read-only"):
            pd.reg_mr(b"immutable", ev.Access.LOCAL_WRITE)
        with pytest.raises(ev.UsageError, match="buffer"):
            pd.reg_mr(12345)
        with pytest.raises(ev.UsageError, match="contiguous"):
            pd.reg_mr(np.zeros((4, 4))[:, 1], ev.Access.LOCAL_WRITE)
        with pytest.raises(ev.UsageError, match="LOCAL_WRITE"):
            pd.reg_mr(bytearray(8), ev.Access.REMOTE_WRITE)
        mr = pd.reg_mr(bytearray(100), ev.Access.LOCAL_WRITE)
        with pytest.raises(ev.UsageError, match="outside MR"):
            mr.view(90, 20)
        with pytest.raises(ev.UsageError, match="outside MR"):
            mr.sge(-1, 2)
        mr.close()
        with pytest.raises(ev.UsageError, match="closed"):
            mr.view()


def test_torch_tensor_registration(provider):
    torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
    require(provider)
    from .verbs_pair import open_ctx

    with open_ctx(provider) as ctx:
        t = torch.zeros(256)
        mr = ctx.alloc_pd().reg_mr(t, ev.Access.all_rdma())
        assert mr.length == 1024
        mr.view(0, 4)[:] = np.float32(2.5).tobytes()
        assert float(t[0]) == 2.5


def test_send_recv(pair):
    a, b = pair
    a.buf[:5] = b"hello"
    b.qp.post_recv(b.mr.sge(100, 50), wr_id=7)
    a.qp.post_send(a.mr.sge(0, 5), wr_id=1)
    (wa,) = a.cq.wait(T)
    (wb,) = b.cq.wait(T)
    assert (wa.wr_id, wa.status, wa.opcode) == (1, WCStatus.SUCCESS, WCOpcode.SEND)
    assert (wb.wr_id, wb.status, wb.opcode, wb.byte_len) == (7, WCStatus.SUCCESS, WCOpcode.RECV, 5)
    assert bytes(b.buf[100:105]) == b"hello"


def test_send_with_imm_scatters_into_several_sges(pair):
    a, b = pair
    a.buf[:10] = b"0123456789"
    b.qp.post_recv([b.mr.sge(0, 4), b.mr.sge(1000, 20)], wr_id=3)
    a.qp.post_send(a.mr.sge(0, 10), wr_id=2, imm=0xABCD)
    (wb,) = b.cq.wait(T)
    assert wb.ok and wb.imm_data == 0xABCD and wb.byte_len == 10
    assert bytes(b.buf[0:4]) == b"0123" and bytes(b.buf[1000:1006]) == b"456789"
    a.cq.wait(T)


def test_write_places_bytes_without_remote_completion(pair):
    a, b = pair
    payload = os.urandom(4096)
    a.buf[:4096] = payload
    a.qp.post_write(a.mr.sge(0, 4096), b.mr.remote(), remote_offset=512, wr_id=11)
    (wa,) = a.cq.wait(T)
    assert wa.ok and wa.opcode == WCOpcode.RDMA_WRITE and wa.wr_id == 11
    assert bytes(b.buf[512:512 + 4096]) == payload  # placed before the requester's completion
    assert b.cq.poll() == []


def test_write_with_imm_consumes_a_receive(pair):
    a, b = pair
    a.buf[:8] = b"ABCDEFGH"
    b.qp.post_recv([], wr_id=42)
    a.qp.post_write_with_imm(a.mr.sge(0, 8), b.mr.remote(), imm=0xDEADBEEF, remote_offset=8, wr_id=5)
    (wb,) = b.cq.wait(T)
    assert (wb.wr_id, wb.opcode, wb.imm_data, wb.byte_len) == (42, WCOpcode.RECV_RDMA_WITH_IMM, 0xDEADBEEF, 8)
    assert bytes(b.buf[8:16]) == b"ABCDEFGH"
    assert a.cq.wait(T)[0].ok


def test_many_writes_then_imm_arrive_in_order(pair):
    a, b = pair
    a.buf[:] = os.urandom(len(a.buf))
    b.qp.post_recv([], wr_id=0)
    chunk = 4096
    n = len(a.buf) // chunk
    for i in reversed(range(1, n)):  # back to front, as FedRDMA-E writes
        a.qp.post_write(a.mr.sge(i * chunk, chunk), b.mr.remote(), remote_offset=i * chunk, wr_id=i, signaled=False)
    a.qp.post_write_with_imm(a.mr.sge(0, chunk), b.mr.remote(), imm=1, wr_id=0)
    (wb,) = b.cq.wait(T)
    assert wb.ok and bytes(b.buf) == bytes(a.buf)
    (wa,) = a.cq.wait(T)  # only the signaled WR completes
    assert wa.wr_id == 0 and a.cq.poll() == []


def test_read(pair):
    a, b = pair
    b.buf[0:6] = b"remote"
    a.qp.post_read(a.mr.sge(50, 6), b.mr.remote(), wr_id=9)
    (wa,) = a.cq.wait(T)
    assert wa.ok and wa.opcode == WCOpcode.RDMA_READ
    assert bytes(a.buf[50:56]) == b"remote"


def test_bad_rkey_gives_rem_access_err_and_flushes(pair):
    a, b = pair
    b.qp.post_recv([], wr_id=77)
    bad = ev.RemoteMR(b.mr.addr, (b.mr.rkey + 1) & 0xFFFFFFFF, b.mr.length)
    a.qp.post_write(a.mr.sge(0, 16), bad, wr_id=1)
    a.qp.post_write(a.mr.sge(0, 16), b.mr.remote(), wr_id=2)
    w1, w2 = a.cq.wait_n(2, T)
    assert (w1.wr_id, w1.status) == (1, WCStatus.REM_ACCESS_ERR)
    assert (w2.wr_id, w2.status) == (2, WCStatus.WR_FLUSH_ERR)
    assert a.qp.state == ev.QPState.ERR
    assert bytes(b.buf[:16]) == bytes(16)
    with pytest.raises(ev.UsageError, match="ERR"):
        a.qp.post_write(a.mr.sge(0, 16), b.mr.remote())
    (wb,) = b.cq.wait(T)  # the peer's connection died too: its receive is flushed
    assert (wb.wr_id, wb.status) == (77, WCStatus.WR_FLUSH_ERR)


def test_out_of_bounds_write_never_touches_memory_outside_the_mr(provider):
    require(provider)
    sides = make_pair(provider)
    a, b = sides
    try:
        big = bytearray(b"\xee" * 3000)
        inner = b.pd.reg_mr(memoryview(big)[1000:2000], ev.Access.all_rdma())
        lying = ev.RemoteMR(inner.addr, inner.rkey, 2000)  # claims more than was registered
        a.buf[:1200] = b"\x11" * 1200
        a.qp.post_write(a.mr.sge(0, 1200), lying, wr_id=1)
        (wa,) = a.cq.wait(T)
        assert wa.status == WCStatus.REM_ACCESS_ERR
        assert big == bytearray(b"\xee" * 3000)
    finally:
        close_pair(sides)


def test_missing_remote_write_flag(provider):
    require(provider)
    sides = make_pair(provider)
    a, b = sides
    try:
        ro = b.pd.reg_mr(bytearray(64), ev.Access.LOCAL_WRITE | ev.Access.REMOTE_READ)
        a.qp.post_write(a.mr.sge(0, 8), ro.remote(), wr_id=1)
        assert a.cq.wait(T)[0].status == WCStatus.REM_ACCESS_ERR
    finally:
        close_pair(sides)


def test_send_larger_than_receive_buffer(pair):
    a, b = pair
    b.qp.post_recv(b.mr.sge(0, 4), wr_id=1)
    a.qp.post_send(a.mr.sge(0, 100), wr_id=2)
    (wb,) = b.cq.wait(T)
    (wa,) = a.cq.wait(T)
    assert wb.status == WCStatus.LOC_LEN_ERR
    assert wa.status == WCStatus.REM_INV_REQ_ERR


def test_receiver_not_ready(provider):
    require(provider)
    if provider == "pyverbs":
        pytest.skip("real NICs retry RNR for ever with rnr_retry=7")
    sides = make_pair(provider, rnr_timeout_s=0.2)
    a, b = sides
    try:
        a.qp.post_write_with_imm(a.mr.sge(0, 8), b.mr.remote(), imm=1, wr_id=4)
        (wa,) = a.cq.wait(T)
        assert (wa.wr_id, wa.status) == (4, WCStatus.RNR_RETRY_EXC_ERR)
    finally:
        close_pair(sides)


def test_rnr_resolved_when_receive_posted_in_time(pair):
    a, b = pair
    a.qp.post_send(a.mr.sge(0, 8), wr_id=1)
    b.qp.post_recv(b.mr.sge(0, 8), wr_id=2)  # posted after the send left: within the RNR window
    assert b.cq.wait(T)[0].ok and a.cq.wait(T)[0].ok


def test_queue_depth_and_message_size_enforced(provider):
    require(provider)
    sides = make_pair(provider, cap=ev.QPCap(max_send_wr=2, max_recv_wr=1, max_send_sge=1))
    a, b = sides
    try:
        b.qp.post_recv([], wr_id=1)
        with pytest.raises(ev.EasyVerbsError, match="receive queue full") as ei:
            b.qp.post_recv([], wr_id=2)
        assert ei.value.errno == 12
        with pytest.raises(ev.UsageError, match="SGEs exceed"):
            a.qp.post_send([a.mr.sge(0, 1), a.mr.sge(1, 1)])
        with pytest.raises(ev.UsageError, match="max_msg_sz"):
            a.qp._check_len(a.ctx.max_msg_bytes + 1)
        with pytest.raises(ev.UsageError, match="remote range"):
            a.qp.post_write(a.mr.sge(0, 16), b.mr.remote(0, 8))
    finally:
        close_pair(sides)


def test_send_queue_full(provider):
    require(provider)
    if provider == "pyverbs":
        pytest.skip("hardware drains the queue too fast to observe it full")
    sides = make_pair(provider, cap=ev.QPCap(max_send_wr=2), link="rate=10mbit")
    a, b = sides
    try:
        a.qp.post_write(a.mr.sge(0, 4096), b.mr.remote(), wr_id=1)
        a.qp.post_write(a.mr.sge(0, 4096), b.mr.remote(), wr_id=2)
        with pytest.raises(ev.EasyVerbsError, match="send queue full"):
            a.qp.post_write(a.mr.sge(0, 4096), b.mr.remote(), wr_id=3)
        a.cq.wait_n(2, T)
    finally:
        close_pair(sides)


def test_unregistered_or_foreign_buffers_rejected(pair):
    a, b = pair
    other_pd = a.ctx.alloc_pd()
    foreign = other_pd.reg_mr(bytearray(16), ev.Access.LOCAL_WRITE)
    with pytest.raises(ev.UsageError, match="another protection domain"):
        a.qp.post_send(foreign.sge())
    with pytest.raises(ev.UsageError, match="expected SGE or MR"):
        a.qp.post_send([bytearray(4)])
    foreign.close()
    with pytest.raises(ev.UsageError, match="closed"):
        a.qp.post_send(foreign)


def test_closed_qp_refuses_work(pair):
    a, b = pair
    a.qp.close()
    with pytest.raises(ev.UsageError, match="closed"):
        a.qp.post_send(a.mr.sge(0, 1))
    with pytest.raises(ev.UsageError, match="closed"):
        a.qp.post_recv(a.mr.sge(0, 1))


def test_bounded_polling(pair):
    a, _ = pair
    assert a.cq.poll() == []
    with pytest.raises(ev.PollTimeout):
        a.cq.wait(0.05)
    with pytest.raises(ev.PollTimeout, match="0 of 3"):
        a.cq.wait_n(3, 0.05)


def test_close_cascade_children_first(provider):
    require(provider)
    sides = make_pair(provider)
    a, b = sides
    kids = [a.qp, a.mr, a.cq, a.pd]
    a.ctx.close()
    assert all(k.closed for k in kids) and a.ctx.closed
    a.ctx.close()  # idempotent
    with pytest.raises(ev.UsageError):
        a.ctx.alloc_pd()
    b.ctx.close()
    assert ev.live_resources() == []


def test_connect_validates(pair):
    a, b = pair
    with pytest.raises(ev.UsageError, match="already RTS"):
        a.qp.connect(b.qp.info())
    info = a.qp.info()
    with pytest.raises(ev.UsageError, match="cannot connect"):
        a.pd.create_qp(a.cq).connect(ev.QPInfo("other", info.qpn, info.psn, info.gid))
