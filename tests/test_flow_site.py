"""`fate-rdma flow setup` checks a site before writing it: a site whose endpoints are off loopback needs the
federation's secret or TLS, else every fate-flow task of it would fail as its endpoint starts."""
from __future__ import annotations

import pytest

from fate_rdma.channel.auth import write_secret
from fate_rdma.cli import main

OFF = ["guest:9999=198.18.1.10:18600", "host:10000=198.18.2.10:18600", "arbiter:10000=198.18.3.10:18600"]
LOOP = ["guest:9999=127.0.0.1:18600", "host:10000=127.0.0.1:18601", "arbiter:10000=127.0.0.1:18602"]


def _setup(tmp_path, endpoints, *extra):
    argv = ["flow", "setup", "--dry-run", "--site", str(tmp_path / "site.yaml"), "--provider", "soft"]
    for e in endpoints:
        argv += ["--endpoint", e]
    return main(argv + list(extra))


@pytest.mark.parametrize("endpoints, extra, said", [
    (OFF, [], "198.18.1.10, 198.18.2.10, 198.18.3.10 (not loopback)"),
    (LOOP, ["--listen-host", "0.0.0.0"], "listen_host) on 0.0.0.0 (not loopback)")])
def test_setup_refuses_endpoints_off_loopback_without_authentication(tmp_path, capsys, endpoints, extra, said):
    assert _setup(tmp_path, endpoints, *extra) == 1
    err = capsys.readouterr().err
    assert said in err and "and no authentication" in err and "--secret-file" in err


@pytest.mark.parametrize("endpoints, extra", [(OFF, []), (LOOP, ["--listen-host", "0.0.0.0"]), (LOOP, [])])
def test_setup_takes_them_with_the_federation_secret_and_loopback_without(tmp_path, capsys, endpoints, extra):
    pytest.importorskip("fate", reason="FATE (pyfate) is not installed: flow setup reports that as its own problem")
    secret = tmp_path / "federation.secret"
    write_secret(str(secret))
    auth = ["--secret-file", str(secret)] if extra or endpoints is OFF else []
    assert _setup(tmp_path, endpoints, *auth, *extra) == 0, capsys.readouterr().err
    assert "would write" in capsys.readouterr().out


def test_what_counts_as_loopback_and_which_hosts_launch_and_flow_look_at():
    from fate_rdma.config import is_loopback_host
    from fate_rdma.federation.config import RdmaFederationConfig

    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert is_loopback_host(host), host
    for host in ("127.example.com", "0.0.0.0", "198.18.1.10", "::", "localhost.example.com", ""):
        assert not is_loopback_host(host), host
    cfg = RdmaFederationConfig.from_section({"endpoints": {"guest:9999": "127.0.0.1:1", "host:10000": "127.0.0.1:2"},
                                             "listen_host": "0.0.0.0"})
    # flow: the site's endpoints listen on 0.0.0.0, which needs the secret; launch: every party on this machine,
    # and the per-job secret it makes covers the wide listen address
    assert cfg.hosts_off_loopback() == ["0.0.0.0"] and cfg.hosts_off_loopback(listen=False) == []
