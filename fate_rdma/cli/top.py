"""`fate-rdma top`: what the site's fate-rdma processes move now, per peer, read from its exporter.

Every INTERVAL seconds it reads the exporter's /metrics (fate-rdma exporter) and prints, per peer (the other
party's endpoint), the send and receive rates over the interval, the bytes and transfers so far, and below them
bytes in flight, registered receive memory, live connections and the errors by side and kind. On a terminal it
redraws in place, like top; `--once` prints one frame (two reads INTERVAL apart) as plain text and exits, for
scripts and logs. Exit codes: 0 ok, 1 the exporter cannot be read, 2 bad usage, 130 interrupted.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .exporter import DEFAULT_LISTEN

DEFAULT_URL = f"http://{DEFAULT_LISTEN}/metrics"
_PEER_KEYS = {"fate_rdma_sent_bytes_total": "sent", "fate_rdma_received_bytes_total": "received",
              "fate_rdma_sent_transfers_total": "sent_n", "fate_rdma_received_transfers_total": "received_n"}
_GAUGES = {"fate_rdma_in_flight_bytes": "in flight", "fate_rdma_registered_bytes": "registered",
           "fate_rdma_connections": "connections"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the exporter's metrics (default {DEFAULT_URL})")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between reads (default 2; rates are over it)")
    p.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    p.add_argument("--count", type=int, default=0, help="frames to print, then exit (default: until Ctrl-C)")


@dataclass
class Snapshot:
    at: float
    peers: Dict[str, Dict[str, float]] = field(default_factory=lambda: collections.defaultdict(
        lambda: collections.defaultdict(float)))
    gauges: Dict[str, float] = field(default_factory=dict)
    errors: Dict[Tuple[str, str], float] = field(default_factory=dict)
    auth_failures: float = 0.0


def parse(text: str, at: float) -> Snapshot:
    """The figures `top` shows, summed over modes, providers and paths, from an exposition `text`."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot(at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _PEER_KEYS:
                snap.peers[s.labels.get("peer", "?")][_PEER_KEYS[s.name]] += s.value
            elif s.name in _GAUGES:
                snap.gauges[_GAUGES[s.name]] = snap.gauges.get(_GAUGES[s.name], 0.0) + s.value
            elif s.name == "fate_rdma_errors_total":
                key = (s.labels.get("side", "?"), s.labels.get("kind", "?"))
                snap.errors[key] = snap.errors.get(key, 0.0) + s.value
            elif s.name == "fate_rdma_authentication_failures_total":
                snap.auth_failures += s.value
    return snap


def read(url: str, timeout_s: float = 5.0) -> Snapshot:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return parse(r.read().decode("utf-8", "replace"), time.monotonic())


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    return f"{bits / 1e9:.2f} Gbit/s" if bits >= 1e8 else f"{bits / 1e6:.1f} Mbit/s"


def frame(url: str, now: Snapshot, before: Optional[Snapshot]) -> List[str]:
    """The lines of one frame: rates over `before` .. `now` (none before the second read)."""
    dt = (now.at - before.at) if before is not None else 0.0
    lines = [f"fate-rdma top   {url}   {time.strftime('%Y-%m-%d %H:%M:%S')}"
             + (f"   rates over {dt:.1f} s" if dt else ""), ""]
    head = f"{'peer':<28} {'send':>13} {'receive':>13} {'sent':>11} {'received':>11} {'transfers out/in':>17}"
    lines.append(head)
    for peer in sorted(now.peers):
        p = now.peers[peer]
        q = before.peers.get(peer, {}) if before is not None else {}
        out = (p["sent"] - q.get("sent", 0.0)) / dt if dt else 0.0
        inc = (p["received"] - q.get("received", 0.0)) / dt if dt else 0.0
        lines.append(f"{peer:<28} {rate(out) if dt else '-':>13} {rate(inc) if dt else '-':>13} {size(p['sent']):>11} "
                     f"{size(p['received']):>11} {int(p['sent_n']):>8}/{int(p['received_n']):<8}")
    if not now.peers:
        lines.append("(no transfers yet: does the site file set metrics_dir to the exporter's --dir?)")
    g = now.gauges
    lines += ["", f"in flight {size(g.get('in flight', 0.0))}   registered {size(g.get('registered', 0.0))}   "
                  f"connections {int(g.get('connections', 0.0))}   authentication failures {int(now.auth_failures)}"]
    errs = ", ".join(f"{side} {kind} {int(v)}" for (side, kind), v in sorted(now.errors.items()) if v)
    lines.append(f"errors: {errs or 'none'}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("fate-rdma top: --interval must be > 0", file=sys.stderr)
        return 2
    tty = sys.stdout.isatty() and not args.once
    before: Optional[Snapshot] = None
    shown = 0
    try:
        while True:
            try:
                now = read(args.url)
            except (OSError, urllib.error.URLError, ValueError) as exc:
                print(f"fate-rdma top: cannot read {args.url}: {exc} (is `fate-rdma exporter` running there?)",
                      file=sys.stderr)
                return 1
            if before is not None or not args.once:
                text = "\n".join(frame(args.url, now, before))
                print(("\x1b[H\x1b[2J" if tty else "") + text + ("" if tty else "\n"), flush=True)
                shown += 1
                if args.once or (args.count and shown >= args.count):
                    return 0
            before = now
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 130
