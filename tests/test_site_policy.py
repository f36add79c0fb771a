"""The site's policy wins: a job's section (FATE-Flow's dag.conf.extra.fate_rdma, or a launcher conf) may tighten
what the site file sets, never loosen it; each key's weaker value is refused naming the key and both values."""
from __future__ import annotations

import json
import types

import pytest
import yaml

from fate_rdma.channel.auth import write_secret
from fate_rdma.config import ChannelConfig
from fate_rdma.errors import ConfigError
from fate_rdma.federation import activate, flow, site_policy
from fate_rdma.federation.config import RdmaFederationConfig

ENDPOINTS = {"guest:9999": "127.0.0.1:18600", "host:10000": "127.0.0.1:18601"}
HALF_MEMORY = ChannelConfig().budget_bytes
GiB = 1 << 30


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "federation.secret"
    write_secret(str(path))
    return str(path)


def merged(site, job):
    out = site_policy.merge(dict(site, endpoints=ENDPOINTS), job, "the job's section", "/etc/site.yaml")
    RdmaFederationConfig.from_section(out)  # (what the job then runs with must be a valid configuration)
    return out


def refused(site, job, key):
    with pytest.raises(ConfigError) as err:
        merged(site, job)
    msg = str(err.value)
    assert f"the job's section sets {key}: " in msg and f"/etc/site.yaml has {key}: " in msg, msg
    return msg


# -- checksum: none < crc32c < xxh3 < blake3 = blake2b ---------------------------------------------------
ORDER = ["none", "crc32c", "xxh3", "blake3", "blake2b"]
RANK = {"none": 0, "crc32c": 1, "xxh3": 2, "blake3": 3, "blake2b": 3}


@pytest.mark.parametrize("site_sum", ORDER)
@pytest.mark.parametrize("job_sum", ORDER)
def test_checksum_stronger_or_equal_only(secret, site_sum, job_sum):
    site = {"checksum": site_sum, "secret_file": secret}
    if RANK[job_sum] >= RANK[site_sum]:
        assert merged(site, {"checksum": job_sum})["checksum"] == job_sum
    else:
        msg = refused(site, {"checksum": job_sum}, "checksum")
        assert f"sets checksum: {job_sum}," in msg and f"has checksum: {site_sum};" in msg
        assert "none < crc32c < xxh3 < blake3 = blake2b" in msg


def test_auto_is_what_it_means_at_the_site(secret):
    """checksum auto is a MAC (blake3) where the site authenticates: a job may not ask for xxh3 there."""
    msg = refused({"secret_file": secret}, {"checksum": "xxh3"}, "checksum")
    assert "has checksum: blake3 (the default" in msg  # (auto, as it reads at this site)
    assert merged({"secret_file": secret}, {"checksum": "auto"})["checksum"] == "blake3"
    assert merged({}, {"checksum": "xxh3"})["checksum"] == "xxh3"  # no secret at the site: auto is xxh3


def test_the_reported_case_none_over_blake2b(secret):
    msg = refused({"checksum": "blake2b", "secret_file": secret}, {"checksum": "none"}, "checksum")
    assert "sets checksum: none" in msg and "has checksum: blake2b" in msg and "never a weaker one" in msg


def test_a_key_the_site_does_not_set_holds_jobs_to_its_default():
    msg = refused({}, {"checksum": "crc32c"}, "checksum")
    assert "has checksum: xxh3 (the default: the site file does not set it)" in msg
    assert merged({}, {"checksum": "xxh3"})["checksum"] == "xxh3"
    assert merged({"checksum": "crc32c"}, {"checksum": "crc32c"})["checksum"] == "crc32c"  # a site still on crc32c


def test_what_the_job_does_not_set_is_the_sites():
    out = merged({"checksum": "crc32c", "same_host": False, "slot_bytes": 64 << 20}, {"mode": "fedrdma"})
    assert out["checksum"] == "crc32c" and out["same_host"] is False and out["slot_bytes"] == 64 << 20
    assert out["mode"] == "fedrdma"


# -- same_host: off, not on ---------------------------------------------------------------------------------
def test_same_host_may_be_switched_off_not_on():
    assert merged({"same_host": True}, {"same_host": False})["same_host"] is False
    assert merged({}, {"same_host": False})["same_host"] is False
    assert merged({"same_host": False}, {"same_host": False})["same_host"] is False
    msg = refused({"same_host": False}, {"same_host": True}, "same_host")
    assert "sets same_host: true," in msg and "has same_host: false;" in msg and "off, not on" in msg


# -- memory bounds and the handshake cap: lower, not higher --------------------------------------------------
@pytest.mark.parametrize("key, site_value", [
    ("memory_budget_bytes", 2 * GiB), ("slot_bytes", 64 << 20), ("slot_initial_bytes", 1 << 20), ("pool_slots", 2),
    ("max_payload_bytes", 8 * GiB), ("recv_cache_bytes", GiB), ("put_buffer_bytes", GiB),
    ("max_pending_handshakes", 16)])
def test_memory_bounds_may_be_lowered_not_raised(key, site_value):
    site = {key: site_value}
    assert merged(site, {key: site_value})[key] == site_value
    lower = site_value // 2 if key != "memory_budget_bytes" else GiB
    assert merged(site, {key: lower})[key] == lower
    msg = refused(site, {key: site_value + 1}, key)
    assert f"sets {key}: {site_value + 1}," in msg and f"has {key}: {site_value};" in msg
    assert "lower it, not raise it" in msg


def test_peer_budget_fraction_may_be_lowered_not_raised():
    assert merged({}, {"peer_budget_fraction": 0.25})["peer_budget_fraction"] == 0.25  # an arbiter of 4 clients
    assert merged({"peer_budget_fraction": 1.0}, {"peer_budget_fraction": 0.5})["peer_budget_fraction"] == 0.5
    msg = refused({}, {"peer_budget_fraction": 1.0}, "peer_budget_fraction")
    assert "has peer_budget_fraction: 0.5 (the default" in msg and "lower it, not raise it" in msg


def test_memory_bounds_against_their_defaults():
    assert merged({}, {"slot_bytes": 8 << 20})["slot_bytes"] == 8 << 20  # what the fate-flow tests' jobs set
    assert merged({}, {"slot_bytes": 256 << 20})["slot_bytes"] == 256 << 20  # the examples: the default
    refused({}, {"slot_bytes": 512 << 20}, "slot_bytes")
    refused({}, {"max_pending_handshakes": 1024}, "max_pending_handshakes")


def test_memory_budget_null_is_half_the_machine():
    # a site without a budget holds a job to half of this machine's memory (what null means)
    assert merged({}, {"memory_budget_bytes": GiB})["memory_budget_bytes"] == GiB
    refused({}, {"memory_budget_bytes": HALF_MEMORY + 1}, "memory_budget_bytes")
    # a site with one: a job's null would lift it to half the machine
    if HALF_MEMORY > 2 * GiB:
        msg = refused({"memory_budget_bytes": 2 * GiB}, {"memory_budget_bytes": None}, "memory_budget_bytes")
        assert "sets memory_budget_bytes: null," in msg


def test_a_value_the_key_does_not_take_is_left_to_the_configurations_own_check():
    with pytest.raises(ConfigError, match="checksum must be"):
        merged({}, {"checksum": "md5"})
    with pytest.raises(ConfigError, match="slot_initial_bytes must be an integer"):
        merged({}, {"slot_initial_bytes": "big"})


# -- site only: tls, auth, secret_file, endpoints, listen_host, ... ------------------------------------------
def test_tls_may_be_switched_on_not_off():
    assert site_policy.merge({"tls": False}, {"tls": True}, "job")["tls"] is True
    assert site_policy.merge({"tls": True}, {"tls": True}, "job")["tls"] is True
    with pytest.raises(ConfigError, match=r"sets tls: false, .* has tls: true; a job may switch TLS on, not off"):
        site_policy.merge({"tls": True}, {"tls": False}, "job")


def test_auth_may_not_be_switched_off(secret):
    site = {"secret_file": secret}  # auth: auto with a secret authenticates
    assert merged(site, {"auth": "hmac"})["auth"] == "hmac"
    assert merged(site, {"auth": "auto"})["auth"] == "auto"
    msg = refused(site, {"auth": "none"}, "auth")
    assert "sets auth: none," in msg and "has auth: auto" in msg
    assert merged({}, {"auth": "none"})["auth"] == "none"  # a site on loopback without a secret: nothing to keep


@pytest.mark.parametrize("key, site_value, job_value", [
    ("secret_file", "SECRET", "/tmp/other.secret"),
    ("secret_file", "SECRET", None),
    ("listen_host", "127.0.0.1", "0.0.0.0"),
    ("provider", "soft", "pyverbs"),
    ("device", "mlx5_0", "mlx5_1"),
    ("tls_ca", "/etc/fate_rdma/ca.pem", "/tmp/my-ca.pem"),
])
def test_site_only_keys_take_the_sites_value_only(secret, key, site_value, job_value):
    site_value = secret if site_value == "SECRET" else site_value
    msg = refused({key: site_value}, {key: job_value}, key)
    assert "set by the site only" in msg
    assert site_policy.merge({key: site_value}, {key: site_value}, "job")[key] == site_value


def test_endpoints_a_job_may_name_only_the_sites_parties_at_their_addresses():
    site = {"endpoints": ENDPOINTS}
    assert site_policy.merge(site, {"endpoints": {"guest:9999": "127.0.0.1:18600"}}, "job")["endpoints"] == \
        {"guest:9999": "127.0.0.1:18600"}  # fewer allowed peers: tighter
    for bad in ({"guest:9999": "10.9.9.9:18600"}, dict(ENDPOINTS, **{"evil:1": "127.0.0.1:9"}), ["guest:9999"]):
        with pytest.raises(ConfigError, match="sets endpoints: .*only parties of the site's endpoints"):
            site_policy.merge(site, {"endpoints": bad}, "job")


# -- where the policy is applied ---------------------------------------------------------------------------
def test_no_site_file_the_job_conf_is_the_only_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("FATE_RDMA_SITE", str(tmp_path / "none.yaml"))
    job = {"endpoints": ENDPOINTS, "checksum": "none", "same_host": True, "slot_bytes": 4 * GiB}
    assert flow.apply_site_policy(job, "job") == job


def _site_file(tmp_path, monkeypatch, **keys):
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(dict({"endpoints": ENDPOINTS}, **keys)))
    monkeypatch.setenv("FATE_RDMA_SITE", str(path))
    return path


def test_a_launcher_job_is_held_to_the_site_file_on_its_machine(tmp_path, monkeypatch, secret):
    path = _site_file(tmp_path, monkeypatch, checksum="blake2b", secret_file=secret)
    with pytest.raises(ConfigError, match=f"sets checksum: none, .*{path} has checksum: blake2b"):
        flow.apply_site_policy({"endpoints": ENDPOINTS, "checksum": "none"}, "job")
    out = flow.apply_site_policy({"endpoints": ENDPOINTS, "mode": "fedrdma"}, "job")
    assert out["checksum"] == "blake2b" and out["secret_file"] == secret and out["mode"] == "fedrdma"
    # activate.wrap (FATE_RDMA_CONF, a task conf or install()): refused before an endpoint is made
    monkeypatch.setattr(activate, "_explicit", {"endpoints": ENDPOINTS, "checksum": "crc32c"})
    with pytest.raises(ConfigError, match="this job's fate_rdma section sets checksum: crc32c"):
        activate.wrap(types.SimpleNamespace(), None)


def test_a_flow_job_that_loosens_the_site_fails_even_under_fallback_fate(tmp_path, monkeypatch, secret):
    _site_file(tmp_path, monkeypatch, checksum="blake2b", secret_file=secret)
    section = {"checksum": "none", "fallback": "fate"}
    monkeypatch.setattr(flow, "fetch_job_conf", lambda url, task: {"extra": {"fate_rdma": section}})
    task = flow.FlowTask("J", "guest", "9999", "nn_0", "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="job J task nn_0 .*dag.conf.extra.fate_rdma sets checksum: none") as err:
        flow.wrap_flow_task(types.SimpleNamespace(local_party=("guest", "9999")), None, task)
    assert not isinstance(err.value, flow.FlowRouteError)  # (the fallback takes FlowRouteErrors only)


def test_flow_check_reports_a_job_conf_that_loosens_the_site(tmp_path, capsys, secret):
    from fate_rdma.cli.flow import _check_job_conf

    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"dag": {"conf": {"extra": {"fate_rdma": {"same_host": True}}}, "parties": []}}))
    problems = _check_job_conf(str(job), {"endpoints": ENDPOINTS, "same_host": False})
    assert len(problems) == 1 and "sets same_host: true" in problems[0] and "has same_host: false" in problems[0]
    assert _check_job_conf(str(job), {"endpoints": ENDPOINTS}) == []


def test_a_flow_section_still_may_not_name_a_site_key():
    for key in site_policy.SITE_ONLY_KEYS:
        with pytest.raises(flow.FlowRouteError, match=f"sets {key}, which belong to the site"):
            flow.check_job_section({key: "x"})


def test_launch_refuses_a_conf_that_loosens_the_site_with_exit_2(tmp_path, monkeypatch, capsys, secret):
    from fate_rdma.cli import main

    _site_file(tmp_path, monkeypatch, checksum="blake2b", secret_file=secret)
    conf, script = tmp_path / "job.yaml", tmp_path / "job.py"
    conf.write_text(json.dumps({"fate_rdma": {"endpoints": ENDPOINTS, "checksum": "none"}}))
    script.write_text("")
    assert main(["launch", "--conf", str(conf), str(script)]) == 2
    assert "sets checksum: none" in capsys.readouterr().err
