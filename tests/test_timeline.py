"""Transfer timelines (fate_rdma/trace.py, `fate-rdma bench timeline`): the events a traced transfer leaves in
both endpoints, in causal order, and the steps the timeline computes from a job's trace files."""
from __future__ import annotations

import json
import os

import pytest

from fate_rdma import trace
from fate_rdma.bench import timeline
from fate_rdma.channel import Endpoint

from .test_channel import cfg_for

MiB = 1 << 20


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """Tracing on for this process, into tmp_path (a fresh file: the module keeps its open file per process)."""
    monkeypatch.setattr(trace, "_dir", str(tmp_path))
    monkeypatch.setattr(trace, "_file", None)
    monkeypatch.setattr(trace, "_who", "")
    return tmp_path


def test_nothing_is_written_unless_tracing_is_on(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "_dir", None)
    monkeypatch.chdir(tmp_path)
    trace.event("put", name="x")
    assert not trace.enabled() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["fedrdma-e", "fedrdma"])
def test_a_transfer_leaves_every_step_in_order(traced, mode):
    cfg = cfg_for(mode, "soft-tcp", slot_bytes=4 * MiB)
    with Endpoint(cfg) as rx, Endpoint(cfg) as tx:
        tid = tx.send(rx.address, bytes(3 * MiB + 5)).result(20)["transfer_id"]
        msg = rx.recv(timeout=20)
        assert msg.transfer_id == tid
        msg.release()
    t = {}
    for e in timeline.load(str(traced)):
        if e.get("tid") == tid:
            t.setdefault(e["ev"], e["t"])
    steps = ["c_send", "c_start", "c_first", "c_arrived", "c_verified", "c_deliver"]
    assert [k for k in steps if k not in t] == [] and "c_header" in t and "c_done" in t
    assert [t[k] for k in steps] == sorted(t[k] for k in steps), t
    assert t["c_verified"] <= t["c_done"]


def _write(folder, pid, events):
    with open(os.path.join(folder, f"trace-{pid}.jsonl"), "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        f.write('{"t": 9, "ev": "cut sho')  # a line a killed process left half written is skipped


def test_the_timeline_splits_a_transfer_into_its_steps(tmp_path):
    g, a = "guest:9999", "arbiter:10000"
    name, tag = "model", "r0"
    _write(tmp_path, 1, [
        {"t": 10.0, "ev": "put", "who": g, "name": name, "tag": tag, "bytes": 100},
        {"t": 10.1, "ev": "c_send", "who": g, "tid": 7, "bytes": 100},
        {"t": 10.15, "ev": "put_sent", "who": g, "tid": 7, "name": name, "tag": tag, "dst": a},
        {"t": 10.2, "ev": "c_first", "who": g, "tid": 7},
        {"t": 10.9, "ev": "c_header", "who": g, "tid": 7},
        {"t": 11.5, "ev": "put_done", "who": g, "tid": 7, "ok": True},
    ])
    _write(tmp_path, 2, [
        {"t": 10.05, "ev": "get", "who": a, "name": name, "tag": tag, "src": [g]},
        {"t": 11.0, "ev": "c_arrived", "who": a, "tid": 7},
        {"t": 11.25, "ev": "c_verified", "who": a, "tid": 7},
        {"t": 11.3, "ev": "c_deliver", "who": a, "tid": 7, "bytes": 100},
        {"t": 11.4, "ev": "stored", "who": a, "tid": 7, "name": name, "tag": tag, "src": g},
        {"t": 11.45, "ev": "got", "who": a, "name": name, "tag": tag, "src": g},
    ])
    (rec,) = timeline.transfers(timeline.load(str(tmp_path)))
    want = {"put_to_wire": 0.2, "wire": 0.8, "verify": 0.25, "to_store": 0.15, "get_to_store": 1.35, "to_got": 0.05,
            "verdict": 0.25}
    assert {k: round(rec[k], 6) for k in want} == want
    assert (rec["src"], rec["dst"], rec["bytes"]) == (g, a, 100)
    (row,) = timeline.summarize([rec, dict(rec, bytes=10)], min_bytes=50)
    assert row["transfers"] == 1 and row["wire"] == 0.8


def test_the_report_says_when_a_folder_holds_no_transfer(tmp_path, capsys):
    assert timeline.print_report(str(tmp_path)) == []
    assert "no complete transfer" in capsys.readouterr().out
