"""FATE integration with real FATE 2.2 (standalone engine): interception, activation, fallback,
descriptor checks, and a three-party FedAvg-style job through FATE's launcher with and without
fate-rdma giving bitwise identical weights."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

fate = pytest.importorskip("fate.arch.federation", reason="FATE (pyfate) is not installed; make test installs it")

from fate_rdma import errors as E  # noqa: E402
from fate_rdma.federation import activate  # noqa: E402
from fate_rdma.federation import wrapper as wrapper_mod  # noqa: E402
from fate_rdma.federation.wrapper import DESC_MAGIC  # noqa: E402
from fate_rdma_lab.bench.local import free_ports  # noqa: E402

from .conftest import require_same_host  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUEST, HOST = ("guest", "9999"), ("host", "10000")


def free_port() -> int:
    return free_ports(1)[0]  # below the ephemeral range: not taken by an outgoing connection before it is bound


def section(endpoints, **kw):
    base = {"enabled": True, "mode": "fedrdma-e", "slot_bytes": 16 << 20, "provider": "soft", "threshold_bytes": 1 << 20,
            "endpoints": endpoints, "chunk_bytes": 1 << 20, "pull_timeout_s": 20,
            # the guest's first put dials the host party while that process may still be importing FATE (a
            # dial retries refused connections within connect_timeout_s): room for a slow, loaded machine
            "connect_timeout_s": 10}
    base.update(kw)
    return base


@pytest.fixture
def guest(tmp_path):
    """The guest in this process (standalone FATE) and the host in another, each under its own section."""
    from fate.arch.computing.backends.standalone import CSession
    from fate.arch.context import Context
    from fate.arch.federation import FederationBuilder

    made = []

    def build(sec, host_sec, fed_id, names="w"):
        host = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fate_party.py"), "--fed-id", fed_id,
                                 "--data-dir", str(tmp_path), "--section", json.dumps(host_sec), "--names", names],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        made.append([None, host])  # killed at the end even if building the guest's federation fails
        activate._explicit = sec
        activate.install()
        cs = CSession(session_id=f"{fed_id}_guest_9999", data_dir=str(tmp_path))
        fed = FederationBuilder(federation_session_id=fed_id, party=GUEST, parties=[GUEST, HOST]).build_standalone(cs)
        made[-1][0] = fed
        return Context(computing=cs, federation=fed), fed, host

    yield build
    activate._explicit = None
    for fed, host in made:
        if getattr(fed, "fate_rdma", None) is not None:
            fed.fate_rdma.close()
        if host.poll() is None:
            host.kill()
        try:  # the host's own account (its log), shown by pytest under the test's teardown when it failed
            out, err = host.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # (a second communicate after host_result's gives the same output)
            host.wait()
        else:
            print(f"host party (exit {host.returncode}), its stderr:\n{(err or '')[-4000:]}")


def host_result(host):
    out, err = host.communicate(timeout=90)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, err[-3000:]
    return json.loads(lines[-1])


def sha(obj):
    import hashlib
    import pickle

    return hashlib.sha256(pickle.dumps(obj)).hexdigest()


def endpoints():
    return {"guest:9999": f"127.0.0.1:{free_port()}", "host:10000": f"127.0.0.1:{free_port()}"}


def test_large_payload_goes_over_the_channel_small_stays_with_fate(guest):
    eps = endpoints()
    ctx, fed, host = guest(section(eps), section(eps), "s1", names="w,w2")
    big = [np.random.default_rng(0).standard_normal(500_000), np.arange(10)]
    small = {"flag": True, "w": np.ones(100)}
    ctx.hosts[0].put("w", big)
    ctx.hosts[0].put("w2", small)
    res = host_result(host)
    assert res.get("error") is None, res
    assert res["w"] == sha(big) and res["w2"] == sha(small)
    assert fed.fate_rdma.stats["rdma_transfers"] == 1 and fed.fate_rdma.stats["rdma_bytes"] > 4_000_000
    assert res["stats"]["rdma_transfers"] == 0  # the host only received


def test_tls_between_parties(guest, tmp_path):
    """tls: true at both parties, each with the certificate of its own party ("guest:9999"), each known
    to the other by its endpoint address: the federation's endpoints map the one to the other."""
    from fate_rdma.cli.tls import make_certificates

    pki = make_certificates(str(tmp_path / "pki"), ["guest:9999", "host:10000"])

    def tls(party):
        f = pki[party]
        return {"tls": True, "tls_cert": f.cert, "tls_key": f.key, "tls_ca": f.ca, "same_host": False}

    eps = endpoints()
    ctx, fed, host = guest(section(eps, **tls("guest:9999")), section(eps, **tls("host:10000")), "s-tls")
    big = [np.random.default_rng(5).standard_normal(500_000)]
    ctx.hosts[0].put("w", big)
    res = host_result(host)
    assert res.get("error") is None, res
    assert res["w"] == sha(big) and fed.fate_rdma.stats["rdma_transfers"] == 1
    assert fed.fate_rdma.endpoint.tls is not None


def test_no_configuration_no_effect(guest, monkeypatch):
    monkeypatch.delenv("FATE_RDMA_CONF", raising=False)
    ctx, fed, host = guest(None, None, "s2")
    assert getattr(fed, "fate_rdma", None) is None
    assert fed.get_default_max_message_size() == type(fed).get_default_max_message_size(fed)
    value = np.random.default_rng(2).standard_normal(300_000)  # FATE slices this itself
    ctx.hosts[0].put("w", value)
    res = host_result(host)
    assert res["w"] == sha(value) and res["stats"] is None


def test_disabled_section_no_effect(guest):
    ctx, fed, host = guest(section({"guest:9999": "127.0.0.1:1"}, enabled=False), None, "s3")
    assert getattr(fed, "fate_rdma", None) is None


def test_unreachable_peer_error_names_party_and_address(guest):
    eps = endpoints()
    dead = f"127.0.0.1:{free_port()}"
    ctx, fed, host = guest(section({**eps, "host:10000": dead}, connect_timeout_s=2), None, "s4")
    with pytest.raises(E.PeerUnreachable, match=f"host:10000 at {dead}"):
        ctx.hosts[0].put("w", np.zeros(300_000))


def test_fallback_to_fate_when_configured(guest, caplog):
    eps = endpoints()
    wrong = {**eps, "host:10000": f"127.0.0.1:{free_port()}"}  # the guest has a wrong address for the host
    ctx, fed, host = guest(section(wrong, fallback="fate", connect_timeout_s=2), section(eps), "s5")
    big = np.random.default_rng(1).standard_normal(400_000)
    ctx.hosts[0].put("w", big)
    res = host_result(host)
    assert res.get("error") is None and res["w"] == sha(big)
    assert fed.fate_rdma.stats["fate_fallbacks"] == 1 and fed.fate_rdma.stats["rdma_transfers"] == 0
    assert "sending through FATE's own federation" in caplog.text


def test_descriptor_checks(guest):
    ctx, fed, host = guest(section(endpoints()), None, "s6")
    shim = fed.fate_rdma
    shim._store.put("k1", b"abc")
    with pytest.raises(E.IntegrityError, match="3 bytes arrived, descriptor says 4"):
        shim._resolve(json.dumps({"id": "k1", "length": 4, "crc32c": 0}).encode(), GUEST, "w")
    shim._store.put("k2", b"abcd")
    with pytest.raises(E.IntegrityError, match="checksum"):
        shim._resolve(json.dumps({"id": "k2", "length": 4, "crc32c": 1}).encode(), GUEST, "w")
    with pytest.raises(E.IntegrityError, match="malformed"):
        shim._resolve(b"{not json", GUEST, "w")
    shim.cfg = shim.cfg.__class__(**{**shim.cfg.__dict__, "pull_timeout_s": 0.2})
    with pytest.raises(E.TransferTimeout, match="did not arrive"):
        shim._resolve(json.dumps({"id": "never", "length": 1, "crc32c": 0}).encode(), GUEST, "w")
    assert DESC_MAGIC[:1] not in (b"\x00", b"\x01")


def test_frame_descriptor_must_announce_a_frame(guest):
    ctx, fed, host = guest(section(endpoints()), None, "s7")
    shim = fed.fate_rdma
    import crc32c

    shim._store.put("k3", memoryview(b"not a frame at all"))
    desc = {"id": "k3", "length": 18, "crc32c": crc32c.crc32c(b"not a frame at all"), "frame": True}
    with pytest.raises(E.IntegrityError, match="announces an array frame"):
        shim._resolve(json.dumps(desc).encode(), GUEST, "w")


def test_osx_engine_wrapped(tmp_path):
    """FATE's OSX engine (gRPC to an OSX message queue; here the project's OSX-compatible test server)
    wrapped the same way: the weights go over the channel, the descriptor through OSX."""
    pytest.importorskip("fate.arch.federation.backends.osx.osx_pb2_grpc")
    import grpc
    from concurrent import futures

    from fate.arch.computing.backends.standalone import CSession
    from fate.arch.context import Context
    from fate.arch.federation import FederationBuilder
    from fate.arch.federation.backends.osx import osx_pb2, osx_pb2_grpc

    from .osx_server import make_servicer

    server = grpc.server(futures.ThreadPoolExecutor(8), options=[("grpc.max_receive_message_length", -1)])
    servicer = make_servicer(osx_pb2, osx_pb2_grpc)
    pushed = []
    orig_push = servicer.push
    servicer.push = lambda request, context: pushed.append(len(request.payload)) or orig_push(request, context)
    osx_pb2_grpc.add_PrivateTransferTransportServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    eps = endpoints()
    host = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fate_party.py"), "--fed-id", "o1",
                             "--data-dir", str(tmp_path), "--section", json.dumps(section(eps)), "--names", "w,w2",
                             "--osx", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        activate._explicit = section(eps)
        activate.install()
        cs = CSession(session_id="o1_guest_9999", data_dir=str(tmp_path))
        fed = FederationBuilder(federation_session_id="o1", party=GUEST, parties=[GUEST, HOST]).build_osx(cs, "127.0.0.1", port)
        assert type(fed).__name__ == "OSXFederation" and fed.fate_rdma is not None
        ctx = Context(computing=cs, federation=fed)
        big = [np.random.default_rng(3).standard_normal(400_000), np.arange(7)]
        small = {"round": 1}
        ctx.hosts[0].put("w", big)
        ctx.hosts[0].put("w2", small)
        res = host_result(host)
        assert res.get("error") is None, res
        assert res["w"] == sha(big) and res["w2"] == sha(small)
        assert fed.fate_rdma.stats["rdma_transfers"] == 1
        # through OSX went only the descriptor and the small object, never the 3.2 MB of weights
        assert pushed and sum(pushed) < 64 << 10
        fed.fate_rdma.close()
    finally:
        activate._explicit = None
        host.kill()
        server.stop(0)


def test_config_errors():
    from fate_rdma.federation.config import RdmaFederationConfig

    with pytest.raises(E.ConfigError, match="endpoints"):
        RdmaFederationConfig.from_section({"mode": "fedrdma"})
    with pytest.raises(E.ConfigError, match="bad entry"):
        RdmaFederationConfig.from_section({"endpoints": {"guest": "x"}})
    with pytest.raises(E.ConfigError, match="fallback"):
        RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}, "fallback": "maybe"})
    with pytest.raises(E.ConfigError, match="unknown key"):
        RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}, "chunk": 1})
    for key, bad in (("get_timeout_s", 0), ("get_timeout_s", "long"), ("pull_timeout_s", -1),
                     ("pull_timeout_s", float("inf")), ("get_timeout_s", float("nan")), ("get_timeout_s", 1e12)):
        with pytest.raises(E.ConfigError, match=f"{key} must be a positive number of seconds"):
            RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}, key: bad})
    assert RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}}).get_timeout_s == 86400
    cfg = RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}, "mode": "fedrdma", "window": 3})
    assert cfg.channel.mode == "fedrdma" and cfg.channel.window == 3
    with pytest.raises(E.ConfigError, match="no entry for party host:2"):
        cfg.address_of(("host", "2"))
    for bad in ("yes", 1, None):
        with pytest.raises(E.ConfigError, match="buffer_puts must be true, false or 'auto'"):
            RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}, "buffer_puts": bad})


def test_buffer_puts_auto_copies_a_put_whose_copy_costs_less_than_the_round_trip_or_a_transfer():
    from fate_rdma.federation.config import PUT_COPY_BYTES_PER_S, PUT_COPY_SMALL_BYTES, RdmaFederationConfig

    auto = RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}})
    assert auto.buffer_puts == "auto"
    mib18, rtt = 18 << 20, 0.020  # LoRA rank 32's upload over a 20 ms link: copied; rank 128's (72 MiB) not
    assert rtt * PUT_COPY_BYTES_PER_S > mib18 and auto.buffers_put(mib18, rtt) and not auto.buffers_put(72 << 20, rtt)
    # a small put is copied on any link (loopback, or no round trip measured yet): its copy costs less than a
    # transfer's fixed costs; one past PUT_COPY_SMALL_BYTES is not, without a round trip that pays for it
    assert auto.buffers_put(1 << 20, 0.0002) and auto.buffers_put(1, 0.0) and auto.buffers_put(PUT_COPY_SMALL_BYTES, 0.0)
    assert not auto.buffers_put(PUT_COPY_SMALL_BYTES + 1, 0.0002) and not auto.buffers_put(PUT_COPY_SMALL_BYTES + 1, 0.0)
    for value, want in ((True, True), (False, False)):
        cfg = RdmaFederationConfig.from_section({"endpoints": {"guest:1": "h:1"}, "buffer_puts": value})
        assert cfg.buffers_put(1 << 30, 0.0) is want and cfg.buffers_put(1, 10.0) is want


def _run_example(out, conf=None, params=600_000):
    cmd = [sys.executable, os.path.join(ROOT, "examples", "fedavg_weights", "fedavg.py")]
    if conf:
        cmd = [sys.executable, "-m", "fate_rdma.cli", "launch", "--conf", conf] + cmd[1:]
    cmd += ["--parties", "guest:9999", "host:10000", "arbiter:10000", "--log_level", "WARNING",
            "--out", str(out), "--params", str(params), "--rounds", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=str(out.parent))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return {r: json.load(open(os.path.join(out, f"{r}.json"))) for r in ("guest", "host", "arbiter")}


def test_three_party_job_bitwise_identical_with_and_without_fate_rdma(tmp_path):
    from fate_rdma.federation.hook import pth_path

    if not os.path.exists(pth_path()):
        pytest.skip("the start-up hook is not installed (make test runs `fate-rdma hook install`)")
    ports = [free_port() for _ in range(3)]
    conf = tmp_path / "fate_rdma.yaml"
    conf.write_text(json.dumps({"fate_rdma": section({"guest:9999": f"127.0.0.1:{ports[0]}",
                                                      "host:10000": f"127.0.0.1:{ports[1]}",
                                                      "arbiter:10000": f"127.0.0.1:{ports[2]}"}, slot_bytes=32 << 20)}))
    plain = _run_example(tmp_path / "plain")
    rdma = _run_example(tmp_path / "rdma", str(conf))
    for role in ("guest", "host", "arbiter"):
        assert plain[role]["sha256"] == rdma[role]["sha256"], role
        assert plain[role]["rdma"] is None
        assert rdma[role]["rdma"]["rdma_transfers"] >= 2 and rdma[role]["rdma"]["fate_fallbacks"] == 0
    assert plain["guest"]["sha256"] == plain["host"]["sha256"]  # both clients end on the same average


def test_buffered_put_sends_what_was_put_though_the_caller_changes_it_at_once(guest):
    """A put of arrays returns while its bytes are still under way (puts to several parties in turn
    overlap); it sends a copy, so changing the arrays right after put, as FATE's own pickling allows,
    changes nothing on the wire."""
    eps = endpoints()
    ctx, fed, host = guest(section(eps, buffer_puts=True), section(eps), "s8")
    big = [np.random.default_rng(3).standard_normal(1_000_000), np.arange(10)]
    want = sha(big)
    ctx.hosts[0].put("w", big)
    big[0][:] = 0.0
    res = host_result(host)
    assert res.get("error") is None and res["w"] == want
    assert fed.fate_rdma.stats["buffered_puts"] == 1 and fed.fate_rdma.flush(10)
    assert fed.fate_rdma._inflight_bytes == 0


def test_a_buffered_put_whose_copy_fails_raises_once_and_sends_nothing(guest, monkeypatch):
    """The copy runs while its first chunks go (transfer.Fill); if it fails, the put raises the copy's
    error, its transfer is cancelled, the room is given back, and the next put is not failed again by it
    (that nothing of a cancelled transfer is delivered: tests/test_fill.py)."""
    from fate_rdma.channel.transfer import Fill

    eps = endpoints()
    ctx, fed, host = guest(section(eps, buffer_puts=True), section(eps), "s8b", names="w2")
    real_run = Fill.run

    def failing_run(self, dest, sources, block_bytes):
        self.advance(self.total - min(self.total, 1 << 20))  # the last MiB is final: its chunk may go
        self.fail(MemoryError("copy failed here"))
        raise MemoryError("copy failed here")

    monkeypatch.setattr(Fill, "run", failing_run)
    big = [np.random.default_rng(5).standard_normal(1_000_000)]
    with pytest.raises(MemoryError, match="copy failed here"):
        ctx.hosts[0].put("w", big)
    monkeypatch.setattr(Fill, "run", real_run)
    assert fed.fate_rdma.flush(10) and fed.fate_rdma._inflight_bytes == 0
    ctx.hosts[0].put("w2", big)  # not failed by the first put's cancelled transfer
    res = host_result(host)
    assert res.get("error") is None and res["w2"] == sha(big), res


def test_a_buffered_put_queues_its_sends_before_its_copy_and_a_failure_before_the_copy_fails_them(guest, monkeypatch):
    """The copy runs once every party's transfer is queued (so chunks go while it runs); a put that fails
    before its copy (here the second party's send) fails the transfers already queued at once (none waits
    for a copy that will not come) and gives its room back."""
    from fate_rdma.channel.transfer import Fill
    from fate_rdma.federation import frames

    eps = endpoints()
    ctx, fed, host = guest(section(eps, buffer_puts=True), section(eps), "s8c", names="w2")
    w, calls = fed.fate_rdma, []
    real_send, real_run = w.endpoint.send, Fill.run

    def send(addr, bufs, md, fill=None):
        calls.append("send")
        if calls.count("send") == 2 and md["name"] == "w":
            raise RuntimeError("second send refused")
        return real_send(addr, bufs, md, fill)

    def run(self, *a):
        calls.append("run")
        return real_run(self, *a)

    monkeypatch.setattr(w.endpoint, "send", send)
    monkeypatch.setattr(Fill, "run", run)
    big = [np.random.default_rng(6).standard_normal(1_000_000)]
    with pytest.raises(RuntimeError, match="second send refused"):
        w._push_bytes(frames.encode(big, w.threshold), "w", "t", [HOST] * 2)
    assert calls == ["send", "send"]  # no copy ran
    t0 = time.monotonic()
    assert w.flush(10) and w._inflight_bytes == 0 and time.monotonic() - t0 < 5
    calls.clear()
    ctx.hosts[0].put("w2", big)
    assert calls == ["send", "run"]
    res = host_result(host)
    assert res.get("error") is None and res["w2"] == sha(big), res


def test_a_put_of_the_same_arrays_again_shares_the_held_copy_and_a_changed_one_does_not(guest, monkeypatch):
    """FATE's aggregators put one average to each client in turn: the second put of the same, unchanged arrays
    while the first's copy is still held sends from that copy (no second copy, no second room); arrays changed
    after that get a copy of their own; every object arrives as it was put, and all room is given back."""
    import concurrent.futures

    from fate_rdma.federation import frames

    eps = endpoints()
    ctx, fed, host = guest(section(eps, buffer_puts=True), section(eps), "s8d", names="w,w2,w3")
    w, gated = fed.fate_rdma, []
    real_send = w.endpoint.send

    def send(addr, bufs, md, fill=None):  # the puts' transfers look unfinished until the test says so
        fut, proxy = real_send(addr, bufs, md, fill), concurrent.futures.Future()
        proxy.transfer_id = fut.transfer_id
        gated.append((fut, proxy))
        return proxy

    monkeypatch.setattr(w.endpoint, "send", send)
    big = [np.random.default_rng(9).standard_normal(1_000_000), np.arange(10)]
    first = sha(big)
    ctx.hosts[0].put("w", big)
    ctx.hosts[0].put("w2", big)
    big[0][123] += 1.0
    ctx.hosts[0].put("w3", big)
    nbytes = len(frames.encode(big, w.threshold))
    try:
        assert (w.stats["buffered_puts"], w.stats["shared_puts"]) == (2, 1)
        assert w._inflight_bytes == 2 * nbytes and w._shared.held() == 2
    finally:  # (else the wrapper's close would wait for them)
        for fut, proxy in gated:
            proxy.set_result(fut.result(30))
    assert w.flush(10) and w._inflight_bytes == 0 and w._shared.held() == 0
    res = host_result(host)
    assert res.get("error") is None and res["w"] == res["w2"] == first and res["w3"] == sha(big) != first, res


def test_put_copies_are_in_shared_memory_on_the_same_host_path(guest):
    """Both parties on this host (the soft provider's same-host path on): a buffered put copies into shared
    memory, which the peer's NIC maps instead of reading with process_vm_readv."""
    require_same_host()
    from easypyverbs.providers.soft import shm

    eps = endpoints()
    ctx, fed, host = guest(section(eps, buffer_puts=True), section(eps), "s9s")
    w = fed.fate_rdma
    big = [np.random.default_rng(8).standard_normal(600_000)]
    ctx.hosts[0].put("w", big)
    assert w.endpoint.same_host_capable and w.put_copies.shared and w.stats["buffered_puts"] == 1
    assert any(shm.region_of([(int(b.ctypes.data), b.nbytes)]) is not None for b in w.put_copies._bufs)
    assert host_result(host)["w"] == sha(big)


def test_buffer_puts_auto_on_loopback_copies_small_puts_only(guest):
    """The default (buffer_puts: auto): to a peer on this host (no link model) a large put's copy costs more
    than waiting for the bytes, so it sends the caller's arrays themselves and returns once they arrived; a
    put of at most PUT_COPY_SMALL_BYTES is copied and returns at once; a put of plain bytes (no copy to pay)
    is buffered whatever its size."""
    from fate_rdma.federation.config import PUT_COPY_SMALL_BYTES

    eps = endpoints()
    room = {"slot_bytes": 32 << 20}  # (puts past PUT_COPY_SMALL_BYTES need slots past the tests' 16 MiB)
    ctx, fed, host = guest(section(eps, **room), section(eps, **room), "s9a", names="w,w2,small")
    big = [np.random.default_rng(4).standard_normal(2_400_000)]  # 19.2 MB
    assert big[0].nbytes > PUT_COPY_SMALL_BYTES
    ctx.hosts[0].put("w", big)
    ctx.hosts[0].put("w2", big)
    w = fed.fate_rdma
    assert w.stats["buffered_puts"] == 0 and not w._inflight and w.put_copies.fresh_bytes == 0
    small = [np.random.default_rng(5).standard_normal(1_200_000)]  # 9.6 MB: copied, the put returns at once
    ctx.hosts[0].put("small", small)
    assert w.stats["buffered_puts"] == 1 and w.put_copies.fresh_bytes >= small[0].nbytes
    assert w.flush(10) and w._inflight_bytes == 0
    pickle = [b"\x01" * (2 << 20)]  # what FATE's serializer hands the wrapper for other objects
    held, fill = w._buffered(pickle, 2 << 20, False, [HOST])
    assert held == pickle and held[0] is pickle[0] and fill is None and w._inflight_bytes == 2 << 20
    w._inflight_bytes -= 2 << 20  # (not sent: the room it took is given back by hand)
    conn = w.endpoint.connect(eps["host:10000"])
    assert conn.near and w.endpoint.round_trip_s(eps["host:10000"]) == 0.0  # (whatever its probe read)
    res = host_result(host)
    assert res.get("error") is None and res["w"] == res["w2"] == sha(big) and res["small"] == sha(small), res


def test_put_copies_unused_for_the_idle_time_are_let_go_of(guest):
    """A party idle between two exchanges (FATE-LLM trains for minutes) holds no put copies: once its copy's
    transfers are done and pool_idle_s has passed without a put reusing it, the buffer is let go of."""
    eps = endpoints()
    ctx, fed, host = guest(section(eps, pool_idle_s=0.5), section(eps), "s9i", names="small")
    small = [np.random.default_rng(6).standard_normal(200_000)]  # 1.6 MB: copied, the put returns at once
    ctx.hosts[0].put("small", small)
    w = fed.fate_rdma
    assert w.stats["buffered_puts"] == 1 and w.put_copies.held_bytes >= small[0].nbytes
    assert w.flush(10)
    deadline = time.monotonic() + 10
    while w.put_copies.held_bytes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert w.put_copies.held_bytes == 0 and w.put_copies.trimmed_bytes >= small[0].nbytes
    res = host_result(host)
    assert res.get("error") is None and res["small"] == sha(small), res


def test_buffer_puts_auto_copies_a_put_to_a_distant_peer(guest):
    """Over the soft provider's link model (20 ms round trip, emulated): once the connection has measured
    its round trip, a put of 18.4 MB (past PUT_COPY_SMALL_BYTES) is copied and returns at once (its copy costs
    less than the wait); the first put, before any round trip is known, waits for its bytes."""
    from fate_rdma.federation.config import PUT_COPY_BYTES_PER_S, PUT_COPY_SMALL_BYTES

    eps = endpoints()
    link = {"soft_link": "rate=10gbit,rtt=20ms", "slot_bytes": 32 << 20}
    ctx, fed, host = guest(section(eps, **link), section(eps, **link), "s9w", names="w,w2")
    w = fed.fate_rdma
    big = [np.random.default_rng(4).standard_normal(2_300_000)]
    assert PUT_COPY_SMALL_BYTES < big[0].nbytes < 0.020 * PUT_COPY_BYTES_PER_S
    ctx.hosts[0].put("w", big)
    assert w.stats["buffered_puts"] == 0  # no round trip measured when it was put
    assert not w.endpoint.connect(eps["host:10000"]).near and w.endpoint.round_trip_s(eps["host:10000"]) >= 0.02
    ctx.hosts[0].put("w2", big)
    assert w.stats["buffered_puts"] == 1 and w.flush(10) and w._inflight_bytes == 0
    res = host_result(host)
    assert res.get("error") is None and res["w"] == res["w2"] == sha(big), res


def test_put_buffer_off_waits_for_delivery(guest):
    eps = endpoints()
    ctx, fed, host = guest(section(eps, put_buffer_bytes=0), section(eps), "s9")
    big = [np.random.default_rng(4).standard_normal(600_000)]
    ctx.hosts[0].put("w", big)
    assert fed.fate_rdma.stats["buffered_puts"] == 0 and not fed.fate_rdma._inflight
    assert host_result(host)["w"] == sha(big)


def test_a_buffered_put_that_fails_later_is_raised_by_the_next_call(guest, caplog):
    """The receiver refuses the payload after the put returned: the error is logged at once, this
    party's next put raises it naming the put, and the receiver's get fails at its deadline."""
    eps = endpoints()
    small_rx = section(eps, mode="fedrdma", max_payload_bytes=1 << 20, pull_timeout_s=3)
    ctx, fed, host = guest(section(eps, mode="fedrdma", buffer_puts=True), small_rx, "s10")
    ctx.hosts[0].put("w", [np.ones(400_000)])  # 3.2 MB: over the host's max_payload_bytes
    assert fed.fate_rdma.flush(20)
    with pytest.raises(E.PeerUnreachable, match="buffered put of 'w'.*failed after it returned"):
        ctx.hosts[0].put("w2", [np.ones(10)])
    assert "failed after it returned" in caplog.text
    res = host_result(host)
    assert "did not arrive" in (res.get("error") or ""), res


def channel_descriptors(eps, tmp_path, **kw):
    """A section with descriptors over the channel: a secret both parties prove."""
    from fate_rdma.channel.auth import write_secret

    secret = tmp_path / "secret"
    if not secret.exists():
        write_secret(str(secret))
    return section(eps, **{"descriptors": "channel", "secret_file": str(secret), **kw})


def test_descriptors_over_the_channel_carry_every_object_without_fate(guest, tmp_path):
    eps = endpoints()
    ctx, fed, host = guest(channel_descriptors(eps, tmp_path), channel_descriptors(eps, tmp_path), "s-desc",
                           names="w,w2")
    through_fate = []
    orig = fed.fate_rdma._orig_push
    fed.fate_rdma._orig_push = lambda **kw: (through_fate.append(kw["name"]), orig(**kw))
    big = [np.random.default_rng(6).standard_normal(500_000), np.arange(10)]
    small = {"flag": True, "w": np.ones(100)}  # below threshold_bytes: with descriptors: fate it takes FATE's path
    ctx.hosts[0].put("w", big)
    ctx.hosts[0].put("w2", small)
    res = host_result(host)
    assert res.get("error") is None, res
    assert res["w"] == sha(big) and res["w2"] == sha(small)
    st = fed.fate_rdma.stats
    assert st["rdma_transfers"] == 1 and st["small_transfers"] == 1 and through_fate == []
    assert 0 < st["small_bytes"] < 1 << 20  # (the counters line adds them up: every object crossed the channel)
    assert res["stats"]["descriptor_wait_seconds"] == 0  # the host waited on the channel alone


def test_channel_descriptors_need_proven_senders_and_no_fallback(guest, tmp_path):
    from fate_rdma.federation.config import RdmaFederationConfig

    eps = endpoints()
    with pytest.raises(E.ConfigError, match="cannot fall back"):
        RdmaFederationConfig.from_section(channel_descriptors(eps, tmp_path, fallback="fate"))
    with pytest.raises(E.ConfigError, match="descriptors must be"):
        RdmaFederationConfig.from_section(section(eps, descriptors="carrier pigeon"))
    with pytest.raises(E.ConfigError, match="needs proven senders"):
        guest(section(eps, descriptors="channel"), None, "s-desc-noauth")
    # auto: channel where the senders are proven and nothing falls back to FATE, else fate
    assert RdmaFederationConfig.from_section(section(eps)).descriptors_in_use == "fate"
    assert RdmaFederationConfig.from_section(channel_descriptors(eps, tmp_path, descriptors="auto")).descriptors_in_use == "channel"
    assert RdmaFederationConfig.from_section(channel_descriptors(eps, tmp_path, descriptors="auto",
                                                                 fallback="fate")).descriptors_in_use == "fate"


def test_parties_with_different_descriptors_are_told(guest, tmp_path, caplog):
    """A guest that announces over the channel and a host that waits for FATE's descriptor cannot connect:
    the guest's put fails at once naming both settings (the host would otherwise wait for a descriptor
    that never comes), and the host's log says why it refused the connection."""
    eps = endpoints()
    host_sec = channel_descriptors(eps, tmp_path, descriptors="fate", pull_timeout_s=3)
    ctx, fed, host = guest(channel_descriptors(eps, tmp_path), host_sec, "s-mix")
    with pytest.raises(Exception, match="uses descriptors: fate and this side descriptors: channel"):
        ctx.hosts[0].put("w", np.zeros(300_000))
    time.sleep(1.0)  # the host's side of the refused handshake has been logged
    host.kill()
    _, err = host.communicate(timeout=30)
    assert "uses descriptors: channel and this side descriptors: fate" in err


def test_an_announcement_at_a_party_with_fate_descriptors_names_both_settings(guest, tmp_path, caplog):
    """What the receive loop does with an announced object at a party with descriptors: fate (a peer that
    predates the hello's terms, or lies there): it names the mismatch instead of waiting in silence."""
    eps = endpoints()
    ctx, fed, host = guest(channel_descriptors(eps, tmp_path, descriptors="fate"), None, "s-mix-old")
    shim = fed.fate_rdma
    with caplog.at_level(logging.ERROR, logger="fate_rdma.federation"):
        shim._mismatch({"announce": True, "name": "w", "tag": "t", "src": "host:10000"}, eps["host:10000"])
    assert "sends with descriptors: channel" in caplog.text and "receives with descriptors: fate" in caplog.text


def test_announced_objects_are_checked(guest, tmp_path, monkeypatch, caplog):
    """What a peer announces over the channel is for this job and party, from the party whose endpoint the
    connection proved; a (name, tag) that arrives twice before its get is refused; the length is checked."""
    eps = endpoints()
    ctx, fed, host = guest(channel_descriptors(eps, tmp_path), None, "s-ann")
    shim = fed.fate_rdma
    good = {"announce": True, "session": "s-ann", "name": "w", "tag": "t", "src": "host:10000", "dst": "guest:9999",
            "length": 3, "crc32c": None, "frame": False}
    key, why = shim._announced_key(good, eps["host:10000"])
    assert key == ("obj", "s-ann", "w", "t", "host:10000") and why == ""
    for bad, peer, reason in [({"session": "other"}, eps["host:10000"], "session"),
                              ({"dst": "arbiter:1"}, eps["host:10000"], "session"),
                              ({"src": "guest:9999"}, eps["host:10000"], "names party"),
                              ({}, "127.0.0.1:1", "names party"),
                              ({"name": 7}, eps["host:10000"], "lacks")]:
        key, why = shim._announced_key({**good, **bad}, peer)
        assert key is None and reason in why
    k = ("obj", "s-ann", "w", "t", "host:10000")
    shim._store.put(k, (good, b"abc"))
    assert shim._take_announced("w", "t", HOST) == b"abc"
    shim._store.put(k, (good, b"abc"))
    shim._store.put(k, (good, b"xyz"))
    with pytest.raises(E.IntegrityError, match="arrived twice"):
        shim._take_announced("w", "t", HOST)
    shim._store.put(k, ({**good, "length": 4}, b"abc"))
    with pytest.raises(E.IntegrityError, match="3 bytes arrived"):
        shim._take_announced("w", "t", HOST)
    # the wait covers the sender's work before its put: get_timeout_s, not pull_timeout_s; it says it waits
    shim.cfg = shim.cfg.__class__(**{**shim.cfg.__dict__, "pull_timeout_s": 0.05, "get_timeout_s": 5.0})
    monkeypatch.setattr(wrapper_mod, "WAIT_REMIND_S", 0.1)
    late = threading.Timer(0.6, shim._store.put, (k, (good, b"abc")))
    late.start()
    with caplog.at_level(logging.INFO, logger="fate_rdma.federation"):
        assert shim._take_announced("w", "t", HOST) == b"abc"
    assert "still waiting for fate-rdma: 'w' (tag 't') from party host:10000" in caplog.text
    shim.cfg = shim.cfg.__class__(**{**shim.cfg.__dict__, "get_timeout_s": 0.3})
    with pytest.raises(E.TransferTimeout, match="'w' \\(tag 't'\\) from party host:10000 did not arrive within 0.3 s"):
        shim._take_announced("w", "t", HOST)
    # an object sent with descriptors: fate (a peer that predates the hello's terms) fails the get it was for at
    # once; one for another session or party fails nothing here
    fate_md = {"id": "x", "session": "s-ann", "name": "m", "tag": "t", "src": "host:10000", "dst": "guest:9999"}
    shim._mismatch({**fate_md, "session": "other"}, eps["host:10000"])
    shim._mismatch({**fate_md, "dst": "arbiter:10000"}, eps["host:10000"])
    with pytest.raises(E.TransferTimeout):
        shim._take_announced("m", "t", HOST)
    shim._mismatch({**fate_md, "name": "n"}, eps["host:10000"])
    with pytest.raises(E.ConfigError, match="sends with descriptors: fate"):
        shim._take_announced("n", "t", HOST)
