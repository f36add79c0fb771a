"""`fate-rdma site check` between three sites (processes of this host, each with its own party, certificate and
site file): every peer passes with its identity proven by certificate; a stopped peer, a peer whose certificate
comes from another CA, and a port where something answers nothing each fail with a line that names the cause."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

from fate_rdma.cli.tls import make_certificates
from fate_rdma_lab.bench.local import free_ports, stop_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTIES = ["guest:9999", "host:10000", "arbiter:10001"]


def _site(tmp_path, name, files, endpoints):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"endpoints": endpoints, "provider": "soft", "tls": True, "tls_cert": files.cert,
                                    "tls_key": files.key, "tls_ca": files.ca, "connect_timeout_s": 3}))
    return str(path)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fate_rdma.cli", "site", "check", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def _serve(site, party, log):
    p = subprocess.Popen([sys.executable, "-m", "fate_rdma.cli", "site", "check", "--serve", "--site", site,
                          "--party", party], stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                         start_new_session=True)
    deadline = time.monotonic() + 60
    while "answering checks" not in open(log).read():
        assert p.poll() is None and time.monotonic() < deadline, open(log).read()
        time.sleep(0.1)
    return p


@pytest.fixture
def sites(tmp_path):
    endpoints = {p: f"127.0.0.1:{port}" for p, port in zip(PARTIES, free_ports(3))}
    files = make_certificates(str(tmp_path / "ca"), PARTIES)
    paths = {p: _site(tmp_path, p.split(":")[0], files[p], endpoints) for p in PARTIES}
    return endpoints, paths


def _lines(out):
    return {line.split(" at ")[0]: line for line in out.splitlines() if " at 127.0.0.1:" in line}


def test_every_peer_passes_with_its_identity_proven(sites, tmp_path):
    endpoints, paths = sites
    served = [_serve(paths[p], p, str(tmp_path / f"{p.split(':')[0]}.log")) for p in PARTIES[1:]]
    try:
        r = _cli("--site", paths["guest:9999"], "--party", "guest:9999")
    finally:
        for p in served:
            stop_group(p)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _lines(r.stdout)
    for peer in PARTIES[1:]:
        line = lines[peer]
        assert "ok: reachable, identity proven by its certificate" in line, line
        assert "1048576 bytes out and back verified" in line and "provider soft" in line and "RTT" in line, line
    assert "2 of 2 peers passed" in r.stdout


def test_a_stopped_peer_a_wrong_ca_and_a_silent_port_are_named(sites, tmp_path):
    endpoints, paths = sites
    # the host's site got its certificate from another CA (its own files, another federation's)
    other = make_certificates(str(tmp_path / "other-ca"), ["host:10000"])["host:10000"]
    wrong = _site(tmp_path, "host-wrong-ca", other, endpoints)
    served = _serve(wrong, "host:10000", str(tmp_path / "host.log"))
    # where the arbiter should be, something accepts connections and never answers (not fate-rdma)
    host, _, port = endpoints["arbiter:10001"].rpartition(":")
    silent = socket.create_server((host, int(port)))
    held = []
    threading.Thread(target=lambda: held.append(silent.accept()), daemon=True).start()
    try:
        t0 = time.monotonic()
        r = _cli("--site", paths["guest:9999"], "--party", "guest:9999", "--timeout", "4")
        took = time.monotonic() - t0
    finally:
        stop_group(served)
        silent.close()
    assert took < 60, took  # (the silent port is given --timeout, not a held peer's patience)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = _lines(r.stdout)
    assert "FAILED at identity" in lines["host:10000"] and "another CA" in lines["host:10000"], lines["host:10000"]
    assert "FAILED at connect" in lines["arbiter:10001"] and "no answer" in lines["arbiter:10001"], lines
    # nobody at the host's port now: refused, naming what to start there
    r = _cli("--site", paths["guest:9999"], "--party", "guest:9999", "--peer", "host:10000")
    assert r.returncode == 1
    line = _lines(r.stdout)["host:10000"]
    assert "connection refused" in line and "site check --serve" in line, line


def test_the_party_must_be_known():
    r = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "site", "check", "--site", "/nonexistent/site.yaml"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_a_silent_data_port_behind_an_answering_bootstrap_port_is_named():
    from fate_rdma.federation.site_check import explain
    from fate_rdma.errors import PeerUnreachable
    exc = PeerUnreachable("cannot connect to fate-rdma endpoint 10.0.0.2:7100: soft QP 3: cannot reach peer NIC "
                          "10.0.0.2:7110: timed out (the peer's soft data port, one of its soft_data_ports: open to "
                          "this host in its firewall?)")
    why = explain(exc, "10.0.0.2:7100", 4)
    assert why.startswith("the endpoint at 10.0.0.2:7100 answered, but its soft data port 10.0.0.2:7110 did not "
                          "(timed out): open that site's soft_data_ports"), why
