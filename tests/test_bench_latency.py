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
            assert r["label"] == "soft (emulated verbs, not RDMA)" and r["checksum"] == "xxh3"
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
    from fate_rdma_lab.bench import latency

    proc, ctl = latency._peer(_fails)
    try:
        with pytest.raises(latency._PeerFailed, match="the peer process failed: ValueError: boom in the peer"):
            latency._ctl_recv(ctl, proc, 30)
        proc.join(10)
        # a failure of the driver's own (its symptom) gives way to the error the peer sent, if any
        assert str(latency._peer_error(ctl, TimeoutError("symptom"))) == "symptom"
    finally:
        latency._stop(proc, ctl)


def test_steps_split_each_message_joined_across_the_two_processes():
    """--steps: a traced pass after the row, each message's sender events joined with its receiver's (the other
    process's file) on the transfer id; every message of the pass (both directions, warm-up included) whole."""
    out = subprocess.run(BASE + ["--sizes", "64K", "--modes", "fedrdma-e", "--steps"], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    split = [r for r in _rows(out.stdout) if r.get("steps")]
    assert len(split) == 1 and split[0]["method"] == "fedrdma-e" and split[0]["emulated"] is True
    assert split[0]["messages"] == 2 * 5  # --reps 5 (after 10 warm-up round trips, left out), a message each way
    for name in ("queue", "post", "wire", "verify", "deliver", "verdict", "total"):
        assert split[0][f"{name}_ms"] is not None and split[0][f"{name}_ms"] >= 0
    assert split[0]["total_ms"] > split[0]["wire_ms"] > 0
    assert "where a message's time goes" in out.stdout


def test_steps_join_on_the_transfer_id_in_the_other_file(tmp_path):
    from fate_rdma_lab.bench.latency import steps

    def write(pid, events):
        (tmp_path / f"trace-{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"t": 1, "ev"')

    # process 1 sends tid 7 (which process 2 receives); process 2 sends its own tid 7 back, received by 1;
    # a tid sent but never received and a receive without its send join nothing
    write(1, [{"t": 0.0, "ev": "c_send", "tid": 7}, {"t": 0.001, "ev": "c_start", "tid": 7},
              {"t": 0.002, "ev": "c_first", "tid": 7}, {"t": 0.010, "ev": "c_done", "tid": 7},
              {"t": 0.020, "ev": "c_arrived", "tid": 7, "peer": "p2"}, {"t": 0.021, "ev": "c_verified", "tid": 7},
              {"t": 0.023, "ev": "c_deliver", "tid": 7}, {"t": 0.5, "ev": "c_send", "tid": 9},
              {"t": 0.6, "ev": "c_arrived", "tid": 11}])
    write(2, [{"t": 0.005, "ev": "c_arrived", "tid": 7, "peer": "p1"}, {"t": 0.006, "ev": "c_verified", "tid": 7},
              {"t": 0.008, "ev": "c_deliver", "tid": 7}, {"t": 0.012, "ev": "c_send", "tid": 7},
              {"t": 0.014, "ev": "c_start", "tid": 7}, {"t": 0.015, "ev": "c_first", "tid": 7},
              {"t": 0.030, "ev": "c_done", "tid": 7}])
    assert steps(str(tmp_path), skip=1) == {"messages": 0, **{f"{k}_ms": None for k in (
        "queue", "post", "wire", "verify", "deliver", "verdict", "total")}}  # each sender's first: warm-up
    got = steps(str(tmp_path))
    assert got["messages"] == 2
    # 1 -> 2: queue 1, post 1, wire 3, verify 1, deliver 2, verdict 4, total 10 ms; 2 -> 1: 2, 1, 5, 1, 2, 9, 18 ms
    assert got == {"messages": 2, "queue_ms": 1.5, "post_ms": 1.0, "wire_ms": 4.0, "verify_ms": 1.0, "deliver_ms": 2.0,
                   "verdict_ms": 6.5, "total_ms": 14.0}


def test_trace_start_and_stop_go_back_to_the_folder_traced_before(tmp_path):
    from fate_rdma import trace

    was = trace._dir
    try:
        assert trace.start(str(tmp_path / "a")) == was
        trace.event("x", tid=1)
        assert trace.start(str(tmp_path / "b")) == str(tmp_path / "a")
        trace.stop(back_to=str(tmp_path / "a"))
        trace.event("y", at=12.5, tid=2)
        trace.stop()
        assert trace._dir is None
        trace.event("z", tid=3)  # off: written nowhere
        lines = [json.loads(x) for f in (tmp_path / "a").iterdir() for x in f.read_text().splitlines()]
        assert [(e["ev"], e["tid"]) for e in lines] == [("x", 1), ("y", 2)] and lines[1]["t"] == 12.5
        assert not (tmp_path / "b").exists()
    finally:
        trace.stop(back_to=was)
