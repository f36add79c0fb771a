"""checked_shm: the same host's cheapest move (one copy out of the sender's shared memory), plain and with the
channel's check, between two real processes (the bench's driver and its peer)."""
from __future__ import annotations

import numpy as np
import pytest

from easypyverbs.buffers import shared_array
from easypyverbs.providers.soft import shm
from fate_rdma_lab.bench import baselines, checked_shm
from fate_rdma_lab.bench.driver import PeerProcess, RawTcp
from fate_rdma.protocol.integrity import BLOCK_BYTES

pytestmark = pytest.mark.skipif(not shm.works(), reason="shared regions (memfd, pidfd_getfd) do not work here")


@pytest.fixture(scope="module")
def link():
    with PeerProcess(module="fate_rdma_lab.bench.transfer_peer") as peer:
        raw = RawTcp(peer)
        try:
            yield raw
        finally:
            raw.close()


def _payload(n: int) -> np.ndarray:
    data = shared_array(n)
    data[:] = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    return data


def test_a_copy_arrives_plain_and_checked(link):
    data = _payload(2 * BLOCK_BYTES + 12345)  # two whole blocks and a short last one, split over the copy threads
    region = checked_shm.sender_region(data)
    assert region is not None and checked_shm.sender_region(np.ones(16, dtype=np.uint8)) is None
    for check in (None, "xxh3", "crc32c"):
        assert baselines.shm_copy(link, data, region, check)() > 0
    # the peer copied exactly these bytes: a checked copy compares its own digests with the sender's
    assert link.peer.cmd({"cmd": "cpu"})["ok"]


def test_digests_that_differ_from_what_was_copied_are_named_with_their_block(link, monkeypatch):
    data = _payload(3 * BLOCK_BYTES)
    other = data.copy()
    other[BLOCK_BYTES + 77] ^= 0x40  # what the sender digests is not what the peer copied: block 1 differs
    real = checked_shm.send_digests
    monkeypatch.setattr(checked_shm, "send_digests", lambda sock, payload, kind: real(sock, memoryview(other), kind))
    with pytest.raises(RuntimeError, match="same-host copy failed: xxh3 digest of block 1 differs: the payload "
                                           "arrived corrupted"):
        baselines.shm_copy(link, data, checked_shm.sender_region(data), "xxh3")()
    monkeypatch.setattr(checked_shm, "send_digests", real)
    assert baselines.shm_copy(link, data, checked_shm.sender_region(data), "xxh3")() > 0  # the link is still good


def test_a_region_that_is_not_the_one_named_is_refused_and_the_link_stays_usable(link):
    data = _payload(BLOCK_BYTES)
    fd, ino, base, size = checked_shm.sender_region(data)
    with pytest.raises(RuntimeError, match="same-host copy refused"):
        baselines.shm_copy(link, data, [fd, ino + 1, base, size], None)()  # another inode than the fd's
    with pytest.raises(RuntimeError, match="same-host copy refused: the payload is not inside the region named"):
        baselines.shm_copy(link, data[: BLOCK_BYTES // 2], [fd, ino, base + BLOCK_BYTES // 2, size], None)()
    fresh = _payload(BLOCK_BYTES)  # (the peer keeps one mapping per file, of the region first named: a new one)
    assert baselines.shm_copy(link, fresh, checked_shm.sender_region(fresh), "xxh3")() > 0
