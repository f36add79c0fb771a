"""Transfer timelines (fate_rdma/trace.py, `fate-rdma bench timeline`): the events a traced transfer leaves in
both endpoints, in causal order, and the steps the timeline computes from a job's trace files."""
from __future__ import annotations

import json
import os
import time

import pytest

from fate_rdma import trace
from fate_rdma_lab.bench import timeline
from fate_rdma_lab.bench.transfer_peer import hold_gil
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
    t, start = {}, None
    for e in timeline.load(str(traced)):
        if e.get("tid") == tid:
            t.setdefault(e["ev"], e["t"])
            start = e if e["ev"] == "c_start" else start
    # what the transfer went over, for the timeline's rows: the soft provider over TCP, said to be emulated
    assert start["mode"] == mode and start["emulated"] is True and start["path"].startswith("tcp")
    assert start["provider"] == "soft"
    steps = ["c_send", "c_start", "c_first", "c_arrived", "c_verified", "c_deliver"]
    assert [k for k in steps if k not in t] == [] and "c_done" in t
    assert [t[k] for k in steps] == sorted(t[k] for k in steps), t
    assert t["c_verified"] <= t["c_done"]


def _write(folder, pid, events):
    with open(os.path.join(folder, f"trace-{pid}.jsonl"), "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        f.write('{"t": 9, "ev": "cut sho')  # a line a killed process left half written is skipped


G, H, A = "guest:9999", "host:10000", "arbiter:10000"


def _upload(t0, src, tid, tag, dst=A, name="model"):
    """A sender's events and a receiver's events of one traced transfer, t0 + the offsets the test checks."""
    sender = [{"t": t0, "ev": "put", "who": src, "name": name, "tag": tag, "bytes": 100},
              {"t": t0 + 0.1, "ev": "c_send", "who": src, "tid": tid, "bytes": 100},
              {"t": t0 + 0.15, "ev": "put_sent", "who": src, "tid": tid, "name": name, "tag": tag, "dst": dst},
              {"t": t0 + 0.2, "ev": "c_first", "who": src, "tid": tid},
              {"t": t0 + 1.5, "ev": "c_done", "who": src, "tid": tid}]
    peer = f"endpoint-of-{src}"  # (the receiving channel knows its peer by its endpoint's name)
    receiver = [{"t": t0 + 1.0, "ev": "c_arrived", "who": dst, "tid": tid, "peer": peer},
                {"t": t0 + 1.25, "ev": "c_verified", "who": dst, "tid": tid, "peer": peer},
                {"t": t0 + 1.3, "ev": "c_deliver", "who": dst, "tid": tid, "bytes": 100, "peer": peer},
                {"t": t0 + 1.4, "ev": "stored", "who": dst, "tid": tid, "peer": peer, "name": name, "tag": tag,
                 "src": src}]
    return sender, receiver


WANT = {"put_to_wire": 0.2, "wire": 0.8, "verify": 0.25, "to_store": 0.15, "get_to_store": 1.35, "to_got": 0.05,
        "verdict": 0.25}


def test_the_timeline_splits_a_transfer_into_its_steps(tmp_path):
    sender, receiver = _upload(10.0, G, 7, "r0")
    _write(tmp_path, 1, sender)
    _write(tmp_path, 2, receiver + [{"t": 10.05, "ev": "get", "who": A, "name": "model", "tag": "r0", "src": [G]},
                                    {"t": 11.45, "ev": "got", "who": A, "name": "model", "tag": "r0", "src": G}])
    (rec,) = timeline.transfers(timeline.load(str(tmp_path)))
    assert {k: round(rec[k], 6) for k in WANT} == WANT
    assert (rec["src"], rec["dst"], rec["bytes"]) == (G, A, 100)
    (row,) = timeline.summarize([rec, dict(rec, bytes=10)], min_bytes=50)
    assert row["transfers"] == 1 and row["wire"] == 0.8 and row["path"] is None  # (no c_start in this trace)
    shm = dict(rec, path="same-host", emulated=True, wire=0.1)
    rows = timeline.summarize([dict(rec, path="tcp", emulated=True), shm, shm])  # two paths: never one median
    assert sorted((r["path"], r["transfers"], r["wire"]) for r in rows) == [("same-host", 2, 0.1), ("tcp", 1, 0.8)]


def test_the_wire_step_says_how_long_each_end_was_held(tmp_path):
    """A hold of the receiving process (FATE's summing keeping the GIL) that covers part of a transfer's wire
    step is counted for the receiver, the sender's own holds for the sender; holds outside the step are not."""
    sender, receiver = _upload(10.0, G, 7, "r0")  # wire: 10.2 -> 11.0
    _write(tmp_path, 1, sender + [{"t": 10.3, "ev": "hold", "who": G, "start": 10.0, "end": 10.3}])
    _write(tmp_path, 2, receiver + [{"t": 10.6, "ev": "hold", "who": A, "start": 10.4, "end": 10.6},
                                    {"t": 11.1, "ev": "hold", "who": A, "start": 10.9, "end": 11.1},
                                    {"t": 12.0, "ev": "hold", "who": A, "start": 11.5, "end": 12.0},
                                    {"t": 12.1, "ev": "hold", "who": A, "start": "x", "end": 12.1},
                                    # the same hold written twice, and one overlapping it: counted once
                                    {"t": 10.6, "ev": "hold", "who": A, "start": 10.4, "end": 10.6},
                                    {"t": 10.7, "ev": "hold", "who": A, "start": 10.5, "end": 10.7}])
    (rec,) = timeline.transfers(timeline.load(str(tmp_path)))
    assert (round(rec["wire_held_tx"], 6), round(rec["wire_held_rx"], 6)) == (0.1, 0.4)
    assert timeline.held([(0.0, 5.0), (1.0, 2.0)], 1.5, 3.0) == 1.5  # never more than the step itself
    (row,) = timeline.summarize([rec])
    assert row["wire_held_rx"] == 0.4


def test_a_hold_of_a_process_with_an_endpoint_is_traced(traced):
    """Native code keeping the GIL (as FATE's secure aggregation does) leaves a `hold` event spanning it."""
    with Endpoint(cfg_for("fedrdma-e", "soft-tcp")):
        time.sleep(0.3)  # (the watchdog beats)
        t0 = time.monotonic()
        hold_gil(0.5)
        t1 = time.monotonic()
        time.sleep(0.3)  # its next beat tells the trace
    holds = [e for e in timeline.load(str(traced)) if e["ev"] == "hold" and e["end"] >= t1 - 0.05]
    assert holds and any(h["start"] <= t0 + 0.15 and h["end"] - h["start"] >= 0.35 for h in holds), holds


def test_two_senders_with_one_tid_and_a_name_reused_across_rounds_stay_apart(tmp_path):
    """tids are unique per sending process only (two clients may both send tid 7), and FATE may reuse a name
    and tag in every round: each transfer joins its own sender's events and its own round's get."""
    events = {G: [], H: [], A: []}
    for r, t0 in enumerate((10.0, 20.0)):
        for src, tid, lag in ((G, 7 + r, 0.0), (H, 7 + r, 0.5)):  # the same tids at both clients
            sender, receiver = _upload(t0 + lag, src, tid, "same-tag")
            events[src] += sender
            events[A] += receiver
        # one get names both sources (FATE's get from several parties), each returns after its bytes
        events[A].append({"t": t0 + 0.05, "ev": "get", "who": A, "name": "model", "tag": "same-tag", "src": [G, H]})
        events[A] += [{"t": t0 + 1.45, "ev": "got", "who": A, "name": "model", "tag": "same-tag", "src": G},
                      {"t": t0 + 1.95, "ev": "got", "who": A, "name": "model", "tag": "same-tag", "src": H}]
    for pid, who in enumerate((G, H, A)):
        _write(tmp_path, pid, sorted(events[who], key=lambda e: e["t"]))
    recs = timeline.transfers(timeline.load(str(tmp_path)))
    assert sorted((r["src"], r["tid"]) for r in recs) == [(G, 7), (G, 8), (H, 7), (H, 8)]
    for r in recs:
        want = dict(WANT, get_to_store=WANT["get_to_store"] + (0.5 if r["src"] == H else 0.0))
        assert {k: round(r[k], 6) for k in want} == want, r


def test_the_report_says_when_a_folder_holds_no_transfer(tmp_path, capsys):
    assert timeline.print_report(str(tmp_path)) == []
    assert "no complete transfer" in capsys.readouterr().out


def test_a_trace_that_cannot_be_written_switches_itself_off(tmp_path, monkeypatch, caplog):
    """The channel's threads call trace.event: a folder it cannot write must not fail a transfer."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(trace, "_dir", str(blocker / "trace"))  # a folder under a file: cannot be made
    monkeypatch.setattr(trace, "_file", None)
    trace.event("put", name="x")
    assert not trace.enabled() and "tracing to" in caplog.text and "switched off" in caplog.text
    trace.event("put", name="y")  # and stays off, quietly
