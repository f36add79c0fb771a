"""Attacks on a real endpoint in its own process, from another process that can reach its address
and nothing more. Each test asserts that the attack fails with the documented error, that the
victim's memory and threads stay bounded (read from /proc through the victim's own report), that
nothing reaches the application, and that a legitimate party keeps exchanging verified payloads.
Figures (memory, threads) are printed with -s."""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import struct
import time

import crc32c
import pytest

from fate_rdma import errors as E
from fate_rdma_lab.bench.driver import PeerProcess
from fate_rdma.channel import Endpoint
from fate_rdma.channel import transfer
from fate_rdma.channel.auth import authenticate, seal, write_secret
from fate_rdma.config import ChannelConfig

import easypyverbs as ev

from . import relay as relay_mod

CHUNK = 64 * 1024
MODES = ["fedrdma", "fedrdma-e"]


@pytest.fixture
def secret(tmp_path):
    path = str(tmp_path / "federation.secret")
    write_secret(path)
    return path


@pytest.fixture
def other_secret(tmp_path):
    path = str(tmp_path / "another.secret")
    write_secret(path)
    return path


def cfg(mode: str, secret_file=None, **kw) -> ChannelConfig:
    base = dict(mode=mode, chunk_bytes=CHUNK, slot_bytes=1 << 20, provider="soft", window=4, max_window=8,
                connect_timeout_s=3, no_progress_timeout_s=10, secret_file=secret_file, max_pending_handshakes=8)
    base.update(kw)
    return ChannelConfig(**base)


class Victim:
    """An endpoint in another process that records what it receives and reports its resources."""

    def __init__(self, config: ChannelConfig, allowed=("client-a",), name=None) -> None:
        self.proc = PeerProcess(module="fate_rdma_lab.bench.transfer_peer")
        r = self.proc.cmd({"cmd": "endpoint", "config": dict(config.__dict__), "record": True, "name": name,
                           "allowed_peers": None if allowed is None else list(allowed)})
        self.address = r["address"]
        self.count = 0

    def stats(self):
        return self.proc.cmd({"cmd": "stats"})

    def expect(self, n: int = 1):
        self.count += n
        r = self.proc.cmd({"cmd": "expect", "count": self.count, "timeout_s": 30})
        assert r["ok"], r
        return r["records"][-n:]

    def close(self) -> None:
        self.proc.close()


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def legit_round_trip(victim: Victim, mode: str, secret: str, nbytes: int = 3 * CHUNK + 5,
                     provider: str = "soft", **kw) -> None:
    """The real party still gets through, verified, under its own name."""
    data = os.urandom(nbytes)
    with Endpoint(cfg(mode, secret, provider=provider, **kw), name="client-a") as ep:
        ep.send(victim.address, data, {"who": "client-a"}).result(30)
    (rec,) = victim.expect()
    assert rec["peer"] == "client-a" and rec["crc32c"] == crc32c.crc32c(data) and rec["nbytes"] == nbytes


#: the attacks whose outcome depends on the verbs provider run on pyverbs too (on rxe0 in the VM, make test-rdma)
PROVIDERS = ["soft", "pyverbs"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_stranger_cannot_pose_as_a_party(mode, secret, other_secret, provider):
    from .verbs_pair import require

    require(provider)
    victim = Victim(cfg(mode, secret, provider=provider))
    try:
        for stranger_secret, match in ((None, "requires authentication|does not authenticate"),
                                       (other_secret, "refused this side's proof")):
            # claims the real party's name
            with Endpoint(cfg(mode, stranger_secret, provider=provider), name="client-a") as ep:
                with pytest.raises(E.AuthenticationError, match=match):
                    ep.send(victim.address, b"poisoned weights" * 1000)
        with Endpoint(cfg(mode, secret, provider=provider), name="client-z") as ep:  # holds the secret, not a party
            with pytest.raises(E.AuthenticationError, match="refused"):
                ep.send(victim.address, b"x" * 100)
        assert victim.stats()["count"] == 0  # nothing reached the application
        assert victim.stats()["peers"] == []
        legit_round_trip(victim, mode, secret, provider=provider)
    finally:
        victim.close()


def test_party_never_sends_to_an_impostor(mode, secret, other_secret):
    """A process listening where a party should be gets no weights: the sender checks its proof."""
    impostor = Victim(cfg(mode, other_secret), allowed=None)
    victim = Victim(cfg(mode, secret))
    try:
        with pytest.raises(RuntimeError, match="AuthenticationError.*refused this side's proof"):
            victim.proc.cmd({"cmd": "send", "address": impostor.address, "hex": (b"weights" * 100).hex()})
        assert impostor.stats()["count"] == 0
        legit_round_trip(victim, mode, secret)
    finally:
        victim.close()
        impostor.close()


def _auth_hello(name: str) -> bytes:
    body = ('{"auth":"hmac-sha256","v":1,"name":"%s","nonce":"%s"}' % (name, secrets.token_hex(32))).encode()
    return struct.pack("!4sBBHI", b"EPVB", 1, 1, 0, len(body)) + body


def test_unauthenticated_connections_cost_nothing(secret):
    """Many strangers at once (auth opening then silence, garbage, HTTP, a huge announced length):
    the victim allocates nothing for them, its threads stay bounded, and the party gets through."""
    victim = Victim(cfg("fedrdma-e", secret, slot_bytes=64 << 20))
    socks = []
    try:
        before = victim.stats()
        host, _, port = victim.address.rpartition(":")
        openers = [_auth_hello("client-a"), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(64),
                   struct.pack("!4sBBHI", b"EPVB", 1, 1, 0, 1 << 30)]
        for i in range(48):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(openers[i % len(openers)])
            socks.append(s)
        time.sleep(1.0)
        during = victim.stats()
        legit_round_trip(victim, "fedrdma-e", secret)  # while the strangers still hold their sockets
        deadline = time.monotonic() + 5  # the victim notices the party's close within its 100 ms tick
        while (after := victim.stats())["pool_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        grew = during["rss_bytes"] - before["rss_bytes"]
        print(f"\nadversary: 48 strangers: victim RSS +{grew / 2**20:.1f} MiB, threads {before['threads']} -> "
              f"{during['threads']}, refused {during['refused']}, budget held {during['budget_held_bytes']}")
        assert during["budget_held_bytes"] == 0 and during["pool_bytes"] == 0  # nothing registered for strangers
        assert grew < 32 << 20
        assert during["threads"] <= before["threads"] + 8 + 2  # at most max_pending_handshakes handshake threads
        assert during["refused"] >= 48 - 8
        assert after["count"] == 1 and after["pool_bytes"] == 0  # the party's pool went with its connection
    finally:
        for s in socks:
            s.close()
        victim.close()


def test_one_source_cannot_take_every_handshake_slot(secret):
    """Strangers from one address that open connections and fall silent hold at most a quarter of the
    pending-handshake slots of an endpoint on a routable address, so a party from elsewhere gets in
    while they wait for their deadline (without that cap they held every slot until it passed)."""
    victim_cfg = cfg("fedrdma-e", secret, max_pending_handshakes=8, connect_timeout_s=20, shared_secret_only=True)
    with Endpoint(victim_cfg, host="0.0.0.0", allowed_peers=["client-a"]) as victim:
        port = int(victim.address.rpartition(":")[2])
        victim.name = f"127.0.0.1:{port}"  # what the party dials, and the name the victim proves
        socks = []
        try:
            for _ in range(8):
                s = socket.socket()
                s.bind(("127.0.0.2", 0))  # another address of this machine: "another host"
                s.connect(("127.0.0.1", port))
                s.sendall(_auth_hello("client-a")[:6])  # a few bytes, then silence
                socks.append(s)
            deadline = time.monotonic() + 5
            while victim.refused < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert victim.refused == 6  # two slots for 127.0.0.2, the other six refused at accept
            data = os.urandom(3 * CHUNK)
            with Endpoint(cfg("fedrdma-e", secret, connect_timeout_s=3), name="client-a") as ep:
                ep.send(victim.name, data).result(20)  # from 127.0.0.1, while the strangers hold their slots
            assert bytes(victim.recv(timeout=20).detach()) == data
        finally:
            for s in socks:
                s.close()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("required,sent", [("crc32c", "none"), ("blake2b", "crc32c")])
def test_integrity_is_the_receivers_decision(mode, secret, provider, monkeypatch, required, sent):
    """A party configured with another checksum is refused at connect, naming both settings. One that
    hides its setting (a peer that predates checksum agreement, or lies about it) and sends another
    checksum has its transfers refused as protocol errors naming the header field: a receiver that
    requires blake2b takes no crc32c, which a man in the middle could recompute."""
    from fate_rdma.channel import handshake

    from .verbs_pair import require

    require(provider)
    victim = Victim(cfg(mode, secret, provider=provider, checksum=required))
    try:
        with Endpoint(cfg(mode, secret, checksum=sent, provider=provider), name="client-a") as ep:
            with pytest.raises(E.ConfigError, match=f"checksum '{required}' and this side '{sent}'"):
                ep.send(victim.address, b"x")
        to_wire = handshake.Hello.to_wire  # from here on: a client that does not say, and does not check
        monkeypatch.setattr(handshake.Hello, "to_wire", lambda h: {k: v for k, v in to_wire(h).items() if k != "checksum"})
        monkeypatch.setattr(handshake, "agree_checksum", lambda mine, peer: None)
        with Endpoint(cfg(mode, secret, checksum=sent, provider=provider), name="client-a") as ep:
            fut = ep.send(victim.address, os.urandom(3 * CHUNK))
            with pytest.raises(E.RemoteProtocolError, match=f"'flags' says {'no checksum' if sent == 'none' else sent}"):
                fut.result(20)
        monkeypatch.undo()
        assert victim.stats()["count"] == 0
        legit_round_trip(victim, mode, secret, provider=provider, checksum=required)
    finally:
        victim.close()


def test_forged_hello_is_refused_naming_the_field(secret):
    """A party that holds the secret but sends a malformed hello (zero slots) is refused before any
    memory is registered for it; the endpoint keeps serving."""
    victim = Victim(cfg("fedrdma-e", secret))
    try:
        host, _, port = victim.address.rpartition(":")
        boot = ev.connect(host, int(port), timeout_s=5)
        from fate_rdma.channel.auth import load_secret

        who = authenticate(boot, "client-a", load_secret(secret), dialer=True, timeout_s=5)
        assert who.authenticated and who.name == victim.address
        seal(boot, who, dialer=True)  # (what an endpoint does next: every later message carries a MAC)
        boot.send({"fate_rdma": 1, "name": "client-a", "qps": 1, "staging": None,
                   "pool": {"slots": 0, "slot_payload_bytes": "lots", "meta_cap": 1}})
        with pytest.raises(ev.BootstrapError):  # the victim closed the connection
            boot.recv(timeout_s=5)
            boot.recv(timeout_s=5)
        boot.close()
        assert victim.stats()["budget_held_bytes"] == 0
        assert "hello from" in victim.stats()["last_refusal"] and "'slots'" in victim.stats()["last_refusal"]
        legit_round_trip(victim, "fedrdma-e", secret)
    finally:
        victim.close()


def test_memory_budget_refuses_before_allocating(secret):
    # FedRDMA: a transfer larger than the budget is refused at its first chunk
    victim = Victim(cfg("fedrdma", secret, memory_budget_bytes=8 << 20))
    try:
        with Endpoint(cfg("fedrdma", secret), name="client-a") as ep:
            with pytest.raises(E.PayloadTooLarge, match="exceeds the receiver's limit for this peer"):
                ep.send(victim.address, bytes(16 << 20)).result(30)
            assert victim.stats()["budget_held_bytes"] < 2 << 20  # only the staging buffers
        legit_round_trip(victim, "fedrdma", secret)
    finally:
        victim.close()
    # FedRDMA-E: a slot's growth beyond the budget is refused at the sender's GROW, before any allocation
    victim = Victim(cfg("fedrdma-e", secret, memory_budget_bytes=8 << 20, slot_bytes=16 << 20,
                        slot_initial_bytes=1 << 20))
    try:
        with Endpoint(cfg("fedrdma-e", secret, slot_bytes=16 << 20), name="client-a") as ep:
            ep.send(victim.address, b"x").result(10)
            victim.expect()
            before = victim.stats()
            with pytest.raises(E.PayloadTooLarge, match="exceeds the receiver's limit for this peer"):
                ep.send(victim.address, bytes(12 << 20)).result(30)
            st = victim.stats()
            assert st["budget_held_bytes"] == before["budget_held_bytes"] < 3 << 20  # the two initial slots only
            assert st["pool_bytes"] == before["pool_bytes"] and st["rss_bytes"] < before["rss_bytes"] + (4 << 20)
        # within this peer's part of the budget (peer_budget_fraction: half): grows
        legit_round_trip(victim, "fedrdma-e", secret, nbytes=2 << 20, slot_bytes=16 << 20)
    finally:
        victim.close()
    # a pool whose initial slots do not fit the budget is never registered: the connection is refused
    victim = Victim(cfg("fedrdma-e", secret, memory_budget_bytes=8 << 20, slot_bytes=16 << 20,
                        slot_initial_bytes=16 << 20))
    try:
        with Endpoint(cfg("fedrdma-e", secret, slot_bytes=16 << 20), name="client-a") as ep:
            with pytest.raises(E.FateRdmaError):
                ep.send(victim.address, b"x").result(10)
        st = victim.stats()
        assert st["budget_held_bytes"] == 0 and st["pool_bytes"] == 0
    finally:
        victim.close()


def test_no_secret_means_loopback_only(tmp_path):
    with pytest.raises(E.ConfigError, match="loopback"):
        Endpoint(cfg("fedrdma", None), host="0.0.0.0")
    world = tmp_path / "world.secret"
    write_secret(str(world))
    os.chmod(world, 0o644)
    with pytest.raises(E.ConfigError, match="readable by other users"):
        Endpoint(cfg("fedrdma", str(world)))


@pytest.mark.parametrize("provider", [*PROVIDERS, "pyverbs-registrations"])
def test_held_slot_is_not_writable_by_the_sender(secret, provider, monkeypatch):
    """A FedRDMA-E slot is the peer's to write only while granted: once its transfer arrived, a WRITE
    with the old rkey fails with a remote access error (the soft NIC as a real one; on pyverbs the slot's
    memory window is deallocated and a new one bound at the next grant, or with EASYPYVERBS_MEMORY_WINDOWS=off
    its MR is deregistered and registered again under a new rkey) and the message the application holds
    does not change; the next grant comes with a new rkey in the CREDIT."""
    from .verbs_pair import require

    windows = provider == "pyverbs"
    if provider == "pyverbs-registrations":
        provider = "pyverbs"
        monkeypatch.setenv("EASYPYVERBS_MEMORY_WINDOWS", "off")
    require(provider)
    c = cfg("fedrdma-e", secret, pool_slots=2, provider=provider)
    with Endpoint(c, name="victim") as victim, Endpoint(c, name="client-a") as client:
        victim_addr = victim.address
        victim.name = victim_addr  # dialers check that the endpoint proves the address they dialed
        conn = client.connect(victim_addr)
        granted = list(conn.slot_sender.slot_mrs)
        if provider == "pyverbs":  # windowed slots where the device has windows, unless switched off
            deadline = time.monotonic() + 10
            while not victim._conns and time.monotonic() < deadline:  # (the accepting side lists it a moment later)
                time.sleep(0.05)
            (theirs,) = {id(c): c for c in victim._conns.values()}.values()
            mrs = theirs.mem.slots.mrs
            assert sorted(m.rkey for m in mrs) == sorted(g.rkey for g in granted)
            if windows and victim.ctx.memory_windows:
                assert all(m._windowed and m.rkey != m._mr.rkey for m in mrs)
            else:
                assert not any(m._windowed for m in mrs) and not victim.ctx.memory_windows
        data = os.urandom(3 * CHUNK)
        client.send(victim_addr, data).result(20)
        msg = victim.recv(timeout=20)
        assert bytes(msg.view) == data
        qp = conn.rcs[0].qp
        junk = conn.pd.reg_mr(bytearray(b"\xee" * 4096), ev.Access.LOCAL_WRITE)
        try:
            qp.post_write(junk.sge(0, 4096), granted[0], remote_offset=64 + 65536, wr_id=999)
            deadline = time.monotonic() + 10
            while conn.dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert conn.dead is not None and "REM_ACCESS_ERR" in str(conn.dead), conn.dead
            assert bytes(msg.view) == data  # the held message did not change
        finally:
            junk.close()
        msg.release()
        # a fresh connection (the old one died with its QP) gets fresh grants and works
        client.send(victim_addr, b"after").result(20)
        assert bytes(victim.recv(timeout=20).detach()) == b"after"


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mode", MODES)
def test_peer_cannot_read_back_receive_memory(secret, provider, mode, monkeypatch):
    """Receive memory is the peer's to write, never to read: after a transfer was delivered, changed in
    place by the application (a sum into the received array, say) and released, an RDMA READ of the
    re-granted FedRDMA-E slot or of the FedRDMA staging buffers fails with a remote access error and
    brings back nothing of the receiver's bytes (the MRs are registered without REMOTE_READ)."""
    from .verbs_pair import require

    require(provider)
    c = cfg(mode, secret, pool_slots=2, provider=provider)
    with Endpoint(c, name="victim") as victim, Endpoint(c, name="client-a") as client:
        victim_addr = victim.address
        victim.name = victim_addr  # dialers check that the endpoint proves the address they dialed
        conn = client.connect(victim_addr)
        data = os.urandom(3 * CHUNK)
        client.send(victim_addr, data).result(20)
        msg = victim.recv(timeout=20)
        assert bytes(msg.view) == data
        if mode == "fedrdma-e":
            slot = next(i for i, mr in enumerate(conn.slot_sender.slot_mrs) if mr.length > 3 * CHUNK)  # the grown one
            old_rkey = conn.slot_sender.slot_mrs[slot].rkey
        secret_bytes = b"\x5a" * 4096
        if mode == "fedrdma-e":  # the application works in place on what it received: the slot, lent
            monkeypatch.setattr(transfer, "LEND_MIN_BYTES", 0)
            view = msg.detach()
            assert msg.lent
            view[:4096] = secret_bytes
            del view  # the slot goes back once the last view of it is gone
        msg.release()
        if mode == "fedrdma-e":  # wait for the CREDIT that grants the slot again, under a new rkey
            deadline = time.monotonic() + 10
            while conn.slot_sender.slot_mrs[slot].rkey == old_rkey and time.monotonic() < deadline:
                time.sleep(0.02)
            assert conn.slot_sender.slot_mrs[slot].rkey != old_rkey, "the slot was not granted again"
            target, at = conn.slot_sender.slot_mrs[slot], conn.slot_sender.offer.offset_in_slot(0)  # the payload
        else:
            target, at = conn.remote["staging"], conn.staged_sender.offer.data_offset(0)
        landed = bytearray(4096)  # (read after the connection is gone: its MRs went with its protection domain)
        sink = conn.pd.reg_mr(landed, ev.Access.LOCAL_WRITE)
        try:
            conn.rcs[0].qp.post_read(sink.sge(0, 4096), target, remote_offset=at, wr_id=998)
            deadline = time.monotonic() + 10
            while conn.dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert conn.dead is not None and "REM_ACCESS_ERR" in str(conn.dead), conn.dead
            got = bytes(landed)
            assert secret_bytes[:64] not in got and data[:64] not in got
        finally:
            sink.close()
        # a fresh connection (the old one died with its QP) works
        client.send(victim_addr, b"after").result(20)
        assert bytes(victim.recv(timeout=20).detach()) == b"after"


def _reframe(frame: bytes, body: bytes, kind=None) -> bytes:
    head = relay_mod.HEADER.unpack(frame[:relay_mod.HEADER.size])
    return relay_mod.HEADER.pack(head[0], head[1], head[2] if kind is None else kind, 0, len(body)) + body


def _rewrite(frame: bytes, old: bytes, new: bytes) -> bytes:
    """The frame with `old` replaced in its JSON (its tag, which the relay cannot recompute, left as it was)."""
    body = frame[relay_mod.HEADER.size:]
    assert old in body[:-16], (old, body[:200])
    return _reframe(frame, body[:-16].replace(old, new, 1) + body[-16:])


_GID = re.compile(rb'"gid":"[^"]*"')

#: attack -> (direction, frame index, what the relay passes on instead): frames 0 and 1 each way are the auth
#: exchange; 2 is the hello, 3 the first QP's descriptor (QPInfo and MR descriptors)
RELAY_ATTACKS = {
    # a downgrade: the dialer's hello asks for an unkeyed checksum, so that payloads could be re-tagged
    "downgrade the checksum": ("dialer", 2, lambda f: [_rewrite(f, b'"checksum":"blake3"', b'"checksum":"xxh3"')]),
    # the victim's data connections sent through the relay (it rewrote the QPInfo so at 9323a13)
    "redirect the data connections": ("dialer", 3, lambda f: [_GID.sub(b'"gid":"127.0.0.1:9"', f, 1)]),
    "forge the acceptor's hello": ("acceptor", 2, lambda f: [_rewrite(f, b'"qps":', b'"qps":1,"x":')]),
    "replay the hello for the QPInfo": ("dialer", 3, None),  # (the relay sends frame 2 again: below)
    "strip the seal": ("dialer", 2, lambda f: [_reframe(f, f[relay_mod.HEADER.size:-16], kind=1)]),
    "drop the hello": ("dialer", 2, lambda f: []),
}


@pytest.mark.parametrize("attack", list(RELAY_ATTACKS))
def test_a_relay_on_the_path_cannot_alter_replay_or_drop_set_up_messages(secret, attack):
    """A relay between two parties (no secret) passes the proof through, then tampers with one bootstrap
    message: the connection fails on the side that reads it, naming what happened (a MAC that fails, or an
    unsealed message), nothing reaches the application, and the parties
    then exchange verified weights over the same (now honest) relay."""
    direction, index, act = RELAY_ATTACKS[attack]
    held = {}

    def tamper(d, i, frame):
        if d == direction and i == index - 1:
            held["previous"] = frame
        if (d, i) != (direction, index):
            return [frame]
        return [held["previous"]] if act is None else act(frame)

    with relay_mod.Relay(("127.0.0.1", 0), tamper) as relay:
        victim = Victim(cfg("fedrdma-e", secret), name=relay.address)
        try:
            host, _, port = victim.address.rpartition(":")
            relay.target = (host, int(port))
            # (a dropped hello: the next message arrives in its place and fails as number 0)
            match = "fails its MAC|is not sealed"
            with Endpoint(cfg("fedrdma-e", secret), name="client-a") as ep:
                with pytest.raises((E.PeerUnreachable, E.RemoteProtocolError, E.FateRdmaError)) as err:
                    ep.send(relay.address, b"weights" * 10000).result(30)
            deadline = time.monotonic() + 10  # (the victim lets go of what it reserved once it sees the dialer go)
            while (stats := victim.stats())["budget_held_bytes"] and time.monotonic() < deadline:
                time.sleep(0.05)
            why = str(err.value) if direction == "acceptor" else stats["last_refusal"]
            assert re.search(match, why), why
            assert stats["count"] == 0 and stats["budget_held_bytes"] == 0
            data = os.urandom(3 * CHUNK + 5)
            with Endpoint(cfg("fedrdma-e", secret), name="client-a") as ep:
                ep.send(relay.address, data, {"who": "client-a"}).result(30)
            (rec,) = victim.expect()
            assert rec["peer"] == "client-a" and rec["crc32c"] == crc32c.crc32c(data)
        finally:
            victim.close()


def _attach(gid: str, qpn: int, token: bytes) -> int:
    """A soft data connection's HELLO to QP `qpn` at NIC `gid` with `token`: the NIC's status (0: attached)."""
    from easypyverbs.providers.soft import wire

    host, _, port = gid.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 1, 0, 7, qpn, 0, 0, token, 0, 0, bytes(16)))
        return wire.HELLO_REPLY.unpack(wire.recv_exactly(s, wire.HELLO_REPLY.size))[3]


def test_a_relay_that_reads_the_set_up_cannot_attach_to_the_data_connections(secret):
    """A relay on the bootstrap's path reads the acceptor's QPInfo (sealed, not encrypted: its gid and QP
    number are readable) and races the dialer to the acceptor's data listener. Over a sealed bootstrap the
    QPInfo carries no attach token (both ends derive it from their session), so the relay's attach is
    refused and the dialer's own goes through, verified. (At 2fff137 the token was in the QPInfo: the relay
    took the QP and the party's connection failed.)"""
    from easypyverbs.providers.soft import wire

    tried = []

    def tamper(d, i, frame):
        head = relay_mod.HEADER.unpack(frame[:relay_mod.HEADER.size])
        body = frame[relay_mod.HEADER.size:]
        obj = json.loads(body[:-16] if head[2] == 2 else body)
        qp = obj.get("qp") if isinstance(obj, dict) else None
        if d == "acceptor" and isinstance(qp, dict) and not tried:
            token = bytes.fromhex(qp.get("token", "")).ljust(16, b"\0")
            tried.append((qp.get("token"), _attach(qp["gid"], qp["qpn"], token)))
        return [frame]

    with relay_mod.Relay(("127.0.0.1", 0), tamper) as relay:
        victim = Victim(cfg("fedrdma-e", secret), name=relay.address)
        try:
            host, _, port = victim.address.rpartition(":")
            relay.target = (host, int(port))
            data = os.urandom(3 * CHUNK + 5)
            with Endpoint(cfg("fedrdma-e", secret), name="client-a") as ep:
                ep.send(relay.address, data, {"who": "client-a"}).result(30)
            (rec,) = victim.expect()
            assert rec["peer"] == "client-a" and rec["crc32c"] == crc32c.crc32c(data)
            assert tried == [("", wire.HELLO_BAD_TOKEN)], tried
        finally:
            victim.close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_slot_key_granted_to_one_peer_is_refused_on_another_peers_queue_pair(secret, provider):
    """Each connection has its own protection domain: a party that learnt another party's slot key and address
    (from a CREDIT, say) and WRITEs with it from its own authenticated queue pair gets a remote access error,
    and the victim's slot keeps the bytes of the party it was granted to, which still transfers verified."""
    from .verbs_pair import require

    require(provider)
    c = cfg("fedrdma-e", secret, pool_slots=2, provider=provider)
    with Endpoint(c, name="victim") as victim, Endpoint(c, name="client-a") as a, \
            Endpoint(c, name="client-b") as b:
        victim.name = victim_addr = victim.address  # dialers check that the endpoint proves the address they dialed
        conn_a, conn_b = a.connect(victim_addr), b.connect(victim_addr)
        sniffed = conn_a.slot_sender.slot_mrs[0]  # a's grant: its rkey and address
        junk = conn_b.pd.reg_mr(bytearray(b"\xee" * 4096), ev.Access.LOCAL_WRITE)
        try:
            conn_b.rcs[0].qp.post_write(junk.sge(0, 4096), sniffed, remote_offset=conn_b.slot_sender.offer.offset_in_slot(0),
                                        wr_id=997)
            deadline = time.monotonic() + 10
            while conn_b.dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert conn_b.dead is not None and "REM_ACCESS_ERR" in str(conn_b.dead), conn_b.dead
        finally:
            junk.close()
        data = os.urandom(3 * CHUNK)
        a.send(victim_addr, data).result(20)
        msg = victim.recv(timeout=20)
        assert bytes(msg.view) == data and msg.peer == "client-a" and conn_a.dead is None
        msg.release()
