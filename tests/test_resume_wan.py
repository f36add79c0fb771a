"""Resume across sites on the WAN testbed, with real packets: two sites in their own network namespaces (each its
own address in 198.18.0.0/15, a router between them), a sender streaming transfers of random sizes to the other
site while the receiving site's nftables first drops everything from the sender for 2 s (TCP rides it out),
then answers it with TCP resets for 1 s (every connection breaks: the transfers are resumed). Every payload
arrives once, verified; the cost of each resume is in the sender's results. Needs root, iproute2 and nft;
skips with the reason otherwise. Longer drops (10 s, 30 s) and more transfers: `fate-rdma-lab eval faults`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fate_rdma.channel.auth import write_secret
from fate_rdma_lab.testbed import bed as wan, firewall

ROOT = str(Path(__file__).resolve().parents[1])
COUNT, MAX_BYTES, PORT = 24, 8 << 20, 7200
CHUNK, WINDOW = 1 << 20, 4


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    reason = firewall.problem()
    if reason:
        pytest.skip(f"site namespaces cannot be built here: {reason}")
    with wan.open_sites(2, f"frrs{os.getpid() % 100000}", str(tmp_path_factory.mktemp("wanstate"))) as tb:
        yield tb


def _firewall(ns: str, rule: str) -> None:
    """The receiving site's input chain: `rule` for what comes from the sending site ("" removes it)."""
    firewall.site_rule(ns, "frresume", f"ip saddr 198.18.1.2 meta l4proto tcp {rule}" if rule else "")


def _site(tb, i: int, *argv: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(wan.in_ns(tb.site_ns(i), [sys.executable, "-m", "fate_rdma_lab.eval.faults_site", *argv]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _lines(proc: subprocess.Popen, into: list) -> threading.Thread:
    def read() -> None:
        for line in proc.stdout:
            into.append(json.loads(line))
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def test_transfers_ride_out_a_drop_and_resume_after_resets(testbed, tmp_path):
    secret = str(tmp_path / "secret")
    write_secret(secret)
    conf = json.dumps({"provider": "soft", "secret_file": secret, "shared_secret_only": True, "mode": "fedrdma",
                       "soft_link": "rate=300mbit", "chunk_bytes": CHUNK, "window": WINDOW, "connect_timeout_s": 3, "no_progress_timeout_s": 20,
                       "resume_window_s": 30})
    tx_addr, rx_addr = f"{testbed.site_addr(0)}:{PORT}", f"{testbed.site_addr(1)}:{PORT}"
    rx_ns = testbed.site_ns(1)
    got, sent = [], []
    rx = _site(testbed, 1, "receive", conf, rx_addr, str(COUNT), "120")
    rx_reader = _lines(rx, got)
    deadline = time.monotonic() + 30
    while not got:
        assert rx.poll() is None and time.monotonic() < deadline, rx.stderr.read() if rx.poll() is not None else ""
        time.sleep(0.05)
    tx = _site(testbed, 0, "send", conf, tx_addr, rx_addr, str(COUNT), str(MAX_BYTES), "7")
    tx_reader = _lines(tx, sent)
    try:
        while len(got) < 4:  # (transfers are moving)
            assert tx.poll() is None or len(sent) > 1, tx.stderr.read()
            time.sleep(0.05)
        _firewall(rx_ns, "drop")
        time.sleep(2)
        _firewall(rx_ns, "")
        while len(got) < 1 + COUNT // 2 and tx.poll() is None:
            time.sleep(0.05)
        _firewall(rx_ns, "reject with tcp reset")
        time.sleep(1)
        _firewall(rx_ns, "")
        tx.wait(180)
        rx.wait(180)
    finally:
        _firewall(rx_ns, "")
        for p in (tx, rx):
            if p.poll() is None:
                p.kill()
    tx_reader.join(10)
    rx_reader.join(10)
    results = [r for r in sent if "i" in r]
    errors = [r for r in results if "error" in r]
    assert not errors, (errors, tx.stderr.read()[-4000:])
    msgs = [r for r in got if "i" in r]
    assert sorted(m["i"] for m in msgs) == list(range(COUNT)), (msgs, rx.stderr.read()[-4000:])  # each once
    assert all(m["ok"] for m in msgs), [m for m in msgs if not m["ok"]]
    assert got[-1].get("end") == COUNT and got[-1]["held_bytes"] == 0
    resumed = [r for r in results if r["resumes"]]
    assert resumed, ("the resets broke no transfer", results)
    assert all(r["resent_bytes"] <= (WINDOW + 1) * CHUNK for r in resumed), resumed  # (the chunks in flight, and one)
