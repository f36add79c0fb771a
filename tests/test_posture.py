"""What an endpoint says its settings protect (channel/posture.py): logged at start, printed by doctor."""
from __future__ import annotations

import pytest

from fate_rdma.channel.auth import write_secret
from fate_rdma.channel.posture import posture
from fate_rdma.config import ChannelConfig


@pytest.fixture
def secret(tmp_path):
    write_secret(str(tmp_path / "s"))
    return str(tmp_path / "s")


def _warnings(cfg, host):
    return [line for level, line in posture(cfg, host) if level == "warning"]


def test_a_shared_secret_between_hosts_says_members_can_impersonate_each_other(secret):
    (w,) = _warnings(ChannelConfig(secret_file=secret), "198.18.0.1")
    assert "members can impersonate each other" in w and "tls request" in w
    assert _warnings(ChannelConfig(secret_file=secret), "127.0.0.1") == []  # one machine: no other member
    lines = " | ".join(line for _, line in posture(ChannelConfig(secret_file=secret), "198.18.0.1"))
    assert "sealed" in lines and "payloads: blake3, a MAC" in lines and "confidentiality: none" in lines


def test_no_secret_and_an_unkeyed_check_are_warnings(secret):
    assert any("NOT authenticated" in w for w in _warnings(ChannelConfig(), "127.0.0.1"))
    unkeyed = ChannelConfig(secret_file=secret, checksum="xxh3", integrity="unkeyed")
    assert any("UNKEYED" in w for w in _warnings(unkeyed, "198.18.0.1"))


def test_doctor_prints_the_posture_of_a_configuration(tmp_path, secret, capsys):
    from fate_rdma.cli import main

    conf = tmp_path / "channel.yaml"
    conf.write_text(f"channel:\n  secret_file: {secret}\n  provider: soft\n")
    main(["doctor", "--config", str(conf)])
    out = capsys.readouterr().out
    assert "security of this configuration" in out and "WARNING: shared secret only (where it listens off loopback)" in out


def test_an_endpoint_off_loopback_on_a_secret_alone_needs_the_sites_word(secret, caplog):
    """Between hosts the default is certificates: the secret alone is refused at start, naming both ways out;
    with shared_secret_only: true it starts and the log says that members can impersonate each other."""
    from fate_rdma import errors as E
    from fate_rdma.channel import Endpoint

    with pytest.raises(E.ConfigError, match="tls: true .*tls request.*shared_secret_only: true"):
        Endpoint(ChannelConfig(secret_file=secret, provider="soft"), host="0.0.0.0")
    with Endpoint(ChannelConfig(secret_file=secret, provider="soft", shared_secret_only=True), host="0.0.0.0"):
        pass
    assert "members can impersonate each other" in caplog.text
    with Endpoint(ChannelConfig(secret_file=secret, provider="soft"), host="127.0.0.1"):  # one machine: as before
        pass
