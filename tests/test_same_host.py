"""The soft provider's same-host data path (process_vm_readv) under the channel: chosen between
processes of one host, verified transfers in both modes, a peer killed mid-transfer, and a peer
that cannot prove it shares the host (it gets the TCP path)."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import crc32c
import numpy as np
import pytest

import easypyverbs as ev
from easypyverbs.providers.soft import samehost, wire
from fate_rdma import errors as E
from fate_rdma_lab.bench.driver import PeerProcess
from fate_rdma.channel import Endpoint
from fate_rdma.config import ChannelConfig

SAME_HOST = "same-host (memfd map / process_vm_readv)"
pytestmark = pytest.mark.skipif(not samehost.available()[0], reason=f"same-host path not available: {samehost.available()[1]}")


def cfg(mode, **kw):
    base = dict(mode=mode, chunk_bytes=1 << 20, same_host_chunk_bytes=16 << 20, slot_bytes=64 << 20, provider="soft", window=4,
                no_progress_timeout_s=10, connect_timeout_s=10)
    base.update(kw)
    return ChannelConfig(**base)


def peer(config):
    p = PeerProcess(module="fate_rdma_lab.bench.transfer_peer")
    addr = p.cmd({"cmd": "endpoint", "config": dict(config.__dict__), "record": True})["address"]
    return p, addr


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_transfers_between_processes_take_the_same_host_path(mode):
    c = cfg(mode)
    p, addr = peer(c)
    try:
        with Endpoint(c) as ep:
            data = np.random.default_rng(3).integers(0, 256, (40 << 20) + 7, dtype=np.uint8)
            info = ep.send(addr, [data[:1000], data[1000:]], {"m": mode}).result(60)
            assert all(rc.qp.data_path == SAME_HOST for rc in ep.connect(addr).rcs)
            # FedRDMA-E copies same-host payloads in larger chunks; FedRDMA keeps the peer's staging size
            chunk = c.same_host_chunk_bytes if mode == "fedrdma-e" else c.chunk_bytes
            assert info["chunks"] == -(-data.nbytes // chunk)  # no Link-Enable chunk: no link to bring up
            rec = p.cmd({"cmd": "expect", "count": 1, "timeout_s": 60})["records"][0]
            assert rec["nbytes"] == data.nbytes and rec["crc32c"] == crc32c.crc32c(data)
    finally:
        p.close()


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
@pytest.mark.parametrize("path, link_enable, small", [("same-host", "auto", False), ("same-host", True, True),
                                                      ("tcp", "auto", False), ("tcp", True, True),
                                                      ("link", "auto", True)])
def test_link_enable_auto_is_off_where_the_soft_provider_has_no_link(mode, path, link_enable, small):
    """Link-Enable's 4 KiB chunk brings a link up; "auto" leaves it out where the soft provider has none (bytes
    copied between processes of this host, or its TCP streams: up since connect), keeps it under its link model
    (an emulated 10 Gbit/s wire), and a configured true is honoured everywhere."""
    c = cfg(mode, provider="soft", same_host=path == "same-host", link_enable=link_enable,
            same_host_chunk_bytes=1 << 20, tcp_chunk_bytes=0, soft_link="rate=10gbit,rtt=1ms" if path == "link" else None)
    data = np.random.default_rng(4).integers(0, 256, (3 << 20) + 8192, dtype=np.uint8)
    with Endpoint(c, name="rx") as rx, Endpoint(c, name="tx") as tx:
        info = tx.send(rx.address, data).result(60)
        assert all(rc.qp.data_path.startswith("same-host") is (path == "same-host") for rc in tx.connect(rx.address).rcs)
        msg = rx.recv(timeout=30)
        assert bytes(msg.view) == data.tobytes()
        msg.release()
    assert info["chunks"] == 4 + small  # three chunks of 1 MiB and the rest (8 KiB; 4 KiB and the 4 KiB one where on)


@pytest.mark.parametrize("mode, link, chunk", [("fedrdma-e", None, 4 << 20), ("fedrdma-e", "rate=10gbit,rtt=1ms", 1 << 20),
                                               ("fedrdma", None, 1 << 20)])
def test_fedrdma_e_writes_tcp_chunks_over_the_soft_providers_tcp(mode, link, chunk):
    """Over the soft provider's TCP (same_host off) on a short path FedRDMA-E writes tcp_chunk_bytes chunks; an
    emulated link (it paces chunks as a wire) and FedRDMA (the peer's staging buffers hold chunk_bytes) keep
    chunk_bytes. (A long path keeps it too: policy.short_tcp_path, tests/test_protocol.py.)"""
    c = cfg(mode, same_host=False, link_enable=False, tcp_chunk_bytes=4 << 20, soft_link=link)
    data = np.random.default_rng(5).integers(0, 256, (10 << 20) + 5, dtype=np.uint8)
    with Endpoint(c, name="rx") as rx, Endpoint(c, name="tx") as tx:
        conn = tx.connect(rx.address)
        deadline = time.monotonic() + 30
        while conn.probe.rtt_s is None:  # the larger chunk waits for the path to be measured short
            assert time.monotonic() < deadline, "the RTT probe measured nothing within 30 s"
            time.sleep(0.01)
        info = tx.send(rx.address, data).result(60)
        assert all(rc.qp.data_path == "tcp" for rc in tx.connect(rx.address).rcs)
        msg = rx.recv(timeout=30)
        assert bytes(msg.view) == data.tobytes()
        msg.release()
    assert info["chunks"] == -(-data.nbytes // chunk)


def test_peer_killed_mid_transfer_on_the_same_host_path():
    # ~4000 round trips: long enough to interrupt; the dead peer is waited for resume_window_s (2 s), then named
    c = cfg("fedrdma", chunk_bytes=64 << 10, window=1, resume_window_s=2)
    p, addr = peer(c)
    try:
        ep = Endpoint(c)
        fut = ep.send(addr, bytes(256 << 20))
        deadline = time.monotonic() + 20
        while fut.progress_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ep.connect(addr).rcs[0].qp.data_path == SAME_HOST
        os.kill(p.proc.pid, signal.SIGKILL)
        with pytest.raises(E.PeerUnreachable, match="not back within resume_window_s"):
            fut.result(30)
        ep.close()
        assert ev.live_resources() == []
    finally:
        p.proc.kill()
        p.proc.wait()
        p.conn.close()


@pytest.mark.parametrize("switch", ["env", "config"])
def test_the_same_host_path_switched_off_sends_over_tcp(monkeypatch, switch):
    """EASYPYVERBS_SOFT_SAME_HOST=off (the operator's switch for every endpoint of a process) and same_host: false
    (one job's) each keep an endpoint's transfers on TCP, though its peer has the path on."""
    p, addr = peer(cfg("fedrdma-e"))  # (spawned before the switch: its side offers the path)
    try:
        if switch == "env":
            monkeypatch.setenv("EASYPYVERBS_SOFT_SAME_HOST", "off")
        with Endpoint(cfg("fedrdma-e", same_host=switch != "config")) as ep:
            assert not ep.same_host_capable
            ep.send(addr, np.arange(3 << 20, dtype=np.uint8)).result(60)
            assert {rc.qp.data_path for rc in ep.connect(addr).rcs} == {"tcp"}
            assert p.cmd({"cmd": "expect", "count": 1, "timeout_s": 60})["records"][0]["nbytes"] == 3 << 20
    finally:
        p.close()


def test_a_process_in_another_network_namespace_is_not_taken_for_this_host():
    """The responder's last check before it offers the path: a peer in another network namespace stands for
    another site (the WAN testbed's namespaces), so its bytes must cross the network."""
    import subprocess

    assert samehost.same_network_namespace(os.getpid())
    try:
        other = subprocess.Popen(["unshare", "--net", "sleep", "30"], stderr=subprocess.PIPE)
    except OSError as exc:
        pytest.skip(f"unshare: {exc}")
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{other.pid}/comm").read().strip() != "sleep":  # (unshare execs sleep once it is in)
            if other.poll() is not None:
                pytest.skip(f"unshare --net refused here: {other.stderr.read().decode().strip()}")
            assert time.monotonic() < deadline, "unshare --net did not exec sleep within 10 s"
            time.sleep(0.01)
        assert not samehost.same_network_namespace(other.pid)
    finally:
        other.kill()
        other.wait()


def test_peer_that_cannot_prove_the_same_host_gets_tcp():
    """A HELLO that offers the path with a probe the responder cannot read back (another host, another
    PID namespace, or a lie) is answered without it."""
    ctx = ev.open_device(provider="soft")
    try:
        qp = ctx.alloc_pd().create_qp(ctx.create_cq())
        host, _, port = ctx.nic_address.rpartition(":")
        for pid, addr in ((1, 0x1000), (os.getpid(), 0)):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, wire.FLAG_SAME_HOST, 1, qp.qpn, 0, 0,
                                          qp.token, pid, addr, os.urandom(16)))
                *_, status, flags = wire.HELLO_REPLY.unpack(wire.recv_exactly(s, wire.HELLO_REPLY.size))
                assert status == wire.HELLO_OK and flags == 0
            qp.close()
            qp = ctx.alloc_pd().create_qp(ctx.create_cq())
    finally:
        ctx.close()


def _spans(base, cuts):
    """(address, length) spans of a buffer at `base` cut at the offsets `cuts`."""
    return [(base + a, b - a) for a, b in zip(cuts, cuts[1:])]


def test_a_large_copy_is_split_across_threads_and_lands_whole(monkeypatch):
    n = (5 << 20) + 123
    src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    threads = []
    real = samehost._read
    monkeypatch.setattr(samehost, "_read", lambda *a: (threads.append(threading.current_thread().name), real(*a)))
    # the two sides cut differently, and neither at the parts' boundaries
    samehost.read_from(os.getpid(), _spans(src.ctypes.data, [0, 1000, (3 << 20) + 5, n]),
                       _spans(dst.ctypes.data, [0, 77, 4 << 20, n - 1, n]), threads=2)
    assert np.array_equal(src, dst)
    assert len(threads) == 2 and any(t.startswith("easypyverbs-soft-copy") for t in threads)



def test_a_copy_with_no_free_helper_does_its_parts_itself_instead_of_queueing(monkeypatch):
    """Several copies at once (one per peer): a part no helper is free for is copied by the caller, so no
    copy waits behind another's; more parts than helpers (threads=3 with one helper) works too."""
    n = 6 << 20
    src = np.random.default_rng(6).integers(0, 256, n, dtype=np.uint8)
    samehost._helper_pool()
    workers = max(1, samehost.COPY_THREADS - 1)
    for _ in range(workers):  # every helper busy with another copy
        assert samehost._idle.acquire(timeout=5)
    threads = []
    real = samehost._read
    monkeypatch.setattr(samehost, "_read", lambda *a: (threads.append(threading.current_thread().name), real(*a)))
    try:
        dst = np.zeros(n, dtype=np.uint8)
        samehost.read_from(os.getpid(), [(src.ctypes.data, n)], [(dst.ctypes.data, n)], threads=3)
        assert np.array_equal(src, dst)
        assert threads == [threading.current_thread().name] * 3
    finally:
        for _ in range(workers):
            samehost._idle.release()
    threads.clear()
    dst = np.zeros(n, dtype=np.uint8)
    samehost.read_from(os.getpid(), [(src.ctypes.data, n)], [(dst.ctypes.data, n)], threads=3)
    assert np.array_equal(src, dst) and len(threads) == 3
    # at least one part went to the helper (two if it was done with the first before the third was handed out)
    assert 1 <= sum(t.startswith("easypyverbs-soft-copy") for t in threads) <= 2

def test_a_split_copy_that_cannot_read_a_part_fails_whole():
    n = 4 << 20
    dst = np.zeros(n, dtype=np.uint8)
    src = np.ones(n // 2, dtype=np.uint8)
    # the second half names an address nothing is mapped at: the copy fails, after both parts ended
    with pytest.raises(OSError, match="process_vm_readv"):
        samehost.read_from(os.getpid(), [(src.ctypes.data, n // 2), (8, n // 2)], [(dst.ctypes.data, n)], threads=2)
    assert (dst[:n // 2] == 1).all()


def test_a_copy_of_many_pieces_over_many_spans_lands_each_byte_in_its_place():
    """Pieces that cross span boundaries both ways (remote spans of odd sizes, local spans of others), each
    reported once, in order within its block, and every byte where it belongs."""
    rng = np.random.default_rng(7)
    sizes = [int(x) for x in rng.integers(1, 300_000, 40)]
    arrays = [rng.integers(0, 256, k, dtype=np.uint8) for k in sizes]
    total = sum(sizes)
    dst = np.zeros(total + 1000, dtype=np.uint8)
    cuts = sorted({0, total, *(int(x) for x in rng.integers(1, total, 9))})
    local = [(dst.ctypes.data + 3 + a, b - a) for a, b in zip(cuts, cuts[1:])]  # (3 bytes in: unaligned)
    piece, block = 64 << 10, 1 << 20
    pieces = [(at, min(piece, total - at), at % block == 0) for at in range(0, total, piece)]
    seen = []
    samehost.read_from(os.getpid(), [(a.ctypes.data, a.nbytes) for a in arrays], local, threads=2, pieces=pieces,
                       on_piece=lambda at, n: seen.append((at, n)))
    assert np.array_equal(dst[3:3 + total], np.concatenate(arrays)) and not dst[:3].any() and not dst[3 + total:].any()
    assert sorted(seen) == [(at, n) for at, n, _ in pieces]
    for b in range(-(-total // block)):  # (parts run at once: order holds within a block, not across them)
        mine = [at for at, _ in seen if at // block == b]
        assert mine == sorted(mine)
    with pytest.raises(ValueError, match="pieces cover"):
        samehost.read_from(os.getpid(), [(arrays[0].ctypes.data, sizes[0])], [(dst.ctypes.data, sizes[0])],
                           pieces=[(0, sizes[0] - 1, True)])
