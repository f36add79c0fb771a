"""`fate-rdma site init`: from one federation description, each site's pieces (site file, key and request, OSX
route table and broker settings, FATE-Flow keys, firewall ports); three sites made with it alone (their
requests signed by one CA) pass `fate-rdma site check` with each other. Bad descriptions name the problem."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from fate_rdma.cli.tls import sign_request
from fate_rdma.errors import ConfigError
from fate_rdma.federation import site_recipe
from fate_rdma.federation.config import RdmaFederationConfig
from fate_rdma_lab.bench.local import free_ports, stop_group

from .test_site_check import _serve as serve_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTIES = ["guest:9999", "host:10000", "arbiter:10001"]


def _fate_rdma(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fate_rdma.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture
def federation(tmp_path):
    """Three sites on this host: each its own endpoint, OSX, FATE-Flow ports and data port range."""
    ports = free_ports(12)
    parties = {}
    for i, p in enumerate(PARTIES):
        e, o, g, h = ports[4 * i: 4 * i + 4]
        parties[p] = {"host": "127.0.0.1", "ports": {"endpoint": e, "osx": o, "flow_grpc": g, "flow_http": h,
                                                      "soft_data": f"{20000 + 100 * i}-{20000 + 100 * i + 7}"}}
    doc = {"parties": parties, "security": "tls", "provider": "soft"}
    path = tmp_path / "federation.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path), doc


def _init_all(tmp_path, fed_path):
    """Every site runs `site init`; the CA signs each site's request; each site gets its certificate and ca.pem."""
    outs = {}
    for p in PARTIES:
        out = tmp_path / p.split(":")[0]
        r = _fate_rdma("site", "init", fed_path, "--party", p, "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert "NEXT.txt" in r.stdout and "tls sign" in r.stdout
        stem = p.replace(":", "_")
        csr = out / "tls" / f"{stem}.csr"
        assert csr.exists() and (out / "tls" / f"{stem}.key").exists()
        sign_request(str(tmp_path / "ca"), str(csr), [p])  # (at the CA; the .pem lands beside the request)
        shutil.copy(tmp_path / "ca" / "ca.pem", out / "tls" / "ca.pem")
        outs[p] = out
    return outs


def test_each_sites_pieces_fit_together(tmp_path, federation):
    fed_path, doc = federation
    outs = _init_all(tmp_path, fed_path)
    for p, out in outs.items():
        me = doc["parties"][p]["ports"]
        site = yaml.safe_load((out / "site.yaml").read_text())
        cfg = RdmaFederationConfig.from_section(site)  # (checks the certificate files too)
        assert cfg.endpoints == {q: f"127.0.0.1:{v['ports']['endpoint']}" for q, v in doc["parties"].items()}
        assert cfg.channel.tls and cfg.channel.soft_data_ports == me["soft_data"]
        routes = json.loads((out / "osx" / "route_table.json").read_text())
        pid = p.split(":")[1]
        assert routes["self_party"] == [pid]
        assert routes["route_table"][pid]["fateflow"] == [{"ip": "127.0.0.1", "port": me["flow_grpc"]}]
        for q, v in doc["parties"].items():
            if q != p:
                assert routes["route_table"][q.split(":")[1]]["default"] == [{"ip": "127.0.0.1",
                                                                              "port": v["ports"]["osx"]}]
        props = (out / "osx" / "broker.properties").read_text()
        assert f"grpc.port={me['osx']}" in props and f"self.party={pid}" in props
        flow = yaml.safe_load((out / "fate_flow" / "service_conf.yaml").read_text())
        assert flow["party_id"] == pid and flow["fateflow"]["proxy_name"] == "osx"
        assert flow["fateflow"]["grpc_port"] == me["flow_grpc"] and flow["federation"]["osx"]["port"] == me["osx"]
        wall = (out / "firewall.txt").read_text()
        assert f"tcp {me['endpoint']}" in wall and f"tcp {me['soft_data']}" in wall and f"tcp {me['osx']}" in wall
    # the sites made this way reach and prove each other
    served = []
    try:
        for p in PARTIES[1:]:
            served.append(serve_checks(str(outs[p] / "site.yaml"), p, str(tmp_path / f"{p.split(':')[0]}.log")))
        r = _fate_rdma("site", "check", "--site", str(outs["guest:9999"] / "site.yaml"), "--party", "guest:9999")
    finally:
        for proc in served:
            stop_group(proc)
    assert r.returncode == 0 and "2 of 2 peers passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("identity proven by its certificate") == 2


def test_init_refuses_to_overwrite_a_site_without_force(tmp_path, federation):
    fed_path, _ = federation
    out = tmp_path / "g"
    assert _fate_rdma("site", "init", fed_path, "--party", "guest:9999", "--out", str(out)).returncode == 0
    key = (out / "tls" / "guest_9999.key").read_bytes()
    again = _fate_rdma("site", "init", fed_path, "--party", "guest:9999", "--out", str(out))
    assert again.returncode == 1 and "exists" in again.stderr
    forced = _fate_rdma("site", "init", fed_path, "--party", "guest:9999", "--out", str(out), "--force")
    assert forced.returncode == 0 and (out / "tls" / "guest_9999.key").read_bytes() == key  # (the key stays)


@pytest.mark.parametrize("doc, match", [
    ({"parties": {"guest:9999": {"host": "a"}, "host:9999": {"host": "b"}}}, "share party id 9999"),
    ({"parties": {"guest": {"host": "a"}}}, "is not role:party_id"),
    ({"parties": {"guest:9999": {}}}, "needs {host: ADDRESS}"),
    ({"parties": {"guest:9999": {"host": "a"}}, "ports": {"endpoint": 70000}}, "ports.endpoint must be a port"),
    ({"parties": {"guest:9999": {"host": "a"}}, "ports": {"soft_data": "9-1"}}, "soft_data must be LOW-HIGH"),
    ({"parties": {"guest:9999": {"host": "a"}}, "security": "none"}, "security must be tls or shared-secret"),
    ({"parties": {"guest:9999": {"host": "a"}}, "extra": 1}, "unknown key"),
    ({}, "needs `parties:`"),
    ({"parties": {"guest:9999": {"host": "a"}, "host:10000": {"host": "a"}}}, "have the same endpoint a:18600"),
    ({"parties": {"guest:9999": {"host": "a", "ports": {"osx": 18700}}}}, "its ports overlap"),
])
def test_a_bad_description_is_named(doc, match):
    with pytest.raises(ConfigError, match=match):
        site_recipe.parse(doc)


def test_a_shared_secret_federation_says_so(tmp_path):
    doc = {"parties": {"guest:9999": {"host": "10.0.0.1"}, "host:10000": {"host": "10.0.0.2"}},
           "security": "shared-secret"}
    steps = site_recipe.write(doc, "guest:9999", str(tmp_path / "g"))
    site = yaml.safe_load((tmp_path / "g" / "site.yaml").read_text())
    assert site["shared_secret_only"] is True and site["secret_file"].endswith("federation.secret")
    assert "impersonate" in steps[0] and not (tmp_path / "g" / "tls").exists()
