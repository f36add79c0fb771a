"""Mutual TLS (`tls: true`): verified round trips in both modes over TLS data connections, and the
refusals: a certificate from another CA, a certificate that names another party (the impersonation
that one shared HMAC secret alone allows), a plaintext peer either way, at the endpoint and at the
soft NIC; the bytes on a soft data connection are not plaintext; configuration errors. Certificates
are made in a temporary folder with `fate-rdma tls init`'s function (the openssl tool)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import time

import crc32c
import numpy as np
import pytest

import easypyverbs as ev
from easypyverbs.tls import MutualTLS
from fate_rdma import errors as E
from fate_rdma_lab.bench.driver import PeerProcess
from fate_rdma.channel import Endpoint
from fate_rdma.channel.auth import write_secret
from fate_rdma.cli.tls import make_certificates
from fate_rdma.config import ChannelConfig
from fate_rdma.federation.flow import FlowRouteError, check_job_section

from .relay import Relay

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command line tool is not installed")

CHUNK = 64 * 1024
PARTIES = ["guest:9999", "host:10000", "arbiter:10000"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The federation's certificates, and a guest certificate from another CA (a stranger's)."""
    root = tmp_path_factory.mktemp("tls")
    ours = make_certificates(str(root / "federation"), PARTIES)
    theirs = make_certificates(str(root / "elsewhere"), ["guest:9999"])
    secret = str(root / "federation.secret")
    write_secret(secret)
    return {"ours": ours, "theirs": theirs, "secret": secret}


def cfg(pki, party=None, mode="fedrdma-e", secret=True, ca=None, files=None, **kw) -> ChannelConfig:
    """A channel config as `party` (None: TLS off); `files`: another certificate set ("theirs")."""
    base = dict(mode=mode, chunk_bytes=CHUNK, slot_bytes=1 << 20, provider="soft", same_host=False, window=4,
                connect_timeout_s=3, no_progress_timeout_s=10, secret_file=pki["secret"] if secret else None)
    if party is not None:
        f = pki[files or "ours"][party]
        base.update(tls=True, tls_cert=f.cert, tls_key=f.key, tls_ca=ca or f.ca)
    base.update(kw)
    return ChannelConfig(**base)


# -- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fedrdma", "fedrdma-e"])
def test_round_trip_over_tls(pki, mode):
    """guest:9999 sends to host:10000 in another process: HMAC inside TLS on the bootstrap, TLS on
    every soft data connection (both directions: WRITEs one way, control frames the other)."""
    peer = PeerProcess(module="fate_rdma_lab.bench.transfer_peer")
    try:
        c = cfg(pki, "host:10000", mode)
        addr = peer.cmd({"cmd": "endpoint", "config": dict(c.__dict__), "record": True,
                         "allowed_peers": ["guest:9999"]})["address"]
        with Endpoint(cfg(pki, "guest:9999", mode), name="guest:9999", party_names={addr: "host:10000"}) as ep:
            data = np.random.default_rng(7).integers(0, 256, 5 * CHUNK + 3, dtype=np.uint8)
            for i in range(2):  # the connection is reused
                ep.send(addr, [data[:1000], data[1000:]], {"i": i}).result(30)
            conn = ep.connect(addr)
            assert conn.identity.authenticated and conn.identity.name == addr
            assert [rc.qp.data_path for rc in conn.rcs] == ["tcp+tls"] * len(conn.rcs)
            recs = peer.cmd({"cmd": "expect", "count": 2, "timeout_s": 30})["records"]
            assert [r["metadata"]["i"] for r in recs] == [0, 1]
            assert all(r["peer"] == "guest:9999" and r["nbytes"] == data.nbytes
                       and r["crc32c"] == crc32c.crc32c(data) for r in recs)
            assert conn.dead is None  # an idle TLS bootstrap does not read as closed
            peer.close()  # under TLS too, the peer's end is seen on the bootstrap socket
            wait_for(lambda: conn.dead is not None, "noticing the peer's end")
    finally:
        peer.close()


# -- refusals at the endpoint -----------------------------------------------------------------------
def wait_for(pred, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


def _refused(acceptor: Endpoint, before: int) -> None:
    """Nothing of the refused peer reached the acceptor's application or memory."""
    wait_for(lambda: acceptor.refused > before, "the refusal")
    assert acceptor.peers() == []
    assert acceptor.budget.held_bytes == 0 and acceptor.pool_bytes() == 0


def test_certificate_from_another_ca_is_refused(pki):
    with Endpoint(cfg(pki, "host:10000"), allowed_peers=["guest:9999"]) as host:
        party = {host.address: "host:10000"}
        # the stranger trusts our CA, but its own certificate comes from another: the acceptor refuses it
        c = cfg(pki, "guest:9999", files="theirs", ca=pki["ours"]["host:10000"].ca)
        with Endpoint(c, name="guest:9999", party_names=party) as stranger:
            with pytest.raises(E.AuthenticationError, match="refused this side's certificate"):
                stranger.send(host.address, b"poisoned weights")
        _refused(host, 0)
        # a dialer of the federation does not talk to an endpoint whose certificate another CA issued
        with Endpoint(cfg(pki, "guest:9999", files="theirs"), name="guest:9999") as impostor, \
                Endpoint(cfg(pki, "host:10000"), name="host:10000",
                         party_names={impostor.address: "guest:9999"}) as dialer:
            with pytest.raises(E.AuthenticationError, match="does not trust"):
                dialer.send(impostor.address, b"weights")
            assert impostor.peers() == []
        with Endpoint(cfg(pki, "guest:9999"), name="guest:9999", party_names=party) as guest:  # the real one
            guest.send(host.address, b"ok").result(20)
        assert host.recv(timeout=10).peer == "guest:9999"


def test_a_party_cannot_pose_as_another(pki):
    """arbiter:10000 holds the federation's secret, as every party does. Without TLS it gets in under
    guest:9999's name; with TLS its certificate names arbiter:10000 and it is refused."""
    allowed = ["guest:9999", "arbiter:10000"]
    with Endpoint(cfg(pki), allowed_peers=allowed) as host, \
            Endpoint(cfg(pki), name="guest:9999") as arbiter:  # secret only: the weakness
        arbiter.send(host.address, b"forged update").result(20)
        assert host.recv(timeout=10).peer == "guest:9999"
    with Endpoint(cfg(pki, "host:10000"), allowed_peers=allowed) as host:
        party = {host.address: "host:10000"}
        for secret in (True, False):  # with the secret inside TLS, and with TLS alone
            with Endpoint(cfg(pki, "arbiter:10000", secret=secret), name="guest:9999", party_names=party) as arbiter:
                with pytest.raises(E.AuthenticationError, match="claims to be 'guest:9999'.*names 'arbiter:10000'"):
                    arbiter.send(host.address, b"forged update")
        _refused(host, 0)
        with Endpoint(cfg(pki, "guest:9999"), name="guest:9999", party_names=party) as guest:
            guest.send(host.address, b"real update").result(20)
        msg = host.recv(timeout=10)
        assert msg.peer == "guest:9999" and bytes(msg.view) == b"real update"
        # and a dialer refuses a party listening where another should be
        with Endpoint(cfg(pki, "arbiter:10000"), name="arbiter:10000") as squatter, \
                Endpoint(cfg(pki, "guest:9999"), name="guest:9999", party_names={squatter.address: "host:10000"}) as g:
            with pytest.raises(E.AuthenticationError, match="must be party 'host:10000'.*names 'arbiter:10000'"):
                g.send(squatter.address, b"weights")


def test_plaintext_peer_is_refused_either_way(pki):
    with Endpoint(cfg(pki, "host:10000", secret=False)) as host, \
            Endpoint(cfg(pki, secret=False), name="guest:9999") as plain:
        with pytest.raises(E.AuthenticationError, match="takes TLS connections only"):
            plain.send(host.address, b"weights")
        _refused(host, 0)
    with Endpoint(cfg(pki, secret=False)) as plain, \
            Endpoint(cfg(pki, "guest:9999", secret=False), name="guest:9999") as tls:
        with pytest.raises(E.AuthenticationError, match="does not speak TLS"):
            tls.send(plain.address, b"weights")
        wait_for(lambda: plain.refused >= 1, "the plaintext acceptor's refusal")  # it notices after the dialer
        assert plain.peers() == []


# -- the soft provider's data connections -----------------------------------------------------------
def _soft_side(tls, size):
    ctx = ev.open_device(provider="soft", same_host=False, retry_timeout_s=5.0, tls=tls)
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(64)
    qp = pd.create_qp(cq, cq, ev.QPCap())
    buf = bytearray(size)
    return ctx, qp, cq, buf, pd.reg_mr(buf, ev.Access.all_rdma())


def _write_through_relay(tls_a, tls_b, payload: bytes):
    """A WRITE from a to b whose connection passes a relay; (what arrived at b, what the relay saw)."""
    a, b = _soft_side(tls_a, len(payload)), _soft_side(tls_b, len(payload))
    host, _, port = b[1].info().gid.rpartition(":")
    relay = Relay((host, int(port)))
    try:
        b[1].connect(a[1].info(), 5)
        a[1].connect(dataclasses.replace(b[1].info(), gid=relay.address), 5)
        a[3][:] = payload
        a[1].post_write(a[4].sge(0, len(payload)), b[4].remote(), wr_id=1)
        (wc,) = a[2].wait(10)
        if not wc.ok:
            raise ev.CompletionError(wc)
        return bytes(b[3]), bytes(relay.dialer_bytes)
    finally:
        relay.close()
        a[0].close()
        b[0].close()


def test_soft_data_connection_is_encrypted(pki):
    guest, host = pki["ours"]["guest:9999"], pki["ours"]["host:10000"]
    tls_g, tls_h = MutualTLS.from_files(guest.cert, guest.key, guest.ca), MutualTLS.from_files(host.cert, host.key, host.ca)
    payload = b"PLAINTEXT WEIGHTS 0123456789 " * 40000  # ~1.1 MiB of a pattern easy to spot
    arrived, wire = _write_through_relay(None, None, payload)  # the control: without TLS the relay sees it
    assert arrived == payload and payload[:4096] in wire
    arrived, wire = _write_through_relay(tls_g, tls_h, payload)
    assert arrived == payload and len(wire) > len(payload)
    assert b"PLAINTEXT WEIGHTS" not in wire and b"SVRB" not in wire  # neither payload nor frame headers


def test_soft_nic_refuses_a_plaintext_peer_and_vice_versa(pki):
    f = pki["ours"]["guest:9999"]
    tls = MutualTLS.from_files(f.cert, f.key, f.ca)
    for tls_a, tls_b, match in ((None, tls, "takes TLS connections only"), (tls, None, "TLS handshake .* failed")):
        a, b = _soft_side(tls_a, 4096), _soft_side(tls_b, 4096)
        try:
            with pytest.raises(ev.EasyVerbsError, match=match):
                a[1].connect(b[1].info(), 3)
        finally:
            a[0].close()
            b[0].close()


# -- configuration ------------------------------------------------------------------------------------
def test_tls_init_cli(tmp_path, capsys):
    from fate_rdma.cli import main

    assert main(["tls", "init", str(tmp_path), "--parties", "guest:9999", "host:10000+arbiter:10000"]) == 0
    out = capsys.readouterr().out
    assert "tls_cert: " + str(tmp_path / "guest_9999.pem") in out and "PRIVATE KEY" not in out
    for stem in ("ca", "guest_9999", "host_10000+arbiter_10000"):
        assert os.stat(tmp_path / f"{stem}.key").st_mode & 0o777 == 0o600
    from fate_rdma.channel.tls import certificate_names

    assert certificate_names(str(tmp_path / "host_10000+arbiter_10000.pem")) == ["host:10000", "arbiter:10000"]
    assert main(["tls", "init", str(tmp_path), "--parties", "guest:9999"]) == 2  # exists: not replaced
    assert main(["tls", "init", str(tmp_path), "--parties", "guest/9999"]) == 2


def test_sites_request_the_ca_signs_and_no_key_travels(tmp_path, capsys):
    """`tls request` at each site (its key stays in the site's folder), `tls sign` at the CA (which sees requests
    only, and names the parties its operator gives): the two sites then talk mutual TLS without a secret, and
    a request signed for another party than it asks for is refused."""
    from fate_rdma.cli import main

    sites = {p: tmp_path / p.replace(":", "_") for p in ("guest:9999", "host:10000")}
    ca = tmp_path / "ca"
    for party, folder in sites.items():
        assert main(["tls", "request", str(folder), "--party", party]) == 0
        stem = party.replace(":", "_")
        assert os.stat(folder / f"{stem}.key").st_mode & 0o777 == 0o600
        assert main(["tls", "sign", str(ca), str(folder / f"{stem}.csr"), "--party", party]) == 0
        shutil.copy(ca / "ca.pem", folder / "ca.pem")  # (the CA sends back the certificate and ca.pem)
    assert sorted(os.listdir(ca)) == ["ca.key", "ca.pem"]  # no site key at the CA
    assert main(["tls", "sign", str(ca), str(sites["host:10000"] / "host_10000.csr"), "--party", "guest:9999"]) == 2
    assert "asks for 'host:10000', not 'guest:9999'" in capsys.readouterr().err
    assert main(["tls", "request", str(sites["guest:9999"]), "--party", "guest:9999"]) == 2  # its key exists

    def site_cfg(party):
        folder, stem = sites[party], party.replace(":", "_")
        return ChannelConfig(provider="soft", same_host=False, connect_timeout_s=5, tls=True,
                             tls_cert=str(folder / f"{stem}.pem"), tls_key=str(folder / f"{stem}.key"),
                             tls_ca=str(folder / "ca.pem"))

    with Endpoint(site_cfg("host:10000"), allowed_peers=["guest:9999"]) as host:  # (named by its address)
        with Endpoint(site_cfg("guest:9999"), name="guest:9999", party_names={host.address: "host:10000"}) as guest:
            guest.send(host.address, b"weights" * 1000).result(20)
            msg = host.recv(20)
            assert bytes(msg.view) == b"weights" * 1000 and msg.peer == "guest:9999"
            assert guest.connect(host.address).send_integrity.kind == "blake3"  # TLS alone keys the MAC
            msg.release()


def test_config_errors(pki, tmp_path):
    f = pki["ours"]["guest:9999"]
    with pytest.raises(E.ConfigError, match="tls: true needs tls_cert, tls_key and tls_ca.*missing tls_key, tls_ca"):
        ChannelConfig(tls=True, tls_cert=f.cert)
    with pytest.raises(E.ConfigError, match="tls_ca .*nowhere.pem cannot be read"):
        ChannelConfig(tls=True, tls_cert=f.cert, tls_key=f.key, tls_ca=str(tmp_path / "nowhere.pem"))
    open_key = tmp_path / "open.key"
    open_key.write_bytes(open(f.key, "rb").read())
    os.chmod(open_key, 0o644)
    with pytest.raises(E.ConfigError, match="accessible to other users.*chmod 600") as err:
        ChannelConfig(tls=True, tls_cert=f.cert, tls_key=str(open_key), tls_ca=f.ca)
    assert "PRIVATE KEY" not in str(err.value)  # key material is never in a message
    with pytest.raises(E.ConfigError, match="tls must be true or false"):
        ChannelConfig(tls="yes")
    other = pki["ours"]["host:10000"]  # a certificate and a key that do not belong together
    with pytest.raises(E.ConfigError, match="cannot load tls_cert"):
        Endpoint(ChannelConfig(tls=True, tls_cert=f.cert, tls_key=other.key, tls_ca=f.ca, provider="soft"))
    with pytest.raises(E.ConfigError, match="names 'guest:9999', not this endpoint's party 'host:10000'"):
        Endpoint(cfg(pki, "guest:9999"), name="127.0.0.1:1", party_names={"127.0.0.1:1": "host:10000"})
    for key in ("tls", "tls_cert", "tls_key", "tls_ca"):  # a job can neither switch TLS off nor swap credentials
        with pytest.raises(FlowRouteError, match="belong to the site"):
            check_job_section({key: False if key == "tls" else f.cert})
    with pytest.raises(E.ConfigError, match="loopback"):  # neither secret nor TLS: loopback only, as before
        Endpoint(cfg(pki, secret=False), host="0.0.0.0")
