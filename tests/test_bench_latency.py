"""`fate-rdma bench latency`: a ping-pong between two processes, the channel beside raw TCP in one run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import require_same_host

BASE = [sys.executable, "-m", "fate_rdma.cli", "bench", "latency", "--provider", "soft", "--reps", "5"]


def _rows(out: str):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_bench_latency_rows_are_labelled_and_compared_with_raw_tcp_of_the_same_run():
    out = subprocess.run(BASE + ["--sizes", "64K,1M"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _rows(out.stdout)
    assert [(r["msg_bytes"], r["method"]) for r in rows] == [
        (65536, "raw_tcp"), (65536, "fedrdma-e"), (65536, "fedrdma"),
        (1 << 20, "raw_tcp"), (1 << 20, "fedrdma-e"), (1 << 20, "fedrdma")]
    for r in rows:
        assert r["bench"] == "latency" and r["rtt_ms_median"] > 0 and r["rtt_ms_p90"] >= r["rtt_ms_median"]
        assert r["cpu_ms_local"] >= 0 and r["cpu_ms_peer"] >= 0 and "loadavg_1m" in r
        if r["method"] == "raw_tcp":
            assert r["emulated"] is False and "x_raw_tcp" not in r
        else:
            assert r["provider"] == "soft" and r["emulated"] is True and r["path"] == "tcp"
            assert r["label"] == "soft (emulated verbs over TCP)" and r["checksum"] == "xxh3"
            raw = next(x for x in rows if x["method"] == "raw_tcp" and x["msg_bytes"] == r["msg_bytes"])
            assert r["x_raw_tcp"] == round(raw["rtt_ms_median"] / r["rtt_ms_median"], 3)
    assert "not RDMA: these are emulated figures" in out.stdout


def test_bench_latency_same_host_path_and_bad_arguments():
    require_same_host()
    out = subprocess.run(BASE + ["--sizes", "4K", "--modes", "fedrdma-e", "--path", "same-host", "--checksum", "none"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    row = _rows(out.stdout)[1]
    assert row["path"].startswith("same-host") and row["checksum"] == "none" and row["emulated"] is True
    for bad, why in ((["--sizes", "0K"], "a size must be positive"), (["--sizes", "1X"], "bad size '1X'"),
                     (["--modes", "grpc"], "modes must be among"), (["--reps", "0"], "--reps >= 1")):
        out = subprocess.run(BASE + bad, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_bench_latency_refuses_a_bad_channel_config_in_one_line():
    out = subprocess.run(BASE[:-4] + ["--provider", "nosuch", "--reps", "2", "--sizes", "4K", "--modes", "fedrdma-e"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ConfigError" in out.stderr and "nosuch" in out.stderr and "Traceback" not in out.stderr


def _fails(ctl):
    raise ValueError("boom in the peer")


def test_a_peer_error_reaches_the_driver_by_name():
    from fate_rdma.bench import latency

    proc, ctl = latency._peer(_fails)
    try:
        with pytest.raises(latency._PeerFailed, match="the peer process failed: ValueError: boom in the peer"):
            latency._ctl_recv(ctl, proc, 30)
        proc.join(10)
        # a failure of the driver's own (its symptom) gives way to the error the peer sent, if any
        assert str(latency._peer_error(ctl, TimeoutError("symptom"))) == "symptom"
    finally:
        latency._stop(proc, ctl)
