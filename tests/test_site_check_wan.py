"""`fate-rdma site check` between three sites in their own network namespaces (the WAN testbed: each site its own
address in 198.18.0.0/15, a router between them) with real nftables rules in the sites, as an operator meets them:
every port open passes; the host's firewall letting the bootstrap port through but dropping the soft provider's
data ports (`soft_data_ports`, the port an operator forgets) and the arbiter's firewall dropping everything fail,
each naming the peer and the silent port. Needs root, iproute2 and nft; skips with the reason otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fate_rdma.cli.tls import make_certificates
from fate_rdma_lab.testbed import bed as wan, firewall

ROOT = str(Path(__file__).resolve().parents[1])
PARTIES = ["guest:9999", "host:10000", "arbiter:10001"]
BOOT, DATA = 7100, "7110-7119"  # each site's bootstrap port and soft data ports (the same numbers at every site)


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    reason = firewall.problem()
    if reason:
        pytest.skip(f"site namespaces cannot be built here: {reason}")
    with wan.open_sites(3, f"frsc{os.getpid() % 100000}", str(tmp_path_factory.mktemp("wanstate"))) as tb:
        yield tb


@pytest.fixture(scope="module")
def sites(testbed, tmp_path_factory):
    d = tmp_path_factory.mktemp("sites")
    endpoints = {p: f"{testbed.site_addr(i)}:{BOOT}" for i, p in enumerate(PARTIES)}
    files = make_certificates(str(d / "ca"), PARTIES)
    paths = {}
    for p in PARTIES:
        path = d / f"{p.split(':')[0]}.yaml"
        path.write_text(yaml.safe_dump({"endpoints": endpoints, "provider": "soft", "tls": True,
                                        "tls_cert": files[p].cert, "tls_key": files[p].key, "tls_ca": files[p].ca,
                                        "soft_data_ports": DATA, "connect_timeout_s": 3}))
        paths[p] = str(path)
    return endpoints, paths, d


def _in_site(tb, party, argv):
    return wan.in_ns(tb.site_ns(PARTIES.index(party)), argv)


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _serve(tb, sites, party):
    _, paths, d = sites
    log = d / f"serve-{party.split(':')[0]}.log"
    p = subprocess.Popen(_in_site(tb, party, [sys.executable, "-m", "fate_rdma.cli", "site", "check", "--serve",
                                              "--site", paths[party], "--party", party]),
                         stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=_env())
    deadline = time.monotonic() + 60
    while "answering checks" not in log.read_text():
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return p


def _check(tb, sites, *extra):
    _, paths, _ = sites
    return subprocess.run(_in_site(tb, "guest:9999", [sys.executable, "-m", "fate_rdma.cli", "site", "check",
                                                      "--site", paths["guest:9999"], "--party", "guest:9999",
                                                      "--timeout", "4", *extra]),
                          capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=180)


def _firewall(tb, party, rule):
    """An nftables input chain in `party`'s namespace dropping what `rule` matches (None: the table removed)."""
    firewall.site_rule(tb.site_ns(PARTIES.index(party)), "frsite", f"{rule} drop" if rule else None)


def _lines(out):
    return {line.split(" at ")[0]: line for line in out.splitlines() if " at 198.18." in line}


@pytest.fixture(scope="module")
def served(testbed, sites):
    procs = [_serve(testbed, sites, p) for p in PARTIES[1:]]
    yield
    for p in procs:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def test_every_peer_passes_across_namespaces(testbed, sites, served):
    r = _check(testbed, sites)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _lines(r.stdout)
    for i, peer in enumerate(PARTIES[1:], 1):
        line = lines[peer]
        assert line.startswith(f"{peer} at {testbed.site_addr(i)}:{BOOT}: ok"), line
        assert "identity proven by its certificate" in line and "1048576 bytes out and back verified" in line, line
    assert "2 of 2 peers passed" in r.stdout


def test_a_firewall_dropping_the_data_ports_or_everything_is_named(testbed, sites, served):
    low, high = DATA.split("-")
    _firewall(testbed, "host:10000", f"tcp dport {low}-{high}")  # the bootstrap port open, the data ports not
    _firewall(testbed, "arbiter:10001", f"tcp dport {BOOT}")  # nothing gets through
    try:
        t0 = time.monotonic()
        r = _check(testbed, sites)
        took = time.monotonic() - t0
    finally:
        _firewall(testbed, "host:10000", None)
        _firewall(testbed, "arbiter:10001", None)
    assert r.returncode == 1, r.stdout + r.stderr
    assert took < 120, took
    lines = _lines(r.stdout)
    host, arbiter = lines["host:10000"], lines["arbiter:10001"]
    assert "FAILED at connect" in arbiter and "no answer" in arbiter and "firewall" in arbiter, arbiter
    assert f"{testbed.site_addr(2)}:{BOOT}" in arbiter, arbiter
    assert "FAILED at connect" in host and f"answered, but its soft data port {testbed.site_addr(1)}:{low} did not" \
        in host and "soft_data_ports" in host, host
    assert "0 of 2 peers passed" in r.stdout, r.stdout
    # the rules gone, both pass again (nothing the failures left behind stays in the way)
    r = _check(testbed, sites)
    assert r.returncode == 0 and "2 of 2 peers passed" in r.stdout, r.stdout + r.stderr
