"""The channel across two processes, in both modes: sizes, limits, integrity, cancellation, peer death,
and three concurrent senders to one receiver.

Every test that moves data runs on each provider: soft always, pyverbs where an RDMA device exists
(skipped with the reason elsewhere; on rxe0 in the qemu VM with `make test-rdma`). Cancel and
peer-death tests need a transfer still in flight when they act: on soft the link model slows it
(`soft_link`), on a real device the sender paces its chunks (`slow_transfer`)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
import time

import crc32c
import numpy as np
import pytest

import easypyverbs as ev
from fate_rdma import errors as E
from fate_rdma_lab.bench.driver import PeerProcess
from fate_rdma.channel import Endpoint
from fate_rdma.config import ChannelConfig

from .conftest import require_same_host
from .verbs_pair import require

CHUNK = 64 * 1024
MODES = ["fedrdma", "fedrdma-e"]
PROVIDERS = ["soft", "soft-tcp", "pyverbs"]  # as cfg_for names them
#: on a real device nothing slows the wire: the sender waits this long before posting each chunk, so a
#: 3 MiB transfer of 64 KiB chunks lasts about 1 s wherever it runs (a fast NIC, rxe in an emulated VM)
PACE_PER_CHUNK_S = 0.02


def wait_for(pred, timeout_s: float, what: str) -> None:
    """Poll `pred` until it holds; fail the test naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


_SECRETS: list = []


def keyed_secret() -> str:
    """A federation secret for endpoints of this process whose checksum is a MAC (blake3, blake2b: keyed by the
    session key an authenticated connection derives): one per test session, removed at exit."""
    if not _SECRETS:
        import atexit
        import shutil
        import tempfile

        from fate_rdma.channel.auth import write_secret

        folder = tempfile.mkdtemp(prefix="fate-rdma-test-secret-")
        atexit.register(shutil.rmtree, folder, True)
        _SECRETS.append(os.path.join(folder, "secret"))
        write_secret(_SECRETS[0])
    return _SECRETS[0]


def cfg_for(mode: str, provider: str = "soft", **kw) -> ChannelConfig:
    """provider "soft" (same-host path between these processes), "soft-tcp" (that path off: TCP, as
    between hosts) or "pyverbs". FedRDMA-E slots start at one chunk, so most transfers here grow them.
    Same-host and soft-TCP FedRDMA-E keep CHUNK too (same_host_chunk_bytes, tcp_chunk_bytes 0), so every leg
    cuts payloads alike (their larger chunks: test_same_host.py)."""
    base = dict(mode=mode, chunk_bytes=CHUNK, slot_bytes=1 << 20, slot_initial_bytes=CHUNK, provider=provider,
                window=4, no_progress_timeout_s=10, connect_timeout_s=10, same_host_chunk_bytes=0,
                tcp_chunk_bytes=0)
    if provider == "soft-tcp":
        base.update(provider="soft", same_host=False)
    if kw.get("checksum") in ("blake3", "blake2b") and not kw.get("secret_file"):
        base["secret_file"] = keyed_secret()
    base.update(kw)
    return ChannelConfig(**base)


def slow_transfer(provider: str, monkeypatch, **kw) -> dict:
    """Config keywords for a transfer that stays in flight for a while: the soft provider's link model
    (rate=50mbit) over TCP, or, on the same-host path and on a real device, this process pacing its
    own chunk posts."""
    if provider == "soft-tcp":
        return dict(kw, soft_link="rate=50mbit")
    from fate_rdma.channel.engine import Engine

    post_data = Engine.post_data

    def paced(self, *a, **k):
        time.sleep(PACE_PER_CHUNK_S)  # on the connection's own thread: its next chunk waits too
        return post_data(self, *a, **k)

    monkeypatch.setattr(Engine, "post_data", paced)
    return kw


class Peer:
    """A receiving endpoint in another process that records what it got."""

    def __init__(self, cfg: ChannelConfig) -> None:
        self.proc = PeerProcess(module="fate_rdma_lab.bench.transfer_peer")
        self.address = self.proc.cmd({"cmd": "endpoint", "config": dict(cfg.__dict__), "record": True})["address"]
        self.count = 0

    def expect(self, n: int = 1, timeout_s: float = 30):
        self.count += n
        return self.proc.cmd({"cmd": "expect", "count": self.count, "timeout_s": timeout_s})["records"]

    def close(self) -> None:
        self.proc.close()


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


@pytest.fixture(params=PROVIDERS)
def provider(request):
    require(request.param)  # pyverbs: skipped, with the reason, where no RDMA device is usable
    if request.param == "soft":
        require_same_host()  # (else this leg would quietly repeat soft-tcp's)
    return request.param


@pytest.fixture
def pair(mode, provider):
    cfg = cfg_for(mode, provider)
    peer = Peer(cfg)
    ep = Endpoint(cfg)
    yield ep, peer
    ep.close()
    peer.close()


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 10 * CHUNK + 7])
def test_sizes(pair, size):
    ep, peer = pair
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    info = ep.send(peer.address, data, {"name": "w", "size": size}).result(30)
    (rec,) = peer.expect()
    assert rec["nbytes"] == size and rec["crc32c"] == crc32c.crc32c(data)
    assert rec["metadata"] == {"name": "w", "size": size}
    assert info["bytes"] == size and info["chunks"] >= max(1, -(-size // CHUNK))


def test_scatter_gather_and_reuse(pair):
    ep, peer = pair
    parts = [b"head", bytearray(b"x" * (3 * CHUNK + 5)), memoryview(b"tail" * 100), np.arange(1000, dtype=np.float64)]
    whole = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    for i in range(3):  # the connection is reused
        ep.send(peer.address, parts, {"i": i}).result(30)
    recs = peer.expect(3)
    assert [r["metadata"]["i"] for r in recs] == [0, 1, 2]
    assert all(r["crc32c"] == crc32c.crc32c(whole) for r in recs)
    assert len(ep.peers()) == 1


def test_payload_larger_than_a_slot(provider):
    cfg = cfg_for("fedrdma-e", provider, slot_bytes=CHUNK * 2)
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            fut = ep.send(peer.address, bytes(CHUNK * 2 + 1))
            with pytest.raises(E.PayloadTooLarge, match="receive slot"):
                fut.result(10)
            ep.send(peer.address, b"still fine").result(10)  # the connection survives
            assert peer.expect()[0]["nbytes"] == 10
    finally:
        peer.close()


def test_too_large_falls_back_to_fedrdma_when_configured(provider):
    cfg = cfg_for("fedrdma-e", provider, slot_bytes=CHUNK, too_large="fedrdma")
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            data = os.urandom(5 * CHUNK)
            assert ep.send(peer.address, data).result(30)["mode"] == "fedrdma"
            rec = peer.expect()[0]
            assert rec["mode"] == "fedrdma" and rec["crc32c"] == crc32c.crc32c(data)
    finally:
        peer.close()


def test_corrupted_transfer_is_detected(pair, monkeypatch):
    _corrupted_transfer_is_detected(*pair, monkeypatch)  # the default checksum (xxh3)


def test_corrupted_transfer_is_detected_under_crc32c(mode, provider, monkeypatch):
    cfg = cfg_for(mode, provider, checksum="crc32c")
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            _corrupted_transfer_is_detected(ep, peer, monkeypatch)
    finally:
        peer.close()


def _corrupted_transfer_is_detected(ep, peer, monkeypatch):
    import concurrent.futures

    import fate_rdma.channel.connection as conn_mod
    import fate_rdma.channel.fedrdma as staged_mod

    class Corrupting:  # the sender computes wrong checksums: as if bytes changed on the way
        @staticmethod
        def crc32c(data, value=0):
            return (crc32c.crc32c(data, value) + 1) & 0xFFFFFFFF

    real_async, real_digest = conn_mod.payload_checksum_async, staged_mod.payload_digest

    def flip(digest):  # crc32c: an int; xxh3 (the default), blake2b: bytes
        return digest ^ 0x5A5A if isinstance(digest, int) else bytes([digest[0] ^ 1]) + digest[1:]

    def bad_async(views, *rest):
        f = real_async(views, *rest)
        out = concurrent.futures.Future()
        f.add_done_callback(lambda g: out.set_result(flip(g.result())))
        return out

    monkeypatch.setattr(staged_mod, "crc32c", Corrupting)
    monkeypatch.setattr(staged_mod, "payload_digest", lambda *a: flip(real_digest(*a)))
    monkeypatch.setattr(conn_mod, "payload_checksum_async", bad_async)
    fut = ep.send(peer.address, os.urandom(3 * CHUNK))
    with pytest.raises(E.IntegrityError, match="refused"):
        fut.result(20)
    monkeypatch.undo()
    ep.send(peer.address, b"ok").result(10)
    assert peer.expect()[0]["nbytes"] == 2  # the corrupted one was never delivered


def test_cancel_mid_transfer(mode, provider, monkeypatch):
    cfg = cfg_for(mode, provider, **slow_transfer(provider, monkeypatch, window=2, slot_bytes=4 << 20))
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            fut = ep.send(peer.address, bytes(3 << 20))  # about 0.5 s on the emulated link, 1 s paced
            wait_for(lambda: fut.progress_bytes > 0, 20, "progress of the transfer")
            assert fut.cancel()
            with pytest.raises(E.TransferCancelled, match="cancelled by sender"):
                fut.result(10)
            ep.send(peer.address, b"after").result(20)
            recs = peer.expect()
            assert recs[0]["nbytes"] == 5  # the cancelled payload was never delivered
    finally:
        peer.close()


@pytest.mark.system  # a peer process is started and killed: about 10 s each
def test_peer_death_mid_transfer_errors_without_leaks(mode, provider, monkeypatch):
    """The peer's process dies: the transfer waits resume_window_s for it to come back, then fails naming it;
    a send meanwhile waits behind it and fails with it."""
    cfg = cfg_for(mode, provider, **slow_transfer(provider, monkeypatch, window=2, slot_bytes=8 << 20,
                                                  resume_window_s=2))
    peer = Peer(cfg)
    try:
        ep = Endpoint(cfg)
        fut = ep.send(peer.address, bytes(6 << 20))
        wait_for(lambda: fut.progress_bytes > 0, 20, "progress of the transfer")
        os.kill(peer.proc.proc.pid, signal.SIGKILL)
        with pytest.raises(E.PeerUnreachable, match="not back within resume_window_s"):  # not a hang
            fut.result(20)
        with pytest.raises(E.PeerUnreachable):
            ep.send(peer.address, b"x").result(10)
        ep.close()
        assert ev.live_resources() == []
    finally:
        peer.proc.proc.kill()
        peer.proc.proc.wait()
        peer.proc.conn.close()


def test_unreachable_peer_is_named(provider):
    cfg = cfg_for("fedrdma-e", provider, connect_timeout_s=0.5)
    with Endpoint(cfg) as ep:
        with pytest.raises(E.PeerUnreachable, match="127.0.0.1:9"):
            ep.send("127.0.0.1:9", b"x")


@contextlib.contextmanager
def closing_listener():
    """A listener that takes each connection and closes it before answering (as an endpoint at its cap of
    pending handshakes does); yields (address, list with one entry per connection taken)."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    taken: list = []

    def close_all():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            taken.append(1)
            c.close()

    acceptor = threading.Thread(target=close_all, daemon=True)
    acceptor.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}", taken
    finally:
        srv.shutdown(socket.SHUT_RDWR)  # (close alone leaves the accept blocked and the port listening)
        srv.close()
        acceptor.join(5)
        assert not acceptor.is_alive()


def test_a_peer_that_closes_every_handshake_is_retried_then_named_with_the_tries():
    """The dial is tried again within connect_timeout_s, then fails naming the address and how many
    connections the peer closed."""
    with closing_listener() as (addr, taken):
        with Endpoint(cfg_for("fedrdma-e", "soft", connect_timeout_s=1.0)) as ep:
            with pytest.raises(E.PeerUnreachable, match=rf"{addr}: .*(closed|lost).*\(attempt \d+, [\d.]+ s after the "
                                                        r"first; the peer closed the \d+ attempts before it during"):
                ep.connect(addr)
    assert len(taken) >= 3


def test_a_dial_retries_on_the_endpoints_policy_without_sleeping():
    """The dial's retry policy is the endpoint's (dial_retry): with a clock that moves only when the policy
    waits, a peer that closes every handshake is tried exactly once per pause within connect_timeout_s."""
    from easypyverbs.retry import Retry

    now = [0.0]
    waits: list = []

    def wait(s: float) -> None:
        waits.append(s)
        now[0] += s

    with closing_listener() as (addr, taken):
        with Endpoint(cfg_for("fedrdma-e", "soft", connect_timeout_s=1.0)) as ep:
            ep.dial_retry = lambda t: Retry(t, first_pause_s=0.2, max_pause_s=0.2, clock=lambda: now[0], sleep=wait)
            with pytest.raises(E.PeerUnreachable, match=rf"{addr}: .*(closed|lost)"):
                ep.connect(addr)
    assert waits == [0.2] * 4 and len(taken) == 5  # attempts at 0, 0.2, 0.4, 0.6, 0.8 of the 1 s


def test_three_concurrent_senders_progress_fairly(mode, provider):
    cfg = cfg_for(mode, provider)
    peer = Peer(cfg)
    eps = []
    try:
        eps += [Endpoint(cfg, name=f"client{i}") for i in range(3)]
        for e in eps:  # connected before the race starts: this tests the transfers' fairness, not connect times
            e.connect(peer.address)
        futs = []
        start = threading.Barrier(3)
        payload = bytes(16 * CHUNK)  # 1 MiB: each message takes longer to move than a thread takes to start

        def blast(i: int) -> None:
            start.wait(10)  # all three clients queue their sends together
            for k in range(6):
                futs.append(eps[i].send(peer.address, payload, {"client": i, "k": k}))

        threads = [threading.Thread(target=blast, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for f in futs:
            f.result(60)
        recs = peer.expect(18, timeout_s=60)
        order = [r["metadata"]["client"] for r in recs]
        assert sorted(order) == sorted([0, 1, 2] * 6)
        # no client starves: every client has a message among the first two thirds of the arrivals (a
        # stricter bound fails on a loaded 2-core machine, where one sender's thread can be held back)
        assert set(order[:12]) == {0, 1, 2}, f"arrival order by client: {order}"
        for i in range(3):  # and each client's messages arrive in the order it sent them
            assert [r["metadata"]["k"] for r in recs if r["metadata"]["client"] == i] == list(range(6))
    finally:
        for e in eps:
            e.close()
        peer.close()


def test_config_rejects_inconsistent_values():
    for kw, match in ((dict(mode="tcp"), "mode"), (dict(window=0), "window"), (dict(window=100, max_window=64), "exceeds"),
                      (dict(chunk_bytes=10), "chunk_bytes"), (dict(checksum="md5"), "checksum"),
                      (dict(provider="pyverbs", soft_link="rate=1gbit"), "soft_link"),
                      (dict(no_progress_timeout_s=10, transfer_timeout_s=5), "no_progress"),
                      (dict(slot_initial_bytes=-1), "slot_initial_bytes"), (dict(pool_idle_s=-1), "pool_idle_s"),
                      (dict(pool_idle_s="soon"), "pool_idle_s")):
        with pytest.raises(E.ConfigError, match=match):
            ChannelConfig(**kw)
    with pytest.raises(E.ConfigError, match="unknown key"):
        ChannelConfig.from_dict({"chunk": 1})


def test_yaml_config_loads(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("channel:\n  mode: fedrdma\n  chunk_bytes: 1048576\n  window: 8\n")
    c = ChannelConfig.from_yaml(str(p))
    assert (c.mode, c.chunk_bytes, c.window) == ("fedrdma", 1 << 20, 8)


def test_several_queue_pairs(mode, provider):
    cfg = cfg_for(mode, provider, qps_per_peer=3)
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            data = os.urandom(13 * CHUNK + 3)
            for _ in range(2):
                ep.send(peer.address, data).result(30)
            assert all(r["crc32c"] == crc32c.crc32c(data) for r in peer.expect(2))
            assert len(ep.connect(peer.address).rcs) == 3
    finally:
        peer.close()


@pytest.mark.parametrize("link, used", [(None, 1), ("rate=1gbit,rtt=20ms", 4)])
def test_auto_queue_pairs_follow_the_measured_path(link, used):
    """qps_per_peer auto stripes over four QPs where the RTT probe measured a long path (here the soft
    link model's 20 ms); to a peer on this host without a link model it sets up one (policy.one_host:
    no path to stripe over); every byte arrives either way."""
    cfg = cfg_for("fedrdma-e", "soft-tcp", qps_per_peer="auto", soft_link=link)
    peer = Peer(cfg)
    try:
        with Endpoint(cfg) as ep:
            data = os.urandom(9 * CHUNK + 5)
            ep.send(peer.address, data).result(30)
            assert [r["crc32c"] for r in peer.expect(1)] == [crc32c.crc32c(data)]
            conn = ep.connect(peer.address)
            assert len(conn.rcs) == used and conn.active_qps == used
    finally:
        peer.close()


def test_shipped_conf_files_load():
    import pathlib

    confs = sorted((pathlib.Path(__file__).parent.parent / "conf").glob("*.yaml"))
    assert confs
    import yaml

    from fate_rdma.federation.config import RdmaFederationConfig

    kinds = set()
    for p in confs:
        doc = yaml.safe_load(p.read_text()) or {}
        if "channel" in doc:
            kinds.add("channel")
            ChannelConfig.from_yaml(str(p))
        elif "fate_rdma" in doc:
            kinds.add("fate_rdma")
            cfg = RdmaFederationConfig.from_section(doc["fate_rdma"])
            assert cfg.endpoints, p.name
        else:
            pytest.fail(f"{p.name}: neither a channel nor a fate_rdma section")
    assert kinds == {"channel", "fate_rdma"}


def test_conf_channel_yaml_lists_every_default():
    """conf/channel.yaml says its values are the defaults: a changed default (same_host_chunk_bytes went 32 ->
    64 MiB with the file still saying 32) must change it too, and a new setting appear in it."""
    import dataclasses
    import pathlib

    import yaml

    doc = yaml.safe_load((pathlib.Path(__file__).parent.parent / "conf" / "channel.yaml").read_text())["channel"]
    defaults = {f.name: f.default for f in dataclasses.fields(ChannelConfig)}  # (as written: checksum auto)
    assert sorted(doc) == sorted(defaults)
    assert {k: v for k, v in doc.items() if defaults[k] != v} == {}


BIG = 10 << 20  # above the 4 MiB checksum block: the whole-payload checksum runs on the block pool


def big_cfg(mode: str, provider: str) -> ChannelConfig:
    return cfg_for(mode, provider, chunk_bytes=1 << 20, slot_bytes=16 << 20, window=8)


def test_concurrent_checksums_never_wait_on_each_other():
    """Whole-payload checksums started together (an arbiter sending to several clients) all finish:
    more of them than the pool has workers, each larger than one block."""
    import concurrent.futures

    from fate_rdma.channel.checksum import payload_checksum, payload_checksum_async
    from fate_rdma.protocol.integrity import Integrity

    data = memoryview(np.random.default_rng(1).integers(0, 256, 16 << 20, dtype=np.uint8)).cast("B")
    expect = payload_checksum([data])
    futs = [payload_checksum_async([data], Integrity("crc32c")) for _ in range(8)]
    done, pending = concurrent.futures.wait(futs, timeout=60)
    assert not pending, "checksums deadlocked on their own pool"
    assert {f.result() for f in done} == {expect}


@pytest.mark.system  # 4 x tens of MiB to three receivers at once: seconds each
def test_large_payloads_at_once_one_to_several(mode, provider):
    cfg = big_cfg(mode, provider)
    peers = [Peer(cfg) for _ in range(3)]
    try:
        with Endpoint(cfg) as ep:
            payloads = [np.random.default_rng(i).integers(0, 256, BIG + i, dtype=np.uint8) for i in range(3)]
            futs = [ep.send(p.address, d, {"i": i}) for i, (p, d) in enumerate(zip(peers, payloads))]
            for f in futs:
                f.result(60)
            for i, p in enumerate(peers):
                (rec,) = p.expect(timeout_s=60)
                assert rec["nbytes"] == BIG + i and rec["crc32c"] == crc32c.crc32c(payloads[i])
    finally:
        for p in peers:
            p.close()


def test_large_payloads_at_once_several_to_one(mode, provider):
    cfg = big_cfg(mode, provider)
    peer = Peer(cfg)
    eps = []
    try:
        eps += [Endpoint(cfg, name=f"client{i}") for i in range(3)]
        payloads = [np.random.default_rng(10 + i).integers(0, 256, BIG + i, dtype=np.uint8) for i in range(3)]
        futs = [None] * 3

        def send(i: int) -> None:
            futs[i] = eps[i].send(peer.address, payloads[i], {"client": i})

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for f in futs:
            f.result(60)
        recs = peer.expect(3, timeout_s=60)
        got = {r["metadata"]["client"]: r for r in recs}
        for i in range(3):
            assert got[i]["nbytes"] == BIG + i and got[i]["crc32c"] == crc32c.crc32c(payloads[i])
    finally:
        for e in eps:
            e.close()
        peer.close()



def test_two_endpoints_dialing_each_other_at_once_lose_nothing():
    """Both ends send first, at the same moment: each dials the other, each accepts the other's
    connection. Neither connection may be closed under the transfer riding on it (an accepted
    connection used to replace the one dialed, and both sides did that at once)."""
    cfg = cfg_for("fedrdma-e", "soft-tcp", slot_bytes=8 << 20)
    data = np.random.default_rng(9).integers(0, 256, 3 << 20, dtype=np.uint8)
    for attempt in range(5):
        a, b = Endpoint(cfg), Endpoint(cfg)
        try:
            go = threading.Barrier(2)

            def send(src, dst):
                go.wait()
                return src.send(dst.address, data, {"from": src.address}).result(30)

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                futs = [pool.submit(send, a, b), pool.submit(send, b, a)]
                infos = [f.result(60) for f in futs]
            assert all(i["bytes"] == data.nbytes for i in infos)
            for ep, other in ((a, b), (b, a)):
                msg = ep.recv(timeout=30)
                assert msg.metadata == {"from": other.address} and crc32c.crc32c(msg.view) == crc32c.crc32c(data)
                msg.release()
            # and afterwards both directions still work, over whichever connections were kept
            a.send(b.address, b"after", {}).result(30)
            b.send(a.address, b"after", {}).result(30)
            assert bytes(a.recv(timeout=30).detach()) == bytes(b.recv(timeout=30).detach()) == b"after"
        finally:
            a.close()
            b.close()


def test_a_dial_that_finishes_after_the_peers_dial_was_accepted_keeps_both(monkeypatch):
    """The other ordering of a simultaneous dial: while A's own dial to B authenticates, A accepts B's
    dial. A keeps the accepted connection as the first and its own as the spare (none untracked, none
    closed), and when the first ends the spare takes over without a new dial."""
    from fate_rdma.channel import dialer as dialer_mod

    cfg = cfg_for("fedrdma-e", "soft-tcp", slot_bytes=1 << 20)
    a, b = Endpoint(cfg), Endpoint(cfg)
    real = dialer_mod.authenticate
    try:
        def dial_after_peer(boot, name, secret, dialer, **kw):
            if dialer and name == a.name:  # B's dial to A completes in the middle of A's dial to B
                b.connect(a.address)
                wait_for(lambda: a._conns.get(b.address) is not None, 10, "A to accept B's dial")
            return real(boot, name, secret, dialer=dialer, **kw)

        monkeypatch.setattr(dialer_mod, "authenticate", dial_after_peer)
        got = a.connect(b.address)
        monkeypatch.setattr(dialer_mod, "authenticate", real)
        accepted, spare = a._conns[b.address], a._extra.get(b.address)
        assert got is accepted and spare is not None and spare is not accepted
        assert accepted.dead is None and spare.dead is None
        assert len(a._all_conns()) == 2
        a.send(b.address, b"on the first", {}).result(30)
        assert bytes(b.recv(timeout=30).detach()) == b"on the first"
        accepted.close()
        wait_for(lambda: a._conns.get(b.address) is spare, 10, "the spare to take over")
        assert a.connect(b.address) is spare
        a.send(b.address, b"on the spare", {}).result(30)
        assert bytes(b.recv(timeout=30).detach()) == b"on the spare"
    finally:
        a.close()
        b.close()
