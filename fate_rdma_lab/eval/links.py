"""`fate-rdma eval link`: transports side by side on the same shaped link of the WAN testbed.

Studies (`--study`, several may be given: one testbed, reshaped in place between links):

- chunks: one plain TCP stream, a gRPC client stream, fedrdma and fedrdma-e with window 1 (the
  paper's stop-and-wait) and the automatic window, and Mooncake Transfer Engine's TCP transport (one
  sync write; a batch of chunk-sized writes), at several chunk sizes: the paper's Table 2, scaled.
- qps: fedrdma-e (auto window) with qps_per_peer 1, 2, 4 (the soft provider opens one TCP stream per
  QP) beside one TCP stream, on a lossy long link: do parallel streams beat one congested stream? (Under
  bbr with the 6-BDP automatic window, one QP did: docs/RESULTS.md section 2; --tcp-cc picks the sites' TCP.)
- link-enable: fedrdma-e and fedrdma, window 1 and auto (or --windows), with link_enable false / true / auto.
- window: fedrdma-e and fedrdma at windows 1..32 and auto: the best window of each link.

Every transfer goes site a -> site b, verified by crc32c at the receiver; each figure is the median
of --reps timed runs after an untimed warm-up. Writes OUT/<UTC time>-link-<studies>/: results.jsonl
(one row per study x link x transport x chunk), table.md, and one PNG per study.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fate_rdma_lab.testbed import bed as wan
from fate_rdma_lab.eval.common import SOFT, MiB, Rows, bars, header, link_line, md_table, measured_link, median, print_md, \
    results_dir, secret_file, size, testbed
from fate_rdma_lab.eval.runners import Result, Transport, run

Link = Tuple[float, float, float]  # (rate Mbit/s, RTT ms, loss %)
STUDIES = ("chunks", "qps", "link-enable", "window")

TRANSPORTS = (
    Transport("tcp stream", "tcp"),
    Transport("grpc stream", "grpc"),
    Transport("fedrdma w=1", "channel", "fedrdma", "1"),
    Transport("fedrdma auto", "channel", "fedrdma", "auto"),
    Transport("fedrdma-e w=1", "channel", "fedrdma-e", "1"),
    Transport("fedrdma-e auto", "channel", "fedrdma-e", "auto"),
    Transport("mooncake sync", "mooncake", "sync"),
    Transport("mooncake batch", "mooncake", "batch"),
)


@dataclass(frozen=True)
class Plan:
    links: Tuple[Link, ...]
    chunks: Tuple[int, ...]
    nbytes: int
    reps: int
    studies: Tuple[str, ...] = ("chunks",)
    qps: Tuple[int, ...] = (1, 2, 4)
    windows: Tuple[str, ...] = ("1", "2", "4", "8", "16", "32", "auto")
    le_windows: Tuple[str, ...] = ("1", "auto")    # the link-enable study's windows
    modes: Tuple[str, ...] = ("fedrdma-e", "fedrdma")
    measure_s: float = 2.0
    links_given: bool = False   # --links: every study on these; otherwise each study's own defaults
    tcp_cc: Optional[str] = None  # the sites' TCP congestion control (None: the host's default)


# The paper's link, 10 Gbit/s x 20 ms, has a BDP of 25 MB; 100 Mbit/s x 20 ms has 250 KB. The rate is
# scaled, so the chunk must be too: what matters is chunk / BDP, printed beside every figure with the
# chunk it corresponds to on the paper's link (64 KiB here ~ 6.7 MB there; 1 MiB here ~ 105 MB there).
PAPER_BDP_BYTES = 10e9 * 0.020 / 8
#: each study's links where --links is not given: chunks as before; qps a lossy long link (where the
#: hybrid-MPTCP seed says parallel streams pay); window three BDPs; link-enable the paper's ratio
STUDY_LINKS: Dict[str, Tuple[Link, ...]] = {
    "chunks": ((100.0, 20.0, 0.0), (200.0, 40.0, 0.0), (100.0, 20.0, 1.0)),
    "qps": ((100.0, 80.0, 1.0), (100.0, 80.0, 0.1)),
    "link-enable": ((100.0, 20.0, 0.0),),
    "window": ((100.0, 20.0, 0.0), (200.0, 40.0, 0.0), (50.0, 80.0, 0.0)),
}
QUICK_LINKS: Dict[str, Tuple[Link, ...]] = {"chunks": ((100.0, 20.0, 0.0),), "qps": ((100.0, 80.0, 1.0),),
                                            "link-enable": ((100.0, 20.0, 0.0),), "window": ((100.0, 20.0, 0.0),)}
# quick: one link per study, 8 MiB, 2 reps (about a minute for chunks)
QUICK = Plan(links=((100.0, 20.0, 0.0),), chunks=(64 * 1024, 1 * MiB), nbytes=8 * MiB, reps=2,
             windows=("1", "4", "16", "auto"), modes=("fedrdma-e",), measure_s=1.0)
FULL = Plan(links=STUDY_LINKS["chunks"], chunks=(16 * 1024, 64 * 1024, 256 * 1024, 1 * MiB, 4 * MiB),
            nbytes=64 * MiB, reps=5)


def bdp_bytes(link: Sequence[float]) -> float:
    return link[0] * 1e6 * link[1] / 1e3 / 8


def study_links(plan: Plan, study: str, quick: bool) -> Tuple[Link, ...]:
    if plan.links_given:
        return plan.links
    return (QUICK_LINKS if quick else STUDY_LINKS)[study]


def cases(plan: Plan, study: str) -> List[Tuple[Transport, Optional[int]]]:
    """(transport, chunk) pairs a study measures on each of its links."""
    if study == "chunks":
        return [(t, c) for t in TRANSPORTS for c in (plan.chunks if t.chunked else [None])]
    chunk = plan.chunks[0] if study == "window" else max(plan.chunks)
    if study == "qps":
        return [(TRANSPORTS[0], None)] + [(Transport(f"{m} auto qps={q}", "channel", m, "auto", qps=q), chunk)
                                           for m in plan.modes[:1] for q in plan.qps]
    if study == "link-enable":
        return [(Transport(f"{m} w={w} le={le}", "channel", m, w, link_enable=le), chunk)
                for m in plan.modes for w in plan.le_windows for le in ("false", "true", "auto")]
    if study == "window":
        return [(Transport(f"{m} w={w}", "channel", m, w), chunk) for m in plan.modes for w in plan.windows]
    raise ValueError(f"unknown study {study!r} (known: {', '.join(STUDIES)})")


def make_row(study: str, res: Result, chunk: Optional[int], link: Link, measured: Dict[str, Any],
             tb: wan.Testbed) -> Dict[str, Any]:
    t = res.transport
    secs = [r["seconds"] for r in res.runs]
    med = median(secs)
    windows = sorted({r["window"] for r in res.runs if r.get("window") is not None})
    return {"study": study, "transport": t.name, "kind": t.kind, "mode": t.mode or None, "window": t.window or None,
            "qps_per_peer": t.qps if t.kind == "channel" else None,
            "link_enable": t.link_enable if t.kind == "channel" else None,
            "chunk_bytes": chunk, "bytes": res.nbytes, "reps": len(res.runs), "median_s": med,
            "median_bps": res.nbytes * 8 / med if med else None, "all_s": secs, "verified": res.verified,
            "window_used": windows or None, "link_bytes": res.link_bytes, "skipped": res.skipped, "error": res.error,
            "label": next((r.get("label") for r in res.runs if r.get("label")), None),
            "link": {"rate_mbit": link[0], "rtt_ms": link[1], "loss_pct": link[2]}, "measured": measured,
            "provider": t.provider, "note": wan.testbed_note(tb, (0, 1))}


def run_eval(plan: Plan, out_root: Path, prefix: str = "freval", timeout_s: float = 300.0,
             log: Callable[[str], None] = print, command: str = "", quick: bool = False) -> Path:
    """Run the plan's studies; returns the results folder. The testbed is removed whatever happens.
    WanError if a transfer failed or was corrupted (after the rows so far are written)."""
    out = results_dir(out_root, "link-" + "+".join(plan.studies))
    rows = Rows(out)
    by_link: Dict[Link, List[str]] = {}
    for s in plan.studies:
        for lk in study_links(plan, s, quick):
            by_link.setdefault(lk, []).append(s)
    first = next(iter(by_link))
    try:
        with secret_file() as secret, testbed(_testbed(first, prefix, plan.tcp_cc), plan.measure_s, log) as bed:
            for lk, studies in by_link.items():
                measured = (bed.shape(_testbed(lk, prefix, plan.tcp_cc)) if lk != first
                            else measured_link(bed.measured))
                for study in studies:
                    for t, chunk in cases(plan, study):
                        res = run(bed.tb, t, plan.nbytes, chunk, plan.reps, timeout_s, secret, rate_mbit=lk[0])
                        row = rows.add(make_row(study, res, chunk, lk, measured, bed.tb))
                        _log_row(row, log)
                        res.check()
    finally:
        lines = rows.save(out, markdown(rows.rows, plan, command), lambda: [
            write_plot([r for r in rows.rows if r["study"] == s], out / f"link_{s.replace('-', '_')}.png")
            for s in plan.studies])
    print_md(lines, log, out)
    return out


def _testbed(link: Link, prefix: str, tcp_cc: Optional[str] = None) -> wan.Testbed:
    spec = wan.LinkSpec(rate_bps=int(link[0] * 1e6), delay_ms=link[1] / 2, loss_pct=link[2])
    return wan.Testbed(links=(spec, spec), prefix=prefix, tcp_cc=tcp_cc)


def _log_row(row: Dict[str, Any], log: Callable[[str], None]) -> None:
    if row["skipped"]:
        log(f"  [{row['study']}] {row['transport']:22s}: skipped: {row['skipped']}")
    elif row["median_bps"]:
        log(f"  [{row['study']}] {row['transport']:22s} chunk {size(row['chunk_bytes']):>7s}: "
            f"{wan.fmt_rate(row['median_bps']):>13s} (median of {row['reps']}, "
            f"{'verified' if row['verified'] else 'FAILED: ' + str(row['error'])})")
    else:
        log(f"  [{row['study']}] {row['transport']:22s}: FAILED: {row['error']}")


def markdown(rows: Sequence[Dict[str, Any]], plan: Plan, command: str) -> List[str]:
    lines = header("fate-rdma eval link", command, [
        f"provider: fate-rdma over the {SOFT}; tcp/grpc: kernel TCP; mooncake: Mooncake Transfer Engine's TCP "
        "transport (P2PHANDSHAKE, no etcd; it checksums nothing, the receiver's crc32c here is ours)",
        f"payload: {plan.nbytes / MiB:g} MiB of seeded random bytes, crc32c verified at the receiver",
        f"repetitions: {plan.reps} timed after one untimed warm-up; figures are medians",
        "connections: tcp stream opens one per transfer (handshake and slow start included); grpc, mooncake "
        "and fedrdma/fedrdma-e keep one warm connection (TCP slow start after idle still applies to all)"])
    for study in plan.studies:
        rs = [r for r in rows if r["study"] == study]
        lines += [f"## study: {study}", ""]
        for lk in dict.fromkeys(json.dumps(r["link"]) for r in rs):
            lines += _link_table(study, [r for r in rs if json.dumps(r["link"]) == lk])
    return lines


def _link_table(study: str, rs: List[Dict[str, Any]]) -> List[str]:
    lk, m = rs[0]["link"], rs[0]["measured"]
    bdp = bdp_bytes((lk["rate_mbit"], lk["rtt_ms"]))
    tcp_bps = next((r["median_bps"] for r in rs if r["kind"] == "tcp" and r["median_bps"]), None)
    out = [f"### {lk['rate_mbit']:g} Mbit/s, {lk['rtt_ms']:g} ms RTT, {lk['loss_pct']:g} % loss", "",
           f"Link: {link_line(m)}. {rs[0]['note']}. BDP {bdp / 1e3:.0f} KB; \"paper chunk\" is the chunk with the "
           f"same chunk/BDP on 10 Gbit/s x 20 ms.", ""]
    cells = []
    for r in rs:
        c = r["chunk_bytes"]
        ratio = c / bdp if c else None
        mbit = f"{r['median_bps'] / 1e6:.1f}" if r["median_bps"] else "-"
        status = "skipped: " + r["skipped"] if r["skipped"] else ("verified" if r["verified"] else f"FAILED: {r['error']}")
        cells.append([r["transport"], r["provider"], size(c), f"{ratio:.2f}" if ratio else "-",
                      f"{ratio * PAPER_BDP_BYTES / 1e6:.1f} MB" if ratio else "-",
                      f"{r['median_s']:.3f}" if r["median_s"] else "-", mbit,
                      f"{r['median_bps'] / tcp_bps:.2f}" if tcp_bps and r["median_bps"] else "-",
                      ", ".join(map(str, r["window_used"] or [])) or "-", status])
    out += md_table(["transport", "provider", "chunk", "chunk/BDP", "paper chunk", "median s", "median Mbit/s",
                     "vs tcp stream", "window used", "verification"], cells)
    if study == "window":
        for mode in dict.fromkeys(r["mode"] for r in rs):
            ok = [r for r in rs if r["mode"] == mode and r["median_bps"] and r["verified"]]
            fixed = [r for r in ok if r["window"] != "auto"]
            auto = next((r for r in ok if r["window"] == "auto"), None)
            if fixed:
                best = max(fixed, key=lambda r: r["median_bps"])
                out += [f"Best window for {mode}: **{best['window']}** ({best['median_bps'] / 1e6:.1f} Mbit/s, "
                        f"{best['window']} x {size(best['chunk_bytes'])} = "
                        f"{int(best['window']) * best['chunk_bytes'] / bdp:.1f} BDP)" + (f"; auto chose {', '.join(map(str, auto['window_used'] or []))} "
                                    f"({auto['median_bps'] / 1e6:.1f} Mbit/s, {auto['median_bps'] / best['median_bps']:.2f}"
                                    f" of the best)" if auto else "") + ".", ""]
    if study == "qps":
        ok = [r for r in rs if r["kind"] == "channel" and r["median_bps"] and r["verified"]]
        if ok:
            best = max(ok, key=lambda r: r["median_bps"])
            one = next((r for r in ok if r["qps_per_peer"] == 1), None)
            out += [f"Best: qps_per_peer={best['qps_per_peer']} ({best['median_bps'] / 1e6:.1f} Mbit/s" +
                    (f", {best['median_bps'] / one['median_bps']:.2f} x one QP" if one else "") +
                    f"); TCP congestion control in the sites: {m.get('tcp_cc') or '?'}.", ""]
    return out


def write_plot(rows: Sequence[Dict[str, Any]], path: Path) -> Optional[Path]:
    """Mbit/s per transport, one bar per chunk size (chunks study) or one series; one panel per link."""
    panels = []
    for lk in dict.fromkeys(json.dumps(r["link"]) for r in rows):
        rs = [r for r in rows if json.dumps(r["link"]) == lk]
        names = list(dict.fromkeys(r["transport"] for r in rs))
        chunks = list(dict.fromkeys(r["chunk_bytes"] for r in rs))
        series = {(f"chunk {size(c)}" if c else "no chunk"): [
            next(((r["median_bps"] or 0) / 1e6 for r in rs if r["transport"] == n and r["chunk_bytes"] == c), None)
            for n in names] for c in chunks}
        l = json.loads(lk)
        panels.append((f"{l['rate_mbit']:g} Mbit/s, {l['rtt_ms']:g} ms RTT, {l['loss_pct']:g} % loss", names, series))
    return bars(path, panels, "Mbit/s (median)", "testbed: real packets, scaled rate; soft provider = emulation")
