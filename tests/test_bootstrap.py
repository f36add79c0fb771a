"""The TCP bootstrap: round trips, and every kind of bad input gives a BootstrapError that names it."""
from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

import easypyverbs as ev
from easypyverbs import bootstrap


def _pair():
    lst = ev.Listener("127.0.0.1", 0)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("srv", lst.accept(5)))
    t.start()
    cli = ev.connect(*lst.address, timeout_s=5)
    t.join()
    lst.close()
    return cli, out["srv"]


def test_exchange_round_trip():
    a, b = _pair()
    with a, b:
        t = threading.Thread(target=lambda: b.exchange({"from": "b"}, 5))
        t.start()
        assert a.exchange({"from": "a", "n": [1, 2]}, 5) == {"from": "b"}
        t.join()


def _raw_client(lst):
    return socket.create_connection(lst.address, timeout=5)


@pytest.mark.parametrize("junk,match", [
    (b"GET / HTTP/1.1\r\n\r\n", "garbage"),
    (bootstrap.HEADER.pack(b"EPVB", 9, 1, 0, 2) + b"{}", "version 9"),
    (bootstrap.HEADER.pack(b"EPVB", 1, 1, 0, 1 << 30), "announced"),
    (bootstrap.HEADER.pack(b"EPVB", 1, 1, 0, 5) + b"{oops", "malformed JSON"),
    (bootstrap.HEADER.pack(b"EPVB", 1, 1, 0, 2) + b"[]", "expected an object"),
    (bootstrap.HEADER.pack(b"EPVB", 1, 1, 0, 100) + b"{}", "closed"),
])
def test_garbage_is_named(junk, match):
    with ev.Listener() as lst:
        raw = _raw_client(lst)
        conn = lst.accept(5)
        raw.sendall(junk)
        raw.shutdown(socket.SHUT_WR)
        with conn, pytest.raises(ev.BootstrapError, match=match):
            conn.recv(timeout_s=2)
        raw.close()


def test_silent_peer_times_out():
    with ev.Listener() as lst:
        raw = _raw_client(lst)
        with lst.accept(5) as conn, pytest.raises(ev.BootstrapError, match="timed out"):
            conn.recv(timeout_s=0.2)
        raw.close()


def test_connect_and_accept_deadlines():
    with ev.Listener() as lst:
        with pytest.raises(ev.BootstrapError, match="no peer connected"):
            lst.accept(0.1)
        port = lst.address[1]
    with pytest.raises(ev.BootstrapError, match="cannot reach"):
        ev.connect("127.0.0.1", port, timeout_s=0.3)


def test_malformed_descriptors_rejected():
    with pytest.raises(ev.BootstrapError, match="qpn"):
        ev.QPInfo.from_dict({"provider": "soft", "psn": 1, "gid": "x", "lid": 0, "mtu": 1, "max_msg_bytes": 1})
    with pytest.raises(ev.BootstrapError, match="must be an integer"):
        ev.QPInfo.from_dict({"provider": "soft", "qpn": "1", "psn": 1, "gid": "x", "lid": 0, "mtu": 1, "max_msg_bytes": 1})
    with pytest.raises(ev.BootstrapError, match="24-bit"):
        ev.QPInfo.from_dict({"provider": "soft", "qpn": 1 << 25, "psn": 1, "gid": "x", "lid": 0, "mtu": 1, "max_msg_bytes": 1})
    with pytest.raises(ev.BootstrapError, match="rkey"):
        ev.RemoteMR.from_dict({"addr": 1, "rkey": -5, "length": 3})


def test_establish_fails_cleanly_on_a_bad_peer():
    a, b = _pair()
    ctx = ev.open_device(provider="soft")
    try:
        t = threading.Thread(target=lambda: b.send({"qp": {"provider": "soft"}, "mrs": {}}))
        t.start()
        with pytest.raises(ev.BootstrapError, match="field"):
            ev.establish(ctx, a, timeout_s=2)
        t.join()
    finally:
        ctx.close()
        a.close()
        b.close()


def test_soft_nic_survives_garbage_connections():
    from .verbs_pair import close_pair, make_pair

    sides = make_pair("soft")
    try:
        host, _, port = sides[1].ctx.nic_address.rpartition(":")
        for junk in (b"\x00" * 100, b"SVRB" + b"\xff" * 40, b""):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(junk)
            s.close()
        a, b = sides
        b.qp.post_recv(b.mr.sge(0, 4), wr_id=1)
        a.buf[:4] = b"ping"
        a.qp.post_send(a.mr.sge(0, 4))
        assert b.cq.wait(5)[0].ok and bytes(b.buf[:4]) == b"ping"
    finally:
        close_pair(sides)


def test_protocol_violation_on_a_qp_errors_it():
    from easypyverbs.providers.soft import wire

    ctx = ev.open_device(provider="soft")
    try:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq()
        qp = pd.create_qp(cq)
        qp.post_recv([], wr_id=5)
        host, _, port = ctx.nic_address.rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, 0, 1, qp.qpn, 0, 0, qp.token, 0, 0, bytes(16)))
        assert wire.HELLO_REPLY.unpack(wire.recv_exactly(s, wire.HELLO_REPLY.size))[3] == wire.HELLO_OK
        s.sendall(b"\xde\xad" * 20)  # not a request frame
        (wc,) = cq.wait(5)
        assert wc.status == ev.WCStatus.WR_FLUSH_ERR and qp.state == ev.QPState.ERR
        s.close()
    finally:
        ctx.close()


def test_soft_qp_cannot_be_attached_without_its_token():
    """Someone who finds a QP number (by scanning) but never got its QPInfo over the bootstrap is
    refused, and the QP stays free for the peer that did."""
    from easypyverbs.providers.soft import wire

    ctx = ev.open_device(provider="soft")
    try:
        qp = ctx.alloc_pd().create_qp(ctx.create_cq())
        host, _, port = ctx.nic_address.rpartition(":")
        for guess in (bytes(16), b"\x01" * 16):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, 0, 1, qp.qpn, 0, 0, guess, 0, 0, bytes(16)))
                assert wire.HELLO_REPLY.unpack(wire.recv_exactly(s, wire.HELLO_REPLY.size))[3] == wire.HELLO_BAD_TOKEN
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, 0, 1, qp.qpn, 0, 0, qp.token, 0, 0, bytes(16)))
            assert wire.HELLO_REPLY.unpack(wire.recv_exactly(s, wire.HELLO_REPLY.size))[3] == wire.HELLO_OK
        assert ev.QPInfo.from_dict(qp.info().to_dict()).token == qp.token.hex()
    finally:
        ctx.close()
