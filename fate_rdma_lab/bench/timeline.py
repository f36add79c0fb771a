"""Timeline: where each transfer of a traced job spent its time, from FATE's put to FATE's get returning.

Reads the trace files a job wrote with FATE_RDMA_TRACE set to FOLDER (fate_rdma/trace.py: every party's
process, one clock for the host) and splits every transfer into its steps, in order:
  put_to_wire    FATE's put began -> the transfer's first chunk posted (framing the object, connecting,
                 waiting behind the connection's earlier transfers and for a receive slot)
  wire           first chunk posted -> the receiver holds every byte (FedRDMA-E: its header landed)
  verify         -> the receiver's checksum held (its verdict sent)
  to_store       -> the wrapper's store holds it (the endpoint's inbox, the wrapper's receive thread)
  get_to_store   when FATE's get began, relative to the store's having it: > 0 the get waited that long for
                 the bytes (the transfer was the get's critical path); < 0 the bytes waited for the get
  to_got         max(store has it, get began) -> FATE's get returns the object (the hand-off, the unframing)
  verdict        verified -> the sender's channel has the verdict
and, beside them, how much of the wire step the sending and the receiving process were at least held
(wire_held_tx, wire_held_rx: their `hold` events, gaps of 50 ms or more in which none of the process's threads
ran, as while FATE's secure aggregation keeps the GIL, or the process was not scheduled; the soft provider's
NIC is a thread of the process, so its bytes wait meanwhile, where a real NIC's would not), and prints the
medians per kind of transfer (sender, receiver, FATE's object name) as JSON lines and a table. Every figure is a difference of CLOCK_MONOTONIC readings of one host: a job whose parties ran on
several hosts can only be read within a party. `fate-rdma bench fate --trace` traces its fate-rdma jobs
and prints this after each; set FATE_RDMA_TRACE in a FATE job's environment to trace any job.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

from fate_rdma_lab.bench.report import emit, human_bytes, median, table

RECEIVER_EVENTS = frozenset({"c_arrived", "c_verified", "c_deliver", "stored"})
STEPS = ("put_to_wire", "wire", "verify", "to_store", "get_to_store", "to_got", "verdict")
HELD = ("wire_held_tx", "wire_held_rx")
#: what each transfer went over, from its sender's c_start (traces written before 2026-12 lack them: None)
WHERE = ("mode", "provider", "emulated", "path")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="the folder FATE_RDMA_TRACE named for the job (trace-<pid>.jsonl files)")
    p.add_argument("--min-bytes", type=int, default=0, help="leave out transfers smaller than this (default: none)")


def load(folder: str, with_file: bool = False) -> List[Dict[str, Any]]:
    """Every event of every trace file in `folder`, in time order (a line cut short by a killed process is
    skipped); `with_file`: each names its file under "file" (one per process)."""
    events = []
    for path in sorted(glob.glob(os.path.join(folder, "trace-*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if isinstance(e, dict) and isinstance(e.get("t"), (int, float)) and isinstance(e.get("ev"), str):
                    if with_file:
                        e["file"] = path
                    events.append(e)
    events.sort(key=lambda e: e["t"])
    return events


def _last_before(events: List[Dict[str, Any]], t: float) -> Optional[Dict[str, Any]]:
    best = None
    for e in events:
        if e["t"] <= t:
            best = e
    return best


Key = Tuple[str, str, str]  # (party, FATE's name, tag)


def held(holds: List[Tuple[float, float]], a: Optional[float], b: Optional[float]) -> Optional[float]:
    """Seconds of [a, b] covered by `holds` ((start, end); overlapping ones, as two processes of one party or a hold
    written twice give, counted once)."""
    if a is None or b is None:
        return None
    total, reach = 0.0, a
    for s, e in sorted(holds):
        s, e = max(s, reach), min(e, b)
        if e > s:
            total += e - s
            reach = e
    return total


def transfers(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per traced transfer that reached the receiver's store: its parties, FATE's name, bytes,
    and the STEPS (seconds; None where an event is missing). A transfer is joined on (party, tid) at its sender
    and on (party, the connection's peer, tid) at its receiver (tids are unique per sending process only), the
    receiver's `stored` naming the sender; FATE's put, get and
    got by (party, name, tag) and time: the put last before the channel took it, the got first after the store
    had it, the get last before that got (a name and tag FATE reuses across rounds joins each round's own)."""
    by: Dict[Tuple[str, Any, Any], Dict[str, Dict[str, Any]]] = defaultdict(dict)
    puts: Dict[Key, List[Dict[str, Any]]] = defaultdict(list)
    gets: Dict[Tuple[str, str, str, str], List[Dict[str, Any]]] = defaultdict(list)
    gots: Dict[Tuple[str, str, str, str], List[Dict[str, Any]]] = defaultdict(list)
    stored = []
    holds: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
    for e in events:
        ev, who = e["ev"], str(e.get("who", ""))
        if ev == "hold" and isinstance(e.get("start"), (int, float)) and isinstance(e.get("end"), (int, float)):
            holds[who].append((float(e["start"]), float(e["end"])))
        elif e.get("tid") is not None:  # a receiver's events name the connection's peer, a sender's need not
            by[(who, e.get("peer") if ev in RECEIVER_EVENTS else None, e["tid"])].setdefault(ev, e)
            if ev == "stored":
                stored.append(e)
        elif ev == "put":
            puts[(who, str(e.get("name")), str(e.get("tag")))].append(e)
        elif ev in ("get", "got"):
            srcs = e.get("src") if ev == "get" else [e.get("src")]
            for src in srcs if isinstance(srcs, list) else []:
                (gets if ev == "get" else gots)[(who, str(e.get("name")), str(e.get("tag")), str(src))].append(e)
    out = []
    for st in stored:
        name, tag, src, dst = str(st.get("name")), str(st.get("tag")), str(st.get("src")), str(st.get("who", ""))
        snd, rcv = by.get((src, None, st["tid"]), {}), by.get((dst, st.get("peer"), st["tid"]), {})
        sent = snd.get("put_sent")
        put = _last_before(puts.get((src, name, tag), []), sent["t"]) if sent else None
        got = next((g for g in gots.get((dst, name, tag, src), []) if g["t"] >= st["t"]), None)
        get = _last_before(gets.get((dst, name, tag, src), []), got["t"]) if got else None

        def at(side: Dict[str, Dict[str, Any]], ev: str) -> Optional[float]:
            return side[ev]["t"] if ev in side else None

        def span(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return None if a is None or b is None else b - a
        start = snd.get("c_start") or {}
        out.append({"tid": st["tid"], "src": src, "dst": dst, "name": name, "tag": tag,
                    **{k: start.get(k) for k in WHERE},
                    "bytes": (rcv.get("c_deliver") or snd.get("c_send") or {}).get("bytes"),
                    "put_to_wire": span(put["t"] if put else None, at(snd, "c_first")),
                    "wire": span(at(snd, "c_first"), at(rcv, "c_arrived")),
                    "verify": span(at(rcv, "c_arrived"), at(rcv, "c_verified")),
                    "to_store": span(at(rcv, "c_verified"), st["t"]),
                    "get_to_store": span(get["t"] if get else None, st["t"]),
                    "to_got": span(None if get is None else max(get["t"], st["t"]), got["t"] if got else None),
                    "verdict": span(at(rcv, "c_verified"), at(snd, "c_done")),
                    "wire_held_tx": held(holds.get(src, []), at(snd, "c_first"), at(rcv, "c_arrived")),
                    "wire_held_rx": held(holds.get(dst, []), at(snd, "c_first"), at(rcv, "c_arrived"))})
    return out


def summarize(recs: List[Dict[str, Any]], min_bytes: int = 0) -> List[Dict[str, Any]]:
    """Medians of the STEPS per (sender, receiver, object name), largest transfers first."""
    groups: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = defaultdict(list)
    for r in recs:  # (transfers over different providers or paths never share a median)
        if (r["bytes"] or 0) >= min_bytes:
            groups[(r["src"], r["dst"], r["name"], *(r.get(k) for k in WHERE))].append(r)
    rows = []
    for (src, dst, name, *where), rs in groups.items():
        sizes = [r["bytes"] for r in rs if r["bytes"] is not None]
        row: Dict[str, Any] = {"bench": "timeline", "src": src, "dst": dst, "name": name, **dict(zip(WHERE, where)),
                               "transfers": len(rs), "bytes": int(median(sizes)) if sizes else None}
        for k in STEPS + HELD:
            xs = [r[k] for r in rs if r[k] is not None]
            row[k] = round(median(xs), 4) if xs else None
        rows.append(row)
    rows.sort(key=lambda r: (-(r["bytes"] or 0), r["src"], r["dst"]))
    return rows


def print_report(folder: str, min_bytes: int = 0, title: str = "") -> List[Dict[str, Any]]:
    rows = summarize(transfers(load(folder)), min_bytes)
    if not rows:
        print(f"timeline: no complete transfer in {folder} (was FATE_RDMA_TRACE set for the job's parties?)")
        return rows
    for r in rows:
        emit(r)
    print(f"timeline{title}: seconds per transfer, medians (a step missing: '-'; get_to_store > 0: the get waited "
          f"for the bytes, < 0: the bytes waited for the get; wire_held_tx/_rx: of the wire step, at least this long "
          f"the sending/receiving process held, its threads not running)")
    shown = [dict(r, size="-" if r["bytes"] is None else human_bytes(r["bytes"]),
                  **{k: "-" if r[k] is None else f"{r[k]:.4f}" for k in STEPS + HELD}) for r in rows]
    table(shown, ["src", "dst", "name", "mode", "provider", "path", "transfers", "size", *STEPS, *HELD])
    if any(r["emulated"] for r in rows):
        print("the soft provider is an emulation of verbs (over TCP, or shared memory on the same-host path), not RDMA")
    return rows


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.folder):
        print(f"bench timeline: {args.folder} is not a folder", file=sys.stderr)
        return 2
    return 0 if print_report(args.folder, args.min_bytes) else 1
