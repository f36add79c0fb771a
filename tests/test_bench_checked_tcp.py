"""checked_tcp: raw TCP with the channel's block-wise check, the baseline that prices the check."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from fate_rdma_lab.bench import checked_tcp
from fate_rdma.protocol.integrity import BLOCK_BYTES


def _stream(payload: memoryview, kind: str) -> bytes:
    """What checked_tcp.send puts on the wire for `payload`."""
    a, b = socket.socketpair()
    got = bytearray()

    def drain() -> None:
        while True:
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    t = threading.Thread(target=drain)
    t.start()
    checked_tcp.send(a, payload, kind)
    a.close()
    t.join(10)
    b.close()
    return bytes(got)


def _receive(wire: bytes, nbytes: int, kind: str):
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: (a.sendall(wire), a.close()))
    t.start()
    out = bytearray(nbytes)
    try:
        return checked_tcp.receive(b, memoryview(out), kind), bytes(out)
    finally:
        t.join(10)
        b.close()


@pytest.mark.parametrize("kind", ["xxh3", "crc32c", "blake2b"])
def test_a_payload_arrives_whole_and_checked(kind):
    n = 2 * BLOCK_BYTES + 12345  # two whole blocks and a short last one, pieces of every length
    payload = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    wire = _stream(memoryview(payload), kind)
    digest = {"xxh3": 16, "crc32c": 4, "blake2b": 32}[kind]
    assert len(wire) == n + 4 + 3 * digest
    error, got = _receive(wire, n, kind)
    assert error is None and got == payload.tobytes()


def test_a_byte_changed_on_the_way_is_named_with_its_block():
    n = 3 * BLOCK_BYTES
    payload = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    wire = bytearray(_stream(memoryview(payload), "xxh3"))
    wire[BLOCK_BYTES + 77] ^= 0x40  # a flipped bit in block 1
    error, _ = _receive(bytes(wire), n, "xxh3")
    assert error == "xxh3 digest of block 1 differs: the payload arrived corrupted"


def test_digests_of_the_wrong_length_are_refused():
    n = BLOCK_BYTES
    wire = bytearray(_stream(memoryview(bytes(n)), "xxh3"))
    error, _ = _receive(bytes(wire[:n]) + (20).to_bytes(4, "big") + bytes(20), n, "xxh3")
    assert error == "the sender's digests are 20 bytes, 16 expected for 1 blocks"


def test_checks_without_block_digests_are_refused_by_name():
    with socket.socket() as s, pytest.raises(ValueError, match="checksum 'none' has no block-wise digests"):
        checked_tcp.send(s, memoryview(b"x"), "none")
