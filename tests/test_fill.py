"""A payload still being copied in while it goes (transfer.Fill): a buffered put's copy overlapped with
its transfer. The copy runs back to front; a chunk goes only once all of its bytes are final, the
checksum (from the copier's block digests where it took them) only once all are; a copy that fails
fails its transfers (none hangs, nothing is delivered)."""
from __future__ import annotations

import threading
import time

import crc32c
import numpy as np
import pytest

from fate_rdma import errors as E
from fate_rdma.channel import Endpoint
from fate_rdma.channel.buffers import GIL_COPY_BYTES, copy_into
from fate_rdma.channel.checksum import block_digest, from_blocks, payload_digest
from fate_rdma.channel.transfer import Fill
from fate_rdma.protocol.fedrdma_e import FedRdmaESender
from fate_rdma.protocol.integrity import BLOCK_BYTES, Integrity

from .test_channel import CHUNK, Peer, cfg_for
from .verbs_pair import require


def _rng(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("kind", ["crc32c", "xxh3"])
@pytest.mark.parametrize("total", [0, 1, BLOCK_BYTES - 1, BLOCK_BYTES, 2 * BLOCK_BYTES + 5])
def test_run_copies_back_to_front_with_the_payloads_block_digests(kind, total):
    src = _rng(total, total)
    cut = total // 3  # two sources, cut inside a block
    sources = [src[:cut], src[cut:]]
    fill, dest, seen = Fill(total, block_digest(kind)), np.zeros(max(total, 1), np.uint8), []
    fill.on_change(lambda: seen.append(fill.ready_from))
    done = []
    fill.when_done(lambda: done.append(True))
    fill.run(dest, sources, BLOCK_BYTES)
    assert bytes(dest[:total]) == bytes(src) and fill.done and fill.error is None and done == [True]
    assert seen == sorted(seen, reverse=True) and (not total or seen[-1] == 0)
    assert all(x % BLOCK_BYTES == 0 for x in seen)  # one advance per block, at its start
    assert from_blocks(kind, fill.digests) == payload_digest(Integrity(kind), [memoryview(src)])


def test_macs_and_none_take_no_block_digests():
    """blake2b and blake3 are keyed per connection: one copy's digests cannot serve every peer."""
    assert block_digest("blake2b") is None and block_digest("blake3") is None and block_digest("none") is None


def test_a_fill_goes_back_to_front_and_a_failure_finishes_it():
    fill = Fill(10)
    fill.advance(6)
    with pytest.raises(ValueError, match="back to front"):
        fill.advance(8)
    late = []
    fill.when_done(lambda: late.append(fill.error))
    fill.fail(RuntimeError("boom"))
    assert fill.done and isinstance(late[0], RuntimeError)


def test_run_fails_the_fill_on_a_bad_source():
    fill = Fill(8)
    with pytest.raises(ValueError):
        fill.run(np.zeros(8, np.uint8), [b"1234"], 4)  # 4 bytes of sources for a fill of 8
    assert fill.error is not None and fill.done


def test_the_sender_posts_only_chunks_whose_bytes_are_final():
    m = FedRdmaESender(1, 1, 0, 10 * CHUNK, CHUNK, window=64, now=0.0, slot_payload_bytes=1 << 30)
    m.ready_from = 10 * CHUNK
    assert m.next_chunks() == []
    m.ready_from = 7 * CHUNK + 1  # chunk 7 is not final yet
    assert [c.seq for c in m.next_chunks()] == [9, 8]
    m.ready_from = 0
    assert [c.seq for c in m.next_chunks()] == [7, 6, 5, 4, 3, 2, 1, 0]


def _slow_copier(fill: Fill, dest: np.ndarray, src: np.ndarray, step: int, fail_at: int = -1) -> threading.Thread:
    """Copy `src` into `dest` back to front, `step` bytes at a time with a pause before each: a chunk
    posted before its bytes are final would carry the zeros `dest` starts with."""

    def run() -> None:
        for lo in range(((src.nbytes - 1) // step) * step, -1, -step):
            time.sleep(0.01)
            if lo < fail_at:
                fill.fail(RuntimeError("source array went away"))
                return
            dest[lo:lo + step] = src[lo:lo + step]
            fill.advance(lo)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.fixture(params=["soft", "soft-tcp", "pyverbs"])
def provider(request):
    """As tests/test_channel.py's: pyverbs where a device is usable (rxe0 in the VM leg), else skipped."""
    require(request.param)
    return request.param


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
@pytest.mark.parametrize("checksum", ["crc32c", "xxh3", "none"])
def test_a_payload_copied_in_while_it_goes_arrives_whole(mode, provider, checksum):
    cfg = cfg_for(mode, provider, checksum=checksum)
    peer, ep = Peer(cfg), Endpoint(cfg)
    try:
        n = 10 * CHUNK + 7
        src, dest = _rng(n, 1), np.zeros(n, np.uint8)
        fill = Fill(n)
        fut = ep.send(peer.address, dest, {"i": 0}, fill)
        _slow_copier(fill, dest, src, CHUNK // 2).join()
        assert fut.result(30)["bytes"] == n
        (rec,) = peer.expect()
        assert rec["crc32c"] == crc32c.crc32c(src), "a chunk went before its bytes were final"
    finally:
        ep.close()
        peer.close()


@pytest.mark.parametrize("checksum", ["crc32c", "xxh3"])
def test_the_copiers_block_digests_make_the_checksum(provider, checksum, monkeypatch):
    import fate_rdma.channel.checksum as ck

    cfg = cfg_for("fedrdma-e", provider, checksum=checksum, slot_bytes=16 << 20)
    peer, ep = Peer(cfg), Endpoint(cfg)
    try:
        n = 2 * BLOCK_BYTES + 5
        src = _rng(n, 2)
        fills = []
        for i in range(2):  # the second with wrong block digests: the receiver must refuse it
            dest = np.zeros(n, np.uint8)
            digest = block_digest(checksum)
            if i:
                digest = (checksum, lambda b, block, f=digest[1]: (f(b, block) ^ 1) if checksum == "crc32c"
                          else bytes(reversed(f(b, block))))
            fill = Fill(n, digest)
            fills.append(fill)
            monkeypatch.setattr(ck, "payload_digest", lambda *a: pytest.fail("digested again, not from the blocks"))
            fut = ep.send(peer.address, dest, {"i": i}, fill)
            fill.run(dest, [src[:n // 3], src[n // 3:]], BLOCK_BYTES)
            if i:
                with pytest.raises(E.IntegrityError):
                    fut.result(30)
            else:
                fut.result(30)
        (rec,) = peer.expect()
        assert rec["crc32c"] == crc32c.crc32c(src) and rec["metadata"] == {"i": 0}
        assert len(fills[0].digests) == 3
    finally:
        ep.close()
        peer.close()


@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_a_copy_that_fails_fails_its_transfer_and_delivers_nothing(mode, provider):
    cfg = cfg_for(mode, provider)
    peer, ep = Peer(cfg), Endpoint(cfg)
    try:
        n = 10 * CHUNK
        src, dest = _rng(n, 3), np.zeros(n, np.uint8)
        fill = Fill(n)
        fut = ep.send(peer.address, dest, {"i": "failed"}, fill)
        _slow_copier(fill, dest, src, CHUNK, fail_at=5 * CHUNK).join()
        with pytest.raises(E.TransferCancelled, match="copy failed.*source array went away"):
            fut.result(30)
        ep.send(peer.address, src, {"i": "next"}).result(30)  # the connection goes on
        (rec,) = peer.expect()
        assert rec["metadata"] == {"i": "next"} and rec["crc32c"] == crc32c.crc32c(src)
    finally:
        ep.close()
        peer.close()


@pytest.mark.system  # runs the lab's bench transfer with its peer process
def test_bench_transfer_puts_rows_are_labelled_and_compared():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "transfer", "--payload-mib", "8", "--reps", "1",
                          "--scenarios", "loopback-tcp", "--methods", "fedrdma-e", "--windows", "auto",
                          "--puts", "copy,overlap", "--put-memory", "fresh"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    methods = {r["method"] for r in rows}
    assert {"fedrdma-e", "fedrdma-e put: copy, then send (fresh)", "fedrdma-e put: copy overlapped (fresh)"} <= methods
    assert all(r["emulated"] is True and r["seconds"] > 0 for r in rows)
    assert "loopback-tcp [soft provider: emulated verbs, not an RDMA figure]: a buffered put with its copy overlapped" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "bench", "transfer", "--puts", "later"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown scenario, method or put later" in bad.stdout + bad.stderr


def test_a_callback_that_raises_keeps_no_other_waiting_and_a_finished_fill_cannot_fail():
    fill, seen = Fill(4), []
    fill.on_change(lambda: 1 / 0)
    fill.when_done(lambda: seen.append("done"))
    fill.advance(0)
    assert seen == ["done"]
    fill.fail(RuntimeError("too late"))
    assert fill.error is None and fill.done


def test_run_takes_digests_only_in_the_checksums_blocks():
    fill = Fill(8, block_digest("crc32c"))
    with pytest.raises(ValueError, match="blocks of"):
        fill.run(np.zeros(8, np.uint8), [b"12345678"], 4)
    assert fill.error is not None


@pytest.mark.parametrize("n", [0, 1, GIL_COPY_BYTES - 1, GIL_COPY_BYTES, GIL_COPY_BYTES + 3])
def test_copy_into_places_pieces_below_and_above_the_gil_threshold(n):
    src, dest = _rng(n, n), np.full(n + 16, 0xAB, np.uint8)
    copy_into(dest, 7, memoryview(src))
    assert bytes(dest[7:7 + n]) == bytes(src) and set(dest[:7]) == {0xAB}
    assert set(dest[7 + n:]) == {0xAB}  # nothing past the piece


@pytest.mark.parametrize("shape", [(3, 5), (GIL_COPY_BYTES // 8 + 1,)])
def test_copy_into_takes_any_contiguous_buffer_and_refuses_one_past_the_end(shape):
    arr = np.random.default_rng(1).standard_normal(shape)  # float64, 2-D: memoryview format "d", not "B"
    dest = np.zeros(arr.nbytes + 8, np.uint8)
    copy_into(dest, 8, memoryview(arr))
    assert bytes(dest[8:]) == arr.tobytes()
    with pytest.raises((ValueError, TypeError)):
        copy_into(dest, 9, memoryview(arr))  # one byte past the end: an error, never a short copy
    with pytest.raises((ValueError, TypeError)):
        copy_into(dest, 0, memoryview(arr[:, ::2] if arr.ndim == 2 else arr[::2]))  # not contiguous


def test_a_fill_of_many_small_tensors_is_byte_exact():
    """A LoRA-like frame: tens of small pieces (each copied holding the GIL) and one large one."""
    rng = np.random.default_rng(2)
    sources = [rng.standard_normal(s) for s in [(4, 768), (2304, 4)] * 12 + [(GIL_COPY_BYTES // 8 + 7,)]]
    total = sum(a.nbytes for a in sources)
    fill, dest = Fill(total, block_digest("xxh3")), np.zeros(total, np.uint8)
    fill.run(dest, sources, BLOCK_BYTES)
    want = b"".join(a.tobytes() for a in sources)
    assert bytes(dest) == want and fill.done and fill.error is None
    assert from_blocks("xxh3", fill.digests) == payload_digest(Integrity("xxh3"), [memoryview(want)])
