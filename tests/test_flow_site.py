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


@pytest.mark.parametrize("endpoints, extra", [(OFF, []), (LOOP, ["--listen-host", "0.0.0.0"])])
def test_setup_off_loopback_wants_certificates_or_says_members_can_impersonate(tmp_path, capsys, endpoints, extra):
    """The secret alone between hosts proves "a member", not which one: setup asks for TLS, or for the explicit
    --shared-secret-only, which it then writes."""
    pytest.importorskip("fate", reason="FATE (pyfate) is not installed: flow setup reports that as its own problem")
    secret = tmp_path / "federation.secret"
    write_secret(str(secret))
    assert _setup(tmp_path, endpoints, "--secret-file", str(secret), *extra) == 1
    err = capsys.readouterr().err
    assert "and no TLS" in err and "--tls-cert" in err and "--shared-secret-only" in err and "impersonate" in err
    assert _setup(tmp_path, endpoints, "--secret-file", str(secret), "--shared-secret-only", *extra) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert "would write" in out and "shared_secret_only: true" in out


def test_setup_takes_loopback_without_a_secret(tmp_path, capsys):
    pytest.importorskip("fate", reason="FATE (pyfate) is not installed: flow setup reports that as its own problem")
    assert _setup(tmp_path, LOOP) == 0, capsys.readouterr().err
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


@pytest.mark.parametrize("moved", [False, True])
def test_the_counters_line_says_what_crossed_the_channel(caplog, moved):
    """A task's closing lines count every object that crossed the channel (small ones under descriptors: channel
    too), and say so when none did because all were under threshold_bytes (a LoRA job's small adapters)."""
    from fate_rdma.federation import flow

    class Rdma:
        endpoint = type("Ep", (), {"holds": 0, "longest_hold_s": 0.0})()
        threshold = 1 << 20
        stats = {"rdma_transfers": 1 if moved else 0, "rdma_bytes": 5 << 20 if moved else 0, "fate_fallbacks": 0,
                 "rdma_seconds": 0.1, "small_transfers": 2 if moved else 0, "small_bytes": 3000 if moved else 0,
                 "below_threshold": 0 if moved else 4}

        def close(self):
            pass

    caplog.set_level("INFO", logger="fate_rdma")
    flow._report(Rdma(), flow.FlowTask("J", "guest", "9999", "nn_0", None))
    text = caplog.text
    if moved:
        assert f"channel_transfers=3 channel_bytes={(5 << 20) + 3000}" in text and "nothing of" not in text
    else:
        assert "channel_transfers=0" in text
        assert "nothing of job J task nn_0 (guest:9999) crossed the channel: its 4 object(s)" in text
        assert "Lower threshold_bytes" in text
