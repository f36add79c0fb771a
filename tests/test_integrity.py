"""Integrity under the receiver's rule: the BLAKE2b tag's layout and coverage (hypothesis), the
session key, checksum agreement at connect, and real endpoints of both modes whose transfers a man
in the middle alters in the receiver's memory before it checks them."""
from __future__ import annotations

import dataclasses
import os
import queue
import random
import threading

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fate_rdma import errors as E
from fate_rdma import protocol as P
from fate_rdma.channel import Endpoint
from fate_rdma.channel.auth import Identity, authenticate, mac_keys, session_key, write_secret
from fate_rdma.channel.checksum import integrities, payload_checksum, payload_digest, payload_leaves
from fate_rdma.protocol.hello import Hello, agree_checksum
from fate_rdma.config import ChannelConfig
from fate_rdma.protocol import integrity as I
from fate_rdma.protocol.frames import FLAG_CRC, FLAG_MAC, FLAG_XXH, HEADER_FIELDS_BYTES

KEY = bytes(range(32))
CHUNK = 64 * 1024
MODES = ["fedrdma", "fedrdma-e"]


def mac_header(kind=P.HeaderKind.SLOT, tid=7, seq=0, nchunks=1, offset=0, length=10, meta_len=0, total=10):
    return P.Header(kind, tid, seq, nchunks, offset, length, meta_len, total)


# -- the tag's layout ----------------------------------------------------------------------------------
def test_tag_sits_in_the_last_16_bytes_under_flag_mac():
    b2 = I.Integrity("blake2b", KEY)
    h = b2.seal(mac_header(meta_len=3), b"abc", b2.chunk_digest([memoryview(bytes(10))]))
    raw = P.encode_header(h)
    assert len(raw) == 64 and HEADER_FIELDS_BYTES == 48
    assert int.from_bytes(raw[4:6], "big") == FLAG_MAC and raw[48:] == h.tag and len(h.tag) == 16
    back = P.decode_header(raw)
    assert back == h and back.checksum == "blake2b" and back.crc == back.meta_crc == 0
    crc = I.Integrity("crc32c").seal(mac_header(), b"", 5)
    assert int.from_bytes(P.encode_header(crc)[4:6], "big") == FLAG_CRC and P.decode_header(P.encode_header(crc)).checksum == "crc32c"
    with pytest.raises(E.LocalProtocolError):
        P.encode_header(dataclasses.replace(h, has_crc=True))
    with pytest.raises(E.LocalProtocolError):
        P.encode_header(dataclasses.replace(h, tag=b"short"))


@pytest.mark.parametrize("offset,value,match", [
    (4, (FLAG_CRC | FLAG_MAC).to_bytes(2, "big"), "flags"), (4, (16).to_bytes(2, "big"), "flags"), (4, (FLAG_XXH | FLAG_MAC).to_bytes(2, "big"), "flags"),
    (6, b"\x00\x01", "reserved"), (60, b"\x00\x00\x00\x01", "reserved"),
])
def test_non_canonical_headers_are_refused(offset, value, match):
    raw = bytearray(P.encode_header(I.Integrity("crc32c").seal(mac_header(), b"", 5)))
    raw[offset:offset + len(value)] = value
    with pytest.raises(E.RemoteProtocolError, match=match):
        P.decode_header(bytes(raw))


@st.composite
def headers(draw):
    """Every header a sender may build: any kind, ids and sizes that decode, and each checksum."""
    n = draw(st.integers(1, 2**32 - 1))
    seq = draw(st.integers(0, n - 1))
    total = draw(st.integers(0, 2**50))
    offset = draw(st.integers(0, total))
    length = draw(st.integers(0, min(total - offset, 2**32 - 1)))
    which = draw(st.sampled_from(I.KINDS))
    crc, meta_crc = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**32 - 1))
    return P.Header(draw(st.sampled_from(list(P.HeaderKind))), draw(st.integers(0, 2**64 - 1)), seq, n, offset, length,
                    draw(st.integers(0, P.frames.MAX_META)) if seq == 0 else 0, total,
                    crc if which == "crc32c" else 0, meta_crc if which == "crc32c" else 0, which == "crc32c",
                    which == "blake2b",
                    draw(st.binary(min_size=16, max_size=16)) if which in ("blake2b", "xxh3", "blake3") else b"",
                    has_xxh=which == "xxh3", has_b3=which == "blake3")


@settings(max_examples=300, deadline=None)
@given(headers())
def test_header_encoding_is_canonical(h):
    raw = P.encode_header(h)
    assert P.decode_header(raw) == h and P.encode_header(P.decode_header(raw)) == raw


def _one_bit_flipped_fails(integ: I.Integrity, payload: bytes, meta: bytes, data) -> None:
    """Seal a header with `integ`, flip one bit of header bytes 0..47 (where the result still decodes),
    of the metadata or of the payload: the tag no longer verifies."""
    h = integ.seal(mac_header(length=len(payload), total=len(payload), meta_len=len(meta)), meta,
                   integ.chunk_digest([memoryview(payload)]))
    raw = P.decode_header(P.encode_header(h))
    assert raw.checksum == integ.kind and integ.verify(raw, meta, integ.chunk_digest([memoryview(payload)]))
    where = data.draw(st.sampled_from(["header", "meta", "payload"] if meta else ["header", "payload"]))
    if where == "header" or not payload and where == "payload":
        buf = bytearray(P.encode_header(h))
        bit = data.draw(st.integers(0, HEADER_FIELDS_BYTES * 8 - 1))
        buf[bit // 8] ^= 1 << bit % 8
        try:
            forged = P.decode_header(bytes(buf))
        except E.RemoteProtocolError:
            return  # refused before any tag is computed
        assert not integ.verify(forged, meta[:forged.meta_len].ljust(forged.meta_len, b"\0"),
                                integ.chunk_digest([memoryview(payload)]))
        return
    target = bytearray(meta if where == "meta" else payload)
    bit = data.draw(st.integers(0, len(target) * 8 - 1))
    target[bit // 8] ^= 1 << bit % 8
    m, p = (bytes(target), payload) if where == "meta" else (meta, bytes(target))
    assert not integ.verify(raw, m, integ.chunk_digest([memoryview(p)]))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=40), st.data())
def test_tag_covers_every_header_field_metadata_and_payload_bit(payload, meta, data):
    """blake2b: one flipped bit anywhere and the tag no longer verifies. Nor does it under the other
    direction's key."""
    _one_bit_flipped_fails(I.Integrity("blake2b", KEY), payload, meta, data)
    h = mac_header(length=len(payload), total=len(payload), meta_len=len(meta))
    send, recv = mac_keys(KEY, dialer=True)
    assert not I.Integrity("blake2b", recv).verify(I.Integrity("blake2b", send).seal(h, meta, I.leaves(send, [memoryview(payload)])),
                                                   meta, I.leaves(recv, [memoryview(payload)]))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=40), st.data())
def test_xxh3_tag_covers_every_header_field_metadata_and_payload_bit(payload, meta, data):
    """xxh3 (against accidents, unkeyed): the same, with FLAG_XXH in the header."""
    _one_bit_flipped_fails(I.Integrity("xxh3"), payload, meta, data)
    h = I.Integrity("xxh3").seal(mac_header(), b"", I.xxh_leaves([memoryview(bytes(10))]))
    assert int.from_bytes(P.encode_header(h)[4:6], "big") == FLAG_XXH


def test_xxh3_leaves_are_positional_and_one_checksum_per_header():
    """Two blocks swapped give other leaves (each is seeded with its index); a header with two checksum
    flags is refused."""
    a, b = b"a" * I.BLOCK_BYTES, b"b" * I.BLOCK_BYTES
    assert I.xxh_leaves([memoryview(a + b)]) != I.xxh_leaves([memoryview(b + a)])
    raw = bytearray(P.encode_header(I.Integrity("xxh3").seal(mac_header(), b"", I.xxh_leaves([memoryview(bytes(10))]))))
    raw[4:6] = (FLAG_XXH | FLAG_CRC).to_bytes(2, "big")
    with pytest.raises(E.RemoteProtocolError, match="more than one checksum"):
        P.decode_header(bytes(raw))


@pytest.mark.parametrize("size", [0, 1, I.BLOCK_BYTES - 1, I.BLOCK_BYTES, I.BLOCK_BYTES + 1, 2 * I.BLOCK_BYTES + 77])
def test_parallel_xxh3_leaves_equal_the_sequential_definition(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    cuts = sorted(random.Random(size).sample(range(size + 1), min(3, size + 1)))
    views = [memoryview(data)[a:b] for a, b in zip([0] + cuts, cuts + [size])]
    want = b"".join(I.xxh_leaf(i, [memoryview(data)[o:o + I.BLOCK_BYTES]])
                    for i, o in enumerate(range(0, size, I.BLOCK_BYTES)))
    assert payload_digest(I.Integrity("xxh3"), views) == want and len(want) == 16 * -(-size // I.BLOCK_BYTES)


@pytest.mark.parametrize("size", [0, 1, I.BLOCK_BYTES - 1, I.BLOCK_BYTES, I.BLOCK_BYTES + 1, 2 * I.BLOCK_BYTES + 77])
def test_parallel_leaves_equal_the_sequential_definition(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    cuts = sorted(random.Random(size).sample(range(size + 1), min(3, size + 1)))
    views = [memoryview(data)[a:b] for a, b in zip([0] + cuts, cuts + [size])]
    want = I.leaves(KEY, [memoryview(data)])
    assert payload_leaves(views, KEY) == want and len(want) == 32 * -(-size // I.BLOCK_BYTES)
    assert payload_leaves([memoryview(data)], bytes(32)) != want or size == 0


# -- the receiver's rule --------------------------------------------------------------------------------
def test_receiver_refuses_any_other_checksum_naming_the_field():
    b2 = I.Integrity("blake2b", KEY)
    data = memoryview(bytes(range(10)))
    chunk = dict(kind=P.HeaderKind.CHUNK, total=10)
    for kind, match in (("crc32c", "'flags' says crc32c.*requires a BLAKE2b MAC"), ("none", "'flags' says no checksum")):
        r = P.FedRdmaReceiver(1000, integrity=b2)
        other = I.Integrity(kind)
        with pytest.raises(E.RemoteProtocolError, match=match):
            r.on_chunk(other.seal(mac_header(**chunk), b"", other.chunk_digest([data])), data, 0.0)
        rx = P.FedRdmaEReceiver(1, 100, integrity=b2)
        with pytest.raises(E.RemoteProtocolError, match=match):
            rx.on_write_imm(0, memoryview(P.encode_header(other.seal(mac_header(), b"", 1))))
        assert rx.held == set()
    r = P.FedRdmaReceiver(1000)  # crc32c: a MAC is not what it asked for either
    with pytest.raises(E.RemoteProtocolError, match="says a BLAKE2b MAC.*requires crc32c"):
        r.on_chunk(b2.seal(mac_header(**chunk), b"", b2.chunk_digest([data])), data, 0.0)


def test_fedrdma_chunk_altered_or_moved_is_refused():
    b2 = I.Integrity("blake2b", KEY)
    data = bytes(range(20))
    h = b2.seal(P.Header(P.HeaderKind.CHUNK, 1, 1, 3, 10, 10, 0, 30), b"", b2.chunk_digest([memoryview(data[10:])]))
    for forged, chunk in ((h, b"X" + data[11:]), (dataclasses.replace(h, offset=20), data[10:]),
                          (dataclasses.replace(h, transfer_id=2), data[10:]), (dataclasses.replace(h, seq=2), data[10:])):
        with pytest.raises(E.IntegrityError, match="blake2b mismatch"):
            P.FedRdmaReceiver(1000, integrity=b2).on_chunk(forged, memoryview(chunk), 0.0)
    assert P.FedRdmaReceiver(1000, integrity=b2).on_chunk(h, memoryview(data[10:]), 0.0).offset == 10


def test_fedrdma_e_slot_tag_and_replay():
    b2 = I.Integrity("blake2b", KEY)
    payload, meta = os.urandom(5000), b'{"n":1}'
    rx = P.FedRdmaEReceiver(1, 8192, meta_cap=64, integrity=b2)
    h = b2.seal(P.Header(P.HeaderKind.SLOT, 3, 0, 2, 0, 2500, len(meta), 5000), meta, I.leaves(KEY, [memoryview(payload)]))
    raw = P.encode_header(h)
    msg = rx.on_write_imm(0, memoryview(raw))
    rx.verify_tag(msg, meta, I.leaves(KEY, [memoryview(payload)]))
    rx.release(0)
    with pytest.raises(E.RemoteProtocolError, match="replay"):
        rx.on_write_imm(0, memoryview(raw))  # the same transfer written again by someone who recorded it
    h4 = b2.seal(dataclasses.replace(h, transfer_id=4), meta, I.leaves(KEY, [memoryview(payload)]))
    msg = rx.on_write_imm(0, memoryview(P.encode_header(h4)))
    with pytest.raises(E.IntegrityError, match="blake2b mismatch"):
        rx.verify_tag(msg, b'{"n":2}', I.leaves(KEY, [memoryview(payload)]))
    assert rx.held == set()


def test_replay_window_forgets_old_ids_but_refuses_them():
    rx = P.FedRdmaEReceiver(1, 100, verify_crc=False)
    raw = lambda tid: memoryview(P.encode_header(mac_header(tid=tid)))  # noqa: E731
    for tid in range(1, P.fedrdma_e.REPLAY_WINDOW + 10):
        rx.unchecked(rx.on_write_imm(0, raw(tid)))
        rx.release(0)
    with pytest.raises(E.RemoteProtocolError, match="replay"):
        rx.on_write_imm(0, raw(3))
    assert len(rx._seen) == P.fedrdma_e.REPLAY_WINDOW


# -- the session key and agreement at connect ------------------------------------------------------------
class FakeBoot:
    def __init__(self, inbox, outbox):
        self.inbox, self.outbox, self.peer = inbox, outbox, ("127.0.0.1", 1)

    def send(self, obj, timeout_s=None):
        self.outbox.put(obj)

    def recv(self, timeout_s=None):
        return self.inbox.get(timeout=timeout_s)

    def exchange(self, obj, timeout_s=None):
        self.send(obj)
        return self.recv(timeout_s)


def handshake(secret_a: bytes, secret_b: bytes):
    ab, ba = queue.Queue(), queue.Queue()
    out = {}

    def side(name, secret, dialer, inbox, outbox):
        try:
            out[name] = authenticate(FakeBoot(inbox, outbox), name, secret, dialer, 5)
        except E.FateRdmaError as exc:
            out[name] = exc

    ts = [threading.Thread(target=side, args=("a", secret_a, True, ba, ab)),
          threading.Thread(target=side, args=("b", secret_b, False, ab, ba))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    return out["a"], out["b"]


def test_session_key_is_shared_fresh_and_never_printed():
    secret = os.urandom(32)
    a, b = handshake(secret, secret)
    assert a.name == "b" and b.name == "a" and a.authenticated and b.authenticated
    assert a.session_key == b.session_key and len(a.session_key) == 32
    assert a.session_key.hex() not in repr(a) and "session_key" not in repr(a)
    assert handshake(secret, secret)[0].session_key != a.session_key  # fresh nonces, fresh key
    assert session_key(secret, "a", "b", b"1", b"2") != session_key(secret, "b", "a", b"1", b"2")
    (ia_send, ia_recv), (ib_send, ib_recv) = integrities("blake2b", a, True), integrities("blake2b", b, False)
    assert ia_send.key == ib_recv.key and ib_send.key == ia_recv.key and ia_send.key != ia_recv.key
    assert KEY.hex() not in repr(I.Integrity("blake2b", KEY))


def test_blake2b_needs_authentication():
    with pytest.raises(E.ConfigError, match=r"blake2b needs authenticated connections \(secret_file or tls\)"):
        ChannelConfig(checksum="blake2b")
    with pytest.raises(E.ConfigError, match="blake2b needs an authenticated connection"):
        integrities("blake2b", Identity("peer", False), True)


def test_checksum_agreement_at_connect():
    agree_checksum("blake2b", Hello("p", 1, checksum="blake2b"))
    agree_checksum("blake2b", Hello("p", 1))  # a peer that does not say: its frames meet the rule one by one
    with pytest.raises(E.ConfigError, match="p has checksum 'crc32c' and this side 'blake2b'"):
        agree_checksum("blake2b", Hello("p", 1, checksum="crc32c"))
    wire = Hello("p", 1, checksum="none").to_wire()
    assert Hello.from_wire(wire, "x").checksum == "none"
    with pytest.raises(E.RemoteProtocolError, match="field 'checksum'"):
        Hello.from_wire(dict(wire, checksum="md5"), "x")


# -- real endpoints ----------------------------------------------------------------------------------------
@pytest.fixture
def secret(tmp_path):
    path = str(tmp_path / "federation.secret")
    write_secret(path)
    return path


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def endpoints(mode, secret, checksum="blake2b"):
    c = ChannelConfig(mode=mode, chunk_bytes=CHUNK, slot_bytes=8 << 20, provider="soft", window=4, max_window=8,
                      connect_timeout_s=5, no_progress_timeout_s=10, secret_file=secret, checksum=checksum)
    rx, tx = Endpoint(c, name="receiver"), Endpoint(c, name="sender")
    rx.name = rx.address  # dialers check that the endpoint proves the address they dialed
    return rx, tx


@pytest.mark.parametrize("checksum", ["blake2b", "xxh3"])
def test_tagged_checksums_deliver_verified_payloads(mode, secret, checksum):
    rx, tx = endpoints(mode, secret, checksum)
    try:
        for size in (0, 1, 3 * CHUNK + 5, (5 << 20) + 3):  # the last spans two 4 MiB leaves
            data = os.urandom(size)
            info = tx.send(rx.address, data, {"size": size}).result(30)
            msg = rx.recv(timeout=30)
            assert info["mode"] == mode and msg.metadata == {"size": size} and bytes(msg.view) == data
            msg.release()
    finally:
        tx.close()
        rx.close()


def _tamper(view: memoryview, meta_cap: int, how: str, mode: str) -> None:
    """A man in the middle's changes to what arrived, before the receiver checks it."""
    h = P.decode_header(bytes(view[:64]))
    data = view[64 + meta_cap:64 + meta_cap + h.length if mode == "fedrdma" else 64 + meta_cap + h.total]
    if how in ("payload", "crc32c") and len(data):
        data[len(data) // 2] ^= 0xFF
    if how == "metadata" and h.meta_len:
        view[64] ^= 0x01
    if how == "nchunks":
        h = dataclasses.replace(h, nchunks=h.nchunks + 1)
    if how == "crc32c":  # recompute the checksum an attacker can compute
        digest = crc32c.crc32c(data) if mode == "fedrdma" else payload_checksum([data])
        h = I.Integrity("crc32c").seal(h, bytes(view[64:64 + h.meta_len]), digest)
    view[:64] = P.encode_header(h)


@pytest.mark.parametrize("checksum", ["blake2b", "xxh3", "crc32c"])
@pytest.mark.parametrize("how,error,match", [
    ("payload", E.IntegrityError, "{} mismatch"), ("metadata", E.IntegrityError, "{} mismatch"),
    ("nchunks", E.IntegrityError, "{} mismatch"), ("crc32c", E.RemoteProtocolError, "'flags' says crc32c"),
])
def test_altered_on_the_wire_is_refused(mode, secret, monkeypatch, how, error, match, checksum):
    """blake2b: what a man in the middle changes; xxh3 and crc32c: what an accident changes (the crc32c
    case: a header that carries a checksum other than the receiver's). The payload case of xxh3 and crc32c
    on FedRDMA-E alters a byte as it lands: there the blocks are digested as they are placed, not read
    again afterwards."""
    from fate_rdma.channel import fedrdma, fedrdma_e

    if how == "crc32c" and checksum == "crc32c":
        pytest.skip("a header resealed with crc32c is what a crc32c receiver expects (the accident model)")
    if how == "nchunks" and checksum == "crc32c":  # crc32c covers payload and metadata, not header fields
        if mode == "fedrdma-e":
            pytest.skip("FedRDMA-E's receiver never reads nchunks (one header, the payload placed whole)")
        error, match = E.RemoteProtocolError, "disagrees on size"  # FedRDMA's chunk headers must agree
    match = match.format(checksum)
    rx, tx = endpoints(mode, secret, checksum)
    armed = [True]
    flipped = []
    if mode == "fedrdma-e" and how == "payload" and checksum in I.BLOCKWISE:
        # the soft NIC digests a slot's blocks as its WRITEs place them (xxh3's accidents happen on the
        # way, not in the receiver's memory afterwards): alter a payload byte as it lands, before its digest
        from easypyverbs.providers.soft import landing

        placed = landing.Landing.landed

        def altered(self, at, nbytes):
            pos, view = self.offset + at, self.digests._view
            if armed[0] and not flipped and view is not None and pos >= self.digests.origin:
                view[pos + nbytes // 2] ^= 0xFF
                flipped.append(pos)
            return placed(self, at, nbytes)
        monkeypatch.setattr(landing.Landing, "landed", altered)
        how = "landed"
    if mode == "fedrdma-e":
        orig = fedrdma_e.SlotReceiver.on_write_imm

        def hooked(self, imm):
            slot = imm >> 16
            if armed[0]:
                _tamper(self.slots.view(slot), self.offer.meta_cap, how, mode)
            return orig(self, imm)
        monkeypatch.setattr(fedrdma_e.SlotReceiver, "on_write_imm", hooked)
    else:
        orig = fedrdma.StagedReceiver.on_chunk

        def hooked(self, st):
            view = self.staging_view(st)
            if armed[0] and P.decode_header(bytes(view[:64])).seq == 0:
                _tamper(view, self.offer.meta_cap, how, mode)
            return orig(self, st)
        monkeypatch.setattr(fedrdma.StagedReceiver, "on_chunk", hooked)
    try:
        fut = tx.send(rx.address, os.urandom(3 * CHUNK + 5), {"w": "weights"})
        with pytest.raises(error, match=match):
            fut.result(30)
        armed[0] = False
        assert bool(flipped) is (how == "landed")
        tx.send(rx.address, b"clean", {"n": 2}).result(30)  # the connection keeps working
        msg = rx.recv(timeout=30)
        assert bytes(msg.view) == b"clean"  # the altered transfer never reached the application
    finally:
        tx.close()
        rx.close()


def test_the_default_checksum_is_keyed_wherever_connections_are(tmp_path):
    """checksum auto: a MAC under the session key with a secret (or TLS), XXH3 without (loopback only)."""
    from fate_rdma.channel.auth import write_secret

    write_secret(str(tmp_path / "s"))
    assert ChannelConfig().checksum == "xxh3"
    assert ChannelConfig(secret_file=str(tmp_path / "s")).checksum == "blake3"
    assert ChannelConfig(secret_file=str(tmp_path / "s"), checksum="crc32c").checksum == "crc32c"
    with pytest.raises(E.ConfigError, match="integrity must be 'keyed' or 'unkeyed'"):
        ChannelConfig(integrity="maybe")


@pytest.mark.parametrize("checksum", ["xxh3", "crc32c", "none"])
def test_an_unkeyed_checksum_off_loopback_needs_the_sites_consent(tmp_path, caplog, checksum):
    """Listening off loopback with a secret, an unkeyed checksum (which a relay could recompute over altered
    weights) is refused at start, naming the setting that allows it; with integrity: unkeyed it starts, and
    says so in the log. On loopback it stays possible."""
    from fate_rdma.channel import Endpoint
    from fate_rdma.channel.auth import write_secret

    write_secret(str(tmp_path / "s"))
    base = dict(secret_file=str(tmp_path / "s"), checksum=checksum, provider="soft", shared_secret_only=True)
    with pytest.raises(E.ConfigError, match=f"checksum {checksum} is not keyed.*integrity: unkeyed"):
        Endpoint(ChannelConfig(**base), host="0.0.0.0")
    with Endpoint(ChannelConfig(**base, integrity="unkeyed"), host="0.0.0.0"):
        pass
    assert f"payloads: {checksum}, UNKEYED (integrity: unkeyed)" in caplog.text
    with Endpoint(ChannelConfig(**base), host="127.0.0.1"):
        pass
