"""The soft provider's same-host path through shared memory (shm.py): a WRITE or SEND from a memfd-backed
buffer is copied by the responder through a read-only mapping; a private buffer still by process_vm_readv;
a region that cannot be mapped (wrong inode, not sealed, not ours) falls back, spans outside the region
named fail the QP, and no mapping outlives the QP or the requester's process."""
from __future__ import annotations

import gc
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import easypyverbs as ev
from easypyverbs.providers.soft import samehost, shm
from fate_rdma import errors as E
from fate_rdma.channel import Endpoint

from .test_same_host import SAME_HOST, cfg, peer
from .verbs_pair import close_pair, make_pair

pytestmark = [pytest.mark.skipif(not shm.self_test()[0], reason=f"shared memory unusable: {shm.self_test()[1]}"),
              pytest.mark.skipif(not samehost.available()[0], reason=f"same-host path not available: {samehost.available()[1]}")]


def _maps_of(pid: int = 0) -> int:
    """How many mappings of another process's shared regions of this provider process `pid` (0: this one)
    holds (this process's own regions, its FedRDMA-E slots among them, are left out)."""
    with open(f"/proc/{pid or 'self'}/maps") as f:
        return sum(f"/memfd:{shm.NAME}" in line and not shm.own_inode(int(line.split()[4])) for line in f)


def _maps_settled(expected: int, timeout_s: float = 20.0) -> int:
    """`_maps_of()` once it has read `expected` three times in a row, else its last reading at the deadline. One
    reading can count a region of this process's own that is being released (its slot dropped with a failed
    connection, say): shm._release forgets a region just before it unmaps it, so that a reused address never
    finds the old one; a mapping that stays is counted by every reading."""
    deadline, run, got = time.monotonic() + timeout_s, 0, _maps_of()
    while time.monotonic() < deadline:
        got = _maps_of()
        run = run + 1 if got == expected else 0
        if run == 3:
            break
        time.sleep(0.02)
    return got


def _pair_with_shared_source(n):
    a, b = make_pair("soft", size=n)
    src = ev.buffers.shared_array(n)
    src[:] = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    return a, b, src, a.pd.reg_mr(src, ev.Access(0))


def test_a_write_from_shared_memory_is_read_through_a_mapping(monkeypatch):
    n = (3 << 20) + 5
    a, b, src, mr = _pair_with_shared_source(n)
    monkeypatch.setattr(samehost, "_read", lambda *x: pytest.fail("process_vm_readv used for a shared region"))
    try:
        assert a.qp.data_path == SAME_HOST
        for i in range(3):  # the region is mapped once, then reused
            a.qp.post_write(mr.sge(0, n), b.mr.remote(), wr_id=i)
            assert a.cq.wait_n(1, 20)[0].ok
        assert bytes(b.buf[:n]) == src.tobytes()
        assert b.qp.responder._regions is not None and b.qp.responder._regions.mapped_total == 1
        mr.close()
    finally:
        close_pair([a, b])
    assert b.qp.responder._regions is not None and not b.qp.responder._regions._maps  # unmapped when the responder ended


def test_a_write_from_private_memory_still_uses_process_vm_readv(monkeypatch):
    a, b = make_pair("soft", size=1 << 20)
    calls = []
    real = samehost._read
    monkeypatch.setattr(samehost, "_read", lambda *x: (calls.append(1), real(*x)))
    try:
        a.buf[:] = bytes(i % 251 for i in range(len(a.buf)))
        a.qp.post_write(a.mr.sge(0, len(a.buf)), b.mr.remote())
        assert a.cq.wait_n(1, 20)[0].ok
        assert b.buf == a.buf and calls and b.qp.responder._regions is None
    finally:
        close_pair([a, b])


@pytest.mark.parametrize("lie", ["inode", "fd", "size", "fifo"])
def test_a_region_that_cannot_be_mapped_is_read_with_process_vm_readv(monkeypatch, tmp_path, lie):
    """A region named with another inode, an fd that is no region of ours (stdin), another size, or a FIFO
    (which an open() of /proc/<pid>/fd/N would block on: the responder takes a duplicate instead): not
    mapped, nothing hangs; the bytes come by process_vm_readv, intact."""
    n = 1 << 20
    a, b, src, mr = _pair_with_shared_source(n)
    real = shm.region_of
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    def wrong(spans):
        fd, ino, base, size = real(spans)
        return {"inode": (fd, ino + 1, base, size), "fd": (0, ino, base, size), "size": (fd, ino, base, size + 4096),
                "fifo": (fifo_fd, os.fstat(fifo_fd).st_ino, base, size)}[lie]

    monkeypatch.setattr(shm, "region_of", wrong)
    try:
        a.qp.post_write(mr.sge(0, n), b.mr.remote())
        assert a.cq.wait_n(1, 20)[0].ok
        assert bytes(b.buf[:n]) == src.tobytes() and b.qp.responder._regions.mapped_total == 0
        mr.close()
    finally:
        close_pair([a, b])
        os.close(fifo_fd)


def test_a_region_with_holes_is_read_with_process_vm_readv(monkeypatch):
    """Bytes the requester never wrote are holes of its memfd; a read fault there would allocate memory
    charged to the responder: while the file has holes, requests go by process_vm_readv (zeros either way)."""
    n = 1 << 20
    a, b = make_pair("soft", size=n)
    src = ev.buffers.shared_array(n)  # never written: all holes
    mr = a.pd.reg_mr(src, ev.Access(0))
    calls = []
    real = samehost._read
    monkeypatch.setattr(samehost, "_read", lambda *x: (calls.append(1), real(*x)))
    try:
        b.buf[:] = b"\xff" * n
        a.qp.post_write(mr.sge(0, n), b.mr.remote())
        assert a.cq.wait_n(1, 20)[0].ok
        assert b.buf[:n] == bytes(n) and calls and b.qp.responder._regions.mapped_total == 1
        mr.close()
    finally:
        close_pair([a, b])


def test_spans_outside_the_region_named_fail_the_qp(monkeypatch):
    n = 1 << 20
    a, b, src, mr = _pair_with_shared_source(n)
    real = shm.region_of
    # names the region 4 KiB further on: it maps (file and size match), and the first 4 KiB lie outside it
    monkeypatch.setattr(shm, "region_of", lambda spans: real(spans)[:2] + (real(spans)[2] + 4096, real(spans)[3]))
    try:
        a.qp.post_write(mr.sge(0, n), b.mr.remote())
        wc = a.cq.wait_n(1, 20)[0]
        assert not wc.ok
        assert b.buf[:n] == bytes(n)  # nothing placed
        mr.close()
    finally:
        close_pair([a, b])


def test_an_unsealed_memfd_is_not_mapped():
    """A file that could shrink under the mapping would fault the reader: only sealed regions are mapped."""
    fd = os.memfd_create(shm.NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        m = mmap.mmap(fd, 4096)
        base = int(np.frombuffer(m, dtype=np.uint8).ctypes.data)
        regions = shm.PeerRegions(os.getpid())
        assert regions.get((fd, os.fstat(fd).st_ino, base, 4096)) is None
        regions.close()
    finally:
        os.close(fd)


def test_a_region_is_forgotten_with_its_array():
    arr = ev.buffers.shared_array(8192)
    base = int(arr.ctypes.data)
    assert shm.region_of([(base, 8192)]) is not None and shm.region_of([(base, 8193)]) is None
    del arr
    assert shm.region_of([(base, 10)]) is None


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_channel_transfer_from_shared_memory_then_sender_killed_leaves_nothing_mapped(mode):
    """A peer process sends from shared memory (its put buffers); the payload arrives intact; then a second
    transfer is cut by killing the sender: this side's responder unmaps its regions as its QP fails."""
    c = cfg(mode, slot_bytes=300 << 20)
    gc.collect()
    before = _maps_of()  # shared arrays of earlier tests in this process, if any are still alive
    p, addr = peer(c)
    try:
        with Endpoint(c) as ep:
            assert ep.same_host_capable
            p.cmd({"cmd": "send", "address": ep.address, "hex": "00" * 16})  # connected, both ways
            assert ep.recv(timeout=20).nbytes == 16
            p.cmd({"cmd": "send_shared", "address": ep.address, "nbytes": 40 << 20})
            with ep.recv(timeout=30) as msg:
                assert bytes(msg.view[:4]) == b"\x01\x02\x03\x04" and msg.nbytes == 40 << 20
                assert not np.frombuffer(msg.view, dtype=np.uint8)[4:].any()
            # the sender's region, mapped by this side's responder, which read the chunks itself: FedRDMA's
            # staging buffers are private, and FedRDMA-E's shared slots take a push only while this side copies
            # another WRITE (shm.take_push; none here)
            assert _maps_settled(before + 1, timeout_s=5) == before + 1
            p.cmd({"cmd": "send_shared", "address": ep.address, "nbytes": 256 << 20, "wait": False})
            time.sleep(0.05)
            os.kill(p.proc.pid, signal.SIGKILL)
            p.proc.wait(10)
            assert _maps_settled(before) == before
            with pytest.raises((E.TransferTimeout, E.FateRdmaError)):
                ep.recv(timeout=0.5)
    finally:
        p.proc.kill()
        p.proc.wait()
        p.conn.close()


def test_a_region_the_requester_frees_is_unmapped_while_the_qp_idles():
    n = 1 << 20
    a, b, src, mr = _pair_with_shared_source(n)
    try:
        a.qp.post_write(mr.sge(0, n), b.mr.remote())
        assert a.cq.wait_n(1, 20)[0].ok
        assert b.qp.responder._regions.mapped == 1
        mr.close()
        del src, mr
        gc.collect()
        deadline = time.monotonic() + 10  # PRUNE_EVERY_S, and no further request comes
        while b.qp.responder._regions.mapped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.qp.responder._regions.mapped == 0
    finally:
        close_pair([a, b])


def test_interpreter_exit_with_a_thread_still_copying_shared_memory_is_clean():
    code = ("import threading, ctypes, easypyverbs as ev\n"
            "a = ev.buffers.shared_array(64 << 20); b = bytearray(64 << 20)\n"
            "dst = (ctypes.c_char * len(b)).from_buffer(b)\n"
            "def spin():\n"
            "    while True: ctypes.memmove(dst, a.ctypes.data, len(b))\n"
            "threading.Thread(target=spin, daemon=True).start()\n")
    for _ in range(3):
        assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
