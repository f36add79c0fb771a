"""The TCP bootstrap: round trips, and every kind of bad input gives a BootstrapError that names it."""
from __future__ import annotations

import socket
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


def _sealed_pair():
    a, b = _pair()
    a.seal(b"a" * 32, b"b" * 32)
    b.seal(b"b" * 32, b"a" * 32)
    return a, b


def test_sealed_messages_round_trip_in_order():
    a, b = _sealed_pair()
    with a, b:
        for i in range(3):
            a.send({"n": i}, 5)
        assert [b.recv(5)["n"] for _ in range(3)] == [0, 1, 2]
        b.send({"back": True}, 5)
        assert a.recv(5) == {"back": True} and a.sealed


def _sealed_frame(key: bytes, number: int, obj: bytes) -> bytes:
    body = obj + ev.BootstrapConn._tag(key, number, obj)
    return bootstrap.HEADER.pack(b"EPVB", 1, bootstrap.KIND_SEALED, 0, len(body)) + body


@pytest.mark.parametrize("frame,match", [
    (_sealed_frame(b"a" * 32, 0, b'{"qp":"relay"}')[:-1] + b"\xff", "fails its MAC"),  # altered (its tag)
    (_sealed_frame(b"x" * 32, 0, b'{"n":0}'), "fails its MAC"),  # forged: another key
    (_sealed_frame(b"a" * 32, 1, b'{"n":1}'), "fails its MAC"),  # out of order: #1 where #0 is due
    (bootstrap.HEADER.pack(b"EPVB", 1, 1, 0, 2) + b"{}", "is not sealed"),  # unsealed, into a sealed connection
    (bootstrap.HEADER.pack(b"EPVB", 1, 2, 0, 3) + b"{}x", "outside"),  # shorter than a tag
])
def test_a_sealed_connection_takes_only_the_next_sealed_message(frame, match):
    """What a relay on the path could try once the two ends sealed their bootstrap connection: each is
    a BootstrapError naming it, before the body is parsed."""
    with ev.Listener() as lst:
        raw = _raw_client(lst)
        conn = lst.accept(5)
        conn.seal(b"b" * 32, b"a" * 32)
        raw.sendall(frame)
        with conn, pytest.raises(ev.BootstrapError, match=match):
            conn.recv(timeout_s=2)
        raw.close()


def test_a_replayed_sealed_message_is_refused():
    a, b = _sealed_pair()
    with a, b:
        a.send({"n": 0}, 5)
        first = ev.BootstrapConn._tag(b"a" * 32, 0, b'{"n":0}')
        assert b.recv(5) == {"n": 0}
        body = b'{"n":0}' + first
        a.sock.sendall(bootstrap.HEADER.pack(b"EPVB", 1, bootstrap.KIND_SEALED, 0, len(body)) + body)
        with pytest.raises(ev.BootstrapError, match="#1 .* fails its MAC"):
            b.recv(5)


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


def test_a_sealed_bootstrap_binds_the_soft_data_connections_to_its_session():
    """Over a sealed bootstrap no QPInfo carries an attach token (a reader of the bootstrap, without the
    session, learns nothing that attaches to a QP): both ends derive it from the seal's keys, and the QPs
    connect and carry a SEND with it."""
    a, b = _sealed_pair()
    ctxs = [ev.open_device(provider="soft") for _ in range(2)]
    sent = []
    for conn in (a, b):
        real = conn.exchange

        def spy(obj, timeout_s=10.0, _real=real):
            sent.append(obj)
            return _real(obj, timeout_s)

        conn.exchange = spy
    out = {}
    try:
        t = threading.Thread(target=lambda: out.setdefault("b", ev.establish(ctxs[1], b, timeout_s=5)))
        t.start()
        ra = ev.establish(ctxs[0], a, timeout_s=5)
        t.join(10)
        rb = out["b"]
        infos = [m["qp"] for m in sent if "qp" in m]
        assert len(infos) == 2 and all(i["token"] == "" for i in infos), infos
        assert ra.qp.token == a.attach_token(ra.qp.qpn, True) == b.attach_token(ra.qp.qpn, False)
        assert rb.qp.token == b.attach_token(rb.qp.qpn, True) != ra.qp.token
        buf = bytearray(4)
        mr = rb.pd.reg_mr(buf, ev.Access.LOCAL_WRITE)
        rb.qp.post_recv(mr.sge(0, 4), wr_id=1)
        src = ra.pd.reg_mr(bytearray(b"ping"), ev.Access.LOCAL_WRITE)
        ra.qp.post_send(src.sge(0, 4))
        assert rb.recv_cq.wait(5)[0].ok and bytes(buf) == b"ping"
    finally:
        for c in ctxs:
            c.close()
        a.close()
        b.close()


def test_a_bound_soft_qp_takes_only_the_derived_token():
    from easypyverbs.providers.soft import wire

    a, b = _sealed_pair()
    ctx = ev.open_device(provider="soft")
    try:
        qp = ctx.alloc_pd().create_qp(ctx.create_cq())
        qp.bind_attach(a.attach_token)
        assert qp.info().token == ""
        host, _, port = ctx.nic_address.rpartition(":")
        for token, status in ((bytes(16), wire.HELLO_BAD_TOKEN), (a.attach_token(qp.qpn, False), wire.HELLO_BAD_TOKEN),
                              (b.attach_token(qp.qpn, False), wire.HELLO_OK)):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, 0, 1, qp.qpn, 0, 0, token, 0, 0, bytes(16)))
                assert wire.HELLO_REPLY.unpack(wire.recv_exactly(s, wire.HELLO_REPLY.size))[3] == status
        other = ctx.alloc_pd().create_qp(ctx.create_cq())  # (a peer that hands its token out in clear)
        mine = ctx.alloc_pd().create_qp(ctx.create_cq())
        mine.bind_attach(a.attach_token)
        with pytest.raises(ev.EasyVerbsError, match="hands out its attach token"):
            mine.connect(other.info(), 2)
        c, d = _pair()
        with c, d, pytest.raises(ev.BootstrapError, match="not sealed"):
            c.attach_token(1, True)
    finally:
        ctx.close()
        a.close()
        b.close()
