"""Holds: a process whose Python cannot run for a while (native code keeping the GIL, as FATE's secure
aggregation does for seconds on a large model) must not fail its own transfers for it.

easypyverbs.stalls' clock leaves such holds out, so the channel's deadlines (a receiver dropping a transfer
that sent no chunk for no_progress_timeout_s) and the soft provider's receive-queue wait count only time in
which the process could act; the endpoint counts each hold and says what it did. A peer's hold still counts
against this side's deadline: its no_progress_timeout_s must exceed that (the soft provider's kernel
timeouts follow it)."""
from __future__ import annotations

import logging
import shutil
import socket
import threading
import time

import crc32c
import numpy as np
import pytest

import easypyverbs as ev
from easypyverbs import stalls
from fate_rdma_lab.bench.driver import PeerProcess
from fate_rdma_lab.bench.transfer_peer import hold_gil
from fate_rdma.channel import Endpoint
from fate_rdma.channel.auth import write_secret
from fate_rdma.config import ChannelConfig
from fate_rdma.errors import PeerUnreachable

from .test_channel import Peer, cfg_for
from .test_tls import cfg as tls_cfg, pki  # noqa: F401  (pki: the module-scoped certificate fixture)


def test_the_clock_leaves_out_a_hold_and_reports_it():
    stalls.ensure_watching()
    got = []
    token = stalls.subscribe(lambda s, _t: got.append(s))
    try:
        time.sleep(0.3)
        c0, m0 = stalls.clock(), time.monotonic()
        time.sleep(1.0)  # an idle wait is not a hold
        c1, m1 = stalls.clock(), time.monotonic()
        assert abs((c1 - c0) - (m1 - m0)) < 0.3
        hold_gil(1.6)
        c2, m2 = stalls.clock(), time.monotonic()  # the first thing to run after it: the hold is left out at once
        time.sleep(0.3)  # the watchdog's next beat tells the subscriber
    finally:
        stalls.unsubscribe(token)
    assert m2 - m1 >= 1.6
    assert (c2 - c1) < (m2 - m1) - 1.0, "the hold was counted as time this process could act"
    assert got and 1.3 <= max(got) <= 2.5, got


def test_the_clock_never_runs_backwards_across_holds():
    """Threads reading the clock while the process is held now and then, each read after the one before."""
    stalls.ensure_watching()
    stop, backwards, reads = [False], [0.0], [0]

    def reader() -> None:
        last = stalls.clock()
        while not stop[0]:
            now = stalls.clock()
            backwards[0] = max(backwards[0], last - now)
            last = now
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            time.sleep(0.2)
            hold_gil(0.6)
    finally:
        stop[0] = True
        for t in threads:
            t.join()
    assert reads[0] > 1000 and backwards[0] == 0.0, (reads[0], backwards[0])


def test_the_soft_nic_waits_for_a_held_peer_as_long_as_the_channel():
    """The soft provider's kernel send/receive timeouts end a QP whose peer reads nothing for that long: they
    follow no_progress_timeout_s, so a held peer gets the channel's whole deadline."""
    cfg = ChannelConfig(provider="soft", no_progress_timeout_s=90)
    with Endpoint(cfg) as ep:
        assert ep.ctx.retry_timeout_s == 90
    with Endpoint(ChannelConfig(provider="soft", no_progress_timeout_s=5)) as ep:
        assert ep.ctx.retry_timeout_s == 30  # (never below the provider's own default)


def test_the_no_progress_default_stays_within_a_shorter_total():
    """A configuration that shortens transfer_timeout_s below the default no-progress deadline (valid when that
    default was 30 s) still loads: the total bounds it. One that sets both the wrong way round is refused."""
    assert ChannelConfig(transfer_timeout_s=60).no_progress_timeout_s == 60
    with pytest.raises(Exception, match="no_progress_timeout_s exceeds transfer_timeout_s"):
        ChannelConfig(transfer_timeout_s=60, no_progress_timeout_s=90)


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_a_held_receiver_keeps_the_transfer_it_was_receiving(mode):
    """The receiver's process is held for 3 s in the middle of a transfer, more than twice its own
    no_progress_timeout_s: once it runs again, the transfer it was receiving must go on and arrive whole, not be
    dropped for a silence that was its own (FedRDMA: its staged receiver drops a transfer that sent no chunk for
    that long; before easypyverbs.stalls it did so here, "no chunk for 1.2 s"). FedRDMA-E's receiver keeps no
    such deadline: there the test shows that a hold mid-transfer breaks nothing. The sender allows 30 s: the
    hold is a peer's there."""
    # 16 MiB: about 1.3 s on the wire, so the hold falls inside it; FedRDMA-E: a slot it fits in
    link = dict(soft_link="rate=100mbit", slot_bytes=16 << 20)
    peer = Peer(cfg_for(mode, "soft-tcp", no_progress_timeout_s=1.2, **link))
    ep = Endpoint(cfg_for(mode, "soft-tcp", no_progress_timeout_s=30, **link))
    try:
        data = np.random.default_rng(5).integers(0, 255, 16 << 20, dtype=np.uint8)
        ep.send(peer.address, b"warm-up").result(30)
        peer.expect(1)
        fut = ep.send(peer.address, data, {"n": 1})
        deadline = time.monotonic() + 30
        while fut.progress_bytes < 1 << 20:  # the receiver holds part of it
            assert not fut.done() and time.monotonic() < deadline, "the transfer ended or stalled before the hold"
            time.sleep(0.005)
        at_hold = fut.progress_bytes
        peer.proc.cmd({"cmd": "hold", "seconds": 3.0, "after_s": 0})
        info = fut.result(60)
        rec = peer.expect(1, timeout_s=60)[-1]
        assert at_hold < data.nbytes
        assert rec["nbytes"] == data.nbytes and rec["crc32c"] == crc32c.crc32c(data)
        assert info["seconds"] >= 3.0
        stats = peer.proc.cmd({"cmd": "stats"})
        assert stats["holds"] >= 1 and 2.5 <= stats["longest_hold_s"] <= 5.0, stats
    finally:
        ep.close()
        peer.close()


@pytest.mark.parametrize("auth", ["none", "secret", "tls"])
def test_a_peer_held_while_this_side_dials_it_is_waited_for(auth, request, tmp_path):
    """The peer's process is held (3.5 s) when this side first dials it, longer than this side's
    connect_timeout_s (1 s): its kernel takes the connection and the hello, but nothing answers until it
    runs again. Before, the dial failed at connect_timeout_s ("timed out waiting for bootstrap header");
    now, while the peer's host acknowledges what this side sent, the handshake waits for it as a transfer
    waits for a held peer (up to no_progress_timeout_s), says so once in the log, and the send arrives.
    With TLS the held peer is met in the TLS handshake itself."""
    kw = dict(connect_timeout_s=1.0, no_progress_timeout_s=20)
    names, allowed = {}, None
    if auth == "none":
        peer_cfg, my_cfg = cfg_for("fedrdma-e", "soft-tcp", **kw), cfg_for("fedrdma-e", "soft-tcp", **kw)
    elif auth == "secret":
        secret = str(tmp_path / "federation.secret")
        write_secret(secret)
        peer_cfg = my_cfg = cfg_for("fedrdma-e", "soft-tcp", secret_file=secret, **kw)
        allowed = ["guest:9999"]
    else:
        if shutil.which("openssl") is None:
            pytest.skip("the openssl command line tool is not installed")
        certs = request.getfixturevalue("pki")
        peer_cfg, my_cfg = tls_cfg(certs, "host:10000", **kw), tls_cfg(certs, "guest:9999", **kw)
        allowed = ["guest:9999"]
    peer = PeerProcess(module="fate_rdma_lab.bench.transfer_peer")
    try:
        cmd = {"cmd": "endpoint", "config": dict(peer_cfg.__dict__), "record": True}
        if allowed:
            cmd["allowed_peers"] = allowed
        addr = peer.cmd(cmd)["address"]
        if auth == "tls":
            names = {addr: "host:10000"}
        with Endpoint(my_cfg, name="guest:9999" if allowed else None, party_names=names) as ep:
            peer.cmd({"cmd": "hold", "seconds": 3.5, "after_s": 0.2})
            time.sleep(1.0)  # the hold has begun (it ends 2.7 s from now)
            with _capture("easypyverbs") as logged:
                t0 = time.monotonic()
                ep.send(addr, b"x" * 1000, {"n": 1}).result(30)
                took = time.monotonic() - t0
            rec = peer.cmd({"cmd": "expect", "count": 1, "timeout_s": 30})["records"][-1]
            assert rec["nbytes"] == 1000 and rec["metadata"] == {"n": 1}
            assert took > 1.0, f"the peer was not held past this side's connect_timeout_s ({took:.2f} s)"
            assert sum("has not answered for" in m and "may be held" in m for m in logged) == 1, logged
    finally:
        peer.close()


def test_a_stranger_silent_mid_handshake_still_gets_connect_timeout(tmp_path):
    """The patience is for peers this side dialed or that proved the secret: a stranger that sends its hello
    and then nothing (its kernel acknowledging everything, as a held peer's would) is closed at the acceptor's
    connect_timeout_s (1 s), not kept for no_progress_timeout_s (20 s), and its pending-handshake slot freed."""
    secret = str(tmp_path / "federation.secret")
    write_secret(secret)
    cfg = cfg_for("fedrdma-e", "soft-tcp", secret_file=secret, connect_timeout_s=1.0, no_progress_timeout_s=20)
    with Endpoint(cfg) as ep:
        host, port = ep.address.rsplit(":", 1)
        boot = ev.connect(host, int(port), timeout_s=5)
        try:
            t0 = time.monotonic()
            boot.exchange({"auth": "hmac-sha256", "v": 1, "name": "stranger:1", "nonce": "00" * 32}, 5)
            with pytest.raises(ev.BootstrapError, match="closed|lost"):
                boot.recv(30)  # no proof from us: the acceptor gives up and closes
            assert time.monotonic() - t0 < 5, "a stranger was given a held peer's patience"
        finally:
            boot.close()
        deadline = time.monotonic() + 5
        while ep.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        while ep._admission.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ep.refused >= 1 and ep._admission.pending == 0  # the slot is back


def test_a_listener_that_never_answers_fails_at_no_progress_not_never():
    """A socket that listens but never accepts (a stuck process: its kernel completes the connect and takes the
    hello, as for a held one) fails the dial once no_progress_timeout_s has passed, naming why."""
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        cfg = cfg_for("fedrdma-e", "soft-tcp", connect_timeout_s=0.5, no_progress_timeout_s=2.0)
        with Endpoint(cfg) as ep:
            t0 = time.monotonic()
            with pytest.raises(PeerUnreachable, match=r"did not answer within 2 s \(no_progress_timeout_s\)"):
                ep.connect("127.0.0.1:%d" % srv.getsockname()[1])
            assert 1.9 < time.monotonic() - t0 < 10
    finally:
        srv.close()


def test_peer_took_everything_reads_the_kernel():
    """Established with everything acknowledged: True; the peer closed (CLOSE_WAIT here): False."""
    from easypyverbs.bootstrap import peer_took_everything
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname()[:2])
    b, _ = srv.accept()
    try:
        a.sendall(b"hello")
        time.sleep(0.1)
        assert peer_took_everything(a)
        b.close()
        time.sleep(0.1)
        assert not peer_took_everything(a)
    finally:
        a.close()
        srv.close()


class _capture:
    """Messages logged under `name` while the block runs."""

    def __init__(self, name: str) -> None:
        self.logger, self.messages = logging.getLogger(name), []
        self.handler = logging.Handler(logging.DEBUG)
        self.handler.emit = lambda rec: self.messages.append(rec.getMessage())  # type: ignore[assignment]

    def __enter__(self) -> list:
        self.logger.addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)


@pytest.mark.parametrize("patient", [False, True])
def test_a_soft_qp_waits_for_a_held_peer_nic_within_the_window(patient):
    """A held peer's soft NIC (a thread of that process) answers a new QP late: within the handshake's window
    the QP's connect waits for it past its timeout (0.3 s here); without a window it fails as before. And a window
    that ends first fails the wait at its end, saying the host acknowledged everything."""
    from easypyverbs.providers.soft import wire
    from easypyverbs.providers.soft.qp import _reply

    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname()[:2], timeout=0.3)
    b, _ = srv.accept()
    try:
        a.sendall(b"hello")
        answer = wire.HELLO_REPLY.pack(wire.HELLO_MAGIC, wire.VERSION, 2, wire.HELLO_OK, 0)
        late = threading.Timer(1.2, b.sendall, args=(answer,))
        late.start()
        try:
            if patient:
                assert _reply(a, "peer", 0.3, stalls.clock() + 10) == answer
            else:
                with pytest.raises(socket.timeout, match="no answer within"):
                    _reply(a, "peer", 0.3, 0.0)
        finally:
            late.join()
        if patient:  # a window shorter than the peer's silence
            late = threading.Timer(1.5, b.sendall, args=(answer,))
            late.start()
            try:
                t0 = time.monotonic()
                with pytest.raises(socket.timeout, match="held or stuck"):
                    _reply(a, "peer", 0.3, stalls.clock() + 0.9)
                assert time.monotonic() - t0 < 1.4
            finally:
                late.join()
    finally:
        a.close()
        b.close()
        srv.close()
