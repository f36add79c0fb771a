"""Prometheus metrics (fate_rdma/metrics.py) and the site's exporter (fate_rdma/exporter.py): a process with
endpoints writes them into metrics_dir, the exporter serves their sum, keeps what ended processes counted and
drops their live gauges; `fate-rdma top` shows them. (A real Prometheus scraping a FATE job: test_prometheus.py.)"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import urllib.request

import pytest

import fate_rdma
from fate_rdma import errors as E
from fate_rdma import exporter, metrics
from fate_rdma.channel.auth import write_secret
from fate_rdma.cli.top import parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _samples(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _files(folder: str) -> list:
    return [f for f in os.listdir(folder) if not f.startswith(".")]  # (.exporter.lock aside)


def _total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


@pytest.fixture(scope="module")
def ended_process(tmp_path_factory):
    """The metrics folder of a process that moved three payloads, had one refused and one dial fail, and ended."""
    d = tmp_path_factory.mktemp("metrics")
    write_secret(str(d / "s1"))
    write_secret(str(d / "s2"))
    r = subprocess.run([sys.executable, "-m", "tests.metrics_peer", str(d / "m"), str(d / "s1"), str(d / "s2")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(d / "m"), json.loads(r.stdout.strip().splitlines()[-1])


def test_the_exporter_serves_what_an_ended_process_counted(ended_process):
    folder, did = ended_process
    assert sorted(f.split("_")[0] for f in _files(folder)) == ["counter", "gauge", "gauge", "histogram"]
    server, url = exporter.serve(folder, "127.0.0.1", 0)
    try:
        first = _samples(url)
        b = did["b"]
        assert _total(first, "fate_rdma_sent_bytes_total", peer=b) == did["bytes"]
        assert _total(first, "fate_rdma_sent_transfers_total", peer=b, mode="fedrdma-e") == did["transfers"]
        assert _total(first, "fate_rdma_received_bytes_total", peer="a") == did["bytes"]
        assert _total(first, "fate_rdma_transfer_duration_seconds_count", peer=b) == did["transfers"]
        assert _total(first, "fate_rdma_errors_total", side="send", kind="too_large") == 1
        assert _total(first, "fate_rdma_authentication_failures_total", side="dialer") == 1
        assert _total(first, "fate_rdma_authentication_failures_total", side="acceptor") == 1
        assert _total(first, "fate_rdma_build_info") == 0  # (livemax: the versions of running processes only)
        assert _total(first, "fate_rdma_exporter_build_info", version=fate_rdma.__version__) == 1
        # the process ended: its live gauges went, its counters were folded into the archive and still count
        assert not any(n in ("fate_rdma_connections", "fate_rdma_in_flight_bytes") and v for (n, _), v in first.items())
        assert sorted(_files(folder)) == ["counter_archive.db", "histogram_archive.db"]
        again = _samples(url)
        assert {k: v for k, v in again.items() if "created" not in k[0]} == \
            {k: v for k, v in first.items() if "created" not in k[0]}
    finally:
        server.shutdown()


def test_top_prints_each_peer_and_the_errors(ended_process):
    folder, did = ended_process
    server, url = exporter.serve(folder, "127.0.0.1", 0)
    try:
        r = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "top", "--once", "--interval", "0.2", "--url", url],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith((did["b"], "a "))}
    assert "1.3 MiB" in rows[did["b"]] and " 3/0" in rows[did["b"]], r.stdout  # sent to b, 3 transfers out
    assert "1.3 MiB" in rows["a"] and "0/3" in rows["a"], r.stdout
    assert "errors: send authentication 1, send too_large 1" in r.stdout  # (the stranger's dial: send_failed)
    assert "authentication failures 2" in r.stdout


def test_top_says_when_the_exporter_cannot_be_read():
    r = subprocess.run([sys.executable, "-m", "fate_rdma.cli", "top", "--once", "--url", "http://127.0.0.1:9/metrics"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and "cannot read http://127.0.0.1:9/metrics" in r.stderr and "exporter" in r.stderr


def test_the_exporter_leaves_a_live_process_files_alone(tmp_path):
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    key = mmap_key("fate_rdma_sent_bytes", "fate_rdma_sent_bytes_total", ["peer"], ["x:1"], "h")
    for pid in (os.getpid(), 2 ** 22 + 1):  # (this process is alive; a pid above pid_max never is)
        d = MmapedDict(str(tmp_path / f"counter_{pid}.db"))
        d.write_value(key, 5.0, 0.0)
        d.close()
    assert exporter.tidy(str(tmp_path)) == {"ended": 1, "folded": 1, "dropped": 0, "unreadable": 0}
    assert sorted(_files(str(tmp_path))) == sorted(["counter_archive.db", f"counter_{os.getpid()}.db"])
    exporter.tidy(str(tmp_path))
    values = [v for _, v, _, _ in MmapedDict.read_all_values_from_file(str(tmp_path / "counter_archive.db"))]
    assert values == [5.0]


def test_every_error_has_a_bounded_kind():
    assert metrics.kind_of(E.IntegrityError("x")) == "integrity"
    assert metrics.kind_of(E.AuthenticationError("x")) == "authentication"
    assert metrics.kind_of(E.RemoteProtocolError("x")) == "protocol"
    assert metrics.kind_of(E.PeerUnreachable("x")) == "unreachable"
    assert metrics.kind_of(KeyError("x")) == "other"
    assert set(metrics.ERROR_KINDS) >= {metrics.kind_of(e) for e in (E.TransferTimeout("t"), E.ConfigError("c"))}


def test_metrics_are_off_unless_the_site_sets_a_folder():
    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    with Endpoint(ChannelConfig(provider="soft")):
        pass
    assert not metrics.enabled()  # (no test of this process sets metrics_dir: the peers above are processes)
    with pytest.raises(E.ConfigError, match="metrics_dir"):
        ChannelConfig(metrics_dir="  ")


def test_parse_sums_over_modes_and_paths():
    text = ('fate_rdma_sent_bytes_total{peer="p",mode="fedrdma",provider="soft",path="tcp-emulated"} 10\n'
            'fate_rdma_sent_bytes_total{peer="p",mode="fedrdma-e",provider="soft",path="tcp-emulated"} 5\n'
            'fate_rdma_connections 2\n')
    snap = parse(text, 0.0)
    assert snap.peers["p"]["sent"] == 15 and snap.gauges["connections"] == 2


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_large_transfer_leaves_one_line_in_the_log(caplog, fmt):
    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    cfg = ChannelConfig(provider="soft", chunk_bytes=256 << 10, log_format=fmt)
    caplog.set_level("INFO", logger="fate_rdma.transfers")
    with Endpoint(cfg) as rx, Endpoint(cfg) as tx:
        tx.send(rx.address, b"s" * 1000).result(20)  # (below metrics.LOG_BYTES: no line)
        tx.send(rx.address, b"b" * (2 << 20)).result(20)
        for _ in range(2):
            rx.recv(20).release()
    lines = [r.getMessage() for r in caplog.records if r.name == "fate_rdma.transfers"]
    assert len(lines) == 1, lines
    if fmt == "json":
        rec = json.loads(lines[0])
        assert rec["peer"] == rx.address and rec["bytes"] == 2 << 20 and rec["ok"] is True
        assert rec["seconds"] > 0 and rec["gbit_s"] > 0 and rec["integrity"] == "xxh3" and rec["mode"] == "fedrdma-e"
        assert rec["path"] in ("tcp-emulated", "same-host-emulated") and rec["provider"] == "soft"
    else:
        assert lines[0].startswith(f"sent {2 << 20} bytes to {rx.address} in ") and "fedrdma-e" in lines[0]


def test_a_failed_large_transfer_is_logged_with_its_kind(caplog):
    from fate_rdma.channel import Endpoint
    from fate_rdma.config import ChannelConfig

    caplog.set_level("INFO", logger="fate_rdma.transfers")
    with Endpoint(ChannelConfig(provider="soft", slot_bytes=1 << 20, max_payload_bytes=1 << 20)) as rx, \
            Endpoint(ChannelConfig(provider="soft", log_format="json")) as tx:
        with pytest.raises(E.PayloadTooLarge):
            tx.send(rx.address, b"x" * (3 << 20)).result(20)
    (line,) = [r for r in caplog.records if r.name == "fate_rdma.transfers"]
    rec = json.loads(line.getMessage())
    assert line.levelname == "WARNING" and rec["ok"] is False and rec["kind"] == "too_large" and rec["error"]


def test_a_corrupt_file_of_an_ended_process_is_set_aside_not_served_twice(tmp_path):
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    dead = 2 ** 22 + 3
    corrupt = struct.pack("ii", 64, 0) + struct.pack("i", 1000) + bytes(52)  # (a key longer than the file)
    (tmp_path / f"counter_{dead}.db").write_bytes(corrupt)
    d = MmapedDict(str(tmp_path / f"histogram_{dead}.db"))
    d.write_value(mmap_key("h", "h_sum", [], [], "h"), 2.5, 0.0)
    d.close()
    assert exporter.tidy(str(tmp_path)) == {"ended": 1, "folded": 1, "dropped": 0, "unreadable": 1}
    assert sorted(_files(str(tmp_path))) == ["counter_" + str(dead) + ".bad", "histogram_archive.db"]
    assert exporter.tidy(str(tmp_path))["folded"] == 0  # (nothing is folded twice)


def test_metrics_stay_off_in_a_folder_others_may_write(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    assert metrics.folder_problem(str(d)) == "any user may write into it"
    os.chmod(d, 0o1777)  # (sticky, as /tmp: others cannot replace our files)
    assert metrics.folder_problem(str(d)) is None
    link = tmp_path / "link"
    link.symlink_to(d)
    assert metrics.folder_problem(str(link)) == "it is a symbolic link"
