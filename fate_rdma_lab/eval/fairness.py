"""`fate-rdma eval fairness`: three clients send to one arbiter at the same moment, on the WAN testbed.

The testbed has at most three sites (wan_spec.SITE_NAMES), so: the arbiter is in site a; client 1 in
site b; clients 2 and 3 share site c. Site c's access link gets twice the rate, so that the two
clients there are not held back by the link they share: the one bottleneck is the arbiter's link
(every path's rate is the slower of its two access links), which the three flows must share. All
links have the same delay (RTT client <-> arbiter = --rtt-ms).

Per transport (one TCP stream per client, a new connection per transfer; the same on one connection
kept for every round, as fate-rdma keeps its QPs; fedrdma-e with the automatic window, one endpoint
per client and one at the arbiter), every client gets ready (connected,
authenticated, RTT probed), then all start at the same wall-clock instant (one clock: the sites are
namespaces of one machine) and each times its transfer until the arbiter holds it verified. A first
simultaneous round is an untimed warm-up. Per round: the gap = (slowest - fastest) / fastest
completion time; target: within 10 %. Jain's index of the clients' rates is printed beside it.

Writes OUT/<UTC time>-fairness/: results.jsonl (one row per client x transport, and one summary row per
transport), table.md, fairness.png.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.eval.common import SOFT, LinkPlan, MiB, Rows, bars, header, link_line, md_table, measured_link, median, print_md, \
    results_dir, secret_file, size, testbed
from fate_rdma_lab.eval.runners import Transport, channel_args
from fate_rdma_lab.testbed.run import SiteProcess, link_rx_bytes

ARBITER = 0
CLIENT_SITES = (1, 2, 2)          # b, c, c: two clients share site c (the testbed has three sites)
#: "tcp stream" opens a connection per transfer (slow start each round); "tcp kept" keeps one per client
#: for every round, as fate-rdma keeps its QPs: the baseline that carries the same TCP state across rounds
#: fedrdma-e with the automatic window, on one QP per client (one TCP stream: as a kept TCP connection, it
#: does not share the bottleneck within 10 %; the default), and with qps_per_peer auto (four QPs striped on
#: this 20 ms path: the clients' shares average over four streams each)
TRANSPORTS = (Transport("tcp stream", "tcp"), Transport("tcp kept", "tcp-kept"),
              Transport("fedrdma-e auto, 1 QP", "channel", "fedrdma-e", "auto", qps=1),
              Transport("fedrdma-e auto, qps auto", "channel", "fedrdma-e", "auto", qps="auto"))
START_MARGIN_S = 0.3              # "go" names an instant this far ahead: every client has read it by then
TARGET_GAP = 0.10


Plan = LinkPlan
FULL = Plan()
QUICK = Plan(rate_mbit=50.0, rtt_ms=10.0, nbytes=4 * MiB, reps=1, measure_s=1.0)


def make_testbed(plan: Plan, prefix: str, tcp_cc: Optional[str] = None) -> wan.Testbed:
    link = wan.LinkSpec(rate_bps=int(plan.rate_mbit * 1e6), delay_ms=plan.rtt_ms / 2)
    wide = dataclasses.replace(link, rate_bps=2 * int(plan.rate_mbit * 1e6))
    return wan.Testbed(links=(link, link, wide), prefix=prefix, tcp_cc=tcp_cc)


def _rounds(clients: List[SiteProcess], rounds: int, timeout_s: float) -> List[List[Dict[str, Any]]]:
    """Start every client at the same instant, `rounds` times; each round's reports, client order."""
    out = []
    for _ in range(rounds):
        at = time.time() + START_MARGIN_S
        for c in clients:
            tell_go(c, at)
        out.append([c.line(timeout_s + 60) for c in clients])
    return out


def tell_go(proc: SiteProcess, at: float) -> None:
    proc.stdin.write(f"go {at:.6f}\n".encode())
    proc.stdin.flush()


def _tcp(tb: wan.Testbed, plan: Plan, timeout_s: float, keep: bool = False) -> List[List[Dict[str, Any]]]:
    rounds = plan.reps + 1
    with SiteProcess(tb, ARBITER, ["serve", "--host", tb.site_addr(ARBITER),
                                   "--deadline-s", str(timeout_s * (rounds + 1))]) as srv:
        addr = srv.line(30)["address"]
        clients = [SiteProcess(tb, s, ["tcp-send", "--to", addr, "--bytes", str(plan.nbytes), "--seed", str(100 + i),
                                       "--reps", str(rounds), "--wait-go", "--timeout-s", str(timeout_s),
                                       *(["--keep"] if keep else [])])
                   for i, s in enumerate(CLIENT_SITES)]
        try:
            for c in clients:
                c.line(60)
            got = _rounds(clients, rounds, timeout_s)[1:]
        finally:
            for c in clients:
                c.close()
    return [[{"seconds": r["seconds"], "ok": r["ok"], "received_bytes": r["sink"]["bytes"]} for r in rnd] for rnd in got]


def _channel(tb: wan.Testbed, t: Transport, plan: Plan, timeout_s: float, secret: str) -> List[List[Dict[str, Any]]]:
    rounds = plan.reps + 1
    common = channel_args(t, plan.nbytes, plan.chunk_bytes, timeout_s, secret, plan.rate_mbit)
    n = len(CLIENT_SITES)
    with SiteProcess(tb, ARBITER, ["channel-recv", "--host", tb.site_addr(ARBITER), "--count", str(n * (rounds + 1)),
                                   *common]) as rx:
        addr = rx.line(60)["address"]
        clients = [SiteProcess(tb, s, ["channel-send", "--host", tb.site_addr(s), "--to", addr, "--bytes",
                                       str(plan.nbytes), "--seed", str(100 + i), "--reps", str(rounds), "--warmup",
                                       "--wait-go", *common]) for i, s in enumerate(CLIENT_SITES)]
        try:
            ready = [c.line(60) for c in clients]
            got = _rounds(clients, rounds, timeout_s)
        finally:
            for c in clients:
                c.close()
        received = [rx.line(30) for _ in range(n * (rounds + 1))]
    out = []
    for k, rnd in enumerate(got[1:], start=1):
        row = []
        for rd, r in zip(ready, rnd):
            m = next((g for g in received if g["peer"] == rd["address"] and g["metadata"].get("rep") == k), None)
            ok = m is not None and m["nbytes"] == plan.nbytes and m["crc32c"] == rd["crc32c"]
            row.append({"seconds": r["seconds"], "ok": ok, "received_bytes": m["nbytes"] if m else 0,
                        "window": (r.get("info") or {}).get("window"), "qps": (r.get("info") or {}).get("qps")})
        out.append(row)
    return out


def run_fairness(plan: Plan, out_root: Path, prefix: str = "freval", timeout_s: float = 300.0,
                 log: Callable[[str], None] = print, command: str = "", tcp_cc: Optional[str] = None) -> Path:
    """Both transports; returns the results folder. WanError (after writing it) if a transfer failed."""
    out = results_dir(out_root, "fairness")
    rows = Rows(out)
    failed: List[str] = []
    try:
        # measured from client 1 to the arbiter: the link as a client sees it
        with secret_file() as secret, testbed(make_testbed(plan, prefix, tcp_cc), plan.measure_s, log,
                                              src=CLIENT_SITES[0], dst=ARBITER) as bed:
            measured = measured_link(bed.measured)
            for t in TRANSPORTS:
                before = link_rx_bytes(bed.tb, CLIENT_SITES[0])
                try:
                    got = _tcp(bed.tb, plan, timeout_s, t.kind == "tcp-kept") if t.kind.startswith("tcp") \
                        else _channel(bed.tb, t, plan, timeout_s, secret)
                except wan.WanError as exc:
                    failed.append(f"{t.name}: {exc}")
                    log(f"  {t.name}: FAILED: {exc}")
                    continue
                crossed = link_rx_bytes(bed.tb, CLIENT_SITES[0]) - before
                _add_rows(rows, t, got, plan, measured, bed.tb, crossed, log)
    finally:
        lines = rows.save(out, markdown(rows.rows, plan, command, failed),
                          lambda: write_plot(rows.rows, out / "fairness.png"))
    print_md(lines, log, out)
    bad = failed + [f"{r['transport']} client {r['client']}: not verified" for r in rows.rows
                    if r["row"] == "client" and not r["verified"]]
    if bad:
        raise wan.WanError("; ".join(bad) + f" (results in {out})")
    return out


def _add_rows(rows: Rows, t: Transport, got: List[List[Dict[str, Any]]], plan: Plan, measured: Dict[str, Any],
              tb: wan.Testbed, crossed: int, log: Callable[[str], None]) -> None:
    common = {"study": "fairness", "transport": t.name, "provider": t.provider, "bytes": plan.nbytes,
              "reps": len(got), "measured": measured, "note": wan.testbed_note(tb, (CLIENT_SITES[0], ARBITER)),
              "link": {"rate_mbit": plan.rate_mbit, "rtt_ms": plan.rtt_ms, "loss_pct": 0.0}}
    for i, s in enumerate(CLIENT_SITES):
        secs = [rnd[i]["seconds"] for rnd in got]
        rows.add({**common, "row": "client", "client": i + 1, "site": wan.SITE_NAMES[s], "all_s": secs,
                  "median_s": median(secs), "verified": all(rnd[i]["ok"] for rnd in got),
                  "received_bytes": sum(rnd[i]["received_bytes"] for rnd in got),
                  "window_used": sorted({rnd[i].get("window") for rnd in got if rnd[i].get("window")}) or None,
                  "qps_used": sorted({rnd[i].get("qps") for rnd in got if rnd[i].get("qps")}) or None})
    gaps = [(max(r["seconds"] for r in rnd) - min(r["seconds"] for r in rnd)) / min(r["seconds"] for r in rnd)
            for rnd in got]
    jains = [_jain([plan.nbytes / r["seconds"] for r in rnd]) for rnd in got]
    aggregate = [len(rnd) * plan.nbytes * 8 / max(r["seconds"] for r in rnd) for rnd in got]
    summary = rows.add({**common, "row": "summary", "gap_per_round": gaps, "median_gap": median(gaps),
                        "jain_per_round": jains, "median_jain": median(jains), "aggregate_bps": median(aggregate),
                        "within_target": (median(gaps) or 0) <= TARGET_GAP, "link_bytes_client1": crossed})
    log(f"  {t.name}: per-client medians " + ", ".join(f"{median([rnd[i]['seconds'] for rnd in got]):.2f} s"
                                                       for i in range(len(CLIENT_SITES))) +
        f"; gap {100 * summary['median_gap']:.1f} % (target <= {100 * TARGET_GAP:g} %), "
        f"Jain {summary['median_jain']:.3f}, aggregate {wan.fmt_rate(summary['aggregate_bps'])}")


def _jain(xs: Sequence[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs else float("nan")


def markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str, failed: Sequence[str]) -> List[str]:
    m = rows[0]["measured"] if rows else {}
    lines = header("fate-rdma eval fairness", command, [
        f"provider: fate-rdma-e over the {SOFT}; tcp stream: kernel TCP",
        "sites: arbiter in site a; client 1 in site b; clients 2 and 3 share site c (the testbed has three sites), "
        "whose link has twice the rate so that only the arbiter's link is shared",
        f"link: {plan.rate_mbit:g} Mbit/s at the arbiter, {plan.rtt_ms:g} ms RTT client <-> arbiter; "
        f"{link_line(m) if m else ''} (client 1 -> arbiter); {rows[0]['note'] if rows else ''}",
        f"payload: {size(plan.nbytes)} per client per round, seeded, crc32c and byte count verified at the arbiter; "
        f"{plan.reps} timed simultaneous rounds after one untimed round; figures are medians",
        f"gap = (slowest - fastest) / fastest completion time in a round; target <= {100 * TARGET_GAP:g} %"])
    cells = []
    for t in dict.fromkeys(r["transport"] for r in rows):
        cl = [r for r in rows if r["transport"] == t and r["row"] == "client"]
        s = next(r for r in rows if r["transport"] == t and r["row"] == "summary")
        cells.append([t, cl[0]["provider"], *[f"{r['median_s']:.2f}" for r in cl], f"{100 * s['median_gap']:.1f} %",
                      "yes" if s["within_target"] else "**no**", f"{s['median_jain']:.3f}",
                      f"{s['aggregate_bps'] / 1e6:.1f}", "all verified" if all(r["verified"] for r in cl) else "FAILED"])
    lines += md_table(["transport", "provider", "client 1 (b) s", "client 2 (c) s", "client 3 (c) s", "gap",
                       "within 10 %", "Jain", "aggregate Mbit/s", "verification"], cells)
    return lines + [f"FAILED: {f}" for f in failed] + [""]


def write_plot(rows: Sequence[Dict[str, Any]], path: Path) -> Optional[Path]:
    ts = list(dict.fromkeys(r["transport"] for r in rows))
    series = {f"client {i + 1} ({wan.SITE_NAMES[s]})": [
        next((r["median_s"] for r in rows if r["transport"] == t and r.get("client") == i + 1), None) for t in ts]
        for i, s in enumerate(CLIENT_SITES)}
    return bars(path, [("3 clients -> 1 arbiter at once: completion time", ts, series)] if rows else [],
                "seconds (median)", "testbed: real packets, scaled rate; soft provider = emulation")
