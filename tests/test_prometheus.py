"""A real Prometheus (Debian's package; deploy/install-prometheus.sh) scrapes the site's `fate-rdma exporter`
while a FATE launcher job of three parties runs over fate-rdma with metrics_dir set: the bytes per peer that
Prometheus' query API reports match the payloads the job moved (within their framing), and errors a process
then induces (a payload its receiver refuses, a dial with the wrong secret) are counted by kind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from fate_rdma.channel.auth import write_secret
from fate_rdma_lab.bench.local import free_ports, run_group, stop_group

from .metrics_job import UPLOAD

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTIES = ["guest:9999", "host:10000", "arbiter:10000"]
#: what the wrapper's frame of one array adds to its bytes (names, dtype, shape), at most
FRAMING = 64 << 10


def _start(cmd, log_path, cwd):
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=cwd, start_new_session=True)


def _wait_for(what, fn, timeout_s, log_path=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.3)
    tail = open(log_path).read()[-3000:] if log_path and os.path.exists(log_path) else ""
    pytest.fail(f"{what} within {timeout_s} s\n{tail}")


def _query(prom: str, expr: str):
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        r = json.load(urllib.request.urlopen(url, timeout=5))
    except OSError:
        return None
    assert r["status"] == "success", r
    return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in r["data"]["result"]}


def _by(result, label):
    return {dict(k).get(label): v for k, v in (result or {}).items()}


@pytest.fixture
def prometheus_and_exporter(tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("Prometheus is not installed (make test runs deploy/install-prometheus.sh; as root: "
                    "apt-get install prometheus)")
    folder = tmp_path / "metrics"
    exp_port, prom_port = free_ports(2)
    exp_log, prom_log = tmp_path / "exporter.log", tmp_path / "prometheus.log"
    exporter = _start([sys.executable, "-m", "fate_rdma.cli", "exporter", "--dir", str(folder), "--listen",
                       f"127.0.0.1:{exp_port}"], exp_log, ROOT)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: fate-rdma\n    static_configs:\n      - targets: ['127.0.0.1:{exp_port}']\n")
    prom = _start([exe, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                   f"--web.listen-address=127.0.0.1:{prom_port}"], prom_log, str(tmp_path))
    url = f"http://127.0.0.1:{prom_port}"
    try:
        _wait_for("the exporter serving", lambda: "serving" in exp_log.read_text(), 30, str(exp_log))
        _wait_for("Prometheus scraping the exporter (target up)",
                  lambda: _by(_query(url, 'up{job="fate-rdma"}'), "job").get("fate-rdma") == 1.0, 60, str(prom_log))
        yield url, str(folder)
    finally:
        for p in (prom, exporter):
            stop_group(p)


def test_prometheus_sees_the_bytes_of_a_fate_job_per_peer_and_the_errors(prometheus_and_exporter, tmp_path):
    pytest.importorskip("fate.arch.launchers.multiprocess_launcher", reason="FATE (pyfate) is not installed")
    from fate_rdma.federation.hook import pth_path

    if not os.path.exists(pth_path()):
        pytest.skip("the start-up hook is not installed (make test runs `fate-rdma hook install`)")
    prom, folder = prometheus_and_exporter
    ports = free_ports(3)
    addr = dict(zip(PARTIES, (f"127.0.0.1:{p}" for p in ports)))
    conf = tmp_path / "fate_rdma.json"
    conf.write_text(json.dumps({"fate_rdma": {"mode": "fedrdma-e", "provider": "soft", "slot_bytes": 32 << 20,
                                              "connect_timeout_s": 10, "metrics_dir": folder, "endpoints": addr}}))
    cmd = [sys.executable, "-m", "fate_rdma.cli", "launch", "--conf", str(conf),
           os.path.join(ROOT, "tests", "metrics_job.py"), "--parties", *PARTIES, "--log_level", "WARNING"]
    r = run_group(cmd, timeout=300, cwd=str(tmp_path))  # (the launcher's parties go with it if it overruns)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]

    guest, host, arbiter = (addr[x] for x in PARTIES)
    up = {guest: UPLOAD["guest"] * 4, host: UPLOAD["host"] * 4}  # float32
    avg = UPLOAD["guest"] * 4  # the mean has the guest's size
    want_sent = {arbiter: up[guest] + up[host], guest: avg, host: avg}  # by the peer it went to
    want_received = {guest: up[guest], host: up[host], arbiter: 2 * avg}  # by the peer it came from

    def scraped():
        sent = _by(_query(prom, "sum by (peer) (fate_rdma_sent_bytes_total)"), "peer")
        received = _by(_query(prom, "sum by (peer) (fate_rdma_received_bytes_total)"), "peer")
        done = set(sent) == set(want_sent) and set(received) == set(want_received)
        return (sent, received) if done else None

    sent, received = _wait_for("Prometheus holding the job's bytes for every peer", scraped, 30)
    for peer, n in want_sent.items():
        assert n <= sent[peer] <= n + 2 * FRAMING, (peer, sent[peer], n)
    for peer, n in want_received.items():
        assert n <= received[peer] <= n + 2 * FRAMING, (peer, received[peer], n)
    transfers = _by(_query(prom, "sum by (peer) (fate_rdma_sent_transfers_total)"), "peer")
    assert transfers == {arbiter: 2.0, guest: 1.0, host: 1.0}, transfers
    p90 = _query(prom, "histogram_quantile(0.9, sum by (le) (rate(fate_rdma_transfer_duration_seconds_bucket[5m])))")
    assert p90 is not None

    # errors, induced by a process of this site that writes into the same folder
    write_secret(str(tmp_path / "s1"))
    write_secret(str(tmp_path / "s2"))
    r = subprocess.run([sys.executable, "-m", "tests.metrics_peer", folder, str(tmp_path / "s1"),
                        str(tmp_path / "s2")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

    def errors():
        e = _by(_query(prom, 'sum by (kind) (fate_rdma_errors_total{side="send"})'), "kind")
        a = _by(_query(prom, "sum by (side) (fate_rdma_authentication_failures_total)"), "side")
        return (e, a) if e.get("too_large") == 1.0 and a.get("dialer") == 1.0 and a.get("acceptor") == 1.0 else None

    e, a = _wait_for("Prometheus counting the induced errors by kind", errors, 30)
    assert {k: v for k, v in e.items() if v} == {"too_large": 1.0, "authentication": 1.0}, e  # (the dial)
    # the job's counters stayed counted after its processes ended (the exporter folded them into its archive)
    assert _by(_query(prom, "sum by (peer) (fate_rdma_sent_bytes_total)"), "peer")[arbiter] == sent[arbiter]
